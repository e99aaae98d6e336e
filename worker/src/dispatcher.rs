//! The dispatcher tier: sessions hashed onto a few long-lived tasks, each owning its sessions.
//!
//! The consumer loop must never wait on a session, so it hands records to a small, fixed set of
//! dispatchers over bounded channels (a full channel is backpressure, handled by the consumer).
//! A dispatcher owns a map from session id to that session's task and forwards each record to
//! it without waiting: a session that is busy retrying keeps its records queued in its own
//! queue, and the dispatcher moves straight on to the next session's record. Because the
//! routing is a consistent hash of the session id, one session always lands on the same
//! dispatcher, hence on one task.
//!
//! Reaping idle sessions is done here, by the only sender, so it cannot race with a send: a
//! session is dropped only when nothing is queued or running for it.
//!
//! The session map is looked up once per record, so it hashes with foldhash (seeded per map)
//! rather than SipHash; and the dispatcher takes every record waiting in its channel at once,
//! so a busy dispatcher pays for one wake-up and one timer check per batch, not per record.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

use crate::handler::Handler;
use crate::record::InputRecord;
use crate::session::{SessionContext, SessionHandle};

/// Records taken from the channel per wake-up, at most.
const BATCH: usize = 128;

pub struct Dispatcher<H> {
    rx: mpsc::Receiver<InputRecord>,
    sessions: foldhash::HashMap<Bytes, SessionHandle>,
    ctx: Arc<SessionContext<H>>,
    idle: Duration,
    tasks: TaskTracker,
}

impl<H: Handler> Dispatcher<H> {
    pub fn new(
        rx: mpsc::Receiver<InputRecord>,
        ctx: Arc<SessionContext<H>>,
        idle: Duration,
        tasks: TaskTracker,
    ) -> Self {
        Self {
            rx,
            sessions: foldhash::HashMap::default(),
            ctx,
            idle,
            tasks,
        }
    }

    /// Runs until the consumer loop drops its sender; session tasks then finish what is queued.
    pub async fn run(mut self) {
        let mut reap = tokio::time::interval((self.idle / 2).max(Duration::from_millis(10)));
        reap.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut batch = Vec::with_capacity(BATCH);
        loop {
            tokio::select! {
                taken = self.rx.recv_many(&mut batch, BATCH) => {
                    if taken == 0 {
                        break;
                    }
                    // One clock read per batch: it only dates the sessions' last activity.
                    let now = Instant::now();
                    for record in batch.drain(..) {
                        self.route(record, now);
                    }
                }
                _ = reap.tick() => self.reap(),
            }
        }
    }

    fn route(&mut self, record: InputRecord, now: Instant) {
        let mut record = record;
        loop {
            let session = record
                .session
                .as_deref()
                .expect("the consumer loop routes only records with a session");
            let sent = match self.sessions.get_mut(session) {
                Some(handle) => handle.send(record, &self.ctx.metrics, now),
                None => {
                    // A copy, not a view: the record's id is a view of its whole buffer, which
                    // the map would otherwise keep for as long as the session lives.
                    let session = Bytes::copy_from_slice(session);
                    let mut handle = SessionHandle::spawn(self.ctx.clone(), &self.tasks);
                    let sent = handle.send(record, &self.ctx.metrics, now);
                    self.sessions.insert(session, handle);
                    sent
                }
            };
            match sent {
                Ok(()) => return,
                Err(back) => {
                    // The task ended (aborted); start a fresh one for this record.
                    if let Some(session) = &back.session {
                        self.sessions.remove(session);
                    }
                    record = back;
                    if self.ctx.abort.is_cancelled() {
                        return;
                    }
                }
            }
        }
    }

    fn reap(&mut self) {
        let now = Instant::now();
        let idle = self.idle;
        self.sessions.retain(|_, s| !s.is_idle(now, idle));
        // A burst of sessions leaves the map's table behind at its peak size; give the memory
        // back once most of them are gone (rare: only after the map shrank to a quarter).
        if self.sessions.capacity() > 1_024 && self.sessions.len() < self.sessions.capacity() / 4 {
            self.sessions.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::Health;
    use crate::metrics::Metrics;
    use crate::producer::{producer_config, ProducerEvents, StageProducer};
    use crate::record::Lease;
    use crate::retry::RetryPolicy;
    use crate::signal::Signal;
    use crate::stuck::{StuckAction, StuckPolicy};
    use crate::HandlerResult;

    struct Noop;

    impl Handler for Noop {
        async fn handle(&self, _: &InputRecord, _: u32) -> HandlerResult {
            Ok(None)
        }
    }

    fn context() -> (
        Arc<SessionContext<Noop>>,
        crate::completion::CompletionReceiver,
    ) {
        let metrics = Metrics::new("test");
        let health = Arc::new(Health::default());
        let (completions, done) = crate::completion::channel();
        // Never connects: a terminal stage without records to dead-letter produces nothing.
        let producer = StageProducer::new(
            &producer_config("127.0.0.1:1", &[]),
            ProducerEvents {
                health: health.clone(),
                metrics: metrics.clone(),
                fatal: Default::default(),
            },
            None,
            "dlq".into(),
            "test".into(),
            completions,
            metrics.clone(),
        )
        .unwrap();
        let ctx = SessionContext {
            handler: Arc::new(Noop),
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

    fn record(session: usize, seq: u64, lease: &Arc<Lease>) -> InputRecord {
        InputRecord {
            topic: "t".into(),
            partition: 0,
            offset: session as i64,
            key: None,
            value: Some(Bytes::from_static(b"v")),
            headers: vec![],
            session: Some(format!("session-{session:07}").into()),
            seq: Some(seq),
            lease: lease.clone(),
        }
    }

    /// What an idle session keeps, once its records are done: its task, its queue and its
    /// entry in the dispatcher's map. A burst of a million users is that many times this
    /// (1,813 bytes with tokio's unbounded channel for the queue and an `async fn` task that
    /// held itself twice; 644 after that, 775 with only the `async fn` back; 552 since the
    /// ordering watchdog keeps a word of bits instead of a queue of recent numbers).
    #[cfg(feature = "jemalloc")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_session_keeps_under_600_bytes() {
        const SESSIONS: usize = 20_000;
        let (ctx, done) = context();
        let (tx, rx) = mpsc::channel(BATCH);
        let tasks = TaskTracker::new();
        let idle = Duration::from_secs(3_600);
        let dispatcher = tokio::spawn(Dispatcher::new(rx, ctx.clone(), idle, tasks.clone()).run());
        let lease = Arc::new(Lease::new(0, 1));
        // Every record's completion taken off its channel (which would count otherwise).
        let settled = || async {
            let mut completed = 0;
            while completed < SESSIONS {
                completed += done.try_iter().count();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        let before = crate::memory::allocated_bytes().unwrap();
        for s in 0..SESSIONS {
            tx.send(record(s, 1, &lease)).await.unwrap();
        }
        settled().await;
        let after = crate::memory::allocated_bytes().unwrap();
        let each = (after - before) / SESSIONS as u64;
        println!("{each} bytes per idle session");
        assert_eq!(ctx.metrics.active_sessions.get(), SESSIONS as i64);
        assert!(each < 600, "{each} bytes per idle session");
        drop(tx);
        dispatcher.await.unwrap();
        tasks.close();
        tasks.wait().await;
    }
}
