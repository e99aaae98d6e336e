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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::BorrowedMessage;
use rdkafka::{Message, Offset as KafkaOffset, TopicPartitionList};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backpressure::{self, Offer, PendingBuffer};
use crate::completion::{Completion, CompletionReceiver};
use crate::config::{RebalanceStrategy, SessionSource};
use crate::dlq::DlqReason;
use crate::health::Health;
use crate::lag::Assigned;
use crate::metrics::Metrics;
use crate::offset_map::{self, DoneAbove};
use crate::offsets::{OffsetTracker, Partition};
use crate::partition_queues::{self, PartitionQueues};
use crate::producer::StageProducer;
use crate::record::{InputRecord, Lease};
use crate::routing::SessionRouter;

/// How long an idle loop waits for records before it serves events and chores again.
const POLL_TIMEOUT: Duration = Duration::from_millis(20);
/// How long a loop with a held partition waits before it looks again whether it may take more.
const HOLD_TICK: Duration = Duration::from_millis(1);
/// Records taken from one partition's queue per turn: a fair share before the next partition.
const BURST: usize = 256;
/// How often a drain (revocation, shutdown) checks for completions.
const DRAIN_CHECK: Duration = Duration::from_millis(50);
/// How often the loop checks it can still reach the broker.
const HEALTH_CHECK: Duration = Duration::from_secs(5);

/// The consumer loop's settings.
#[derive(Debug, Clone)]
pub struct IntakeSettings {
    pub input: String,
    pub session: SessionSource,
    pub commit_interval: Duration,
    pub max_in_flight_per_partition: usize,
    /// Longest wait for a revoked partition's in-flight records.
    pub revoke_drain_timeout: Duration,
    /// Longest wait for in-flight records at shutdown.
    pub shutdown_timeout: Duration,
}

/// The consumer settings the guarantees rely on, then the user's extra properties.
pub fn consumer_config(
    brokers: &str,
    group: &str,
    strategy: RebalanceStrategy,
    extra: &[(String, String)],
) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        // Starting at the end would skip what was produced before the stage first ran.
        .set("auto.offset.reset", "earliest")
        // Each partition has its own queue (see `partition_queues`), so this bounds what is
        // prefetched per assigned partition.
        .set("queued.max.messages.kbytes", "4096");
    for (k, v) in extra {
        c.set(k, v);
    }
    c.set("group.id", group)
        .set(
            "partition.assignment.strategy",
            strategy.assignment_strategy(),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    c
}

/// What the loop knows about one assigned partition.
struct PartitionState {
    lease: Arc<Lease>,
    pending: PendingBuffer,
    /// Not taking records from its queue (see [`backpressure`]).
    held: bool,
    /// Records taken in and neither completed nor released unprocessed.
    unreleased: usize,
    /// Offsets above the committed watermark that a previous owner finished (commit metadata).
    done_above: DoneAbove,
    /// The completed-offset map no longer fits in commit metadata: take no new records until
    /// the watermark catches up.
    map_overflow: bool,
}

/// Everything the loop and the rebalance callback share.
struct Book {
    topic: Arc<str>,
    /// The assignment, shared with the lag reporter.
    assigned: Assigned,
    tracker: OffsetTracker,
    partitions: HashMap<Partition, PartitionState>,
    /// Bumped on every assignment change, so the loop knows to split off or drop queues.
    assignment_version: u64,
    next_epoch: u64,
    completions: CompletionReceiver,
}

impl Book {
    /// Applies one completion (or release) to the tracker.
    fn apply(&mut self, c: Completion, metrics: &Metrics) {
        let Some(state) = self.partitions.get_mut(&c.partition) else {
            return; // from a partition we no longer own
        };
        if state.lease.epoch != c.epoch {
            return; // from an earlier assignment of this partition
        }
        state.unreleased = state.unreleased.saturating_sub(1);
        if c.done {
            if let Err(e) = self.tracker.complete(c.partition, c.offset) {
                tracing::error!(error = %e, partition = c.partition, "offset bookkeeping");
            }
        }
        metrics.in_flight.set(self.tracker.in_flight() as i64);
    }

    /// Applies every completion already waiting.
    fn apply_ready(&mut self, metrics: &Metrics) {
        while let Ok(c) = self.completions.try_recv() {
            self.apply(c, metrics);
        }
    }

