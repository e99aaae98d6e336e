//! Which offsets of a partition are safe to commit.
//!
//! Sessions finish out of order: offset 104 may complete while 102 is still retrying. Committing
//! the highest completed offset would let a crash skip 102 forever, so the commit point is the
//! *contiguous watermark*: the lowest offset that was handed out and has not finished yet (or,
//! when nothing is unfinished, one past the highest offset handed out). Offsets that Kafka never
//! delivers (compaction, transaction markers) are simply never begun, so gaps in the offset space
//! need no special case.
//!
//! A watermark counts as committed only once the broker has confirmed it. A commit is *sent*,
//! then *confirmed* or *failed* by the broker's answer; a watermark sent and never answered is
//! sent again after a few commit turns, so a lost or misrouted answer cannot freeze the
//! partition's committed offset while every probe looks green. What a crash would replay is
//! everything from the last *confirmed* commit, not from the watermark: that is the span the
//! in-flight cap is checked against (see [`PartitionOffsets::replay_span`]), so a commit
//! outage holds intake at the cap instead of letting the replay grow.
//!
//! The in-flight offsets are a deque from the oldest unfinished offset to the newest begun
//! (see [`InFlight`]): every record begins and completes an offset, so this is on the record
//! path, and a deque costs no allocation per offset where a tree set costs a node's worth.
//!
//! This module is pure bookkeeping — no Kafka, no tokio — so it can be tested exhaustively.

use std::collections::VecDeque;

use crate::commit::leader_epochs::{Epoch, EpochRuns, UNKNOWN};
pub use crate::record::{Offset, Partition};

/// In-flight and completed offsets of one partition.
#[derive(Debug, Default, Clone)]
pub struct PartitionOffsets {
    /// Offsets begun and not yet completed.
    in_flight: InFlight,
    /// One past the highest offset begun; `None` until the first record.
    next: Option<Offset>,
    /// The first offset begun in this assignment: where a replay starts when nothing was
    /// ever confirmed.
    first: Option<Offset>,
    /// The last watermark the broker confirmed (or the committed offset found on assignment).
    confirmed: Option<Offset>,
    /// The last watermark sent and not yet answered, and for how many commit turns.
    sent: Option<(Offset, u32)>,
    /// The last commit answered failed, and no later one succeeded yet.
    failing: bool,
    /// Something completed since the last commit was sent (the completed-offset map changed).
    dirty: bool,
    /// The leader epochs of the offsets begun.
    epochs: EpochRuns,
}

/// Offsets begun and not yet completed, ascending.
///
/// Slots from the oldest unfinished offset to the newest begun, each marked done or not: a
/// begin pushes at the back (offsets are begun in increasing order), a completion marks its
/// slot — found at its index when the offsets since the front are contiguous, by binary search
/// across gaps — and done slots at the front are dropped, so the front is always unfinished.
/// Its length is bounded by the replay span, which the in-flight cap bounds; the room a burst
/// grew it to is given back on a commit turn once it is mostly empty ([`InFlight::release_spare`]).
#[derive(Debug, Default, Clone)]
struct InFlight {
    slots: VecDeque<Slot>,
    /// Slots not done.
    unfinished: usize,
    /// Commit turns in a row the deque has stood mostly empty (see [`InFlight::release_spare`]).
    spare_turns: u32,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    offset: Offset,
    done: bool,
}

impl InFlight {
    /// Adds `offset`, which must be above every offset added before.
    fn insert(&mut self, offset: Offset) {
        debug_assert!(self.slots.back().is_none_or(|s| s.offset < offset));
        self.slots.push_back(Slot {
            offset,
            done: false,
        });
        self.unfinished += 1;
    }

    /// Marks `offset` done; false when it is not in flight.
    fn remove(&mut self, offset: Offset) -> bool {
        let Some(slot) = self.position(offset).map(|i| &mut self.slots[i]) else {
            return false;
        };
        if slot.done {
            return false;
        }
        slot.done = true;
        self.unfinished -= 1;
        while self.slots.front().is_some_and(|s| s.done) {
            self.slots.pop_front();
        }
        true
    }

