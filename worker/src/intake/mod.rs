//! The consumer loop: fetch, track, route, commit — on one dedicated thread.
//!
//! One thread owns the Kafka consumer and everything about the partitions it holds: the offset
//! tracker, each partition's lease, pending buffer and hold. It never waits on a session. Each
//! turn it serves the consumer's events, takes the records waiting in the queues of the
//! partitions that are not held (each partition has its own queue, see `partition_queues`),
//! applies the completions that came back, drains pending buffers, and commits the contiguous
//! watermarks when the interval is up.
//!
//! It is a plain thread rather than a tokio task because librdkafka runs the rebalance callback
//! *inside* `poll`, and on revocation that callback must wait (up to a deadline) for the
//! partition's in-flight records to finish and then commit synchronously — blocking, by design.
//! On a dedicated thread that wait blocks nothing else: session tasks keep running on the
//! runtime and their completions arrive over the completion channel.
//!
//! Partition state sits in a `Mutex<Book>` inside the consumer context so that the loop and
//! the rebalance callback (which runs on the same thread, within `poll`) can both reach it; the
//! lock is never contended.
//!
//! A commit is done when the broker says so: commits are synchronous, sent by the commit
//! thread (see `committer`) or, for a revocation's and the shutdown's final commit, by the loop
//! itself; every answer goes back to the offset tracker, which sends unconfirmed watermarks
//! again — an early one not at once after a refusal (see `commit_backoff`).
//!
//! Every turn, and every check of a drain, also judges the membership fence (see
//! `membership`): when the group coordinator has been silent too long, writes stop and the
//! producer's queued ones are purged, until it answers again.
//!
//! Where the rest lives: the book of partitions in `book`, the rebalance callbacks in
//! `rebalance`, the stop (drain, final commit, leaving the group) in `shutdown`, the fence's
//! own timer in `fence_timer`, the settings in `settings`, the `exactlyOnce` commits in
//! `transactional`.

mod book;
mod commit_backoff;
mod fence_timer;
pub mod fetched;
pub mod kafka_epoch;
pub mod partition_queues;
pub mod prefetch;
mod rebalance;
mod settings;
mod shutdown;
mod transactional;

pub use settings::{consumer_config, IntakeSettings};

use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::BorrowedMessage;
use rdkafka::{Message, Offset as KafkaOffset};
use tokio_util::sync::CancellationToken;

use crate::commit::committer::Committer;
use crate::commit::completion::CompletionReceiver;
use crate::commit::lag::Assigned;
use crate::commit::leader_epochs::Epoch;
use crate::commit::offset_map::DoneAbove;
use crate::commit::offsets::{Offset, OffsetError, Partition};
use crate::dispatch::backpressure::{self, Offer};
use crate::dispatch::handoff::{Batch, Handoff, Refused};
use crate::dispatch::routing::SessionRouter;
use crate::group::membership::Fence;
use crate::intake::book::{Book, PartitionState};
use crate::intake::fence_timer::FenceTimer;
use crate::intake::kafka_epoch::ReadAtEpoch;
use crate::intake::partition_queues::PartitionQueues;
use crate::intake::rebalance::IntakeContext;
use crate::ops::health::Health;
use crate::ops::metrics::Metrics;
use crate::ops::signal::Doorbell;
use crate::ops::signal::Signal;
use crate::output::producer::StageProducer;
use crate::record::DlqReason;
use crate::record::{InputRecord, Lease};
use crate::session::settle::{Outcome, Settler};
use commit_backoff::CommitBackoff;

/// How long an idle loop waits for records before it serves events and chores again.
const POLL_TIMEOUT: Duration = Duration::from_millis(20);
/// Events and records served from the consumer's main queue per turn, at most.
const MAIN_QUEUE_BURST: usize = 4_096;
/// How long a loop with a held partition waits before it looks again whether it may take more.
const HOLD_TICK: Duration = Duration::from_millis(1);
/// Records taken from one partition's queue per turn: a fair share before the next partition.
const BURST: usize = 256;
/// Commit intervals a commit may go unanswered before its partitions count as failing.
const COMMIT_STALL_TURNS: u32 = 3;
/// How often the loop reads how many records wait in the partition queues (a gauge).
const PREFETCH_READ: Duration = Duration::from_millis(100);
/// How often the loop looks for partitions given up for a fence whose grace is over.
const FENCED_CHECK: Duration = Duration::from_millis(500);
/// How often the loop checks it can still reach the broker.
const HEALTH_CHECK: Duration = Duration::from_secs(5);

