//! The consumer loop: fetch, track, route, commit — on one dedicated thread.
//!
//! One thread owns the Kafka consumer and everything about the partitions it holds: the offset
//! tracker, each partition's lease and pending buffer, the pause state. It never waits on a
//! session. Each turn it polls for a record (briefly), applies the completions that came back,
//! drains pending buffers, and commits the contiguous watermarks when the interval is up.
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
use crate::producer::StageProducer;
use crate::record::{InputRecord, Lease};
use crate::routing::SessionRouter;

/// How long one `poll` may wait for a record before the loop does its other chores.
const POLL_TIMEOUT: Duration = Duration::from_millis(20);
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
    pub dispatcher_capacity: usize,
    /// Fraction of capacity under which a paused partition resumes.
    pub resume_below: f64,
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
        .set("queued.max.messages.kbytes", "16384");
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
    paused: bool,
    /// The dispatcher that last refused a record of this partition.
    blocked_on: Option<usize>,
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
                    paused: false,
                    blocked_on: None,
                    unreleased: 0,
                    done_above,
                    map_overflow: false,
                },
            );
            tracing::info!(partition = p, "partition assigned");
        }
        // librdkafka keeps a partition's paused flag across assignments: a partition paused
        // for backpressure when it was revoked would come back paused, and our fresh state
        // would never resume it. New assignments start fetching.
        let mut fresh = TopicPartitionList::new();
        for e in tpl.elements_for_topic(&self.settings.input) {
            fresh.add_partition(&self.settings.input, e.partition());
        }
        drop(book);
        if fresh.count() > 0 {
            if let Err(e) = consumer.resume(&fresh) {
                tracing::warn!(error = %e, "resuming newly assigned partitions failed");
            }
        }
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
        if let Rebalance::Revoke(tpl) = rebalance {
            self.on_revoke(consumer, tpl);
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
    consumer: BaseConsumer<IntakeContext>,
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
                next_epoch: 0,
                completions,
            }),
            settings,
            metrics,
            health,
            closing: AtomicBool::new(false),
        };
        let consumer: BaseConsumer<IntakeContext> = config.create_with_context(context)?;
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
        let mut last_commit = Instant::now();
        let mut last_health = Instant::now();
        while !self.stop.is_cancelled() {
            self.ctx().health.beat();
            if let Some(polled) = self.consumer.poll(POLL_TIMEOUT) {
                match polled {
                    Ok(message) => {
                        self.intake(&message);
                        // Take a burst of already-fetched records before the chores.
                        for _ in 0..256 {
                            match self.consumer.poll(Duration::ZERO) {
                                Some(Ok(m)) => self.intake(&m),
                                Some(Err(e)) => {
                                    tracing::warn!(error = %e, "consume error");
                                    break;
                                }
                                None => break,
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "consume error"),
                }
            }
            self.ctx().book().apply_ready(&self.ctx().metrics);
            self.relieve_pressure();
            if last_commit.elapsed() >= self.ctx().settings.commit_interval {
                self.commit(CommitMode::Async, false);
                last_commit = Instant::now();
            }
            if last_health.elapsed() >= HEALTH_CHECK {
                self.check_broker();
                last_health = Instant::now();
            }
        }
        self.shutdown();
    }

    /// Takes one record in: track it, then route it, park it, or dead-letter it.
    fn intake(&self, message: &BorrowedMessage<'_>) {
        let ctx = self.consumer.context();
        let partition = message.partition();
        let offset = message.offset();
        let mut book = ctx.book();
        let book = &mut *book;
        let Some(state) = book.partitions.get_mut(&partition) else {
            return; // a late record of a partition no longer assigned here
        };
        let lease = state.lease.clone();
        if book.tracker.begin(partition, offset).is_err() {
            // Already taken in (a re-fetch after pause/resume); never process twice.
            return;
        }
        ctx.metrics.records_in.inc();
        if state.done_above.is_done(offset) {
            // Finished by a previous owner (commit metadata): skip, but keep it in the books so
            // the watermark moves over it.
            ctx.metrics.replay_skipped.inc();
            let _ = book.tracker.complete(partition, offset);
            return;
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
        } else if state.paused || !state.pending.is_empty() {
            state.pending.park(record);
        } else {
            let d = self
                .router
                .route(record.session.as_deref().unwrap_or_default());
            match offer(&self.dispatchers[d], record) {
                Offer::Taken => {}
                Offer::Full(record) => {
                    state.blocked_on = Some(d);
                    state.pending.park(record);
                }
                Offer::Closed(_) => state.unreleased -= 1,
            }
        }
        let span = book.tracker.partition(partition).map_or(0, |p| p.span());
        if !state.paused
            && (state.map_overflow
                || backpressure::should_pause(
                    state.pending.len(),
                    backpressure::park_limit(ctx.settings.dispatcher_capacity),
                    span,
                    ctx.settings.max_in_flight_per_partition,
                ))
        {
            state.paused = true;
            pause_partition(&self.consumer, &book.topic, partition, true);
        }
    }

    /// Moves parked records on and resumes partitions whose pressure is gone.
    fn relieve_pressure(&self) {
        let ctx = self.consumer.context();
        let mut book = ctx.book();
        let book = &mut *book;
        let mut paused = 0;
        let mut pending_total = 0;
        for (p, state) in book.partitions.iter_mut() {
            if state.map_overflow && !state.paused {
                // The last commit could not carry the completed-offset map: hold intake now
                // rather than at the partition's next record.
                state.paused = true;
                pause_partition(&self.consumer, &book.topic, *p, true);
            }
            if !state.paused && state.pending.is_empty() {
                continue;
            }
            let (_, closed) = state.pending.drain(|record| {
                let d = self
                    .router
                    .route(record.session.as_deref().unwrap_or_default());
                let result = offer(&self.dispatchers[d], record);
                if matches!(result, Offer::Full(_)) {
                    state.blocked_on = Some(d);
                }
                result
            });
            state.unreleased = state.unreleased.saturating_sub(closed.len());
            if !state.paused {
                // Parked without a pause: what is still parked waits for the next round.
                pending_total += state.pending.len();
                if state.pending.is_empty() {
                    state.blocked_on = None;
                }
                continue;
            }
            let span = book.tracker.partition(*p).map_or(0, |o| o.span());
            let (free, capacity) = state.blocked_on.map_or(
                (
                    ctx.settings.dispatcher_capacity,
                    ctx.settings.dispatcher_capacity,
                ),
                |d| {
                    (
                        self.dispatchers[d].capacity(),
                        self.dispatchers[d].max_capacity(),
                    )
                },
            );
            if !state.map_overflow
                && backpressure::may_resume(
                    state.pending.len(),
                    span,
                    ctx.settings.max_in_flight_per_partition,
                    free,
                    capacity,
                    ctx.settings.resume_below,
                )
            {
                state.paused = false;
                state.blocked_on = None;
                pause_partition(&self.consumer, &book.topic, *p, false);
            } else {
                paused += 1;
                pending_total += state.pending.len();
            }
        }
        let overflowing = book.partitions.values().filter(|s| s.map_overflow).count();
        ctx.metrics.paused_partitions.set(paused);
        ctx.metrics.map_overflow_partitions.set(overflowing as i64);
        ctx.metrics.pending_records.set(pending_total as i64);
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

fn pause_partition(
    consumer: &BaseConsumer<IntakeContext>,
    topic: &str,
    partition: Partition,
    pause: bool,
) {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    let result = if pause {
        consumer.pause(&tpl)
    } else {
        consumer.resume(&tpl)
    };
    match result {
        Ok(()) => tracing::debug!(partition, pause, "partition fetch state changed"),
        Err(e) => tracing::warn!(error = %e, partition, pause, "pause/resume failed"),
    }
}