    fn unreleased(&self, partitions: &[Partition]) -> usize {
        partitions
            .iter()
            .filter_map(|p| self.partitions.get(p))
            .map(|s| s.unreleased)
            .sum()
    }

    /// Releases (without completing) every parked record of `partition`.
    fn drop_pending(&mut self, partition: Partition) {
        if let Some(state) = self.partitions.get_mut(&partition) {
            let dropped = state.pending.take_all().len();
            state.unreleased = state.unreleased.saturating_sub(dropped);
        }
    }

    /// Watermarks of `partitions` (all when `None`) as a commit list; marks them committed.
    fn commit_list(&mut self, only: Option<&[Partition]>, force: bool) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        let mut chosen: Vec<(Partition, i64)> = Vec::new();
        for (p, offsets) in self.tracker.partitions() {
            if only.is_some_and(|ps| !ps.contains(&p)) {
                continue;
            }
            let candidate = if force {
                offsets.watermark()
            } else {
                offsets.commit_candidate()
            };
            if let Some(w) = candidate {
                chosen.push((p, w));
            }
        }
        for (p, w) in chosen {
            let Some(o) = self.tracker.partition_mut(p) else {
                continue;
            };
            let map = offset_map::encode(w, o.next().unwrap_or(w), o.in_flight_offsets());
            o.mark_committed(w);
            let overflow = matches!(map, Err(offset_map::MapError::TooLarge(_)));
            if let Some(state) = self.partitions.get_mut(&p) {
                if overflow && !state.map_overflow {
                    tracing::warn!(
                        partition = p,
                        "completed-offset map too large for commit \
                        metadata; committing the plain watermark and holding intake"
                    );
                }
                state.map_overflow = overflow;
            }
            let _ = tpl.add_partition_offset(&self.topic, p, KafkaOffset::Offset(w));
            if let (Ok(text), Some(mut el)) = (map, tpl.find_partition(&self.topic, p)) {
                el.set_metadata(text);
            }
        }
        tpl
    }
}

/// The librdkafka context: rebalance and commit callbacks, with access to the [`Book`].
pub struct IntakeContext {
    book: Mutex<Book>,
    settings: IntakeSettings,
    metrics: Metrics,
    health: Arc<Health>,
    /// Set once shutdown has drained and committed: later revocations (from close) just drop.
    closing: AtomicBool,
}

impl IntakeContext {
    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn on_assign(&self, consumer: &BaseConsumer<IntakeContext>, tpl: &TopicPartitionList) {
        let committed = self.committed_maps(consumer, tpl);
        let mut book = self.book();
        for e in tpl.elements_for_topic(&self.settings.input) {
            let p = e.partition();
            if book.partitions.contains_key(&p) {
                continue;
            }
            let done_above = committed
                .get(&p)
                .cloned()
                .unwrap_or_else(|| DoneAbove::empty(0));
            book.next_epoch += 1;
            let lease = Arc::new(Lease::new(p, book.next_epoch));
            book.tracker.assign(p);
            if let Ok(mut a) = book.assigned.lock() {
                a.insert(p);
            }
            book.partitions.insert(
                p,
                PartitionState {
                    lease,
                    pending: PendingBuffer::default(),
                    held: false,
                    unreleased: 0,
                    done_above,
                    map_overflow: false,
                },
            );
            tracing::info!(partition = p, "partition assigned");
        }
        book.assignment_version += 1;
    }

