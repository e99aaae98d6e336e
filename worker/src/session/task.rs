//! The session task: one session's records, one at a time, in arrival order.
//!
//! This is where per-session order comes from. A session task takes the next record only after
//! the previous one has succeeded or gone to the DLQ, and a transient failure is retried *here*,
//! in place, after a backoff: the session's later records simply wait in its queue behind the
//! failing one, so they cannot overtake it, and no other session is held up because every
//! session has its own task. There is no retry queue and no retry state machine.
//!
//! A record is finished when it is *settled* (see `settle`): its output or dead letter is
//! acknowledged by the broker. Only then does the task take the next record, so a produce that
//! fails cannot let a later output of the session overtake it.
//!
//! A handler that panics is a failed attempt like any transient error: the panic is caught,
//! counted and logged, and the same record is retried in place after a backoff; the session's
//! queued records stay queued behind it.
//!
//! Session tasks exist only while a session is active: the dispatcher spawns one on a record for a
//! session without one, and a task with nothing to do for 250 ms hibernates (ends, handing what it
//! remembers back to the dispatcher, see `SessionHandle`); the session itself is forgotten after
//! `sessionIdleMs` without work. A session remembers the event ids it recently settled, so a record
//! replayed upstream (the same event again, in the same assignment) is not processed and produced
//! twice. An id enters that memory only once its result is acknowledged, so a skip never hides a
//! loss; and it is honoured only within the assignment that settled it (see `RecentEvents`).

use std::collections::VecDeque;
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use futures::FutureExt;
use rand::Rng;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::handler::{Handler, HandlerError, HandlerResult};
use crate::ops::batched::Batched;
use crate::ops::health::Health;
use crate::ops::metrics::Metrics;
use crate::ops::signal::Signal;
use crate::ops::telemetry;
use crate::ops::watchdog::SeqWatch;
use crate::output::producer::StageProducer;
use crate::record::DlqReason;
use crate::record::InputRecord;
use crate::session::mailbox;
use crate::session::retry::RetryPolicy;
use crate::session::settle::{Outcome, Settled, Settler};
use crate::session::stuck::{StuckPolicy, StuckWatch, Verdict};

/// How many finished event ids a session task remembers.
const RECENT_EVENT_IDS: usize = 256;

/// What every session task of a stage shares.
pub struct SessionContext<H> {
    pub handler: Arc<H>,
    pub producer: StageProducer,
    pub retry: RetryPolicy,
    pub stuck: StuckPolicy,
    pub metrics: Metrics,
    pub health: Arc<Health>,
    /// Cancelled when the shutdown deadline passes: stop mid-record, leave it uncommitted.
    pub abort: Signal,
    /// Cancelled at shutdown unless the stage drains everything queued: a session finishes
    /// the record it is working on and releases the ones queued behind it (the partition's
    /// next owner takes them).
    pub release_queued: Signal,
}

impl<H> SessionContext<H> {
    fn settler(&self) -> Settler<'_> {
        Settler {
            producer: &self.producer,
            metrics: &self.metrics,
            health: &self.health,
            abort: &self.abort,
        }
    }
}

/// A session as its dispatcher sees it: the queue of its running task, or, while it is hibernated,
/// what its last task remembered.
///
/// A session with nothing to do keeps its task for a while (a new task per record would cost a
/// spawn per record), then *hibernates*: the task ends and its memory (order watch, recent event
/// ids) comes back here, a few words in the dispatcher's map, until the next record starts a
/// task with it or the session is reaped. A million sessions idling between two messages then
/// cost their map entries, not a million tasks and queues (see `mailbox`).
#[derive(Default)]
pub struct SessionHandle {
    /// Boxed records: the queue's slots stay allocated while the task lives (a few for an
    /// idle one, see `mailbox`); a pointer each instead of a whole record. `None`: hibernated.
    tx: Option<mailbox::Sender<Box<InputRecord>, Memory>>,
    /// What the session's last task left when it hibernated (the default while a task runs).
    kept: Memory,
    last_active: Option<Instant>,
    /// Order check of the records as they reach the session (the watchdog's "intake").
    intake: SeqWatch,
    /// On the dispatcher's list of sessions to tend (from its task's start until it is found
    /// hibernated).
    listed: bool,
}

/// What a session remembers from one task to the next.
#[derive(Default)]
pub struct Memory {
    /// Order check at handler entry.
    entry: SeqWatch,
    recent: RecentEvents,
}

/// What [`SessionHandle::send`] did with a record.
#[derive(Debug, PartialEq, Eq)]
pub enum Sent {
    /// Queued for the session's task.
    Queued,
    /// Queued for a task started for it (the session was new or hibernated), and the session is
    /// not on the dispatcher's list to tend: list it.
    Started,
}

