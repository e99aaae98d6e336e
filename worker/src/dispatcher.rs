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
                    let mut handle =
                        SessionHandle::spawn(session.clone(), self.ctx.clone(), &self.tasks);
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