    fn position(&self, offset: Offset) -> Option<usize> {
        let front = self.slots.front()?.offset;
        let guess = usize::try_from(offset.checked_sub(front)?).ok()?;
        if self.slots.get(guess).is_some_and(|s| s.offset == offset) {
            return Some(guess);
        }
        self.slots.binary_search_by_key(&offset, |s| s.offset).ok()
    }

    fn first(&self) -> Option<Offset> {
        self.slots.front().map(|s| s.offset)
    }

    fn iter(&self) -> impl Iterator<Item = Offset> + '_ {
        self.slots.iter().filter(|s| !s.done).map(|s| s.offset)
    }

    fn len(&self) -> usize {
        self.unfinished
    }

    /// Gives back most of the room a burst grew the deque to, once it has stood three quarters
    /// empty or more for [`SPARE_TURNS`] commit turns in a row: a burst at the default cap
    /// leaves 64–128 KiB per partition behind, which a worker at rest would hold for good. Not
    /// sooner, and not below [`RESTING_SLOTS`]: a load whose records in flight swing (early
    /// commits come every few milliseconds in a drain) would otherwise shrink and grow it in
    /// turns, copying it each time.
    fn release_spare(&mut self) {
        let capacity = self.slots.capacity();
        if capacity <= RESTING_SLOTS || self.slots.len() > capacity / 4 {
            self.spare_turns = 0;
            return;
        }
        self.spare_turns += 1;
        if self.spare_turns >= SPARE_TURNS {
            self.spare_turns = 0;
            self.slots
                .shrink_to((self.slots.len() * 2).max(RESTING_SLOTS));
        }
    }
}

/// Slots an in-flight deque keeps room for however empty it is.
const RESTING_SLOTS: usize = 256;
/// Commit turns in a row an in-flight deque must stand mostly empty before its room is given
/// back: three seconds at the default `commitIntervalMs` (1 s) when nothing else commits, about
/// when a burst's sessions are reaped and the heap is trimmed (`ops::memory`; room given back
/// after the last trim's purge is returned by jemalloc's decay, ~10 s later); a few early
/// commits' worth in a drain.
const SPARE_TURNS: u32 = 3;

/// Commit turns a sent, unanswered watermark waits before it is sent again.
pub const RESEND_AFTER_TURNS: u32 = 5;

impl PartitionOffsets {
    /// Records that `offset` was handed out for processing. Offsets must be begun in increasing
    /// order (the order the partition delivers them); an offset at or below one already begun is
    /// a replay of the same fetch and is rejected.
    ///
    /// `epoch` is the leader epoch the record was read at: an offset below the next one
    /// expected but of a newer epoch is not a replay but a record the log was rewritten with
    /// (see [`crate::commit::leader_epochs`]), refused as [`OffsetError::Rewritten`].
    pub fn begin(&mut self, offset: Offset, epoch: Epoch) -> Result<(), OffsetError> {
        if let Some(next) = self.next {
            if offset < next {
                if self.epochs.rewritten(offset, epoch) {
                    return Err(OffsetError::Rewritten { offset, epoch });
                }
                return Err(OffsetError::NotIncreasing { offset, next });
            }
        }
        self.epochs.taken(offset, epoch);
        self.in_flight.insert(offset);
        self.next = Some(offset + 1);
        self.first.get_or_insert(offset);
        Ok(())
    }

    /// Marks `offset` done (processed, or written to the DLQ). Completing an offset that is not
    /// in flight is reported, not ignored: it means two owners for one record.
    pub fn complete(&mut self, offset: Offset) -> Result<(), OffsetError> {
        if self.in_flight.remove(offset) {
            self.dirty = true;
            Ok(())
        } else {
            Err(OffsetError::NotInFlight { offset })
        }
    }

    /// The offset to commit: every offset below it is done. `None` before the first record.
    pub fn watermark(&self) -> Option<Offset> {
        self.in_flight.first().or(self.next)
    }

    /// The watermark to send now: it is not confirmed yet (or the completed-offset map above
    /// it changed), and it is not already on its way (unless unanswered for
    /// [`RESEND_AFTER_TURNS`] turns).
    pub fn commit_candidate(&self) -> Option<Offset> {
        let watermark = self.watermark()?;
        if self.confirmed == Some(watermark) && !self.dirty {
            return None;
        }
        match self.sent {
            Some((w, turns)) if w == watermark && !self.dirty && turns < RESEND_AFTER_TURNS => None,
            _ => Some(watermark),
        }
    }