/// The consumer loop. Build it with [`IntakeLoop::new`], then [`IntakeLoop::run`] it on its own
/// thread.
pub struct IntakeLoop {
    consumer: Arc<BaseConsumer<IntakeContext>>,
    dispatchers: Vec<Handoff>,
    /// Records taken in this turn, a batch per dispatcher, handed over at the turn's end (see
    /// `handoff`).
    outbox: RefCell<Vec<Batch>>,
    router: SessionRouter,
    producer: StageProducer,
    runtime: tokio::runtime::Handle,
    tokens: IntakeTokens,
    committer: RefCell<Committer>,
    /// What the loop waits on when it took nothing: rung by the partition queues and by the
    /// commit thread's answers.
    doorbell: Arc<Doorbell>,
    /// Judges the membership fence while the loop's thread is blocked (see [`FenceTimer`]).
    fence_timer: RefCell<Option<FenceTimer>>,
}

/// How the consumer loop is told to stop, and tells the sessions to.
#[derive(Clone, Default)]
pub struct IntakeTokens {
    /// Stop taking records; drain; commit; close.
    pub stop: CancellationToken,
    /// Cancelled by the loop when the shutdown deadline passes: sessions give up mid-record.
    pub abort: Signal,
    /// Cancelled by the loop at shutdown (unless draining everything queued): sessions release
    /// what is queued behind their current record.
    pub release_queued: Signal,
    /// Cancelled on a fatal client error (by either client): stop at once, exit non-zero.
    pub fatal: CancellationToken,
}

/// Why the consumer loop ended badly.
#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    #[error("subscribing to the input topic failed: {0}")]
    Subscribe(KafkaError),
    #[error("the final commit failed ({0}); progress since the last commit will be replayed")]
    FinalCommit(String),
    #[error("a fatal Kafka client error stopped the worker")]
    Fatal,
}

