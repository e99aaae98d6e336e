//! The dispatcher tier: sessions hashed onto a few long-lived tasks, each owning its sessions.
//!
//! The consumer loop must never wait on a session, so it hands records to a small, fixed set of
//! dispatchers, in batches, each over a bounded hand-off (`handoff`; a full one is backpressure,
//! handled by the consumer).
//! A dispatcher owns a map from session id to that session's task and forwards each record to
//! it without waiting: a session that is busy retrying keeps its records queued in its own
//! queue, and the dispatcher moves straight on to the next session's record. Because the
//! routing is a function of the session id's hash alone (`routing`), one session always lands on
//! the same dispatcher, hence on one task.
//!
//! Hibernation and reaping idle sessions is done here, by the only sender, so neither can race with
//! a send: a session with nothing queued or running for `HIBERNATE_AFTER` gives up its task and
//! keeps only its map entry (see `session::SessionHandle`); after `sessionIdleMs` it is dropped.
//! Only the sessions with a task (the *awake* list) are looked at for hibernation, so a tick costs
//! what is running, not every session known.
//!
//! The session map is looked up once per record, with the hash the record's session id was given
//! at intake (it also chose this dispatcher), so the id is hashed once per record, not twice;
//! and the dispatcher takes every batch waiting for it at once, so a busy
//! dispatcher pays for one wake-up and one clock read per turn of the consumer loop, not per
//! record.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::task::TaskTracker;

use crate::dispatch::handoff::{Batch, Takeoff};
use crate::handler::Handler;
use crate::record::session_id::{session_hash, SessionId};
use crate::record::InputRecord;
use crate::session::task::{Sent, SessionContext, SessionHandle};

/// Batches taken from the consumer loop per wake-up, at most.
const BATCHES: usize = 16;
/// How long a session with nothing to do keeps its task before it hibernates. A session that comes
/// back later pays for a new task (~1 µs); one idling meanwhile costs its task and queue
/// (~300 bytes).
pub const HIBERNATE_AFTER: Duration = Duration::from_millis(250);

pub struct Dispatcher<H> {
    rx: Takeoff,
    /// Each session known, found by its id's hash (`session_hash`).
    sessions: hashbrown::HashTable<Known>,
    /// The sessions to tend, with their hashes: each started a task since it was last found
    /// hibernated (some may since have been reaped). Empty when sessions do not hibernate.
    awake: Vec<(u64, SessionId)>,
    ctx: Arc<SessionContext<H>>,
    idle: Duration,
    /// Hibernation only pays where sessions are kept longer than a task is.
    hibernates: bool,
    tasks: TaskTracker,
}

/// A session in a dispatcher's map: a copy of its id (see `session_id`) and its handle.
struct Known {
    id: SessionId,
    handle: SessionHandle,
}

impl Known {
    /// The hash the map keeps it under; computed again only when the table grows or shrinks.
    fn hash(&self) -> u64 {
        session_hash(self.id.as_bytes())
    }
}

impl<H: Handler> Dispatcher<H> {
    pub fn new(
        rx: Takeoff,
        ctx: Arc<SessionContext<H>>,
        idle: Duration,
        tasks: TaskTracker,
    ) -> Self {
        Self {
            rx,
            sessions: hashbrown::HashTable::new(),
            awake: Vec::new(),
            ctx,
            idle,
            hibernates: idle > HIBERNATE_AFTER,
            tasks,
        }
    }

    /// Runs until the consumer loop drops its sender; session tasks then finish what is queued.
    pub async fn run(mut self) {
        let every = if self.hibernates {
            HIBERNATE_AFTER
        } else {
            self.idle
        } / 2;
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_reap = Instant::now();
        let mut batches: Vec<Batch> = Vec::with_capacity(BATCHES);
        loop {
            tokio::select! {
                taken = self.rx.take(&mut batches, BATCHES) => {
                    if taken == 0 {
                        break;
                    }
                    // One clock read per wake-up: it only dates the sessions' last activity.
                    let now = Instant::now();
                    for record in batches.drain(..).flatten() {
                        self.route(record, now);
                    }
                }
                _ = tick.tick() => {
                    let now = Instant::now();
                    if self.hibernates {
                        self.hibernate(now);
                    }
                    if now.duration_since(last_reap) >= self.idle / 2 {
                        self.reap(now);
                        last_reap = now;
                    }
                }
            }
        }
        self.ctx.metrics.sessions.sub(self.sessions.len() as i64);
    }

