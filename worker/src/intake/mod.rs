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
//! again. Shutdown keeps serving the consumer while it drains (rebalances, commit
//! answers, `max.poll.interval.ms`), commits progress as it goes, keeps its write fence
//! *before* it leaves the group (results on their way land or are purged first, so none lands
//! after the next owner's), and reports a final commit that failed as a failure of the run.
//!
//! Every turn, and every check of a drain, also judges the membership fence (see
//! `membership`): when the group coordinator has been silent too long, writes stop and the
//! producer's queued ones are purged, until it answers again.

pub mod fetched;
pub mod kafka_epoch;
pub mod partition_queues;
pub mod prefetch;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::BorrowedMessage;
use rdkafka::{Message, Offset as KafkaOffset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use crate::commit::committer::Committer;
use crate::commit::completion::{Completion, CompletionReceiver};
use crate::commit::lag::Assigned;
use crate::commit::leader_epochs::Epoch;
use crate::commit::offset_map::{self, DoneAbove};
use crate::commit::offsets::{Offset, OffsetError, OffsetTracker, Partition};
use crate::config::RebalanceStrategy;
use crate::dispatch::backpressure::{self, Offer, PendingBuffer};
use crate::dispatch::handoff::{Batch, Handoff, Refused};
use crate::dispatch::routing::SessionRouter;
use crate::group::membership::{Fence, Verdict};
use crate::intake::kafka_epoch::ReadAtEpoch;
use crate::intake::partition_queues::PartitionQueues;
use crate::intake::prefetch::Prefetch;
use crate::kafka::client_settings::ClientSettings;
use crate::ops::health::Health;
use crate::ops::metrics::Metrics;
use crate::ops::signal::Doorbell;
use crate::ops::signal::Signal;
use crate::output::producer::StageProducer;
use crate::record::topic_name::TopicName;
use crate::record::DlqReason;
use crate::record::SessionSource;
use crate::record::{InputRecord, Lease};
use crate::session::settle::{Outcome, Settler};

/// How long an idle loop waits for records before it serves events and chores again.
const POLL_TIMEOUT: Duration = Duration::from_millis(20);
/// Events and records served from the consumer's main queue per turn, at most.
const MAIN_QUEUE_BURST: usize = 4_096;
/// How long a loop with a held partition waits before it looks again whether it may take more.
const HOLD_TICK: Duration = Duration::from_millis(1);
/// Records taken from one partition's queue per turn: a fair share before the next partition.
const BURST: usize = 256;
/// How often a drain (revocation, shutdown) checks for completions.
const DRAIN_CHECK: Duration = Duration::from_millis(50);
/// How long shutdown waits for the answers of the deliveries it purged.
const PURGE_ANSWERS: Duration = Duration::from_secs(2);
/// How long a refused final commit is tried again (a rebalance under way at shutdown).
const FINAL_COMMIT_RETRIES: Duration = Duration::from_secs(5);
/// `close_commit_failures` before any revocation of the close has committed.
const CLOSE_COMMIT_NOT_RUN: usize = usize::MAX;
/// Commit intervals a commit may go unanswered before its partitions count as failing.
const COMMIT_STALL_TURNS: u32 = 3;
/// How often the loop reads how many records wait in the partition queues (a gauge).
const PREFETCH_READ: Duration = Duration::from_millis(100);
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
    /// After that, longest wait for the results of a revoked partition already on their way
    /// to the broker (the fence): as much of the poll budget as the revocation has left.
    pub write_fence_timeout: Duration,
    /// Longest wait for in-flight records at shutdown.
    pub shutdown_timeout: Duration,
    /// After that, longest wait for the results already on their way to the broker, before
    /// they are given up (purged) and the worker leaves the group.
    pub shutdown_fence_timeout: Duration,
    /// At shutdown, also process the records queued behind each session's current one
    /// (otherwise they are released to the partition's next owner).
    pub shutdown_drain_queued: bool,
    /// What librdkafka may prefetch (the consumer was created with its share per partition).
    pub prefetch: Prefetch,
    /// The group's `session.timeout.ms`: the membership fence's measure.
    pub session_timeout: Duration,
}

