//! The rebalance callbacks: what happens to the book when partitions come and go.
//!
//! librdkafka calls these inside `poll`, on the consumer loop's thread, so they may block it:
//! an assignment reads the committed offsets and their completed-offset maps; a revocation
//! drains the partitions' in-flight records (bounded), waits for their results on their way
//! (the write fence), takes back what is still queued, makes their final commit and forgets
//! them; a lost assignment is forgotten at once, without drain or commit, since another member
//! may own it already. The book (`book`) holds each partition's phase through this.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::{Offset as KafkaOffset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use crate::commit::offset_map::{self, DoneAbove};
use crate::commit::offsets::Partition;
use crate::group::membership::{Fence, Verdict};
use crate::intake::book::{Book, Leaving};
use crate::intake::kafka_epoch;
use crate::intake::partition_queues;
use crate::intake::settings::IntakeSettings;
use crate::ops::health::Health;
use crate::ops::metrics::Metrics;
use crate::output::producer::StageProducer;
use crate::record::Lease;

/// How often a drain (revocation, shutdown) checks for completions.
pub(super) const DRAIN_CHECK: Duration = Duration::from_millis(50);

/// The librdkafka context: rebalance and commit callbacks, with access to the [`Book`].
pub(crate) struct IntakeContext {
    pub(super) book: Mutex<Book>,
    pub(super) settings: IntakeSettings,
    pub(super) metrics: Metrics,
    pub(super) health: Arc<Health>,
    /// Cancelled on a fatal client error: the worker stops and exits non-zero.
    pub(super) fatal: CancellationToken,
    /// The membership fence, and the producer it purges when it closes.
    pub(super) fence: Arc<Fence>,
    pub(super) producer: StageProducer,
}

impl IntakeContext {
    pub(super) fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Closes the write gate when the group coordinator has been silent too long (and takes
    /// back what the producer still has queued), opens it when it has answered again.
    pub(super) fn judge_membership(&self) {
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
        let new: Vec<Partition> = tpl
            .elements_for_topic(&self.settings.input)
            .iter()
            .map(|e| e.partition())
            .collect();
        if !self.open_transactions(&new) {
            return;
        }
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
            if !book.assign(p, committed.get(&p)) {
                continue;
            }
            if let (Some(t), Some(state)) = (self.producer.transactions(), book.partitions.get(&p))
            {
                t.since(p, state.lease.epoch);
            }
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
    pub(super) fn committed_maps(
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
        let leases = book.start_draining(&partitions);
        if consumer.assignment_lost() {
            book.lose(&partitions);
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
        } else if matches!(book.leaving, Leaving::Closing { .. }) {
            // The revocation of the stop itself (or one during it): every session has ended
            // and the write fence has run, so what is done is done. A final commit refused
            // while a rebalance was under way is accepted here, inside the rebalance.
            if let Some(transactions) = self.producer.transactions() {
                self.commit_transactions(
                    consumer,
                    &mut book,
                    transactions,
                    Some(&partitions),
                    true,
                );
            } else {
                let tpl = book.commit_list(Some(&partitions), true);
                if tpl.count() > 0 {
                    let result = consumer.commit(&tpl, CommitMode::Sync);
                    book.commit_answered(&result, &tpl, &self.metrics);
                }
            }
            // Counted from the book, not from the answer: a partition with progress that is
            // not confirmed as it is counts however it got so.
            book.count_close_commit(&partitions);
        } else {
            let drain_for = self.settings.revoke_drain_timeout;
            book = drain(book, &partitions, Instant::now() + drain_for, self);
            // Handlers still running past the deadline write nothing from now on; results
            // already sent must land before the partition changes hands.
            book.revoke(&partitions);
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
            let failed = if let Some(transactions) = self.producer.transactions() {
                self.commit_transactions(consumer, &mut book, transactions, Some(&partitions), true)
            } else {
                let tpl = book.commit_list(Some(&partitions), true);
                if tpl.count() > 0 {
                    let result = consumer.commit(&tpl, CommitMode::Sync);
                    book.commit_answered(&result, &tpl, &self.metrics)
                } else {
                    0
                }
            };
            if failed > 0 {
                self.metrics.final_commit_failures.inc();
                tracing::warn!(
                    "final commit of revoked partitions failed; their progress \
                    since the last commit will be replayed by the next owner"
                );
            }
        }
        // exactlyOnce: committed above, or lost: what is open is aborted.
        self.close_transactions(&partitions);
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
        self.close_transactions(&dropped);
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