    fn route(&mut self, record: Box<InputRecord>, now: Instant) {
        let mut record = record;
        loop {
            let hash = record.session_hash();
            let id = record
                .session()
                .expect("the consumer loop routes only records with a session");
            let sent = match self.sessions.find_mut(hash, |k| k.id.as_bytes() == id) {
                Some(known) => {
                    let sent = known.handle.send(record, &self.ctx, &self.tasks, now);
                    if matches!(sent, Ok(Sent::Started)) && self.hibernates {
                        self.awake.push((hash, known.id.clone()));
                    }
                    sent.map(drop)
                }
                None => {
                    let id = SessionId::new(id);
                    let mut handle = SessionHandle::default();
                    let sent = handle.send(record, &self.ctx, &self.tasks, now);
                    if self.hibernates {
                        self.awake.push((hash, id.clone()));
                    }
                    self.sessions
                        .insert_unique(hash, Known { id, handle }, Known::hash);
                    self.ctx.metrics.sessions.inc();
                    sent.map(drop)
                }
            };
            match sent {
                Ok(()) => return,
                Err(back) => {
                    // The task ended (aborted); start a fresh one for this record.
                    let hash = back.session_hash();
                    if let Some(id) = back.session() {
                        if let Ok(known) = self.sessions.find_entry(hash, |k| k.id.as_bytes() == id)
                        {
                            known.remove();
                            self.ctx.metrics.sessions.dec();
                        }
                    }
                    record = back;
                    if self.ctx.abort.is_cancelled() {
                        return;
                    }
                }
            }
        }
    }

    /// Asks the awake sessions idle for `HIBERNATE_AFTER` to hibernate, and forgets the ones that
    /// have.
    fn hibernate(&mut self, now: Instant) {
        let sessions = &mut self.sessions;
        self.awake.retain(|(hash, id)| {
            sessions
                .find_mut(*hash, |k| k.id == *id)
                .is_some_and(|k| k.handle.tend(now, HIBERNATE_AFTER))
        });
    }