/// The consumer settings the guarantees rely on, then the user's extra properties.
pub fn consumer_config(
    brokers: &str,
    group: &str,
    strategy: RebalanceStrategy,
    prefetch: Prefetch,
    extra: &[(String, String)],
) -> ClientConfig {
    let mut c = ClientSettings::new(brokers).base();
    // How much one fetch brings and how soon a full queue is looked at again (the user's
    // `kafka:` may change these).
    for (k, v) in prefetch.fetch_settings(extra) {
        c.set(k, v);
    }
    for (k, v) in extra {
        c.set(k, v);
    }
    // Each partition has its own queue (see `partition_queues`), so these are per partition:
    // shares of the worker's totals.
    for (k, v) in prefetch.queue_settings() {
        c.set(k, v);
    }
    c.set("group.id", group)
        .set("group.protocol", strategy.group_protocol())
        // Starting at the end would skip what was produced before the stage first ran.
        .set("auto.offset.reset", "earliest")
        // An aborted transaction's records (an exactly-once upstream stage's zombie) are never
        // input.
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    if let Some(assignor) = strategy.assignment_strategy() {
        c.set("partition.assignment.strategy", assignor);
    }
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
    /// Rewound (see [`IntakeLoop::rewind`]) after a rewritten record at this offset: records
    /// above it are what was left of the fetch before the rewind, dropped until the refetch
    /// starts (a record at or below it). `Offset::MIN` after a failed seek: nothing more.
    rewound_at: Option<Offset>,
}

impl PartitionState {
    fn new(lease: Arc<Lease>, done_above: DoneAbove) -> Self {
        Self {
            lease,
            pending: PendingBuffer::default(),
            held: false,
            unreleased: 0,
            done_above,
            map_overflow: false,
            rewound_at: None,
        }
    }
}

/// Everything the loop and the rebalance callback share.
struct Book {
    topic: TopicName,
    /// The assignment, shared with the lag reporter.
    assigned: Assigned,
    tracker: OffsetTracker,
    /// Looked up for every record, so with foldhash, not SipHash (as the tracker's).
    partitions: foldhash::HashMap<Partition, PartitionState>,
    /// Bumped on every assignment change, so the loop knows to split off or drop queues.
    assignment_version: u64,
    next_epoch: u64,
    completions: CompletionReceiver,
}

impl Book {
    /// Applies one completion (or release) to the tracker; [`Book::apply_ready`] sets the
    /// in-flight gauge after.
    fn apply(&mut self, c: Completion) {
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
    }

    /// Applies every completion already waiting (and any applied since the last call), then
    /// sets the in-flight gauge once: summing it over the partitions per completion cost more
    /// than applying one.
    fn apply_ready(&mut self, metrics: &Metrics) {
        while let Ok(c) = self.completions.try_recv() {
            self.apply(c);
        }
        metrics.in_flight.set(self.tracker.in_flight() as i64);
    }

    fn unreleased(&self, partitions: &[Partition]) -> usize {
        partitions
            .iter()
            .filter_map(|p| self.partitions.get(p))
            .map(|s| s.unreleased)
            .sum()
    }

    fn unreleased_total(&self) -> usize {
        self.partitions.values().map(|s| s.unreleased).sum()
    }

    /// Releases (without completing) every parked record of `partition`.
    fn drop_pending(&mut self, partition: Partition) {
        if let Some(state) = self.partitions.get_mut(&partition) {
            let dropped = state.pending.take_all().len();
            state.unreleased = state.unreleased.saturating_sub(dropped);
        }
    }

    /// Watermarks of `partitions` (all when `None`) to send now, as a commit list; marks them
    /// sent. `force` sends every watermark, confirmed or not (a final commit).
    fn commit_list(&mut self, only: Option<&[Partition]>, force: bool) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        let mut chosen: Vec<(Partition, i64)> = Vec::new();
        for (p, offsets) in self.tracker.partitions_mut() {
            if only.is_some_and(|ps| !ps.contains(&p)) {
                continue;
            }
            if !force {
                offsets.tick();
            }
            let candidate = if force {
                // Everything not already confirmed as it is.
                (!offsets.is_settled())
                    .then(|| offsets.watermark())
                    .flatten()
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
            let map = offset_map::encode(
                w,
                o.next().unwrap_or(w),
                o.newest_epoch(),
                o.in_flight_offsets(),
            );
            let epoch = o.epoch_below(w);
            o.mark_sent(w);
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
            if let Some(epoch) = epoch {
                kafka_epoch::set_committed_epoch(&mut tpl, &self.topic, p, epoch);
            }
        }
        tpl
    }

