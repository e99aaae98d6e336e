//! The book of partitions: what the consumer loop knows about each partition it holds.
//!
//! The loop and the rebalance callbacks (which librdkafka runs inside `poll`, on the loop's
//! thread) keep the same book: each partition's lease, parked records, hold and rebalance
//! phase, the offset tracker, and the completions on their way back. Everything here is
//! bookkeeping — which watermarks to commit with which metadata, what a commit's answer
//! confirms, which partitions are failing — and none of it calls the consumer, so it is tested
//! without a broker (see the tests below). The rebalance (`rebalance`), the loop and the
//! shutdown decide when; the book says what.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::error::KafkaResult;
use rdkafka::{Offset as KafkaOffset, TopicPartitionList};

use crate::commit::completion::{Completion, CompletionReceiver};
use crate::commit::lag::Assigned;
use crate::commit::offset_map::{self, DoneAbove};
use crate::commit::offsets::{Offset, OffsetTracker, Partition};
use crate::dispatch::backpressure::PendingBuffer;
use crate::intake::kafka_epoch;
use crate::ops::metrics::Metrics;
use crate::record::topic_name::TopicName;
use crate::record::Lease;

/// Where a partition is in a rebalance, or in the stop. Its [`Lease`] carries the same news
/// to the sessions (draining, revoked); the book holds the phase, the lease follows it.
///
/// A revocation moves a partition `Owned` → `Draining` → `Revoked`, then commits it and
/// forgets it; a lost assignment goes `Owned` → `Lost` and is forgotten at once; the shutdown's
/// write fence moves every partition `Owned` → `Revoked` before the worker leaves the group.
/// In `exactlyOnce`, a partition whose producer was fenced goes `Owned` → `Fenced` and back to
/// `Owned` when it is reopened (or leaves as any other would).
/// A forgotten partition is out of the book: nothing that comes back for it (a completion, a
/// commit's answer) finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Assigned: its records are taken in, and their results written.
    Owned,
    /// Being revoked: no record of it is taken in any more, its parked ones are released, and
    /// the ones in flight may finish until the drain's deadline.
    Draining,
    /// Its lease is revoked: no result of it starts being written. The results already on
    /// their way are waited for (the write fence), then its final commit is made.
    Revoked,
    /// Lost (session timeout, fenced member): another member may own it already, so no drain
    /// and no commit; its results still queued are taken back from the producer.
    Lost,
    /// `exactlyOnce`: given up `since` then, its producer fenced by another with its
    /// transactional id (`intake::transactional`): its lease revoked, its books empty, no
    /// record of it taken in, no transaction open. Reopened after a grace if still assigned.
    Fenced { since: Instant },
}

/// How long after a commit's answer an early commit waits, at most, for the records taken
/// since to be done ([`Book::early_commit_gathered`]). Quick handlers are done within a hold
/// tick or two of the consumer loop; a slow handler's records are not waited for longer.
const EARLY_COMMIT_GATHER: Duration = Duration::from_millis(2);

/// Whether the worker is leaving the group, and how the commits of the revocations that
/// leaving brings went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Leaving {
    /// A member: a revocation drains, fences and commits what it takes away.
    No,
    /// Shutdown has drained, kept its write fence and made its final commit: a revocation now
    /// (the close's own, or one under way) commits what is not confirmed yet, at once.
    /// `unconfirmed`: how many partitions those revocations left with progress the broker has
    /// not confirmed; `None` until one has run.
    Closing { unconfirmed: Option<usize> },
}

impl Phase {
    /// Whether records of the partition are taken in.
    pub(super) fn takes_records(self) -> bool {
        self == Phase::Owned
    }
}

