//! The bench handler: the one piece of "business logic" every system runs.
//!
//! Comparing designs means giving them identical work, so there is exactly one handler, and the
//! systems differ only in how they get records to it and retry it. Each call checks the
//! session's order (before any work, so an overtaking record is caught where it happens), does
//! the scenario's simulated I/O (a wait the runtime's reactor ends, see `simulated_io`), decides
//! the scenario's faults, and on success records the record's latency: from the producer's
//! stamp to the end of the successful call.
//! Faults are deterministic: a transient fault is a hash of (seed, session, seq, attempt), so
//! every system sees the same failing attempts; the isolation scenario's failing session fails
//! every attempt during a wall-clock window that starts when the load starts.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use rand::Rng;
use serde::{Deserialize, Serialize};
use sessionflow_worker::session::retry::RetryPolicy;

use crate::measurement::{now_us, Histogram, OrderCheck};
use crate::workload::RecordView;

/// What the handler does, per scenario.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HandlerSpec {
    /// Simulated I/O per attempt (a wait that ends when due, see `simulated_io`), in ms.
    pub io_ms: u64,
    /// Fraction of attempts that fail transiently.
    pub transient_rate: f64,
    pub seed: u64,
    /// A session that fails every attempt for `fail_for_ms`, from `fail_from_ms` after the load
    /// starts.
    pub fail_sid: Option<u32>,
    pub fail_from_ms: u64,
    pub fail_for_ms: u64,
}

/// A uniform draw in [0, 1) fixed by its inputs (splitmix64 finaliser over their mix).
pub fn draw(seed: u64, sid: u32, seq: u64, attempt: u32) -> f64 {
    let mut z = seed
        ^ (sid as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ seq.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
        ^ (attempt as u64).wrapping_mul(0x1656_67b1_9e37_79f9);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The handler and everything it measures, shared by a system's tasks.
pub struct Core {
    spec: HandlerSpec,
    order: OrderCheck,
    /// Latency of every record.
    pub all: Histogram,
    /// Latency of the records of every session but the failing one.
    pub healthy: Histogram,
    handled: AtomicU64,
    healthy_handled: AtomicU64,
    attempts: AtomicU64,
    first_us: AtomicU64,
    last_us: AtomicU64,
    warm: Vec<AtomicBool>,
    /// When the load started (µs since the epoch); 0 until the parent says.
    load_started_us: AtomicU64,
    /// Run by the call that finishes the given record (see [`Core::on_handled`]).
    milestones: OnceLock<Vec<Milestone>>,
}

/// An action for the call that finishes the `at`th record.
pub struct Milestone {
    pub at: u64,
    pub action: Box<dyn Fn() + Send + Sync>,
}

/// A status line of a system measured in another process: its counters (absolute) and what its
/// histograms gained since its previous line, as (bucket, count) pairs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RemoteStatus {
    pub handled: u64,
    pub healthy_handled: u64,
    pub attempts: u64,
    pub first_us: Option<u64>,
    pub last_us: Option<u64>,
    pub order_violations: u64,
    pub all: Vec<(usize, u64)>,
    pub healthy: Vec<(usize, u64)>,
}

/// A snapshot of the counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    pub handled: u64,
    pub healthy_handled: u64,
    pub attempts: u64,
    pub first_us: Option<u64>,
    pub last_us: Option<u64>,
    pub order_violations: u64,
}

impl Core {
    pub fn new(spec: HandlerSpec, sessions: usize, partitions: usize) -> Self {
        Self {
            spec,
            order: OrderCheck::new(sessions),
            all: Histogram::default(),
            healthy: Histogram::default(),
            handled: AtomicU64::new(0),
            healthy_handled: AtomicU64::new(0),
            attempts: AtomicU64::new(0),
            first_us: AtomicU64::new(u64::MAX),
            last_us: AtomicU64::new(0),
            warm: (0..partitions).map(|_| AtomicBool::new(false)).collect(),
            load_started_us: AtomicU64::new(0),
            milestones: OnceLock::new(),
        }
    }

    /// Each milestone's action runs in the call that finishes its record, on that call's
    /// thread, right after the count: the callgrind workload brackets its measured window so.
    /// A count read by another thread is late under valgrind, which runs one thread at a time
    /// and may let a consumer's thread handle thousands of records before the reader runs.
    /// Set once; later calls are ignored.
    pub fn on_handled(&self, milestones: Vec<Milestone>) {
        let _ = self.milestones.set(milestones);
    }

    pub fn spec(&self) -> &HandlerSpec {
        &self.spec
    }