    fn reap(&mut self, now: Instant) {
        let idle = self.idle;
        let before = self.sessions.len();
        self.sessions.retain(|k| !k.handle.is_idle(now, idle));
        self.ctx
            .metrics
            .sessions
            .sub((before - self.sessions.len()) as i64);
        // A burst of sessions leaves the map's table behind at its peak size; give the memory
        // back once most of them are gone (rare: only after the map shrank to a quarter).
        if self.sessions.capacity() > 1_024 && self.sessions.len() < self.sessions.capacity() / 4 {
            self.sessions.shrink_to_fit(Known::hash);
        }
        if self.awake.capacity() > 1_024 && self.awake.len() < self.awake.capacity() / 4 {
            self.awake.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::health::Health;
    use crate::ops::metrics::Metrics;
    use crate::ops::signal::Signal;
    use crate::record::Lease;
    use crate::session::retry::RetryPolicy;
    use crate::session::stuck::{StuckAction, StuckPolicy};
    use crate::HandlerResult;
    use std::sync::atomic::Ordering::Relaxed;

    #[cfg(feature = "jemalloc")]
    struct Noop;

    #[cfg(feature = "jemalloc")]
    impl Handler for Noop {
        async fn handle(&self, _: &InputRecord, _: u32) -> HandlerResult {
            Ok(None)
        }
    }

    /// The handler calls, in the order they began: (session, seq).
    #[derive(Default)]
    struct Recording(std::sync::Mutex<Vec<(Vec<u8>, u64)>>);

    impl Handler for Recording {
        async fn handle(&self, record: &InputRecord, _: u32) -> HandlerResult {
            let call = (record.session().unwrap().to_vec(), record.seq().unwrap());
            self.0.lock().unwrap().push(call);
            Ok(None)
        }
    }

    fn context<H: Handler>(
        handler: H,
    ) -> (
        Arc<SessionContext<H>>,
        crate::commit::completion::CompletionReceiver,
    ) {
        let metrics = Metrics::new("test");
        let health = Arc::new(Health::default());
        // Never connects: a terminal stage without records to dead-letter produces nothing.
        let (producer, done) = crate::output::producer::terminal_stage(&metrics, &health);
        let ctx = SessionContext {
            handler: Arc::new(handler),
            producer,
            retry: RetryPolicy::default(),
            stuck: StuckPolicy {
                timeout: Duration::from_secs(60),
                action: StuckAction::Log,
            },
            metrics,
            health,
            abort: Signal::default(),
            release_queued: Signal::default(),
        };
        (Arc::new(ctx), done)
    }

    fn record(session: usize, seq: u64, lease: &Arc<Lease>) -> Box<InputRecord> {
        record_with(session, seq, lease, None)
    }

    /// A record of `session-NNNNNNN` (its key) numbered `seq`, carrying `event` as its event id.
    fn record_with(
        session: usize,
        seq: u64,
        lease: &Arc<Lease>,
        event: Option<&[u8]>,
    ) -> Box<InputRecord> {
        use crate::record::{header, Parts};
        let (key, seq) = (format!("session-{session:07}"), seq.to_string());
        let mut headers = vec![(header::SEQ, Some(seq.as_bytes()))];
        headers.extend(event.map(|e| (header::EVENT_ID, Some(e))));
        let parts = Parts {
            key: Some(key.as_bytes()),
            value: Some(b"v"),
            headers: &headers,
        };
        let source = crate::record::SessionSource::Key;
        let record = InputRecord::new("t".into(), 0, session as i64, parts, &source, lease.clone());
        Box::new(record)
    }

    /// A dispatcher over `handler` whose sessions are kept for an hour (they hibernate, if
    /// `hibernates`, and are never reaped), fed and drained by the test.
    struct Harness<H> {
        ctx: Arc<SessionContext<H>>,
        done: crate::commit::completion::CompletionReceiver,
        tx: crate::dispatch::handoff::Handoff,
        dispatcher: tokio::task::JoinHandle<()>,
        tasks: TaskTracker,
        lease: Arc<Lease>,
    }

    impl<H: Handler> Harness<H> {
        fn start(handler: H, hibernates: bool) -> Self {
            let (ctx, done) = context(handler);
            let (tx, rx) = crate::dispatch::handoff::handoff(1_024);
            let tasks = TaskTracker::new();
            let idle = Duration::from_secs(3_600);
            let mut dispatcher = Dispatcher::new(rx, ctx.clone(), idle, tasks.clone());
            dispatcher.hibernates = hibernates;
            Self {
                ctx,
                done,
                tx,
                dispatcher: tokio::spawn(dispatcher.run()),
                tasks,
                lease: Arc::new(Lease::new(0, 1)),
            }
        }

        /// One record to each of `sessions`, numbered `seq`, in batches as the consumer loop
        /// hands them over.
        async fn send(&self, sessions: std::ops::Range<usize>, seq: u64) {
            let mut sessions = sessions.peekable();
            while sessions.peek().is_some() {
                let batch = sessions.by_ref().take(256);
                let batch = batch.map(|s| record(s, seq, &self.lease)).collect();
                self.hand_over(batch).await;
            }
        }

        /// Hands `batch` over, waiting while the dispatcher has no room.
        async fn hand_over(&self, batch: crate::dispatch::handoff::Batch) {
            let mut batch = batch;
            loop {
                match self.tx.offer(batch) {
                    Ok(()) => return,
                    Err(crate::dispatch::handoff::Refused::Full(back)) => batch = back,
                    Err(crate::dispatch::handoff::Refused::Closed(_)) => {
                        panic!("the dispatcher ended")
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }

        /// Takes `n` completions off their channel (the test's stand-in for the consumer loop;
        /// left there, they would count as allocated).
        async fn settle(&self, n: usize) {
            let mut completed = 0;
            while completed < n {
                completed += self.done.try_iter().count();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }

        /// Waits until every session task has hibernated (a minute at most: ~HIBERNATE_AFTER is
        /// enough).
        async fn hibernated(&self) {
            let waiting = async {
                while self.ctx.metrics.active_sessions.get() > 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(60), waiting)
                .await
                .expect("the idle sessions never hibernated");
        }

        /// Heap bytes per session after one record to each of `sessions` is done (and, with
        /// `hibernated`, every session has hibernated). The count is the process's: hold
        /// [`measuring`] for the whole test, so another bytes test's sessions, made or freed
        /// meanwhile on the threads of `cargo test`, do not count.
        #[cfg(feature = "jemalloc")]
        async fn bytes_per_session(&self, sessions: usize, hibernated: bool) -> u64 {
            let before = crate::ops::memory::allocated_bytes().unwrap();
            self.send(0..sessions, 1).await;
            self.settle(sessions).await;
            if hibernated {
                self.hibernated().await;
            }
            let after = crate::ops::memory::allocated_bytes().unwrap();
            (after - before) / sessions as u64
        }

        async fn stop(self) {
            drop(self.tx);
            self.dispatcher.await.unwrap();
            assert_eq!(self.ctx.metrics.sessions.get(), 0);
            self.tasks.close();
            self.tasks.wait().await;
        }
    }

    /// One heap-measuring test at a time in this process (see `bytes_per_session`).
    #[cfg(feature = "jemalloc")]
    async fn measuring() -> tokio::sync::MutexGuard<'static, ()> {
        crate::ops::memory::HEAP_MEASURED.lock().await
    }

    /// What an idle session keeps before it hibernates, once its records are done: its task, its
    /// queue and its entry in the dispatcher's map. Until sessions hibernated, a burst of a million
    /// users was that many times this (1,813 bytes with tokio's unbounded channel for the queue
    /// and an `async fn` task that held itself twice; 644 after that, 775 with only the
    /// `async fn` back; 552 since the ordering watchdog keeps a word of bits instead of a queue
    /// of recent numbers; ~670–700 since the map entry holds what a hibernated session keeps).
    #[cfg(feature = "jemalloc")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_session_keeps_under_750_bytes_until_it_hibernates() {
        const SESSIONS: usize = 20_000;
        let _alone = measuring().await;
        // None hibernates while the test measures, however slow the build.
        let h = Harness::start(Noop, false);
        let each = h.bytes_per_session(SESSIONS, false).await;
        println!("{each} bytes per idle session");
        assert_eq!(h.ctx.metrics.active_sessions.get(), SESSIONS as i64);
        assert!(each < 750, "{each} bytes per idle session");
        h.stop().await;
    }

    /// What a hibernated session keeps: its entry in the dispatcher's map (its id, its order
    /// watches and recent event ids) and its place on the list of sessions to tend, no task
    /// and no queue: ~230 bytes (~700 while its task waits, 552 before sessions hibernated).
    #[cfg(feature = "jemalloc")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hibernated_session_keeps_under_300_bytes() {
        // Many: what the threads' allocation caches hold (counted as allocated) is spread thin.
        const SESSIONS: usize = 100_000;
        let _alone = measuring().await;
        let h = Harness::start(Noop, true);
        let each = h.bytes_per_session(SESSIONS, true).await;
        println!("{each} bytes per hibernated session");
        assert_eq!(h.ctx.metrics.sessions.get(), SESSIONS as i64);
        assert!(each < 300, "{each} bytes per hibernated session");
        h.stop().await;
    }

    /// A hibernated session's next task starts with what the last one remembered: an event settled
    /// before the session hibernated is a replay after it (and is not processed again).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hibernated_session_starts_again_with_what_it_remembered() {
        let h = Harness::start(Recording::default(), true);
        let event = |seq| record_with(7, seq, &h.lease, Some(b"event-7"));
        h.hand_over(vec![event(1)]).await;
        h.settle(1).await;
        h.hibernated().await;
        h.hand_over(vec![event(1)]).await;
        h.settle(1).await;
        assert_eq!(h.ctx.metrics.replay_skipped.get(), 1);
        assert_eq!(h.ctx.handler.0.lock().unwrap().len(), 1, "processed once");
        assert_eq!(h.ctx.metrics.sessions.get(), 1);
        h.stop().await;
    }

    /// Records arriving while their sessions hibernate (rounds spaced around the hibernate time, so
    /// sends meet tasks that are idle, asked to hibernate, hibernated, or hibernated and not yet
    /// collected): each session's records reach the handler once each, in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_racing_with_hibernation_keep_their_order() {
        const SESSIONS: usize = 300;
        const ROUNDS: u64 = 8;
        let h = Harness::start(Recording::default(), true);
        let mut fewest_tasks = i64::MAX;
        for seq in 1..=ROUNDS {
            h.send(0..SESSIONS, seq).await;
            h.settle(SESSIONS).await;
            // From well before the hibernate to well after it.
            let quiet = HIBERNATE_AFTER.mul_f64(0.5 + seq as f64 / ROUNDS as f64);
            tokio::time::sleep(quiet).await;
            fewest_tasks = fewest_tasks.min(h.ctx.metrics.active_sessions.get());
        }
        assert!(
            fewest_tasks < SESSIONS as i64,
            "no session ever hibernated: the test did not test hibernation"
        );
        let calls = h.ctx.handler.0.lock().unwrap().clone();
        assert_eq!(calls.len(), SESSIONS * ROUNDS as usize);
        let mut last = std::collections::HashMap::new();
        for (session, seq) in calls {
            let before = last.insert(session.clone(), seq).unwrap_or(0);
            assert_eq!(seq, before + 1, "{session:?}: {seq} after {before}");
        }
        let violations = &h.ctx.metrics.order_violations;
        assert_eq!(violations.with_label_values(&["intake"]).get(), 0);
        assert_eq!(violations.with_label_values(&["handler"]).get(), 0);
        h.stop().await;
    }

    /// A handler that takes a millisecond, so a session's records queue behind each other and
    /// its task works through several in one run.
    struct Slow;

    impl Handler for Slow {
        async fn handle(&self, _: &InputRecord, _: u32) -> HandlerResult {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Ok(None)
        }
    }

    /// Every handler attempt is in `handler_duration_seconds` once the session tasks have
    /// finished their runs, however a run held them back (`ops::batched`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_handler_time_reaches_the_histogram_when_the_runs_end() {
        const SESSIONS: usize = 4;
        const RECORDS: u64 = 100;
        let h = Harness::start(Slow, true);
        for seq in 1..=RECORDS {
            h.send(0..SESSIONS, seq).await;
        }
        h.settle(SESSIONS * RECORDS as usize).await;
        h.hibernated().await;
        let seen = h.ctx.metrics.handler_outcome.ok.get_sample_count();
        assert_eq!(seen, SESSIONS as u64 * RECORDS);
        h.stop().await;
    }