    /// Whether to commit now rather than at the interval: the replay span has reached half of
    /// `cap` (past the cap the partition is held), and the watermark has moved at least an
    /// eighth of `cap` past the last confirmed commit (or none was ever confirmed). A draining
    /// backlog sits above half the cap for as long as it drains, and with a commit per turn
    /// whose watermark had moved, the consumer loop sent ~430 commits a second there (P2),
    /// each carrying every partition's completed-offset map; a commit gives back an eighth of
    /// the cap at least, more than a held partition waits for (a tenth).
    pub fn wants_early_commit(&self, cap: usize) -> bool {
        let step = i64::try_from((cap / 8).max(1)).unwrap_or(i64::MAX);
        self.replay_span() >= cap / 2
            && self
                .commit_candidate()
                .is_some_and(|w| self.confirmed.is_none_or(|c| w >= c.saturating_add(step)))
    }

    /// A commit turn passed: an unanswered commit ages, and room a burst left in the in-flight
    /// offsets is given back.
    pub fn tick(&mut self) {
        if let Some((_, turns)) = &mut self.sent {
            *turns += 1;
        }
        self.in_flight.release_spare();
    }

    /// `offset` (with the map of the moment) was sent to the broker.
    pub fn mark_sent(&mut self, offset: Offset) {
        self.sent = Some((offset, 0));
        self.dirty = false;
    }

    /// Nothing to commit: the broker confirmed the current watermark, its map has not
    /// changed since, and no other commit is on its way. A final commit skips such partitions,
    /// so a stop during a rebalance has fewer commits to get accepted.
    pub fn is_settled(&self) -> bool {
        self.watermark().is_some_and(|w| self.confirmed == Some(w))
            && !self.dirty
            && self.sent.is_none()
    }

    /// The broker confirmed a commit of `offset`.
    pub fn commit_confirmed(&mut self, offset: Offset) {
        self.confirmed = Some(self.confirmed.map_or(offset, |c| c.max(offset)));
        if self.sent.is_some_and(|(w, _)| w <= offset) {
            self.sent = None;
        }
        self.failing = false;
    }

    /// The broker refused (or never answered) a commit of `offset`: send again next turn.
    pub fn commit_failed(&mut self, offset: Offset) {
        if self.confirmed.is_some_and(|c| c >= offset) {
            return; // an older commit's failure after a newer one landed
        }
        if self.sent.is_some_and(|(w, _)| w == offset) {
            self.sent = None;
        }
        // The map sent with it did not land either.
        self.dirty = true;
        self.failing = true;
    }

    /// The commit on its way has gone unanswered for too long (librdkafka keeps retrying a
    /// commit while the coordinator is away, and answers nothing meanwhile): count it as failing
    /// for the replay span until an answer comes.
    pub fn commit_stalled(&mut self) -> bool {
        let stalled = self.sent.is_some() && !self.failing;
        if stalled {
            self.failing = true;
        }
        stalled
    }

    /// The committed offset found on assignment (what a crash now would replay from).
    pub fn set_confirmed(&mut self, offset: Offset) {
        self.confirmed = Some(offset);
    }

    /// The leader epoch of the record just below `watermark` (what a commit of `watermark`
    /// carries, so that a new owner's start is validated against the log), if it was taken in.
    pub fn epoch_below(&self, watermark: Offset) -> Option<Epoch> {
        self.epochs.epoch_of(watermark - 1)
    }

    /// The newest leader epoch taken in ([`UNKNOWN`] before the first record): no record
    /// marked done in a completed-offset map written now is newer.
    pub fn newest_epoch(&self) -> Epoch {
        self.epochs.newest().unwrap_or(UNKNOWN)
    }

    /// The last watermark the broker confirmed.
    pub fn confirmed(&self) -> Option<Offset> {
        self.confirmed
    }

    /// Whether the last commit answer was a failure.
    pub fn is_failing(&self) -> bool {
        self.failing
    }

    /// Offsets from the watermark to the newest one begun: what a crash now could replay
    /// while commits keep up.
    pub fn span(&self) -> usize {
        match (self.watermark(), self.next) {
            (Some(w), Some(n)) => usize::try_from(n - w).unwrap_or(0),
            _ => 0,
        }
    }