/// What the loop knows about one assigned partition.
pub(super) struct PartitionState {
    pub(super) lease: Arc<Lease>,
    /// Where the partition is in a rebalance (or the stop).
    pub(super) phase: Phase,
    pub(super) pending: PendingBuffer,
    /// Not taking records from its queue (see [`backpressure`]).
    pub(super) held: bool,
    /// Records taken in and neither completed nor released unprocessed.
    pub(super) unreleased: usize,
    /// Offsets above the committed watermark that a previous owner finished (commit metadata).
    pub(super) done_above: DoneAbove,
    /// The completed-offset map no longer fits in commit metadata: take no new records until
    /// the watermark catches up.
    pub(super) map_overflow: bool,
    /// Rewound (see [`IntakeLoop::rewind`]) after a rewritten record at this offset: records
    /// above it are what was left of the fetch before the rewind, dropped until the refetch
    /// starts (a record at or below it). `Offset::MIN` after a failed seek: nothing more.
    pub(super) rewound_at: Option<Offset>,
    /// Records settled (completed, not released) since the partition's last commit: in
    /// `exactlyOnce`, how many records the next committed transaction marks done.
    pub(super) settled_since_commit: u64,
}

impl PartitionState {
    pub(super) fn new(lease: Arc<Lease>, done_above: DoneAbove) -> Self {
        Self {
            lease,
            phase: Phase::Owned,
            pending: PendingBuffer::default(),
            held: false,
            unreleased: 0,
            done_above,
            map_overflow: false,
            rewound_at: None,
            settled_since_commit: 0,
        }
    }
}

/// Everything the loop and the rebalance callbacks share.
pub(super) struct Book {
    pub(super) topic: TopicName,
    /// The assignment, shared with the lag reporter.
    pub(super) assigned: Assigned,
    pub(super) tracker: OffsetTracker,
    /// Looked up for every record, so with foldhash, not SipHash (as the tracker's).
    pub(super) partitions: foldhash::HashMap<Partition, PartitionState>,
    /// Bumped on every assignment change, so the loop knows to split off or drop queues.
    pub(super) assignment_version: u64,
    pub(super) next_epoch: u64,
    pub(super) completions: CompletionReceiver,
    pub(super) leaving: Leaving,
    /// `exactlyOnce`: a commit never goes without its completed-offset map.
    pub(super) exactly_once: bool,
}

impl Book {
    pub(super) fn new(
        topic: TopicName,
        assigned: Assigned,
        completions: CompletionReceiver,
    ) -> Self {
        Self {
            topic,
            assigned,
            tracker: OffsetTracker::new(),
            partitions: foldhash::HashMap::default(),
            assignment_version: 0,
            next_epoch: 0,
            completions,
            leaving: Leaving::No,
            exactly_once: false,
        }
    }

    /// Takes a newly assigned partition into the book under a new lease, with its committed
    /// offset (the confirmed watermark) and completed-offset map when the broker has them.
    /// False, and nothing changes, when the partition is in the book already.
    pub(super) fn assign(
        &mut self,
        partition: Partition,
        committed: Option<&(Offset, DoneAbove)>,
    ) -> bool {
        if self.partitions.contains_key(&partition) {
            return false;
        }
        let (confirmed, done_above) = match committed {
            Some((w, map)) => (Some(*w), map.clone()),
            None => (None, DoneAbove::empty(0)),
        };
        self.next_epoch += 1;
        let lease = Arc::new(Lease::new(partition, self.next_epoch));
        self.tracker.assign(partition);
        if let (Some(w), Some(o)) = (confirmed, self.tracker.partition_mut(partition)) {
            o.set_confirmed(w);
        }
        if let Ok(mut a) = self.assigned.lock() {
            a.insert(partition);
        }
        self.partitions
            .insert(partition, PartitionState::new(lease, done_above));
        true
    }

    /// A revocation begins: `partitions` take no record any more, their parked records are
    /// released, and their sessions are told (the lease drains). Returns their leases.
    pub(super) fn start_draining(&mut self, partitions: &[Partition]) -> Vec<Arc<Lease>> {
        let mut leases = Vec::new();
        for p in partitions {
            if let Some(state) = self.partitions.get_mut(p) {
                state.lease.drain();
                if state.phase == Phase::Owned {
                    // (A revocation while closing finds the stop's fence up: still revoked.)
                    state.phase = Phase::Draining;
                }
                leases.push(state.lease.clone());
            }
            self.drop_pending(*p);
        }
        leases
    }