    /// Takes the broker's answer to a commit of `tpl` (the whole request's `result`, and each
    /// partition's own error) into the tracker. Returns how many partitions failed.
    fn commit_answered(
        &mut self,
        result: &KafkaResult<()>,
        tpl: &TopicPartitionList,
        metrics: &Metrics,
    ) -> usize {
        let mut failed = 0;
        for el in tpl.elements_for_topic(&self.topic) {
            let KafkaOffset::Offset(offset) = el.offset() else {
                continue;
            };
            let error = result.as_ref().err().cloned().or(el.error().err());
            if let Some(e) = &error {
                // Counted whether or not the partition is still ours: a commit refused as
                // from a stale generation is how a fenced member learns it.
                failed += 1;
                metrics.commit_errors.inc();
                tracing::warn!(error = %e, partition = el.partition(), offset,
                    "offset commit failed; will send it again");
            }
            let Some(o) = self.tracker.partition_mut(el.partition()) else {
                continue; // revoked meanwhile
            };
            match error {
                None => {
                    o.commit_confirmed(offset);
                    metrics
                        .committed_offset
                        .with_label_values(&[el.topic(), &el.partition().to_string()])
                        .set(offset);
                }
                Some(_) => o.commit_failed(offset),
            }
        }
        self.count_failing(metrics);
        failed
    }

    /// Whether a partition wants its commit now rather than at the interval, before the cap
    /// holds intake ([`crate::commit::offsets::PartitionOffsets::wants_early_commit`]).
    fn commit_urgent(&self, cap: usize) -> bool {
        self.tracker
            .partitions()
            .any(|(_, o)| o.wants_early_commit(cap))
    }

    /// The commit thread's commit has gone unanswered for several intervals: the partitions
    /// it carries count as failing (counted and logged once per stall).
    fn commit_stalled(&mut self, metrics: &Metrics) {
        let mut stalled = Vec::new();
        for (p, o) in self.tracker.partitions_mut() {
            if o.commit_stalled() {
                stalled.push(p);
            }
        }
        if !stalled.is_empty() {
            metrics.commit_errors.inc();
            tracing::warn!(partitions = ?stalled,
                "offset commit unanswered for several commit intervals (coordinator away?); \
                 counting from the last confirmed commit");
        }
        self.count_failing(metrics);
    }

    fn count_failing(&self, metrics: &Metrics) {
        let failing = self
            .tracker
            .partitions()
            .filter(|(_, o)| o.is_failing())
            .count();
        metrics.commit_failing_partitions.set(failing as i64);
    }

    /// Drops `partitions` without a drain or a commit: their leases are revoked (results of
    /// their records are no longer written), their parked records released.
    fn forget(&mut self, partitions: &[Partition]) {
        for p in partitions {
            if let Some(state) = self.partitions.remove(p) {
                state.lease.revoke();
            }
            self.tracker.revoke(*p);
            if let Ok(mut a) = self.assigned.lock() {
                a.remove(p);
            }
        }
        self.assignment_version += 1;
    }

    /// How many of `partitions` have progress the broker has not confirmed as it is.
    fn unsettled(&self, partitions: &[Partition]) -> usize {
        partitions
            .iter()
            .filter(|p| {
                self.tracker
                    .partition(**p)
                    .is_some_and(|o| o.watermark().is_some() && !o.is_settled())
            })
            .count()
    }

    /// Results of `leases` still on their way to the broker.
    fn writes_in_flight(leases: &[Arc<Lease>]) -> u64 {
        leases.iter().map(|l| l.writes_in_flight()).sum()
    }
}

/// The librdkafka context: rebalance and commit callbacks, with access to the [`Book`].
pub struct IntakeContext {
    book: Mutex<Book>,
    settings: IntakeSettings,
    metrics: Metrics,
    health: Arc<Health>,
    /// Set once shutdown has drained and made its final commit: later revocations (from
    /// close) commit what is not confirmed yet, and say how that went here.
    closing: AtomicBool,
    /// Partitions whose commit a revocation while closing could not get confirmed
    /// ([`CLOSE_COMMIT_NOT_RUN`] until one has run).
    close_commit_failures: AtomicUsize,
    /// Cancelled on a fatal client error: the worker stops and exits non-zero.
    fatal: CancellationToken,
    /// The membership fence, and the producer it purges when it closes.
    fence: Arc<Fence>,
    producer: StageProducer,
}