    /// Sessions the order check knows (the scenario's).
    /// Bytes the harness itself keeps per session in this process (the order check's words).
    pub fn harness_bytes(&self) -> u64 {
        self.order.bytes()
    }

    pub fn sessions(&self) -> usize {
        self.order.sessions()
    }

    /// What a system measured in another process reported (see `systems::parallel_consumer`):
    /// its histograms' new counts first, then its counters, so that a record counted here is
    /// already in the histograms when the run loop sees it.
    pub fn absorb(&self, r: &RemoteStatus) {
        for &(i, n) in &r.all {
            self.all.add(i, n);
        }
        for &(i, n) in &r.healthy {
            self.healthy.add(i, n);
        }
        if let Some(first) = r.first_us {
            self.first_us.fetch_min(first, Ordering::AcqRel);
        }
        if let Some(last) = r.last_us {
            self.last_us.fetch_max(last, Ordering::AcqRel);
        }
        self.order.set_violations(r.order_violations);
        self.attempts.store(r.attempts, Ordering::Release);
        self.healthy_handled
            .store(r.healthy_handled, Ordering::Release);
        self.handled.store(r.handled, Ordering::Release);
    }

    pub fn set_load_started(&self, us: u64) {
        self.load_started_us.store(us, Ordering::Release);
    }

    /// Whether a warm-up record of every partition has arrived.
    pub fn all_warm(&self) -> bool {
        self.warm.iter().all(|w| w.load(Ordering::Acquire))
    }

    pub fn warm_up(&self, partition: i32) {
        if let Some(w) = self.warm.get(partition as usize) {
            w.store(true, Ordering::Release);
        }
    }

    pub fn counts(&self) -> Counts {
        let first = self.first_us.load(Ordering::Acquire);
        let last = self.last_us.load(Ordering::Acquire);
        Counts {
            handled: self.handled.load(Ordering::Acquire),
            healthy_handled: self.healthy_handled.load(Ordering::Acquire),
            attempts: self.attempts.load(Ordering::Acquire),
            first_us: (first != u64::MAX).then_some(first),
            last_us: (last != 0).then_some(last),
            order_violations: self.order.violations(),
        }
    }

    /// The raw consumer's "handling": no work, no faults, only the measurements.
    pub fn observe(&self, v: RecordView, partition: i32) {
        if v.warmup {
            return self.warm_up(partition);
        }
        self.begin(v, 1);
        self.finish(v);
    }

    /// One handler call (one attempt). `Err` is a transient failure.
    pub async fn call(&self, v: RecordView, partition: i32, attempt: u32) -> Result<(), String> {
        if v.warmup {
            self.warm_up(partition);
            return Ok(());
        }
        self.begin(v, attempt);
        if self.spec.io_ms > 0 {
            crate::simulated_io::wait(Duration::from_millis(self.spec.io_ms)).await;
        }
        if self.fails(v, attempt) {
            return Err(format!("injected transient fault, attempt {attempt}"));
        }
        self.finish(v);
        Ok(())
    }