    /// Stops the writes of `partitions` (their leases are revoked): what a handler still
    /// running returns is not written. Returns their leases, to wait for the writes on their
    /// way.
    pub(super) fn revoke(&mut self, partitions: &[Partition]) -> Vec<Arc<Lease>> {
        self.move_to(partitions, Phase::Revoked)
    }

    /// `partitions` are lost: their leases are revoked at once.
    pub(super) fn lose(&mut self, partitions: &[Partition]) -> Vec<Arc<Lease>> {
        self.move_to(partitions, Phase::Lost)
    }

    fn move_to(&mut self, partitions: &[Partition], phase: Phase) -> Vec<Arc<Lease>> {
        let mut leases = Vec::new();
        for p in partitions {
            if let Some(state) = self.partitions.get_mut(p) {
                state.lease.revoke();
                state.phase = phase;
                leases.push(state.lease.clone());
            }
        }
        leases
    }

    /// Shutdown is about to leave the group (see [`Leaving::Closing`]).
    pub(super) fn start_closing(&mut self) {
        self.leaving = Leaving::Closing { unconfirmed: None };
    }

    /// A revocation while closing has made its commit of `partitions`: counts those whose
    /// progress is not confirmed as it is, however it got so (not from the commit's answer).
    pub(super) fn count_close_commit(&mut self, partitions: &[Partition]) {
        let failed = self.unsettled(partitions);
        if let Leaving::Closing { unconfirmed } = &mut self.leaving {
            *unconfirmed = Some(unconfirmed.unwrap_or(0) + failed);
        }
    }

    /// `exactlyOnce`: `partition`'s transaction committed: how many records it marked done
    /// (settled since the previous commit), counting from zero again.
    pub(super) fn take_settled(&mut self, partition: Partition) -> u64 {
        self.partitions
            .get_mut(&partition)
            .map_or(0, |s| std::mem::take(&mut s.settled_since_commit))
    }

    /// The partitions in the book.
    pub(super) fn all_partitions(&self) -> Vec<Partition> {
        self.partitions.keys().copied().collect()
    }

    /// Applies one completion (or release) to the tracker; [`Book::apply_ready`] sets the
    /// in-flight gauge after.
    pub(super) fn apply(&mut self, c: Completion) {
        let Some(state) = self.partitions.get_mut(&c.partition) else {
            return; // from a partition we no longer own
        };
        if state.lease.epoch != c.epoch {
            return; // from an earlier assignment of this partition
        }
        state.unreleased = state.unreleased.saturating_sub(1);
        if c.done {
            state.settled_since_commit += 1;
            if let Err(e) = self.tracker.complete(c.partition, c.offset) {
                tracing::error!(error = %e, partition = c.partition, "offset bookkeeping");
            }
        }
    }

    /// Applies every completion already waiting (and any applied since the last call), then
    /// sets the in-flight gauge once: summing it over the partitions per completion cost more
    /// than applying one.
    pub(super) fn apply_ready(&mut self, metrics: &Metrics) {
        while let Ok(c) = self.completions.try_recv() {
            self.apply(c);
        }
        metrics.in_flight.set(self.tracker.in_flight() as i64);
    }

    pub(super) fn unreleased(&self, partitions: &[Partition]) -> usize {
        partitions
            .iter()
            .filter_map(|p| self.partitions.get(p))
            .map(|s| s.unreleased)
            .sum()
    }

    pub(super) fn unreleased_total(&self) -> usize {
        self.partitions.values().map(|s| s.unreleased).sum()
    }

    /// Releases (without completing) every parked record of `partition`.
    pub(super) fn drop_pending(&mut self, partition: Partition) {
        if let Some(state) = self.partitions.get_mut(&partition) {
            let dropped = state.pending.take_all().len();
            state.unreleased = state.unreleased.saturating_sub(dropped);
        }
    }