impl SessionHandle {
    /// Queues a record behind the session's earlier ones, `now` being the time it arrived,
    /// starting a task on `tasks` if the session has none. Returns the record if the task
    /// ended without hibernation (aborted).
    pub fn send<H: Handler>(
        &mut self,
        record: Box<InputRecord>,
        ctx: &Arc<SessionContext<H>>,
        tasks: &TaskTracker,
        now: Instant,
    ) -> Result<Sent, Box<InputRecord>> {
        if self.intake.observe(record.lease.epoch, record.seq()) {
            ctx.metrics
                .order_violations
                .with_label_values(&["intake"])
                .inc();
            tracing::error!(session = %record.session_str(), offset = record.offset,
                seq = record.seq(), "order violation at intake");
        }
        self.last_active = Some(now);
        let mut record = record;
        if let Some(tx) = &self.tx {
            match tx.send(record) {
                Ok(()) => return Ok(Sent::Queued),
                // Hibernated since the dispatcher last looked: a new task takes over its memory.
                Err(back) => match tx.hibernated() {
                    Some(kept) => {
                        self.kept = kept;
                        record = back;
                    }
                    None => return Err(back),
                },
            }
        }
        let (tx, rx) = mailbox::mailbox();
        let task = SessionTask {
            rx,
            ctx: ctx.clone(),
            memory: std::mem::take(&mut self.kept),
        };
        tasks.spawn(task.run());
        let tx = self.tx.insert(tx);
        tx.send(record)?;
        if self.listed {
            return Ok(Sent::Queued);
        }
        self.listed = true;
        Ok(Sent::Started)
    }

    /// Looks after a listed session: asks its task to hibernate once the session has been idle for
    /// `hibernate_after`, and takes its memory back once it has. False when it has no task any more
    /// (and is off the list).
    pub fn tend(&mut self, now: Instant, hibernate_after: std::time::Duration) -> bool {
        let Some(tx) = &self.tx else {
            self.listed = false;
            return false;
        };
        if let Some(kept) = tx.hibernated() {
            self.kept = kept;
            self.tx = None;
            self.listed = false;
            return false;
        }
        if self.is_idle(now, hibernate_after) {
            tx.ask_to_hibernate();
        }
        true
    }

    /// Idle: nothing queued or running, for at least `idle`.
    pub fn is_idle(&self, now: Instant, idle: std::time::Duration) -> bool {
        self.tx.as_ref().is_none_or(|tx| tx.unfinished() == 0)
            && self
                .last_active
                .is_none_or(|last| now.duration_since(last) >= idle)
    }
}

/// Event ids a session settled recently, each with the assignment (lease epoch) it was
/// settled under, oldest evicted first.
///
/// A replay is skipped only within the assignment that settled it (an upstream replay of the
/// same event). Once the partition has been away and come back, another owner may have
/// written the session's later records meanwhile; skipping the rest of a replayed range the
/// new owner started would leave the session's output ending on an older record.
///
/// Only ids carried in the `sessionflow-event-id` header are remembered: an id made from the
/// record's own offset (`topic-partition-offset`) cannot come again within an assignment,
/// whose offsets are taken in once each (see `offsets`), so remembering it would only cost.
/// One allocation per id remembered, shared by the map and the eviction order; nothing at all
/// (a null pointer in the task) until the first id, since most sessions never see one.
#[derive(Default)]
struct RecentEvents(Option<Box<Remembered>>);

#[derive(Default)]
struct Remembered {
    order: VecDeque<Arc<str>>,
    epochs: foldhash::HashMap<Arc<str>, u64>,
}

impl RecentEvents {
    fn contains(&self, id: &str, epoch: u64) -> bool {
        self.0
            .as_ref()
            .is_some_and(|r| r.epochs.get(id) == Some(&epoch))
    }

    /// Whether `record` is a replay of one settled recently under the same assignment. With
    /// nothing remembered (stages whose input carries no event ids) it costs no header scan.
    fn replays(&self, record: &InputRecord) -> bool {
        self.0.is_some()
            && record
                .carried_event_id()
                .is_some_and(|id| self.contains(id, record.lease.epoch))
    }

    fn insert(&mut self, id: &str, epoch: u64) {
        let r = self.0.get_or_insert_with(Box::default);
        if let Some(known) = r.epochs.get_mut(id) {
            *known = epoch;
            return;
        }
        let id: Arc<str> = id.into();
        r.epochs.insert(id.clone(), epoch);
        r.order.push_back(id);
        if r.order.len() > RECENT_EVENT_IDS {
            if let Some(old) = r.order.pop_front() {
                r.epochs.remove(&old);
            }
        }
    }
}

struct SessionTask<H> {
    rx: mailbox::Receiver<Box<InputRecord>, Memory>,
    ctx: Arc<SessionContext<H>>,
    memory: Memory,
}