impl IntakeLoop {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: &ClientConfig,
        settings: IntakeSettings,
        completions: CompletionReceiver,
        assigned: Assigned,
        dispatchers: Vec<Handoff>,
        producer: StageProducer,
        metrics: Metrics,
        health: Arc<Health>,
        runtime: tokio::runtime::Handle,
        tokens: IntakeTokens,
    ) -> KafkaResult<Self> {
        let fence = Arc::new(Fence::new(
            settings.session_timeout,
            producer.gate().clone(),
            Instant::now(),
        ));
        let context = IntakeContext {
            book: Mutex::new(Book::new(
                settings.input.as_str().into(),
                assigned,
                completions,
            )),
            settings,
            metrics,
            health,
            fatal: tokens.fatal.clone(),
            fence: fence.clone(),
            producer: producer.clone(),
        };
        context.book().exactly_once = producer.transactions().is_some();
        let consumer: Arc<BaseConsumer<IntakeContext>> =
            Arc::new(config.create_with_context(context)?);
        let router = SessionRouter::new(dispatchers.len());
        let doorbell = Arc::new(Doorbell::default());
        let committer = Committer::spawn(
            consumer.clone(),
            &consumer.context().settings.input,
            fence,
            doorbell.clone(),
        )
        .map_err(|e| KafkaError::ClientCreation(format!("commit thread: {e}")))?;
        Ok(Self {
            committer: RefCell::new(committer),
            consumer,
            outbox: RefCell::new(dispatchers.iter().map(|_| Batch::new()).collect()),
            dispatchers,
            router,
            producer,
            runtime,
            tokens,
            doorbell,
            fence_timer: RefCell::new(None),
        })
    }

    fn ctx(&self) -> &IntakeContext {
        self.consumer.context()
    }

    /// Runs until `stop` (or `fatal`) is cancelled, then drains, commits and closes.
    pub fn run(self) -> Result<(), IntakeError> {
        if !self.wait_for_input_topic() {
            let result = self.fatal_or(Ok(()));
            self.close();
            return result;
        }
        if let Err(e) = self.consumer.subscribe(&[&self.ctx().settings.input]) {
            tracing::error!(error = %e, "subscribe failed");
            self.close();
            return Err(IntakeError::Subscribe(e));
        }
        match FenceTimer::start(self.consumer.clone()) {
            Ok(timer) => *self.fence_timer.borrow_mut() = Some(timer),
            Err(e) => tracing::warn!(error = %e,
                "no thread for the membership fence; it is judged by the consumer loop only"),
        }
        let mut queues = PartitionQueues::new(
            self.consumer.clone(),
            &self.ctx().settings.input,
            self.doorbell.clone(),
        );
        let mut seen_assignment = 0;
        let mut last_commit = Instant::now();
        let mut last_health = Instant::now();
        let mut last_prefetch_read = Instant::now();
        let mut last_fenced_check = Instant::now();
        let mut last_answer = Instant::now();
        let mut backoff = CommitBackoff::default();
        while !self.stopping() {
            self.ctx().health.beat();
            crate::ops::memory::hand_back_cache_after_trim();
            self.ctx().judge_membership();
            if let Some(transactions) = self.producer.transactions() {
                // exactlyOnce: transactions that can no longer commit are aborted, and their
                // partitions rewound (or given up, when fenced), before anything more is
                // taken in; given-up partitions still assigned after their grace reopened.
                let ctx = self.ctx();
                if transactions.any_doomed() || transactions.any_fenced() {
                    ctx.abort_doomed(&self.consumer, &mut ctx.book(), transactions);
                }
                if last_fenced_check.elapsed() >= FENCED_CHECK {
                    ctx.reopen_fenced(&self.consumer, &mut ctx.book(), transactions);
                    last_fenced_check = Instant::now();
                }
            }
            // Events (rebalances run in here) and records not in a partition queue yet; after a
            // queue is split off, the main queue once more: its records of that partition are
            // older than any in the new queue.
            let mut took = self.drain_main_queue();
            loop {
                let changed = {
                    let book = self.ctx().book();
                    (book.assignment_version != seen_assignment).then(|| {
                        let assigned: Vec<Partition> = book.partitions.keys().copied().collect();
                        (book.assignment_version, assigned)
                    })
                };
                let Some((version, assigned)) = changed else {
                    break;
                };
                seen_assignment = version;
                if queues.sync(&assigned) {
                    took |= self.drain_main_queue();
                }
            }
            // A commit's answer first, then what it and the completions changed (parked
            // records handed on, held partitions let go), then the take: a partition the answer
            // gave room takes in the same turn, which the early commit's gather counts on.
            if let Some(refused) = self.take_commit_answers() {
                last_answer = Instant::now();
                backoff.answered(refused > 0);
            }
            let (holding, released) = self.relieve_pressure();
            took |= self.take_from_partitions(&queues);
            self.ctx().book().apply_ready(&self.ctx().metrics);
            // Every interval, and early when a partition's replay span reaches half its cap
            // (the cap counts from the last confirmed commit, so commits must keep up;
            // three quarters in exactlyOnce, see `Book::commit_urgent`) once the records
            // taken since the last answer are done, or a short while after it
            // (`Book::early_commit_gathered`); after refused commits, not before the backoff's
            // wait (`CommitBackoff`).
            let interval = last_commit.elapsed() >= self.ctx().settings.commit_interval;
            if interval || {
                let book = self.ctx().book();
                let since_answer = last_answer.elapsed();
                since_answer >= backoff.early_wait()
                    && book.early_commit_gathered(since_answer)
                    && book.commit_urgent(
                        self.ctx().settings.max_in_flight_per_partition,
                        self.producer.transactions().is_some(),
                    )
            } {
                self.commit_in_background(interval);
            }
            if interval {
                last_commit = Instant::now();
            }
            if last_prefetch_read.elapsed() >= PREFETCH_READ {
                let waiting = queues.waiting();
                self.ctx().metrics.prefetched_records.set(waiting as i64);
                last_prefetch_read = Instant::now();
            }
            if last_health.elapsed() >= HEALTH_CHECK {
                self.check_broker();
                last_health = Instant::now();
            }
            // A released partition may have records waiting: its queue rings nobody (it never
            // went empty), so look at once.
            if !took && !released {
                queues.wait(if holding { HOLD_TICK } else { POLL_TIMEOUT });
            }
        }
        drop(queues);
        self.shutdown()
    }

    fn stopping(&self) -> bool {
        self.tokens.stop.is_cancelled() || self.tokens.fatal.is_cancelled()
    }

    /// `result`, unless a fatal error ended the run.
    fn fatal_or(&self, result: Result<(), IntakeError>) -> Result<(), IntakeError> {
        if self.tokens.fatal.is_cancelled() {
            Err(IntakeError::Fatal)
        } else {
            result
        }
    }

    /// Serves the consumer's events and takes every record waiting in its main queue. True
    /// when a record was taken.
    fn drain_main_queue(&self) -> bool {
        let mut took = false;
        // Each record handed over at once: a rebalance served next in this queue must find
        // every record taken either with a dispatcher or parked, none in the outbox.
        self.serve_main_queue(|message| {
            // Locked per record here: the rebalance callback, which locks the book too, runs
            // between two of them.
            self.intake(&mut self.ctx().book(), message);
            self.hand_over();
            took = true;
        });
        took
    }

    /// Serves everything waiting in the consumer's main queue, handing records to `take`.
    fn serve_main_queue(&self, take: impl FnMut(&BorrowedMessage<'_>)) {
        partition_queues::serve_main_queue(&self.consumer, MAIN_QUEUE_BURST, take);
    }

    /// Takes up to a burst of waiting records from each partition that is not held, in one
    /// call per partition (see `fetched`). True when a record was taken.
    ///
    /// A record taken from librdkafka cannot be put back, so a burst asks for no more than the
    /// partition's in-flight room ([`backpressure::room`]).
    fn take_from_partitions(&self, queues: &PartitionQueues<IntakeContext>) -> bool {
        let cap = self.ctx().settings.max_in_flight_per_partition;
        let mut took = false;
        for p in queues.partitions() {
            let room = {
                let book = self.ctx().book();
                match book.partitions.get(&p) {
                    Some(state) if !state.held && state.phase.takes_records() => {
                        let span = book.tracker.partition(p).map_or(0, |o| o.replay_span());
                        backpressure::room(span, cap)
                    }
                    _ => continue,
                }
            };
            // The book is locked once for the burst, at its first record: a partition's queue
            // holds records only, so nothing between them calls back into the loop.
            let mut book = None;
            let taken = queues.take(p, room.min(BURST), |message| match message {
                Ok(message) => {
                    let book = book.get_or_insert_with(|| self.ctx().book());
                    self.intake(book, message)
                }
                Err(e) => tracing::warn!(error = %e, partition = p, "consume error"),
            });
            drop(book);
            took |= taken > 0;
        }
        self.hand_over();
        took
    }

    /// Hands each dispatcher the batch this turn gathered for it. What finds no room (the
    /// batch's last records) is parked, record by record in the order taken, in the pending
    /// buffers of the records' partitions (it holds them; `relieve_pressure` offers them
    /// again). A batch for a dispatcher that is gone (shutdown) is dropped, and its records are
    /// no longer counted as waiting to be released.
    fn hand_over(&self) {
        let mut outbox = self.outbox.borrow_mut();
        for (dispatcher, batch) in self.dispatchers.iter().zip(outbox.iter_mut()) {
            if batch.is_empty() {
                continue;
            }
            let (refused, closed) = match dispatcher.offer(std::mem::take(batch)) {
                Ok(()) => continue,
                Err(Refused::Full(back)) => (back, false),
                Err(Refused::Closed(back)) => (back, true),
            };
            let ctx = self.ctx();
            let mut book = ctx.book();
            for record in refused {
                let Some(state) = book.partitions.get_mut(&record.partition) else {
                    continue; // cannot happen: no rebalance is served within a turn
                };
                if closed {
                    state.unreleased = state.unreleased.saturating_sub(1);
                } else {
                    state.pending.park(record);
                    state.held = true;
                }
            }
        }
    }

    /// The partition's log was truncated and written on from `at` by a newer leader (its
    /// record there was read again at the newer `epoch`: see [`crate::commit::leader_epochs`]).
    /// librdkafka has moved the fetch position back without a word, and the records from `at`
    /// on are new ones, never processed. Every record of the partition in flight is given up
    /// (its lease revoked: what is not written yet is not written), its books start over, and
    /// it is fetched again from its contiguous watermark, or from `at` if lower: what was in
    /// flight is replayed and what was rewritten is processed — nothing is skipped. (Outputs of
    /// the records the truncation took away may already be written; Kafka lost those inputs.)
    fn rewind(&self, book: &mut Book, partition: Partition, at: Offset, epoch: Epoch) {
        let ctx = self.ctx();
        let from = book
            .tracker
            .partition(partition)
            .and_then(|o| o.watermark())
            .map_or(at, |w| w.min(at));
        book.next_epoch += 1;
        let lease = Arc::new(Lease::new(partition, book.next_epoch));
        let Some(state) = book.partitions.get_mut(&partition) else {
            return;
        };
        state.lease.revoke();
        let given_up = state.unreleased;
        *state = PartitionState::new(lease, DoneAbove::empty(from));
        state.rewound_at = Some(at);
        book.tracker.revoke(partition);
        book.tracker.assign(partition);
        ctx.metrics.log_truncations.inc();
        tracing::warn!(
            partition,
            at,
            epoch,
            from,
            given_up,
            "input log truncated and rewritten by a new leader: records in flight given up, \
             replaying the partition from its watermark"
        );
        if let Err(e) = self.consumer.seek(
            &ctx.settings.input,
            partition,
            KafkaOffset::Offset(from),
            Duration::from_secs(10),
        ) {
            // librdkafka would go on from `at`, and the records from `from` up to it, given up
            // above, would never be processed here. Take nothing more from the partition (its
            // fresh books stay empty, so no commit passes `from`) and stop loudly: the restart
            // replays from the committed offset, which is at most `from`.
            if let Some(state) = book.partitions.get_mut(&partition) {
                state.rewound_at = Some(Offset::MIN);
            }
            ctx.metrics.fatal_errors.inc();
            ctx.health.fail();
            tracing::error!(error = %e, partition, from,
                "seek after a log truncation failed: the worker stops (the restart replays)");
            self.tokens.fatal.cancel();
        }
    }

    /// Takes one record in: track it, then route it, park it, or dead-letter it; hold its
    /// partition if that is now due.
    fn intake(&self, book: &mut Book, message: &(impl Message + ReadAtEpoch)) {
        let ctx = self.consumer.context();
        let partition = message.partition();
        let offset = message.offset();
        let epoch = message.leader_epoch();
        let Some(state) = book.partitions.get_mut(&partition) else {
            return; // a late record of a partition no longer assigned here
        };
        if !state.phase.takes_records() {
            return; // being revoked, or the stop's fence is up: left to the next owner
        }
        if let Some(at) = state.rewound_at {
            if offset > at {
                // The rest of a fetch from before a rewind: fetched again from its start.
                return;
            }
            state.rewound_at = None;
        }
        match book.tracker.begin(partition, offset, epoch) {
            Ok(()) => {}
            Err(OffsetError::Rewritten { .. }) => {
                self.rewind(book, partition, offset, epoch);
                return;
            }
            // Already taken in (a record fetched again); never process twice.
            Err(_) => return,
        }
        ctx.metrics.records_in.inc();
        if state.done_above.is_done(offset, epoch) {
            // Finished by a previous owner (commit metadata): skip, but keep it in the books so
            // the watermark moves over it.
            ctx.metrics.replay_skipped.inc();
            let _ = book.tracker.complete(partition, offset);
            return;
        }
        state.unreleased += 1;
        // Boxed here, once: the dispatcher's channel, the pending buffer and the session's queue
        // then move a pointer, not the record.
        let record = Box::new(InputRecord::from_message(
            message,
            book.topic,
            &ctx.settings.session,
            state.lease.clone(),
        ));
        if record.session().is_none() {
            let producer = self.producer.clone();
            let metrics = ctx.metrics.clone();
            let health = ctx.health.clone();
            let abort = self.tokens.abort.clone();
            self.runtime.spawn(async move {
                let settler = Settler {
                    producer: &producer,
                    metrics: &metrics,
                    health: &health,
                    abort: &abort,
                };
                let outcome = Outcome::DeadLetter {
                    reason: DlqReason::MissingSession,
                    error: "record has no session id".into(),
                    attempts: 0,
                };
                settler.settle(&record, outcome, None, Instant::now()).await;
            });
        } else if !state.pending.is_empty() {
            state.pending.park(record);
        } else {
            let d = self.router.route(record.session_hash());
            self.outbox.borrow_mut()[d].push(record);
        }
        let span = book
            .tracker
            .partition(partition)
            .map_or(0, |p| p.replay_span());
        if state.map_overflow
            || backpressure::should_hold(
                state.pending.len(),
                span,
                ctx.settings.max_in_flight_per_partition,
            )
        {
            state.held = true;
        }
    }

    /// Moves parked records on, and lets held partitions take records again once their
    /// pressure has eased. Returns whether a partition is still held, and whether one was
    /// released.
    fn relieve_pressure(&self) -> (bool, bool) {
        let ctx = self.consumer.context();
        let mut book = ctx.book();
        let book = &mut *book;
        let cap = ctx.settings.max_in_flight_per_partition;
        let (mut held, mut overflowing, mut pending_total) = (0, 0, 0);
        let mut released = false;
        for (p, state) in book.partitions.iter_mut() {
            if !state.pending.is_empty() {
                let (_, closed) = state.pending.drain(|record| {
                    let d = self.router.route(record.session_hash());
                    offer(&self.dispatchers[d], record)
                });
                state.unreleased = state.unreleased.saturating_sub(closed.len());
            }
            let span = book.tracker.partition(*p).map_or(0, |o| o.replay_span());
            let pending = state.pending.len();
            if state.map_overflow {
                // The last commit could not carry the completed-offset map: hold now rather
                // than at the partition's next record, until a commit carries one again.
                state.held = true;
                overflowing += 1;
            } else if state.held {
                state.held = !backpressure::may_take_again(pending, span, cap);
                released |= !state.held;
            } else {
                state.held = backpressure::should_hold(pending, span, cap);
            }
            held += usize::from(state.held);
            pending_total += pending;
        }
        ctx.metrics.paused_partitions.set(held as i64);
        ctx.metrics.map_overflow_partitions.set(overflowing);
        ctx.metrics.pending_records.set(pending_total as i64);
        (held > 0, released)
    }

    /// Hands the watermarks that need sending to the commit thread, unless its last commit is
    /// still unanswered (the next turn tries again).
    /// `interval`: this is the interval's turn (an unanswered commit ages by one).
    fn commit_in_background(&self, interval: bool) {
        let mut committer = self.committer.borrow_mut();
        if committer.busy() {
            if interval && committer.note_busy_turn() == COMMIT_STALL_TURNS {
                let ctx = self.ctx();
                ctx.book().commit_stalled(&ctx.metrics);
            }
            return;
        }
        let ctx = self.ctx();
        if let Some(transactions) = self.producer.transactions() {
            drop(committer);
            let mut book = ctx.book();
            ctx.commit_transactions(&self.consumer, &mut book, transactions, None, false);
            return;
        }
        let tpl = ctx.book().commit_list(None, false);
        if tpl.count() > 0 && committer.send(tpl).is_err() {
            tracing::error!("the commit thread is gone; commits stop");
        }
    }

    /// Takes the commit thread's answer, if one has arrived, into the tracker: how many of its
    /// partitions were refused.
    fn take_commit_answers(&self) -> Option<usize> {
        let a = self.committer.borrow_mut().answer()?;
        let ctx = self.ctx();
        Some(
            ctx.book()
                .commit_answered(&a.result, &a.offsets, &ctx.metrics),
        )
    }

    /// Blocks (with retries) until the input topic exists. False when stopped meanwhile.
    fn wait_for_input_topic(&self) -> bool {
        let mut logged = false;
        while !self.stopping() {
            self.ctx().health.beat();
            if self.check_broker() {
                return true;
            }
            if !logged {
                tracing::warn!(topic = %self.ctx().settings.input,
                    "waiting for the broker and the input topic; not ready");
                logged = true;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        false
    }

    /// Asks the broker for the input topic's metadata; sets readiness from the answer.
    fn check_broker(&self) -> bool {
        let topic = &self.ctx().settings.input;
        let ok = match self
            .consumer
            .fetch_metadata(Some(topic), Duration::from_secs(2))
        {
            Ok(md) => md
                .topics()
                .iter()
                .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()),
            Err(_) => false,
        };
        self.ctx().health.set_ready(ok);
        ok
    }
}

/// One parked record offered again, as a batch of its own (backpressure is rare enough).
fn offer(dispatcher: &Handoff, record: Box<InputRecord>) -> Offer {
    let one = |mut batch: Batch| batch.pop().expect("the batch of one comes back whole");
    match dispatcher.offer(vec![record]) {
        Ok(()) => Offer::Taken,
        Err(Refused::Full(back)) => Offer::Full(one(back)),
        Err(Refused::Closed(back)) => Offer::Closed(one(back)),
    }
}