    /// The handler times a run holds reach the histogram when the task waits, not only when its
    /// run ends: while a record of the run retries with backoff, the times of the records
    /// before it are already there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_handler_times_are_added_before_a_retrys_backoff() {
        held_times_are_added_while(Sickness::Fails).await;
    }

    /// The same while a record's handler takes long (it was not done at its first poll).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_handler_times_are_added_while_a_handler_takes_long() {
        held_times_are_added_while(Sickness::Hangs).await;
    }

    /// Records 1 to [`SickAt::SEQ`] of one session in one run, the last of them held up by
    /// `sickness` until the test heals it: meanwhile the handler times of the records before
    /// it are in the histogram.
    async fn held_times_are_added_while(sickness: Sickness) {
        let h = Harness::start(SickAt::new(sickness), true);
        let records = (1..=SickAt::SEQ)
            .map(|seq| record(0, seq, &h.lease))
            .collect();
        h.hand_over(records).await;
        let before_it = SickAt::SEQ - 1;
        let held_up = || match sickness {
            Sickness::Fails => h.ctx.metrics.retries.get() > 0,
            Sickness::Hangs => h.ctx.handler.hanging.load(Relaxed),
        };
        let held_up_with_the_times_in = async {
            let ok = &h.ctx.metrics.handler_outcome.ok;
            while !held_up() || ok.get_sample_count() < before_it {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), held_up_with_the_times_in)
            .await
            .expect("the times of the records before the held-up one were still held");
        assert_eq!(h.done.try_iter().count() as u64, before_it, "still held up");
        h.ctx.handler.sick.store(false, Relaxed);
        h.settle(1).await;
        let ok = h.ctx.metrics.handler_outcome.ok.get_sample_count();
        assert_eq!(ok, SickAt::SEQ);
        h.stop().await;
    }

    #[derive(Clone, Copy)]
    enum Sickness {
        /// Fails transiently (and is retried with backoff).
        Fails,
        /// Does not return.
        Hangs,
    }

    /// Record 1 takes a moment (so the rest queue behind it, one run), record [`Self::SEQ`] is
    /// held up by its sickness while `sick`, the others succeed at once.
    struct SickAt {
        sickness: Sickness,
        sick: std::sync::atomic::AtomicBool,
        /// Record [`Self::SEQ`]'s handler is waiting to be healed.
        hanging: std::sync::atomic::AtomicBool,
    }

    impl SickAt {
        const SEQ: u64 = 6;

        fn new(sickness: Sickness) -> Self {
            Self {
                sickness,
                sick: true.into(),
                hanging: false.into(),
            }
        }
    }

    impl Handler for SickAt {
        async fn handle(&self, record: &InputRecord, _: u32) -> HandlerResult {
            if record.seq() == Some(1) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if record.seq() != Some(Self::SEQ) {
                return Ok(None);
            }
            match self.sickness {
                Sickness::Fails if self.sick.load(Relaxed) => {
                    Err(crate::handler::HandlerError::Transient("sick".into()))
                }
                Sickness::Fails => Ok(None),
                Sickness::Hangs => {
                    while self.sick.load(Relaxed) {
                        self.hanging.store(true, Relaxed);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Ok(None)
                }
            }
        }
    }
}