impl IntakeContext {
    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Closes the write gate when the group coordinator has been silent too long (and takes
    /// back what the producer still has queued), opens it when it has answered again.
    fn judge_membership(&self) {
        match self.fence.judge(Instant::now()) {
            Verdict::Same => {}
            Verdict::Doubted(silence) => {
                self.producer.purge();
                self.metrics.membership_doubts.inc();
                self.metrics.write_gate_closed.set(1);
                tracing::warn!(
                    silence_ms = silence.as_millis() as u64,
                    "no answer from the group coordinator for two thirds of the session \
                     timeout: writes stop (queued ones are taken back) until it answers, since \
                     it may give this worker's partitions to another member"
                );
            }
            Verdict::Restored => {
                self.metrics.write_gate_closed.set(0);
                tracing::info!("the group coordinator answers again: writes resume");
            }
        }
    }

    fn on_assign(&self, consumer: &BaseConsumer<IntakeContext>, tpl: &TopicPartitionList) {
        let committed = match consumer.committed_offsets(tpl.clone(), Duration::from_secs(10)) {
            Ok(c) => {
                self.validate_starts(consumer, &c);
                self.committed_maps(&c)
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading committed offsets failed; replaying from the watermark");
                HashMap::new()
            }
        };
        let mut book = self.book();
        for e in tpl.elements_for_topic(&self.settings.input) {
            let p = e.partition();
            if book.partitions.contains_key(&p) {
                continue;
            }
            let (confirmed, done_above) = match committed.get(&p) {
                Some((w, map)) => (Some(*w), map.clone()),
                None => (None, DoneAbove::empty(0)),
            };
            book.next_epoch += 1;
            let lease = Arc::new(Lease::new(p, book.next_epoch));
            book.tracker.assign(p);
            if let (Some(w), Some(o)) = (confirmed, book.tracker.partition_mut(p)) {
                o.set_confirmed(w);
            }
            if let Ok(mut a) = book.assigned.lock() {
                a.insert(p);
            }
            book.partitions
                .insert(p, PartitionState::new(lease, done_above));
            tracing::info!(partition = p, "partition assigned");
        }
        let prefetch = self.settings.prefetch;
        if !prefetch.holds(book.partitions.len()) {
            tracing::warn!(
                assigned = book.partitions.len(),
                counted = prefetch.partitions,
                prefetch_kbytes = prefetch.bound_kbytes(book.partitions.len()),
                budget_kbytes = prefetch.total_kbytes,
                "more partitions assigned than the input topic had at start: the prefetch \
                 exceeds prefetchKbytes by a share per extra partition until the worker restarts"
            );
        }
        book.assignment_version += 1;
    }

    /// Has librdkafka check each newly assigned partition's committed offset against the log
    /// before it fetches from there: a seek to the offset with the leader epoch committed with
    /// it. librdkafka starts an assignment at the committed offset without that check (it
    /// checks only on a seek, or when it sees the leader epoch rise), so a log truncated and
    /// written on while no one owned the partition would be read from the committed offset on,
    /// and the rewritten records below it skipped. With the check, a truncation below the
    /// committed offset moves the start back to the truncation point (see `leader_epochs`).
    fn validate_starts(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        committed: &TopicPartitionList,
    ) {
        let topic = &self.settings.input;
        let mut starts = TopicPartitionList::new();
        for e in committed.elements_for_topic(topic) {
            let KafkaOffset::Offset(w) = e.offset() else {
                continue;
            };
            let Some(epoch) = kafka_epoch::committed_epoch(committed, topic, e.partition()) else {
                continue; // committed without an epoch: nothing to check against
            };
            if starts
                .add_partition_offset(topic, e.partition(), KafkaOffset::Offset(w))
                .is_ok()
            {
                kafka_epoch::set_committed_epoch(&mut starts, topic, e.partition(), epoch);
            }
        }
        if starts.count() == 0 {
            return;
        }
        match consumer.seek_partitions(starts, Duration::from_secs(10)) {
            Ok(result) => {
                for e in result.elements() {
                    if let Err(err) = e.error() {
                        tracing::warn!(error = %err, partition = e.partition(),
                            "could not check the committed offset against the log");
                    }
                }
            }
            Err(err) => tracing::warn!(error = %err,
                "could not check the committed offsets against the log"),
        }
    }

    /// The committed offsets of the newly assigned partitions, each with its completed-offset
    /// map (empty where the broker kept no metadata, or where the map cannot be trusted).
    fn committed_maps(
        &self,
        committed: &TopicPartitionList,
    ) -> HashMap<Partition, (i64, DoneAbove)> {
        let mut maps = HashMap::new();
        let cap = self.settings.max_in_flight_per_partition;
        for e in committed.elements_for_topic(&self.settings.input) {
            let KafkaOffset::Offset(w) = e.offset() else {
                continue;
            };
            let map = match offset_map::decode_within(w, e.metadata(), cap) {
                Ok(map) => {
                    if map.count() > 0 {
                        tracing::info!(
                            partition = e.partition(),
                            watermark = w,
                            already_done = map.count(),
                            "resuming with a completed-offset map"
                        );
                    }
                    map
                }
                Err(err) => {
                    self.metrics.offset_maps_ignored.inc();
                    tracing::warn!(partition = e.partition(), watermark = w, error = %err,
                        "ignoring the completed-offset map; replaying from the watermark");
                    DoneAbove::empty(w)
                }
            };
            maps.insert(e.partition(), (w, map));
        }
        maps
    }

    /// Revocation: stop routing, let in-flight records finish (bounded), wait for the results
    /// already on their way, commit, forget. A *lost* assignment (session timeout, fenced
    /// member) is forgotten at once: another member may already own it, so neither a drain nor
    /// a commit (bound to fail) makes sense.
    fn on_revoke(&self, consumer: &BaseConsumer<IntakeContext>, tpl: &TopicPartitionList) {
        let partitions: Vec<Partition> = tpl
            .elements_for_topic(&self.settings.input)
            .iter()
            .map(|e| e.partition())
            .collect();
        // The revocation can take a while (drain, write fence, final commit): say when it
        // starts, so that a slow one shows in the log as such.
        tracing::info!(
            ?partitions,
            lost = consumer.assignment_lost(),
            "revocation begins"
        );
        let mut book = self.book();
        let mut leases = Vec::new();
        for p in &partitions {
            if let Some(state) = book.partitions.get(p) {
                state.lease.drain();
                leases.push(state.lease.clone());
            }
            book.drop_pending(*p);
        }
        if consumer.assignment_lost() {
            leases.iter().for_each(|l| l.revoke());
            // Another member may own them already: what the producer still holds of theirs
            // must not land after its writes.
            let in_flight = self.take_back(&leases);
            if in_flight > 0 {
                tracing::warn!(
                    in_flight,
                    ?partitions,
                    "lost partitions had results on their way: taken back from the producer"
                );
            }
            self.metrics.lost_partitions.inc_by(partitions.len() as u64);
            tracing::warn!(
                ?partitions,
                unfinished = book.unreleased(&partitions),
                "partitions lost (session timeout or fenced): dropped without drain or commit"
            );
        } else if self.closing.load(Ordering::Acquire) {
            // The revocation of the stop itself (or one during it): every session has ended
            // and the write fence has run, so what is done is done. A final commit refused
            // while a rebalance was under way is accepted here, inside the rebalance.
            let tpl = book.commit_list(Some(&partitions), true);
            if tpl.count() > 0 {
                let result = consumer.commit(&tpl, CommitMode::Sync);
                book.commit_answered(&result, &tpl, &self.metrics);
            }
            // Counted from the book, not from the answer: a partition with progress that is
            // not confirmed as it is counts however it got so.
            let failed = book.unsettled(&partitions);
            let before = self.close_commit_failures.load(Ordering::Acquire);
            let total = if before == CLOSE_COMMIT_NOT_RUN {
                failed
            } else {
                before + failed
            };
            self.close_commit_failures.store(total, Ordering::Release);
        } else {
            let drain_for = self.settings.revoke_drain_timeout;
            book = drain(book, &partitions, Instant::now() + drain_for, self);
            // Handlers still running past the deadline write nothing from now on; results
            // already sent must land before the partition changes hands.
            leases.iter().for_each(|l| l.revoke());
            let fence = Instant::now() + self.settings.write_fence_timeout;
            book = drain_writes(book, &leases, fence, self);
            // The fence waited as long as the group's rebalance allows (the write fence fits
            // inside max.poll.interval.ms, the rebalance timeout of both protocols): take the
            // rest back, so nothing queued is sent once the partition moves.
            let late = self.take_back(&leases);
            if late > 0 {
                tracing::error!(
                    late,
                    ?partitions,
                    "results of revoked partitions still unacknowledged at the fence's deadline: \
                     purged from the producer (any already on the wire may still land)"
                );
            }
            let tpl = book.commit_list(Some(&partitions), true);
            if tpl.count() > 0 {
                let result = consumer.commit(&tpl, CommitMode::Sync);
                if book.commit_answered(&result, &tpl, &self.metrics) > 0 {
                    self.metrics.final_commit_failures.inc();
                    tracing::warn!(
                        "final commit of revoked partitions failed; their progress \
                        since the last commit will be replayed by the next owner"
                    );
                }
            }
        }
        for p in &partitions {
            let unfinished = book.unreleased(&[*p]);
            tracing::info!(partition = p, unfinished, "partition revoked");
        }
        book.forget(&partitions);
        self.metrics.in_flight.set(book.tracker.in_flight() as i64);
    }

    /// Takes back from the producer what it still holds, when results of `leases` (partitions
    /// leaving this worker) are on their way: none may land after the next owner's. The purge
    /// takes back every queued write, and those of partitions still owned are written again
    /// (see `settle`). Returns how many of the leaving partitions' results were out (counted
    /// as late writes).
    fn take_back(&self, leases: &[Arc<Lease>]) -> u64 {
        let in_flight = Book::writes_in_flight(leases);
        if in_flight > 0 {
            self.producer.purge();
            self.metrics.late_writes.inc_by(in_flight);
        }
        in_flight
    }

    /// A rebalance error: librdkafka has dropped partitions (all of them with the eager
    /// protocol). Forget every partition it no longer has assigned, rather than keep leases
    /// nobody holds; they will be assigned again.
    fn on_rebalance_error(&self, consumer: &BaseConsumer<IntakeContext>, error: &KafkaError) {
        let still: Vec<Partition> = consumer
            .assignment()
            .map(|tpl| {
                tpl.elements_for_topic(&self.settings.input)
                    .iter()
                    .map(|e| e.partition())
                    .collect()
            })
            .unwrap_or_default();
        let mut book = self.book();
        let dropped: Vec<Partition> = book
            .partitions
            .keys()
            .copied()
            .filter(|p| !still.contains(p))
            .collect();
        tracing::warn!(error = %error, ?dropped,
            "rebalance error: dropping the state of partitions no longer assigned");
        let leases: Vec<Arc<Lease>> = dropped
            .iter()
            .filter_map(|p| book.partitions.get(p).map(|s| s.lease.clone()))
            .collect();
        for p in &dropped {
            book.drop_pending(*p);
        }
        book.forget(&dropped);
        // As for a lost assignment: nothing of theirs may land after a new owner's writes.
        self.take_back(&leases);
        self.metrics.in_flight.set(book.tracker.in_flight() as i64);
    }
}

/// Waits (releasing nothing) until the given partitions have nothing unreleased, or `deadline`.
fn drain<'a>(
    book: MutexGuard<'a, Book>,
    partitions: &[Partition],
    deadline: Instant,
    ctx: &IntakeContext,
) -> MutexGuard<'a, Book> {
    wait_until(book, deadline, ctx, |book| book.unreleased(partitions) == 0)
}