    /// A baseline's in-place retry loop: the same record until it succeeds, sleeping the
    /// engine's backoff (same policy, same full jitter) between attempts.
    pub async fn call_until_done(&self, v: RecordView, partition: i32, retry: &RetryPolicy) {
        let mut attempt = 1;
        while self.call(v, partition, attempt).await.is_err() {
            let delay = retry.delay(attempt, rand::rng().random::<f64>());
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    fn begin(&self, v: RecordView, attempt: u32) {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        if attempt == 1 {
            self.first_us.fetch_min(now_us(), Ordering::AcqRel);
        }
        self.order.enter(v.sid, v.seq, attempt);
    }

    fn finish(&self, v: RecordView) {
        self.order.finish(v.sid, v.seq);
        let done = now_us();
        let latency = done.saturating_sub(v.produced_us);
        self.all.record(latency);
        if self.spec.fail_sid != Some(v.sid) {
            self.healthy.record(latency);
            self.healthy_handled.fetch_add(1, Ordering::AcqRel);
        }
        self.last_us.fetch_max(done, Ordering::AcqRel);
        let handled = self.handled.fetch_add(1, Ordering::AcqRel) + 1;
        if let Some(milestones) = self.milestones.get() {
            for m in milestones.iter().filter(|m| m.at == handled) {
                (m.action)();
            }
        }
    }

    fn fails(&self, v: RecordView, attempt: u32) -> bool {
        if self.spec.transient_rate > 0.0
            && draw(self.spec.seed, v.sid, v.seq, attempt) < self.spec.transient_rate
        {
            return true;
        }
        if self.spec.fail_sid == Some(v.sid) {
            let started = self.load_started_us.load(Ordering::Acquire);
            let from = started + self.spec.fail_from_ms * 1_000;
            let until = from + self.spec.fail_for_ms * 1_000;
            let now = now_us();
            return started > 0 && now >= from && now < until;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(sid: u32, seq: u64) -> RecordView {
        RecordView {
            sid,
            seq,
            produced_us: now_us(),
            warmup: false,
        }
    }

    /// The Parallel Consumer's Java twin of the handler (`bench/parallel-consumer/`) checks its
    /// own draw and histogram buckets against these same values each time it starts.
    #[test]
    fn the_java_twin_shares_these_draws_and_buckets() {
        assert_eq!(draw(7, 3, 17, 2), 0.9332074446829549);
        assert_eq!(draw(13, 9, 50_000, 1), 0.1735520976621442);
        let buckets: Vec<usize> = [0, 127, 128, 1_000, 5_000, 123_456, 1 << 44]
            .into_iter()
            .map(crate::measurement::bucket_index)
            .collect();
        assert_eq!(buckets, [0, 127, 128, 317, 462, 760, 2_496]);
    }

    #[test]
    fn draws_are_uniform_enough_and_deterministic() {
        let n = 100_000;
        let below = (0..n)
            .filter(|i| draw(7, (i % 10) as u32, *i as u64, 1) < 0.1)
            .count();
        assert!((9_000..11_000).contains(&below), "{below}");
        assert_eq!(draw(1, 2, 3, 4), draw(1, 2, 3, 4));
        assert_ne!(draw(1, 2, 3, 4), draw(1, 2, 3, 5));
    }

    #[tokio::test(start_paused = true)]
    async fn retries_in_place_until_success_and_stay_in_order() {
        let spec = HandlerSpec {
            transient_rate: 0.5,
            seed: 3,
            ..Default::default()
        };
        let core = Core::new(spec, 2, 1);
        let retry = RetryPolicy {
            initial: Duration::from_millis(1),
            max: Duration::from_millis(10),
            multiplier: 2.0,
            max_attempts: 0,
        };
        for seq in 1..=50 {
            core.call_until_done(view(0, seq), 0, &retry).await;
            core.call_until_done(view(1, seq), 0, &retry).await;
        }
        let c = core.counts();
        assert_eq!(c.handled, 100);
        assert_eq!(c.order_violations, 0);
        assert!(
            c.attempts > 150,
            "about half the attempts fail: {}",
            c.attempts
        );
        assert_eq!(core.all.snapshot().count(), 100);
    }

    #[tokio::test]
    async fn a_milestone_runs_in_the_call_that_finishes_its_record_and_sees_that_count() {
        let core = std::sync::Arc::new(Core::new(HandlerSpec::default(), 1, 1));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let milestone = |at: u64| Milestone {
            at,
            action: Box::new({
                let (core, seen) = (std::sync::Arc::downgrade(&core), seen.clone());
                move || {
                    let handled = core.upgrade().map(|c| c.counts().handled);
                    seen.lock().unwrap().push((at, handled));
                }
            }),
        };
        core.on_handled(vec![milestone(3), milestone(5)]);
        let retry = RetryPolicy::default();
        for seq in 1..=6 {
            core.call_until_done(view(0, seq), 0, &retry).await;
        }
        assert_eq!(
            *seen.lock().unwrap(),
            [(3, Some(3)), (5, Some(5))],
            "each once, at its own count"
        );
    }

    #[tokio::test]
    async fn the_failing_session_fails_only_inside_its_window() {
        let spec = HandlerSpec {
            fail_sid: Some(1),
            fail_from_ms: 0,
            fail_for_ms: 60_000,
            ..Default::default()
        };
        let core = Core::new(spec, 2, 1);
        // Before the load starts, nothing fails.
        assert!(core.call(view(1, 1), 0, 1).await.is_ok());
        core.set_load_started(now_us());
        assert!(core.call(view(1, 2), 0, 1).await.is_err());
        assert!(core.call(view(0, 1), 0, 1).await.is_ok());
        let c = core.counts();
        assert_eq!((c.handled, c.healthy_handled), (2, 1));
    }

    #[test]
    fn warmups_are_counted_per_partition_and_not_measured() {
        let core = Core::new(HandlerSpec::default(), 1, 2);
        let warm = RecordView {
            sid: u32::MAX,
            seq: 0,
            produced_us: 0,
            warmup: true,
        };
        core.observe(warm, 0);
        assert!(!core.all_warm());
        core.observe(warm, 1);
        assert!(core.all_warm());
        assert_eq!(core.counts().handled, 0);
        assert_eq!(core.counts().order_violations, 0);
    }
}