impl<H: Handler> SessionTask<H> {
    // Not an `async fn`: that would copy `self` into the future twice (the argument, then the
    // binding it is moved into), and every idle session's task would carry both.
    #[allow(clippy::manual_async_fn)]
    fn run(mut self) -> impl Future<Output = ()> + Send {
        async move {
            self.ctx.metrics.active_sessions.inc();
            // The dispatcher drops the sender when it reaps this session or shuts down (queued
            // records are still processed first), or asks the task to hibernate when it is idle.
            'task: loop {
                while let Some(record) = self.rx.recv().await {
                    // Boxed: the future of a record (handler call, retries, produce) is large
                    // and needed only while the session works; an idle session keeps only its
                    // queue. One box serves the records queued behind this one too.
                    if Box::pin(self.work(record)).await.is_break() {
                        break 'task;
                    }
                }
                match self.rx.hibernate(std::mem::take(&mut self.memory)) {
                    Ok(()) => break,
                    // A record came after all: back to work, with the memory.
                    Err(memory) => self.memory = memory,
                }
            }
            self.ctx.metrics.active_sessions.dec();
        }
    }

    /// Takes `first`, then each record already queued behind it, until none is left (without
    /// waiting for more); `Break` when shutdown aborted the work.
    async fn work(&mut self, first: Box<InputRecord>) -> ControlFlow<()> {
        // The run's `ok` handler times (see `batched`); what it holds is added when it drops.
        let mut ok_seconds = Batched::default();
        let mut next = Some(first);
        while let Some(record) = next {
            if self.ctx.abort.is_cancelled() {
                return ControlFlow::Break(());
            }
            if record.lease.is_draining() || self.ctx.release_queued.is_cancelled() {
                self.ctx.producer.release(&record);
            } else if self.memory.recent.replays(&record) {
                self.ctx.metrics.replay_skipped.inc();
                self.ctx.producer.complete(&record);
            } else {
                self.process(record, &mut ok_seconds).await;
            }
            self.rx.finished();
            next = self.rx.try_next();
        }
        ControlFlow::Continue(())
    }

    /// Runs one record until it is settled (output or DLQ acknowledged), or releases it
    /// (abort, revocation).
    async fn process(&mut self, record: Box<InputRecord>, ok_seconds: &mut Batched) {
        if self.memory.entry.observe(record.lease.epoch, record.seq()) {
            self.ctx
                .metrics
                .order_violations
                .with_label_values(&["handler"])
                .inc();
            tracing::error!(session = %record.session_str(), offset = record.offset,
                seq = record.seq(), "order violation at handler entry");
        }
        let span = telemetry::record_span(&record);
        let traced = !span.is_none();
        let started = Instant::now();
        let mut watch = StuckWatch::start(self.ctx.stuck, started);
        let settled = async {
            match self
                .attempt(&record, &mut watch, started, traced, ok_seconds)
                .await
            {
                Some(outcome) => {
                    let settler = self.ctx.settler();
                    let settling = settler.settle(&record, outcome, Some(&mut watch), started);
                    tokio::pin!(settling);
                    match ready_at_once(settling.as_mut(), ok_seconds).await {
                        Some(settled) => settled,
                        // A write awaiting the broker, or the membership fence.
                        None => settling.await,
                    }
                }
                None => {
                    self.ctx.producer.release(&record);
                    Settled::Released
                }
            }
        }
        .instrument(span)
        .await;
        watch.finish(&self.ctx.metrics);
        if let (Settled::Done, Some(id)) = (settled, record.carried_event_id()) {
            self.memory.recent.insert(id, record.lease.epoch);
        }
    }

    /// Tries the record until it succeeds or must go to the DLQ, or `None` when it is
    /// abandoned (abort, or its partition moved to another worker, which redoes it). `traced`:
    /// the record has a span, and each attempt gets a child of it.
    async fn attempt(
        &self,
        record: &InputRecord,
        watch: &mut StuckWatch,
        first_start: Instant,
        traced: bool,
        ok_seconds: &mut Batched,
    ) -> Option<Outcome> {
        let ctx = &*self.ctx;
        let mut attempt: u32 = 1;
        let mut started = first_start;
        loop {
            let call = self
                .call(record, attempt)
                .instrument(telemetry::attempt_span(traced, attempt));
            tokio::pin!(call);
            // A handler that is done at its first poll (most are, for a cached or CPU-only step)
            // never arms the stuck timer or registers with the abort token, which would cost a
            // timer-wheel entry per record.
            let result = match ready_at_once(call.as_mut(), ok_seconds).await {
                Some(r) => r,
                None => loop {
                    tokio::select! {
                        biased;
                        r = &mut call => break r,
                        _ = ctx.abort.cancelled() => return None,
                        _ = watch.expired(), if watch.armed() => {
                            if watch.fire(record, &ctx.metrics, first_start) == Verdict::DeadLetter {
                                return Some(Outcome::DeadLetter {
                                    reason: DlqReason::Stuck,
                                    error: format!("handler did not finish within {:?} (attempt {attempt})",
                                        ctx.stuck.timeout),
                                    attempts: attempt,
                                });
                            }
                        }
                    }
                },
            };
            let ended = Instant::now();
            let seconds = ended.saturating_duration_since(started).as_secs_f64();
            let outcomes = &ctx.metrics.handler_outcome;
            match &result {
                Ok(_) => ok_seconds.observe(&outcomes.ok, seconds, ended),
                Err(HandlerError::Transient(_)) => outcomes.transient.observe(seconds),
                Err(HandlerError::Poison(_)) => outcomes.poison.observe(seconds),
            }
            let error = match result {
                Ok(payload) => return Some(Outcome::Output(payload)),
                Err(HandlerError::Poison(e)) => {
                    return Some(Outcome::DeadLetter {
                        reason: DlqReason::Poison,
                        error: e,
                        attempts: attempt,
                    })
                }
                Err(HandlerError::Transient(e)) if !ctx.retry.may_retry(attempt) => {
                    return Some(Outcome::DeadLetter {
                        reason: DlqReason::RetriesExhausted,
                        error: e,
                        attempts: attempt,
                    })
                }
                Err(HandlerError::Transient(e)) => e,
            };
            ctx.metrics.retries.inc();
            let delay = ctx.retry.delay(attempt, rand::rng().random::<f64>());
            tracing::debug!(session = %record.session_str(), offset = record.offset,
                attempt, ?delay, error = %error, "transient failure; retrying in place");
            ok_seconds.waiting();
            let sleep = tokio::time::sleep(delay);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    _ = &mut sleep => break,
                    _ = ctx.abort.cancelled() => return None,
                    _ = watch.expired(), if watch.armed() => {
                        if watch.fire(record, &ctx.metrics, first_start) == Verdict::DeadLetter {
                            return Some(Outcome::DeadLetter {
                                reason: DlqReason::Stuck,
                                error: format!("still failing after {:?}: {error}", ctx.stuck.timeout),
                                attempts: attempt,
                            });
                        }
                    }
                }
            }
            if record.lease.is_draining() {
                return None;
            }
            attempt += 1;
            started = Instant::now();
        }
    }

    /// One handler attempt; a panic inside the handler is a transient failure of it.
    async fn call(&self, record: &InputRecord, attempt: u32) -> HandlerResult {
        let call = std::panic::AssertUnwindSafe(self.ctx.handler.handle(record, attempt));
        match call.catch_unwind().await {
            Ok(result) => result,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-text panic payload".into());
                self.ctx.metrics.handler_panics.inc();
                tracing::error!(session = %record.session_str(), partition = record.partition,
                    offset = record.offset, attempt, panic = %message,
                    "handler panicked; retrying the record in place");
                Err(HandlerError::Transient(format!(
                    "handler panicked: {message}"
                )))
            }
        }
    }
}