    /// Watermarks of `partitions` (all when `None`) to send now, as a commit list; marks them
    /// sent. `force` sends every watermark, confirmed or not (a final commit).
    pub(super) fn commit_list(
        &mut self,
        only: Option<&[Partition]>,
        force: bool,
    ) -> TopicPartitionList {
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
            let next = o.next().unwrap_or(w).max(w);
            // Resumed from a committed map (assignment, rewind) whose offsets from `next` on
            // are not taken in again yet: what it marks done there stays marked. Their outputs
            // were written by the commit that map came with; a map without them would have
            // the next owner (or rewind) write them again (exactlyOnce: twice in the output).
            let inherited = self
                .partitions
                .get(&p)
                .map(|s| &s.done_above)
                .filter(|d| d.end() > next);
            let map = match inherited {
                Some(d) => offset_map::encode(
                    w,
                    d.end(),
                    o.newest_epoch().max(d.epoch()),
                    o.in_flight_offsets().chain(d.not_done_from(next)),
                ),
                None => offset_map::encode(w, next, o.newest_epoch(), o.in_flight_offsets()),
            };
            let epoch = o.epoch_below(w);
            let overflow = matches!(map, Err(offset_map::MapError::TooLarge(_)));
            if overflow && self.exactly_once {
                // The map must go with the transaction's outputs: no plain-watermark fallback.
                // Not committed now; intake held until the map fits (docs/exactly-once.md).
                if let Some(state) = self.partitions.get_mut(&p) {
                    if !state.map_overflow {
                        tracing::warn!(
                            partition = p,
                            "completed-offset map too large for commit metadata; the \
                            partition's transaction stays open and intake is held until it fits"
                        );
                    }
                    state.map_overflow = true;
                }
                continue;
            }
            o.mark_sent(w);
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
    pub(super) fn commit_answered(
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

    /// Whether an early commit may go, `since_answer` after the last commit's answer: the
    /// records taken since are done (nothing is in flight in any partition), or it has waited
    /// for them [`EARLY_COMMIT_GATHER`].
    ///
    /// The answer gives the partitions it carried their room back, and they take records in
    /// the same turn. An early commit sent at once carries none of that progress, since none
    /// of it is done yet; with one commit outstanding at a time, partitions at their cap then
    /// split into two groups that take turns in alternate commits, each getting its room back
    /// every other round trip. At `maxInFlightPerPartition` 125, P1 drained ~55,000 msg/s that
    /// way on Apache Kafka (a commit's round trip is ~5.6 ms there), against ~1,000,000 at the
    /// default budget (bench/NOTES.md, "A small in-flight budget").
    pub(super) fn early_commit_gathered(&self, since_answer: Duration) -> bool {
        since_answer >= EARLY_COMMIT_GATHER || self.tracker.partitions().all(|(_, o)| o.span() == 0)
    }

    /// Whether a partition wants its commit now rather than at the interval, before the cap
    /// holds intake ([`crate::commit::offsets::PartitionOffsets::wants_early_commit`]).
    ///
    /// In `exactlyOnce` (`transactional`) a commit is a turn of broker round trips per
    /// partition during which the consumer loop and every write of the stage wait (the
    /// barrier), not a request handed to a thread: it is early only from three quarters of the
    /// cap, after three sixteenths of it gained (the rule for `cap` × 1.5). At half the cap a
    /// P1 backlog (hot sessions keep the span above it) committed on almost every turn, and
    /// the loop waited in commits for ~30–50 % of the drain (bench/NOTES.md). The hold is
    /// still at the cap, and when to commit changes nothing of what a commit guarantees.
    pub(super) fn commit_urgent(&self, cap: usize, transactional: bool) -> bool {
        let cap = if transactional { cap + cap / 2 } else { cap };
        self.tracker
            .partitions()
            .any(|(_, o)| o.wants_early_commit(cap))
    }

    /// The commit thread's commit has gone unanswered for several intervals: the partitions
    /// it carries count as failing (counted and logged once per stall).
    pub(super) fn commit_stalled(&mut self, metrics: &Metrics) {
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
    pub(super) fn forget(&mut self, partitions: &[Partition]) {
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
    pub(super) fn unsettled(&self, partitions: &[Partition]) -> usize {
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
    pub(super) fn writes_in_flight(leases: &[Arc<Lease>]) -> u64 {
        leases.iter().map(|l| l.writes_in_flight()).sum()
    }
}

#[cfg(test)]
mod tests;