/// Waits until no result of `leases` is on its way to the broker any more, or `deadline`.
fn drain_writes<'a>(
    book: MutexGuard<'a, Book>,
    leases: &[Arc<Lease>],
    deadline: Instant,
    ctx: &IntakeContext,
) -> MutexGuard<'a, Book> {
    wait_until(book, deadline, ctx, |_| Book::writes_in_flight(leases) == 0)
}

/// Applies completions as they come until `done` or `deadline`. The loop is draining, not
/// wedged: it keeps its liveness heartbeat.
fn wait_until<'a>(
    mut book: MutexGuard<'a, Book>,
    deadline: Instant,
    ctx: &IntakeContext,
    done: impl Fn(&Book) -> bool,
) -> MutexGuard<'a, Book> {
    loop {
        ctx.health.beat();
        ctx.judge_membership();
        book.apply_ready(&ctx.metrics);
        if done(&book) || Instant::now() >= deadline {
            return book;
        }
        if let Ok(c) = book.completions.recv_timeout(DRAIN_CHECK) {
            book.apply(c);
        }
    }
}

impl ClientContext for IntakeContext {
    fn error(&self, error: KafkaError, reason: &str) {
        match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::AllBrokersDown) => self.health.set_ready(false),
            Some(RDKafkaErrorCode::Fatal) => {
                self.metrics.fatal_errors.inc();
                self.health.fail();
                tracing::error!(error = %error, reason, "fatal consumer error: the worker stops");
                self.fatal.cancel();
                return;
            }
            _ => {}
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
            Rebalance::Error(e) => self.on_rebalance_error(consumer, e),
            Rebalance::Revoke(_) => {}
        }
    }
}

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