/// `future`'s answer if it has one at its first poll. If not, the task is about to wait (a
/// handler still working, a write awaiting the broker): what `ok_seconds` holds of the run's
/// handler times goes to the histogram first (see `Batched::waiting`).
async fn ready_at_once<F: Future>(
    future: std::pin::Pin<&mut F>,
    ok_seconds: &mut Batched,
) -> Option<F::Output> {
    match futures::poll!(future) {
        Poll::Ready(output) => Some(output),
        Poll::Pending => {
            ok_seconds.waiting();
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_events_are_honoured_within_their_assignment_and_evicted_oldest_first() {
        let mut recent = RecentEvents::default();
        assert!(!recent.contains("e-0", 1));
        for i in 0..RECENT_EVENT_IDS {
            recent.insert(&format!("e-{i}"), 1);
        }
        assert!(recent.contains("e-0", 1));
        assert!(
            !recent.contains("e-0", 2),
            "another assignment's replay is processed"
        );
        // Settled again under a later assignment: that one counts now.
        recent.insert("e-1", 2);
        assert!(recent.contains("e-1", 2) && !recent.contains("e-1", 1));
        recent.insert("e-new", 1);
        assert!(!recent.contains("e-0", 1), "the oldest is evicted");
        assert!(recent.contains("e-2", 1) && recent.contains("e-new", 1));
        let r = recent.0.as_ref().unwrap();
        assert_eq!(r.order.len(), RECENT_EVENT_IDS);
        assert_eq!(r.epochs.len(), RECENT_EVENT_IDS);
    }
}