    /// The completed-offset maps committed for the newly assigned partitions (empty where the
    /// broker kept no metadata).
    fn committed_maps(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        tpl: &TopicPartitionList,
    ) -> HashMap<Partition, DoneAbove> {
        let mut maps = HashMap::new();
        let committed = match consumer.committed_offsets(tpl.clone(), Duration::from_secs(10)) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "reading committed offsets failed; replaying from the watermark");
                return maps;
            }
        };
        for e in committed.elements_for_topic(&self.settings.input) {
            let KafkaOffset::Offset(w) = e.offset() else {
                continue;
            };
            match offset_map::decode(w, e.metadata()) {
                Ok(map) => {
                    if map.count() > 0 {
                        tracing::info!(
                            partition = e.partition(),
                            watermark = w,
                            already_done = map.count(),
                            "resuming with a completed-offset map"
                        );
                    }
                    maps.insert(e.partition(), map);
                }
                Err(err) => tracing::warn!(partition = e.partition(), error = %err,
                    "ignoring commit metadata; replaying from the watermark"),
            }
        }
        maps
    }

    /// Revocation: stop routing, let in-flight records finish (bounded), commit, forget.
    fn on_revoke(&self, consumer: &BaseConsumer<IntakeContext>, tpl: &TopicPartitionList) {
        let partitions: Vec<Partition> = tpl
            .elements_for_topic(&self.settings.input)
            .iter()
            .map(|e| e.partition())
            .collect();
        let mut book = self.book();
        for p in &partitions {
            if let Some(state) = book.partitions.get(p) {
                state.lease.revoke();
            }
            book.drop_pending(*p);
        }
        if !self.closing.load(Ordering::Acquire) {
            let deadline = Instant::now() + self.settings.revoke_drain_timeout;
            book = drain(book, &partitions, deadline, &self.metrics);
            let tpl = book.commit_list(Some(&partitions), true);
            if tpl.count() > 0 {
                match consumer.commit(&tpl, CommitMode::Sync) {
                    Ok(()) => record_committed(&self.metrics, &tpl),
                    Err(e) => {
                        self.metrics.commit_errors.inc();
                        tracing::warn!(error = %e, "final commit of revoked partitions failed");
                    }
                }
            }
        }
        for p in &partitions {
            let unfinished = book.unreleased(&[*p]);
            book.partitions.remove(p);
            book.tracker.revoke(*p);
            if let Ok(mut a) = book.assigned.lock() {
                a.remove(p);
            }
            tracing::info!(partition = p, unfinished, "partition revoked");
        }
        book.assignment_version += 1;
        self.metrics.in_flight.set(book.tracker.in_flight() as i64);
    }
}

/// Waits (releasing nothing) until the given partitions have nothing unreleased, or `deadline`.
fn drain<'a>(
    mut book: MutexGuard<'a, Book>,
    partitions: &[Partition],
    deadline: Instant,
    metrics: &Metrics,
) -> MutexGuard<'a, Book> {
    loop {
        book.apply_ready(metrics);
        if book.unreleased(partitions) == 0 || Instant::now() >= deadline {
            return book;
        }
        if let Ok(c) = book.completions.recv_timeout(DRAIN_CHECK) {
            book.apply(c, metrics);
        }
    }
}

fn record_committed(metrics: &Metrics, tpl: &TopicPartitionList) {
    for e in tpl.elements() {
        if let KafkaOffset::Offset(o) = e.offset() {
            metrics
                .committed_offset
                .with_label_values(&[e.topic(), &e.partition().to_string()])
                .set(o);
        }
    }
}

impl ClientContext for IntakeContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(rdkafka::types::RDKafkaErrorCode::AllBrokersDown)
        ) {
            self.health.set_ready(false);
        }
        tracing::warn!(error = %error, reason, "kafka client error");
    }
}

impl ConsumerContext for IntakeContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => self.on_revoke(consumer, tpl),
            Rebalance::Assign(tpl) => {
                for e in tpl.elements_for_topic(&self.settings.input) {
                    if !partition_queues::detach_before_assign(
                        consumer,
                        &self.settings.input,
                        e.partition(),
                    ) {
                        tracing::warn!(partition = e.partition(), "partition queue not detached");
                    }
                }
            }
            Rebalance::Error(_) => {}
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => self.on_assign(consumer, tpl),
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => record_committed(&self.metrics, offsets),
            Err(e) => {
                self.metrics.commit_errors.inc();
                tracing::warn!(error = %e, "offset commit failed; will retry");
                // Forget the optimistic marks so the next turn commits again.
                let mut book = self.book();
                for el in offsets.elements() {
                    if let Some(o) = book.tracker.partition_mut(el.partition()) {
                        o.forget_committed();
                    }
                }
            }
        }
    }
}

/// The consumer loop. Build it with [`IntakeLoop::new`], then [`IntakeLoop::run`] it on its own
/// thread.
pub struct IntakeLoop {
    consumer: Arc<BaseConsumer<IntakeContext>>,
    dispatchers: Vec<mpsc::Sender<InputRecord>>,
    router: SessionRouter,
    producer: StageProducer,
    runtime: tokio::runtime::Handle,
    stop: CancellationToken,
    abort: CancellationToken,
}