    /// What a crash now would replay: everything from the last commit the broker confirmed
    /// (or, before any, from the first record taken in) to the newest record taken in. At
    /// least [`span`](Self::span); more while a commit is on its way, and much more while
    /// commits fail.
    pub fn replay_span(&self) -> usize {
        let floor = match (self.confirmed, self.first) {
            // Below the first record fetched there is nothing to replay.
            (Some(c), Some(f)) => c.max(f),
            (Some(c), None) => c,
            (None, Some(f)) => f,
            (None, None) => return self.span(),
        };
        match self.next {
            Some(n) => usize::try_from(n - floor).unwrap_or(0).max(self.span()),
            None => self.span(),
        }
    }

    /// One past the highest offset begun.
    pub fn next(&self) -> Option<Offset> {
        self.next
    }

    /// Unfinished offsets, ascending.
    pub fn in_flight_offsets(&self) -> impl Iterator<Item = Offset> + '_ {
        self.in_flight.iter()
    }

    /// Number of offsets begun and not completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The oldest unfinished offset.
    pub fn oldest_in_flight(&self) -> Option<Offset> {
        self.in_flight.first()
    }
}

/// Offsets of every partition this worker owns.
#[derive(Debug, Default)]
pub struct OffsetTracker {
    /// Looked up twice per record: foldhash, not SipHash.
    partitions: foldhash::HashMap<Partition, PartitionOffsets>,
}

impl OffsetTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts tracking a partition (on assignment). Existing state is kept.
    pub fn assign(&mut self, partition: Partition) {
        self.partitions.entry(partition).or_default();
    }

    /// Forgets a partition (after revocation). Completions that arrive later are ignored.
    pub fn revoke(&mut self, partition: Partition) -> Option<PartitionOffsets> {
        self.partitions.remove(&partition)
    }

    pub fn begin(
        &mut self,
        partition: Partition,
        offset: Offset,
        epoch: Epoch,
    ) -> Result<(), OffsetError> {
        self.partitions
            .entry(partition)
            .or_default()
            .begin(offset, epoch)
    }

    /// Marks an offset done. Returns `Ok(false)` when the partition is no longer owned (the
    /// completion of a record from before a revocation), which is harmless.
    pub fn complete(&mut self, partition: Partition, offset: Offset) -> Result<bool, OffsetError> {
        match self.partitions.get_mut(&partition) {
            Some(p) => p.complete(offset).map(|()| true),
            None => Ok(false),
        }
    }

    pub fn partition(&self, partition: Partition) -> Option<&PartitionOffsets> {
        self.partitions.get(&partition)
    }

    pub fn partition_mut(&mut self, partition: Partition) -> Option<&mut PartitionOffsets> {
        self.partitions.get_mut(&partition)
    }

    /// Watermarks that moved since their last commit, ascending by partition.
    pub fn commit_candidates(&self) -> Vec<(Partition, Offset)> {
        let mut out: Vec<_> = self
            .partitions
            .iter()
            .filter_map(|(p, o)| o.commit_candidate().map(|w| (*p, w)))
            .collect();
        out.sort_unstable();
        out
    }

    pub fn partitions(&self) -> impl Iterator<Item = (Partition, &PartitionOffsets)> {
        self.partitions.iter().map(|(p, o)| (*p, o))
    }

    pub fn partitions_mut(&mut self) -> impl Iterator<Item = (Partition, &mut PartitionOffsets)> {
        self.partitions.iter_mut().map(|(p, o)| (*p, o))
    }

    /// Total offsets in flight over all partitions.
    pub fn in_flight(&self) -> usize {
        self.partitions.values().map(|p| p.in_flight()).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffsetError {
    #[error("offset {offset} begun after offset {} (offsets must increase)", .next - 1)]
    NotIncreasing { offset: Offset, next: Offset },
    #[error("offset {offset} read again at the newer leader epoch {epoch}: the log was truncated and rewritten")]
    Rewritten { offset: Offset, epoch: Epoch },
    #[error("offset {offset} completed but it is not in flight")]
    NotInFlight { offset: Offset },
}

#[cfg(test)]
mod tests;
