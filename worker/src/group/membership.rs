//! The membership fence: no write while the group coordinator may have given up on us.
//!
//! The group coordinator drops a member it has not heard from for `session.timeout.ms` and
//! gives its partitions to others. librdkafka notices this itself (and revokes the partitions
//! as *lost*) only in the steady state of its join protocol: a member in the middle of a
//! rejoin whose connection to the coordinator hangs — a network partition, a broker that
//! stopped without closing its sockets — keeps its partitions, and keeps writing their
//! results, until its requests time out (`socket.timeout.ms`, a minute by default). Meanwhile
//! the partitions' new owner writes the same sessions: two writers, and the old one's results
//! land after the new one's (RELIABILITY.md, footnote 9).
//!
//! So the worker keeps its own clock of when the coordinator last answered it ([`WordClock`]):
//! the commit thread records the answers to commits, and asks for a committed offset (a
//! read-only request to the coordinator) when it has nothing else to send or its commits are
//! refused. Such an answer shows the coordinator can be reached, not that it still counts this
//! worker as a member; librdkafka's own checks are left to judge that. When the last word
//! is older than two thirds of the session timeout, the [`WriteGate`] closes: no result is
//! written, and the producer's queued writes are purged (their records are written again once
//! the gate opens, or released if their partition is revoked meanwhile). The last third of the
//! session timeout is what the purge has to take the writes back before the coordinator could
//! hand the partitions to anyone. The next answer opens the gate again.
//!
//! The clock counts from when a request was *sent*: the coordinator resets a member's session
//! when it receives a request, so an answer proves the session was alive at the send, not at
//! the answer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::record::Lease;

/// How often a write waiting at the closed gate looks whether its partition was revoked.
const REVOKED_CHECK: Duration = Duration::from_millis(100);

/// When the group coordinator last answered this worker.
#[derive(Debug)]
pub struct WordClock {
    base: Instant,
    /// Milliseconds from `base` to the send time of the latest answered request.
    last_ms: AtomicU64,
}

impl WordClock {
    /// A clock that counts the worker's start as the last word.
    pub fn new(now: Instant) -> Self {
        Self {
            base: now,
            last_ms: AtomicU64::new(0),
        }
    }

    /// The coordinator answered a request sent at `sent`.
    pub fn heard(&self, sent: Instant) {
        let ms = sent.saturating_duration_since(self.base).as_millis() as u64;
        self.last_ms.fetch_max(ms, Ordering::AcqRel);
    }

    /// How long it is, at `now`, since the send of the last answered request.
    pub fn silence(&self, now: Instant) -> Duration {
        let last = self.base + Duration::from_millis(self.last_ms.load(Ordering::Acquire));
        now.saturating_duration_since(last)
    }
}

/// Whether results may be written. Open, or closed until the coordinator answers again.
#[derive(Debug, Default)]
pub struct WriteGate {
    closed: AtomicBool,
    opened: Notify,
}

impl WriteGate {
    /// Closes the gate; true when it was open.
    pub fn close(&self) -> bool {
        !self.closed.swap(true, Ordering::AcqRel)
    }

    /// Opens the gate and wakes every write waiting at it; true when it was closed.
    pub fn open(&self) -> bool {
        let was_closed = self.closed.swap(false, Ordering::AcqRel);
        if was_closed {
            self.opened.notify_waiters();
        }
        was_closed
    }

    pub fn is_open(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
    }

    /// Waits until the gate is open: true then, or false once `lease` is revoked (its record
    /// must be released, not written).
    pub async fn pass(&self, lease: &Lease) -> bool {
        loop {
            // Registered before the check, so an `open` in between is not missed.
            let opened = self.opened.notified();
            if self.is_open() {
                return !lease.is_revoked();
            }
            if lease.is_revoked() {
                return false;
            }
            let _ = tokio::time::timeout(REVOKED_CHECK, opened).await;
        }
    }
}

/// What [`Fence::judge`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing changed.
    Same,
    /// Silent too long: the gate has just closed (the caller purges the producer).
    Doubted(Duration),
    /// The coordinator answered again: the gate has just opened.
    Restored,
}

/// The clock, the gate, and the rule that joins them.
#[derive(Debug)]
pub struct Fence {
    pub clock: WordClock,
    pub gate: std::sync::Arc<WriteGate>,
    /// Silence after which the gate closes: two thirds of the session timeout.
    pub doubt_after: Duration,
    /// Silence after which the commit thread asks the coordinator something: a third.
    pub probe_after: Duration,
}

impl Fence {
    pub fn new(session_timeout: Duration, gate: std::sync::Arc<WriteGate>, now: Instant) -> Self {
        Self {
            clock: WordClock::new(now),
            gate,
            doubt_after: session_timeout * 2 / 3,
            probe_after: session_timeout / 3,
        }
    }