impl IntakeLoop {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: &ClientConfig,
        settings: IntakeSettings,
        completions: CompletionReceiver,
        assigned: Assigned,
        dispatchers: Vec<mpsc::Sender<InputRecord>>,
        producer: StageProducer,
        metrics: Metrics,
        health: Arc<Health>,
        runtime: tokio::runtime::Handle,
        stop: CancellationToken,
        abort: CancellationToken,
    ) -> KafkaResult<Self> {
        let context = IntakeContext {
            book: Mutex::new(Book {
                topic: settings.input.as_str().into(),
                assigned,
                tracker: OffsetTracker::new(),
                partitions: HashMap::new(),
                assignment_version: 0,
                next_epoch: 0,
                completions,
            }),
            settings,
            metrics,
            health,
            closing: AtomicBool::new(false),
        };
        let consumer: Arc<BaseConsumer<IntakeContext>> =
            Arc::new(config.create_with_context(context)?);
        let router = SessionRouter::new(dispatchers.len());
        Ok(Self {
            consumer,
            dispatchers,
            router,
            producer,
            runtime,
            stop,
            abort,
        })
    }

    fn ctx(&self) -> &IntakeContext {
        self.consumer.context()
    }

    /// Runs until `stop` is cancelled, then drains, commits and closes.
    pub fn run(self) {
        if !self.wait_for_input_topic() {
            return self.close();
        }
        if let Err(e) = self.consumer.subscribe(&[&self.ctx().settings.input]) {
            tracing::error!(error = %e, "subscribe failed");
            return self.close();
        }
        let mut queues = PartitionQueues::new(self.consumer.clone(), &self.ctx().settings.input);
        let mut seen_assignment = 0;
        let mut last_commit = Instant::now();
        let mut last_health = Instant::now();
        while !self.stop.is_cancelled() {
            self.ctx().health.beat();
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
            took |= self.take_from_partitions(&queues);
            self.ctx().book().apply_ready(&self.ctx().metrics);
            let (holding, released) = self.relieve_pressure();
            if last_commit.elapsed() >= self.ctx().settings.commit_interval {
                self.commit(CommitMode::Async, false);
                last_commit = Instant::now();
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
        self.shutdown();
    }

    /// Serves the consumer's events and takes every record waiting in its main queue. True
    /// when a record was taken.
    fn drain_main_queue(&self) -> bool {
        let mut took = false;
        while let Some(polled) = self.consumer.poll(Duration::ZERO) {
            match polled {
                Ok(message) => {
                    self.intake(&message);
                    took = true;
                }
                Err(e) => tracing::warn!(error = %e, "consume error"),
            }
        }
        took
    }

    /// Takes up to a burst of waiting records from each partition that is not held. True when
    /// a record was taken.
    fn take_from_partitions(&self, queues: &PartitionQueues<IntakeContext>) -> bool {
        let mut took = false;
        for p in queues.partitions() {
            if self.ctx().book().partitions.get(&p).is_none_or(|s| s.held) {
                continue;
            }
            for _ in 0..BURST {
                match queues.poll(p) {
                    Some(Ok(message)) => {
                        took = true;
                        if self.intake(&message) {
                            break;
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, partition = p, "consume error");
                        break;
                    }
                    None => break,
                }
            }
        }
        took
    }

    /// Takes one record in: track it, then route it, park it, or dead-letter it. True when its
    /// partition is held now.
    fn intake(&self, message: &BorrowedMessage<'_>) -> bool {
        let ctx = self.consumer.context();
        let partition = message.partition();
        let offset = message.offset();
        let mut book = ctx.book();
        let book = &mut *book;
        let Some(state) = book.partitions.get_mut(&partition) else {
            return false; // a late record of a partition no longer assigned here
        };
        let lease = state.lease.clone();
        if book.tracker.begin(partition, offset).is_err() {
            // Already taken in (a record fetched again); never process twice.
            return state.held;
        }
        ctx.metrics.records_in.inc();
        if state.done_above.is_done(offset) {
            // Finished by a previous owner (commit metadata): skip, but keep it in the books so
            // the watermark moves over it.
            ctx.metrics.replay_skipped.inc();
            let _ = book.tracker.complete(partition, offset);
            return state.held;
        }
        state.unreleased += 1;
        let record =
            InputRecord::from_message(message, book.topic.clone(), &ctx.settings.session, lease);
        if record.session.is_none() {
            let producer = self.producer.clone();
            self.runtime.spawn(async move {
                producer
                    .dead_letter(
                        &record,
                        DlqReason::MissingSession,
                        "record has no session id",
                        0,
                    )
                    .await;
            });
        } else if !state.pending.is_empty() {
            state.pending.park(record);
        } else {
            let d = self
                .router
                .route(record.session.as_deref().unwrap_or_default());
            match offer(&self.dispatchers[d], record) {
                Offer::Taken => {}
                Offer::Full(record) => state.pending.park(record),
                Offer::Closed(_) => state.unreleased -= 1,
            }
        }
        let span = book.tracker.partition(partition).map_or(0, |p| p.span());
        if state.map_overflow
            || backpressure::should_hold(
                state.pending.len(),
                span,
                ctx.settings.max_in_flight_per_partition,
            )
        {
            state.held = true;
        }
        state.held
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
                    let d = self
                        .router
                        .route(record.session.as_deref().unwrap_or_default());
                    offer(&self.dispatchers[d], record)
                });
                state.unreleased = state.unreleased.saturating_sub(closed.len());
            }
            let span = book.tracker.partition(*p).map_or(0, |o| o.span());
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

    fn commit(&self, mode: CommitMode, force: bool) {
        let tpl = self.ctx().book().commit_list(None, force);
        if tpl.count() == 0 {
            return;
        }
        match self.consumer.commit(&tpl, mode) {
            Ok(()) if matches!(mode, CommitMode::Sync) => {
                record_committed(&self.ctx().metrics, &tpl)
            }
            Ok(()) => {} // the commit callback reports the outcome
            Err(e) => {
                self.ctx().metrics.commit_errors.inc();
                tracing::warn!(error = %e, "offset commit failed");
                let mut book = self.ctx().book();
                for el in tpl.elements() {
                    if let Some(o) = book.tracker.partition_mut(el.partition()) {
                        o.forget_committed();
                    }
                }
            }
        }
    }

    /// Blocks (with retries) until the input topic exists. False when stopped meanwhile.
    fn wait_for_input_topic(&self) -> bool {
        let mut logged = false;
        while !self.stop.is_cancelled() {
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

    /// Stop fetching, let sessions finish up to the deadline, commit, close.
    fn shutdown(mut self) {
        let ctx = self.consumer.context();
        ctx.health.set_ready(false);
        // No new records reach the sessions: dispatchers end when their senders are gone,
        // session tasks finish what is queued. Parked records are released uncommitted.
        self.dispatchers.clear();
        let partitions: Vec<Partition> = {
            let mut book = ctx.book();
            let ps: Vec<Partition> = book.partitions.keys().copied().collect();
            for p in &ps {
                book.drop_pending(*p);
            }
            ps
        };
        let deadline = Instant::now() + ctx.settings.shutdown_timeout;
        let book = drain(ctx.book(), &partitions, deadline, &ctx.metrics);
        let unfinished = book.unreleased(&partitions);
        drop(book);
        if unfinished > 0 {
            tracing::warn!(
                unfinished,
                "shutdown deadline passed; unfinished records will be replayed"
            );
        }
        self.abort.cancel();
        self.commit(CommitMode::Sync, true);
        tracing::info!("final watermarks committed");
        self.close();
    }

    fn close(self) {
        self.ctx().closing.store(true, Ordering::Release);
        self.consumer.unsubscribe();
        // Serve the revocation that unsubscribing triggers, briefly.
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until && self.consumer.poll(Duration::from_millis(50)).is_some() {}
        drop(self.consumer);
    }
}

fn offer(dispatcher: &mpsc::Sender<InputRecord>, record: InputRecord) -> Offer {
    match dispatcher.try_send(record) {
        Ok(()) => Offer::Taken,
        Err(mpsc::error::TrySendError::Full(r)) => Offer::Full(r),
        Err(mpsc::error::TrySendError::Closed(r)) => Offer::Closed(r),
    }
}