/// How often the membership fence is judged on its own thread.
const FENCE_TICK: Duration = Duration::from_millis(100);

/// The membership fence judged on a timer of its own. The consumer loop judges it every
/// turn, but its thread blocks for seconds at a time in a revocation's drain and final commit,
/// in `committed_offsets` of an assignment and in metadata requests; during a cooperative
/// rebalance the partitions it still holds keep writing meanwhile, and a coordinator silent
/// past two thirds of the session timeout must close the gate then too.
struct FenceTimer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FenceTimer {
    fn start(consumer: Arc<BaseConsumer<IntakeContext>>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("membership-fence".into())
            .spawn(move || {
                while !stopped.load(Ordering::Acquire) {
                    consumer.context().judge_membership();
                    std::thread::sleep(FENCE_TICK);
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for FenceTimer {
    /// Ends the thread (and its hold on the consumer) before the consumer is closed.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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
            book: Mutex::new(Book {
                topic: settings.input.as_str().into(),
                assigned,
                tracker: OffsetTracker::new(),
                partitions: foldhash::HashMap::default(),
                assignment_version: 0,
                next_epoch: 0,
                completions,
            }),
            settings,
            metrics,
            health,
            closing: AtomicBool::new(false),
            close_commit_failures: AtomicUsize::new(CLOSE_COMMIT_NOT_RUN),
            fatal: tokens.fatal.clone(),
            fence: fence.clone(),
            producer: producer.clone(),
        };
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
        while !self.stopping() {
            self.ctx().health.beat();
            self.ctx().judge_membership();
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
            self.take_commit_answers();
            // Every interval, and early when a partition's replay span reaches half its cap
            // (the cap counts from the last confirmed commit, so commits must keep up).
            let interval = last_commit.elapsed() >= self.ctx().settings.commit_interval;
            if interval
                || self
                    .ctx()
                    .book()
                    .commit_urgent(self.ctx().settings.max_in_flight_per_partition)
            {
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
                    Some(state) if !state.held => {
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
            let d = self.router.route(record.session().unwrap_or_default());
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
                    let d = self.router.route(record.session().unwrap_or_default());
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
        let tpl = ctx.book().commit_list(None, false);
        if tpl.count() > 0 && committer.send(tpl).is_err() {
            tracing::error!("the commit thread is gone; commits stop");
        }
    }

    /// Takes the commit thread's answer, if one has arrived, into the tracker.
    fn take_commit_answers(&self) {
        let answer = self.committer.borrow_mut().answer();
        if let Some(a) = answer {
            let ctx = self.ctx();
            ctx.book()
                .commit_answered(&a.result, &a.offsets, &ctx.metrics);
        }
    }

    /// Commits every watermark synchronously on this thread (the final commit). Returns how
    /// many partitions failed.
    fn commit_now(&self) -> usize {
        let ctx = self.ctx();
        let tpl = ctx.book().commit_list(None, true);
        if tpl.count() == 0 {
            return 0;
        }
        let result = self.consumer.commit(&tpl, CommitMode::Sync);
        ctx.book().commit_answered(&result, &tpl, &ctx.metrics)
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

    /// Stop taking records, let sessions finish their current record (or, with
    /// `shutdownDrainQueued`, everything queued) up to the deadline while still serving the
    /// consumer and committing progress, wait for the results on their way, commit, close.
    fn shutdown(mut self) -> Result<(), IntakeError> {
        let ctx = self.consumer.context();
        ctx.health.set_ready(false);
        if self.tokens.fatal.is_cancelled() {
            // The producer cannot write any more: nothing in flight will settle.
            self.tokens.abort.cancel();
        }
        if !ctx.settings.shutdown_drain_queued {
            self.tokens.release_queued.cancel();
        }
        // No new records reach the sessions: dispatchers end when their senders are gone.
        // Parked records are released uncommitted.
        self.dispatchers.clear();
        {
            let mut book = ctx.book();
            let ps: Vec<Partition> = book.partitions.keys().copied().collect();
            for p in &ps {
                book.drop_pending(*p);
            }
        }
        let deadline = Instant::now() + ctx.settings.shutdown_timeout;
        if !self.serve_until(deadline, |book| book.unreleased_total() == 0) {
            tracing::warn!(
                unfinished = ctx.book().unreleased_total(),
                "shutdown deadline passed; unfinished records will be replayed"
            );
        }
        self.tokens.abort.cancel();
        self.fence_before_leaving();
        let last = self.committer.borrow_mut().finish();
        if let Some(a) = last {
            ctx.book()
                .commit_answered(&a.result, &a.offsets, &ctx.metrics);
        }
        let failed = self.final_commit(deadline + ctx.settings.shutdown_fence_timeout);
        let metrics = ctx.metrics.clone();
        let fatal = self.tokens.fatal.clone();
        let failed = match self.close() {
            // The close's revocation committed what the final commit could not.
            Some(0) if failed > 0 => {
                tracing::info!(
                    failed,
                    "the final commit was refused, the close's revocation committed it"
                );
                0
            }
            _ => failed,
        };
        let result = match failed {
            0 => {
                tracing::info!("final watermarks committed");
                Ok(())
            }
            failed => {
                metrics.final_commit_failures.inc();
                tracing::error!(
                    failed,
                    "final commit failed; progress since the last \
                    confirmed commit will be replayed"
                );
                Err(IntakeError::FinalCommit(format!(
                    "{failed} partition(s) not committed"
                )))
            }
        };
        if fatal.is_cancelled() {
            Err(IntakeError::Fatal)
        } else {
            result
        }
    }

    /// The final commit. A rebalance may be under way as the worker stops (other members
    /// joining or leaving at once), and the broker then refuses commits of the old generation:
    /// serve the consumer (the revocation commits what it takes away) and try again until
    /// `until` (the stop's own deadline, at least [`FINAL_COMMIT_RETRIES`] from now) before
    /// calling it a failure; partitions already confirmed as they are are not sent again.
    /// Returns how many partitions failed the last try; the close's revocation gets one more
    /// chance (see [`IntakeLoop::close`]).
    fn final_commit(&self, until: Instant) -> usize {
        let until = until.max(Instant::now() + FINAL_COMMIT_RETRIES);
        loop {
            let failed = self.commit_now();
            if failed == 0 || Instant::now() >= until {
                return failed;
            }
            tracing::info!(
                failed,
                "final commit refused; serving the group and trying again"
            );
            let pause = Instant::now() + DRAIN_CHECK * 4;
            while Instant::now() < pause {
                self.serve_events_only();
                std::thread::sleep(DRAIN_CHECK / 5);
            }
        }
    }

    /// Keeps the group served — its events (rebalances), commit answers, commits of progress
    /// every interval, the liveness heartbeat — while completions come in, until `done` or
    /// `deadline`. Returns whether `done` was reached. Shutdown waits this way: a member that
    /// stops polling for `max.poll.interval.ms` is dropped from the group, and its commits then
    /// fail.
    fn serve_until(&self, deadline: Instant, done: impl Fn(&Book) -> bool) -> bool {
        let ctx = self.ctx();
        let mut last_commit = Instant::now();
        loop {
            ctx.health.beat();
            ctx.judge_membership();
            {
                let mut book = ctx.book();
                book.apply_ready(&ctx.metrics);
                if done(&book) {
                    return true;
                }
                if Instant::now() >= deadline {
                    return false;
                }
                if let Ok(c) = book.completions.recv_timeout(DRAIN_CHECK) {
                    book.apply(c);
                }
            }
            self.serve_events_only();
            self.take_commit_answers();
            if last_commit.elapsed() >= ctx.settings.commit_interval {
                self.commit_in_background(true);
                last_commit = Instant::now();
            }
        }
    }

    /// The write fence of a shutdown, kept while this worker is still a member of the group.
    /// Once it leaves, the next owner redoes what was not done; a result of this worker landing
    /// after that would end a session on an older record. So: no new write (the leases are
    /// revoked), wait — serving the group — for the results on their way, and give up (purge
    /// from the producer, which then never sends them) what is still out at the deadline.
    fn fence_before_leaving(&self) {
        let ctx = self.ctx();
        let leases: Vec<Arc<Lease>> = ctx
            .book()
            .partitions
            .values()
            .map(|s| s.lease.clone())
            .collect();
        leases.iter().for_each(|l| l.revoke());
        let fence = Instant::now() + ctx.settings.shutdown_fence_timeout;
        if self.serve_until(fence, |_| Book::writes_in_flight(&leases) == 0) {
            return;
        }
        let out = Book::writes_in_flight(&leases);
        self.producer.purge();
        tracing::warn!(
            out,
            "results still unacknowledged at the shutdown fence: given up before leaving the \
             group (their records are replayed by the next owner)"
        );
        // The purge answers every delivery at once; the writers then drop their permits.
        self.serve_until(Instant::now() + PURGE_ANSWERS, |_| {
            Book::writes_in_flight(&leases) == 0
        });
        let late = Book::writes_in_flight(&leases);
        if late > 0 {
            ctx.metrics.late_writes.inc_by(late);
            tracing::error!(
                late,
                "results still unacknowledged after the purge; they may land after the next \
                 owner's"
            );
        }
    }

    /// Serves the consumer's events (rebalances, commit answers) without taking records: any
    /// record still in the main queue is left uncommitted, for the next owner.
    fn serve_events_only(&self) {
        self.serve_main_queue(|_| {});
    }

    /// Leaves the group. The revocation this triggers commits what is not confirmed yet;
    /// returns how many partitions it failed to commit, `None` if no revocation ran.
    fn close(self) -> Option<usize> {
        // Its thread holds the consumer too: end it before the consumer is closed.
        self.committer.borrow_mut().finish();
        self.ctx().closing.store(true, Ordering::Release);
        self.consumer.unsubscribe();
        // Serve the revocation that unsubscribing triggers, briefly.
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until && self.consumer.assignment().is_ok_and(|a| a.count() > 0) {
            self.consumer.poll(Duration::from_millis(50));
        }
        let failures = self.ctx().close_commit_failures.load(Ordering::Acquire);
        drop(self.fence_timer.take());
        drop(self.consumer);
        (failures != CLOSE_COMMIT_NOT_RUN).then_some(failures)
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