    /// Closes or opens the gate for the silence at `now`.
    pub fn judge(&self, now: Instant) -> Verdict {
        let silence = self.clock.silence(now);
        if silence >= self.doubt_after {
            if self.gate.close() {
                return Verdict::Doubted(silence);
            }
        } else if self.gate.open() {
            return Verdict::Restored;
        }
        Verdict::Same
    }

    /// Whether the commit thread should ask the coordinator something now.
    pub fn wants_probe(&self, now: Instant) -> bool {
        self.clock.silence(now) >= self.probe_after
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;

    const SESSION: Duration = Duration::from_secs(6);

    fn fence(start: Instant) -> Fence {
        Fence::new(SESSION, Arc::new(WriteGate::default()), start)
    }

    #[test]
    fn the_gate_closes_after_two_thirds_of_the_session_timeout_of_silence_and_once() {
        let t0 = Instant::now();
        let f = fence(t0);
        assert_eq!(f.judge(t0 + Duration::from_millis(3_999)), Verdict::Same);
        assert!(f.gate.is_open());
        assert_eq!(
            f.judge(t0 + Duration::from_secs(4)),
            Verdict::Doubted(Duration::from_secs(4))
        );
        assert!(!f.gate.is_open());
        assert_eq!(f.judge(t0 + Duration::from_secs(5)), Verdict::Same);
    }

    #[test]
    fn an_answer_reopens_the_gate_counted_from_its_request_s_send() {
        let t0 = Instant::now();
        let f = fence(t0);
        assert!(matches!(
            f.judge(t0 + Duration::from_secs(10)),
            Verdict::Doubted(_)
        ));
        // Answered now, but sent long ago: still too old.
        f.clock.heard(t0 + Duration::from_secs(5));
        assert_eq!(f.judge(t0 + Duration::from_secs(10)), Verdict::Same);
        assert!(!f.gate.is_open());
        f.clock.heard(t0 + Duration::from_secs(9));
        assert_eq!(f.judge(t0 + Duration::from_secs(10)), Verdict::Restored);
        assert!(f.gate.is_open());
    }

    #[test]
    fn a_late_answer_to_an_older_request_does_not_move_the_clock_back() {
        let t0 = Instant::now();
        let clock = WordClock::new(t0);
        clock.heard(t0 + Duration::from_secs(8));
        clock.heard(t0 + Duration::from_secs(2));
        assert_eq!(
            clock.silence(t0 + Duration::from_secs(9)),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn a_probe_is_wanted_after_a_third_of_the_session_timeout() {
        let t0 = Instant::now();
        let f = fence(t0);
        assert!(!f.wants_probe(t0 + Duration::from_millis(1_999)));
        assert!(f.wants_probe(t0 + Duration::from_secs(2)));
        f.clock.heard(t0 + Duration::from_secs(2));
        assert!(!f.wants_probe(t0 + Duration::from_secs(3)));
    }

    #[tokio::test]
    async fn a_write_at_the_closed_gate_waits_for_it_to_open() {
        let gate = Arc::new(WriteGate::default());
        let lease = Arc::new(Lease::new(0, 1));
        assert!(gate.close());
        let waiting = tokio::spawn({
            let (gate, lease) = (gate.clone(), lease.clone());
            async move { gate.pass(&lease).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "passed a closed gate");
        assert!(gate.open());
        assert!(waiting.await.unwrap());
    }

    #[tokio::test]
    async fn a_write_at_the_closed_gate_gives_up_when_its_partition_is_revoked() {
        let gate = Arc::new(WriteGate::default());
        let lease = Arc::new(Lease::new(0, 1));
        gate.close();
        let waiting = tokio::spawn({
            let (gate, lease) = (gate.clone(), lease.clone());
            async move { gate.pass(&lease).await }
        });
        lease.revoke();
        assert!(!waiting.await.unwrap());
        // And an open gate does not let a revoked lease through either.
        gate.open();
        assert!(!gate.pass(&lease).await);
    }

    proptest! {
        /// Whatever the order of answers and judgements, the gate is closed exactly when the
        /// silence (from the latest send answered) has reached the doubt threshold.
        #[test]
        fn the_gate_follows_the_silence(
            steps in proptest::collection::vec((0u64..10_000, any::<bool>(), 0u64..10_000), 1..50)
        ) {
            let t0 = Instant::now();
            let f = fence(t0);
            let mut now = t0;
            let mut latest = t0;
            for (advance, answer, age) in steps {
                now += Duration::from_millis(advance);
                if answer {
                    let sent = now - Duration::from_millis(age).min(now - t0);
                    f.clock.heard(sent);
                    latest = latest.max(sent);
                }
                f.judge(now);
                let silent = now - latest >= f.doubt_after;
                prop_assert_eq!(f.gate.is_open(), !silent);
            }
        }
    }
}
