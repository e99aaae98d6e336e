//! The session task: one session's records, one at a time, in arrival order.
//!
//! This is where per-session order comes from. A session task takes the next record only after
//! the previous one has succeeded or gone to the DLQ, and a transient failure is retried *here*,
//! in place, after a backoff: the session's later records simply wait in its queue behind the
//! failing one, so they cannot overtake it, and no other session is held up because every
//! session has its own task. There is no retry queue and no retry state machine.
//!
//! Session tasks exist only while a session is active; the dispatcher spawns them on a
//! session's first record and drops them after `sessionIdleMs` without work.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use rand::Rng;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::dlq::DlqReason;
use crate::handler::{Handler, HandlerError};
use crate::metrics::Metrics;
use crate::producer::StageProducer;
use crate::record::InputRecord;
use crate::retry::RetryPolicy;

/// What every session task of a stage shares.
pub struct SessionContext<H> {
    pub handler: Arc<H>,
    pub producer: StageProducer,
    pub retry: RetryPolicy,
    pub metrics: Metrics,
    /// Cancelled when the shutdown deadline passes: stop mid-record, leave it uncommitted.
    pub abort: CancellationToken,
}

/// A running session's queue, as its dispatcher sees it.
pub struct SessionHandle {
    pub tx: mpsc::UnboundedSender<InputRecord>,
    /// Records sent to the task and not yet finished by it.
    pub queued: Arc<AtomicUsize>,
    pub last_active: Instant,
}

impl SessionHandle {
    /// Spawns the task of `session` on `tasks`.
    pub fn spawn<H: Handler>(
        session: Bytes,
        ctx: Arc<SessionContext<H>>,
        tasks: &tokio_util::task::TaskTracker,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let task = SessionTask {
            session,
            rx,
            queued: queued.clone(),
            ctx,
        };
        tasks.spawn(task.run());
        Self {
            tx,
            queued,
            last_active: Instant::now(),
        }
    }

    /// Queues a record behind the session's earlier ones. Returns it if the task is gone.
    // Handing the record back (a move, not a copy) is the point of the error variant.
    #[allow(clippy::result_large_err)]
    pub fn send(&mut self, record: InputRecord) -> Result<(), InputRecord> {
        self.queued.fetch_add(1, Ordering::AcqRel);
        self.last_active = Instant::now();
        self.tx.send(record).map_err(|e| {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            e.0
        })
    }

    /// Idle: nothing queued or running, for at least `idle`.
    pub fn is_idle(&self, now: Instant, idle: std::time::Duration) -> bool {
        self.queued.load(Ordering::Acquire) == 0 && now.duration_since(self.last_active) >= idle
    }
}

struct SessionTask<H> {
    session: Bytes,
    rx: mpsc::UnboundedReceiver<InputRecord>,
    queued: Arc<AtomicUsize>,
    ctx: Arc<SessionContext<H>>,
}

impl<H: Handler> SessionTask<H> {
    async fn run(mut self) {
        self.ctx.metrics.active_sessions.inc();
        // The dispatcher drops the sender when it reaps this session or shuts down; queued
        // records are still processed first.
        while let Some(record) = self.rx.recv().await {
            if self.ctx.abort.is_cancelled() {
                break;
            }
            if record.lease.is_revoked() {
                self.ctx.producer.release(&record);
            } else {
                self.process(record).await;
            }
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        self.ctx.metrics.active_sessions.dec();
        tracing::trace!(session = %String::from_utf8_lossy(&self.session), "session task ended");
    }

    /// Runs one record to completion (success or DLQ), or releases it (abort, revocation).
    async fn process(&self, record: InputRecord) {
        if !self.attempt_until_settled(&record).await {
            self.ctx.producer.release(&record);
        }
    }

    /// Tries the record until it succeeds or goes to the DLQ (true), or is abandoned (false).
    async fn attempt_until_settled(&self, record: &InputRecord) -> bool {
        let ctx = &*self.ctx;
        let mut attempt: u32 = 1;
        loop {
            let started = Instant::now();
            let result = tokio::select! {
                r = ctx.handler.handle(record, attempt) => r,
                _ = ctx.abort.cancelled() => return false,
            };
            let outcome = match &result {
                Ok(_) => "ok",
                Err(HandlerError::Transient(_)) => "transient",
                Err(HandlerError::Poison(_)) => "poison",
            };
            ctx.metrics
                .handler_seconds
                .with_label_values(&[outcome])
                .observe(started.elapsed().as_secs_f64());
            match result {
                Ok(payload) => {
                    ctx.producer.output(record, payload).await;
                    return true;
                }
                Err(HandlerError::Poison(e)) => {
                    let reason = DlqReason::Poison;
                    ctx.producer.dead_letter(record, reason, &e, attempt).await;
                    return true;
                }
                Err(HandlerError::Transient(e)) if !ctx.retry.may_retry(attempt) => {
                    let reason = DlqReason::RetriesExhausted;
                    ctx.producer.dead_letter(record, reason, &e, attempt).await;
                    return true;
                }
                Err(HandlerError::Transient(e)) => {
                    ctx.metrics.retries.inc();
                    let delay = ctx.retry.delay(attempt, rand::rng().random::<f64>());
                    tracing::debug!(session = %record.session_str(), offset = record.offset,
                        attempt, ?delay, error = %e, "transient failure; retrying in place");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = ctx.abort.cancelled() => return false,
                    }
                    if record.lease.is_revoked() {
                        return false; // the partition moved to another worker, which redoes it
                    }
                    attempt += 1;
                }
            }
        }
    }
}
