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
/// Its length is bounded by the replay span, which the in-flight cap bounds.
#[derive(Debug, Default, Clone)]
struct InFlight {
    slots: VecDeque<Slot>,
    /// Slots not done.
    unfinished: usize,
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
}

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

    /// A commit turn passed: an unanswered commit ages.
    pub fn tick(&mut self) {
        if let Some((_, turns)) = &mut self.sent {
            *turns += 1;
        }
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_confirmed_unchanged_watermark_is_settled_until_anything_moves() {
        let mut p = PartitionOffsets::default();
        assert!(!p.is_settled(), "nothing begun");
        for o in 10..=12 {
            p.begin(o, 0).unwrap();
        }
        p.complete(10).unwrap();
        assert!(!p.is_settled(), "never committed");
        p.mark_sent(11);
        assert!(!p.is_settled(), "on its way");
        p.commit_confirmed(11);
        assert!(p.is_settled());
        // Completing above the watermark changes the map: no longer settled.
        p.complete(12).unwrap();
        assert!(!p.is_settled(), "the map changed");
        p.mark_sent(11);
        p.commit_failed(11);
        assert!(!p.is_settled(), "the map's commit failed");
        p.mark_sent(11);
        p.commit_confirmed(11);
        assert!(p.is_settled());
        p.complete(11).unwrap();
        assert!(!p.is_settled(), "the watermark moved");
    }

    #[test]
    fn watermark_stops_at_the_first_unfinished_offset() {
        let mut p = PartitionOffsets::default();
        assert_eq!(p.watermark(), None);
        for o in 100..=104 {
            p.begin(o, 0).unwrap();
        }
        assert_eq!(p.watermark(), Some(100));
        p.complete(100).unwrap();
        p.complete(101).unwrap();
        p.complete(103).unwrap();
        p.complete(104).unwrap();
        // 102 still running: 104 done must not let the commit pass 102.
        assert_eq!(p.watermark(), Some(102));
        assert_eq!(p.span(), 3);
        p.complete(102).unwrap();
        assert_eq!(p.watermark(), Some(105));
        assert_eq!(p.span(), 0);
    }

    #[test]
    fn gaps_in_the_offset_space_do_not_block_the_watermark() {
        let mut p = PartitionOffsets::default();
        p.begin(10, 0).unwrap();
        p.begin(15, 0).unwrap(); // 11..14 compacted away
        p.complete(10).unwrap();
        assert_eq!(p.watermark(), Some(15));
        p.complete(15).unwrap();
        assert_eq!(p.watermark(), Some(16));
    }

    #[test]
    fn misuse_is_reported() {
        let mut p = PartitionOffsets::default();
        p.begin(5, 0).unwrap();
        assert_eq!(
            p.begin(5, 0),
            Err(OffsetError::NotIncreasing { offset: 5, next: 6 })
        );
        assert_eq!(p.complete(7), Err(OffsetError::NotInFlight { offset: 7 }));
        p.complete(5).unwrap();
        assert_eq!(p.complete(5), Err(OffsetError::NotInFlight { offset: 5 }));
    }

    #[test]
    fn an_offset_read_again_at_a_newer_leader_epoch_is_a_rewrite_not_a_replay() {
        let mut p = PartitionOffsets::default();
        for o in 0..10 {
            p.begin(o, 4).unwrap();
        }
        for o in 10..20 {
            p.begin(o, 6).unwrap();
        }
        // Fetched again, same records: refused as a replay.
        assert_eq!(
            p.begin(12, 6),
            Err(OffsetError::NotIncreasing {
                offset: 12,
                next: 20
            })
        );
        // The log truncated at 12 and rewritten by the leader of epoch 7.
        assert_eq!(
            p.begin(12, 7),
            Err(OffsetError::Rewritten {
                offset: 12,
                epoch: 7
            })
        );
        // A commit carries the epoch of the record below its watermark.
        assert_eq!(p.epoch_below(10), Some(4));
        assert_eq!(p.epoch_below(11), Some(6));
        assert_eq!(p.epoch_below(0), None);
        assert_eq!(p.newest_epoch(), 6);
        assert_eq!(PartitionOffsets::default().newest_epoch(), UNKNOWN);
    }

    #[test]
    fn commit_candidate_only_when_the_watermark_moved() {
        let mut t = OffsetTracker::new();
        t.begin(0, 0, 0).unwrap();
        t.begin(1, 7, 0).unwrap();
        assert_eq!(t.commit_candidates(), vec![(0, 0), (1, 7)]);
        t.partition_mut(0).unwrap().mark_sent(0);
        t.partition_mut(1).unwrap().mark_sent(7);
        assert!(t.commit_candidates().is_empty());
        t.partition_mut(0).unwrap().commit_confirmed(0);
        t.partition_mut(1).unwrap().commit_confirmed(7);
        assert!(t.commit_candidates().is_empty());
        t.complete(1, 7).unwrap();
        assert_eq!(t.commit_candidates(), vec![(1, 8)]);
    }

    #[test]
    fn a_failed_commit_is_sent_again_and_an_unanswered_one_after_a_few_turns() {
        let mut p = PartitionOffsets::default();
        p.begin(0, 0).unwrap();
        p.complete(0).unwrap();
        p.mark_sent(1);
        assert_eq!(p.commit_candidate(), None);
        p.commit_failed(1);
        assert!(p.is_failing());
        assert_eq!(
            p.commit_candidate(),
            Some(1),
            "a failure is retried at once"
        );
        p.mark_sent(1);
        for _ in 0..RESEND_AFTER_TURNS {
            assert_eq!(p.commit_candidate(), None);
            p.tick();
        }
        assert_eq!(p.commit_candidate(), Some(1), "no answer: sent again");
        p.mark_sent(1);
        p.commit_confirmed(1);
        assert!(!p.is_failing());
        assert_eq!(p.confirmed(), Some(1));
        assert_eq!(
            p.commit_candidate(),
            None,
            "idle and confirmed: nothing to send"
        );
    }

    #[test]
    fn a_stalled_commit_counts_as_failing_until_answered() {
        let mut p = PartitionOffsets::default();
        for o in 0..300 {
            p.begin(o, 0).unwrap();
            p.complete(o).unwrap();
        }
        p.set_confirmed(0);
        p.begin(300, 0).unwrap();
        p.mark_sent(300);
        assert!(p.commit_stalled());
        assert!(p.is_failing());
        assert!(!p.commit_stalled(), "reported once");
        assert_eq!(
            p.replay_span(),
            301,
            "everything since the last confirmed commit"
        );
        p.commit_confirmed(300);
        assert!(!p.is_failing());
        assert_eq!(p.replay_span(), 1);
        assert!(!p.commit_stalled(), "nothing on its way");
    }

    #[test]
    fn an_old_failure_after_a_newer_success_changes_nothing() {
        let mut p = PartitionOffsets::default();
        for o in 0..10 {
            p.begin(o, 0).unwrap();
            p.complete(o).unwrap();
        }
        p.mark_sent(10);
        p.commit_confirmed(10);
        p.commit_failed(5);
        assert!(!p.is_failing());
        assert_eq!(p.commit_candidate(), None);
    }

    #[test]
    fn the_replay_span_counts_from_the_last_confirmed_commit() {
        let mut p = PartitionOffsets::default();
        p.set_confirmed(100);
        for o in 100..150 {
            p.begin(o, 0).unwrap();
            p.complete(o).unwrap();
        }
        p.mark_sent(150);
        p.commit_confirmed(150);
        for o in 150..400 {
            p.begin(o, 0).unwrap();
            p.complete(o).unwrap();
        }
        p.begin(400, 0).unwrap();
        assert_eq!(p.span(), 1);
        assert_eq!(p.replay_span(), 251, "150..=400 would be replayed");
        p.mark_sent(400);
        p.commit_failed(400);
        assert_eq!(p.replay_span(), 251, "still, while the commit fails");
        p.mark_sent(400);
        p.commit_confirmed(400);
        assert_eq!(p.replay_span(), 1, "confirmed: only the unfinished record");
    }

    #[test]
    fn completions_after_revoke_are_ignored() {
        let mut t = OffsetTracker::new();
        t.begin(3, 1, 0).unwrap();
        assert!(t.revoke(3).is_some());
        assert_eq!(t.complete(3, 1), Ok(false));
        assert!(t.commit_candidates().is_empty());
    }

    #[test]
    fn an_early_commit_waits_for_half_the_cap_and_an_eighth_of_it_gained() {
        const CAP: usize = 80;
        let mut p = PartitionOffsets::default();
        p.set_confirmed(0);
        for o in 0..39 {
            p.begin(o, 0).unwrap();
        }
        for o in 0..20 {
            p.complete(o).unwrap();
        }
        assert!(
            !p.wants_early_commit(CAP),
            "39 in the span, below half of 80"
        );
        p.begin(39, 0).unwrap();
        assert!(p.wants_early_commit(CAP), "40 in the span, 20 gained");
        p.mark_sent(20);
        p.commit_confirmed(20);
        for o in 40..60 {
            p.begin(o, 0).unwrap();
        }
        for o in 20..29 {
            p.complete(o).unwrap();
        }
        assert_eq!(p.replay_span(), 40);
        assert!(!p.wants_early_commit(CAP), "9 gained, less than an eighth");
        p.complete(29).unwrap();
        assert!(p.wants_early_commit(CAP), "10 gained, an eighth");
        p.mark_sent(30);
        assert!(!p.wants_early_commit(CAP), "already on its way");
    }

    #[test]
    fn an_early_commit_needs_no_gain_before_the_first_confirmed_one_or_with_a_tiny_cap() {
        let mut p = PartitionOffsets::default();
        for o in 0..4 {
            p.begin(o, 0).unwrap();
        }
        p.complete(0).unwrap();
        assert!(p.wants_early_commit(8), "nothing confirmed yet");
        p.mark_sent(1);
        p.commit_confirmed(1);
        p.complete(1).unwrap();
        assert!(
            p.wants_early_commit(4),
            "a cap below 8 asks for one offset gained"
        );
        assert!(!p.wants_early_commit(64), "a span of 3 is below half of 64");
    }

    /// A strategy for "n offsets with gaps, completed in an arbitrary order".
    fn offsets_and_order() -> impl Strategy<Value = (Vec<Offset>, Vec<usize>)> {
        prop::collection::vec(1i64..4, 1..200).prop_flat_map(|steps| {
            let offsets: Vec<Offset> = steps
                .iter()
                .scan(0i64, |acc, s| {
                    *acc += s;
                    Some(*acc)
                })
                .collect();
            let order: Vec<usize> = (0..offsets.len()).collect();
            (Just(offsets), Just(order).prop_shuffle())
        })
    }

    proptest! {
        /// Under any completion order, the watermark never passes an unfinished offset, never
        /// moves backwards, and reaches one past the last offset when everything is done.
        #[test]
        fn never_commits_past_an_incomplete_offset((offsets, order) in offsets_and_order()) {
            let mut p = PartitionOffsets::default();
            for &o in &offsets {
                p.begin(o, 0).unwrap();
            }
            let mut done = vec![false; offsets.len()];
            let mut last = p.watermark().unwrap();
            for i in order {
                p.complete(offsets[i]).unwrap();
                done[i] = true;
                let w = p.watermark().unwrap();
                prop_assert!(w >= last, "watermark moved back from {} to {}", last, w);
                last = w;
                for (j, &o) in offsets.iter().enumerate() {
                    if o < w {
                        prop_assert!(done[j], "watermark {} passed unfinished offset {}", w, o);
                    }
                }
                // And it is the highest such point: the offset at the watermark (if begun) is
                // unfinished.
                if let Some(j) = offsets.iter().position(|&o| o == w) {
                    prop_assert!(!done[j]);
                }
            }
            prop_assert_eq!(p.watermark(), Some(offsets.last().unwrap() + 1));
            prop_assert_eq!(p.in_flight(), 0);
        }

        /// Whatever the order of sends, answers and turns, a watermark that is not confirmed
        /// is never left without a send pending or coming: the partition converges to
        /// committed = processed once the broker answers.
        #[test]
        fn unconfirmed_watermarks_are_always_sent_again(
            events in prop::collection::vec(0u8..4, 1..200),
        ) {
            let mut p = PartitionOffsets::default();
            p.begin(0, 0).unwrap();
            p.complete(0).unwrap();
            let mut in_flight: Vec<Offset> = Vec::new();
            for e in events {
                match e {
                    0 => if let Some(w) = p.commit_candidate() { p.mark_sent(w); in_flight.push(w); },
                    1 => if let Some(w) = in_flight.pop() { p.commit_failed(w); },
                    2 => { in_flight.clear(); } // answers lost
                    _ => p.tick(),
                }
            }
            // Answers lost for good: within RESEND_AFTER_TURNS turns the watermark is sent again.
            let mut sent_again = p.confirmed() == Some(1);
            for _ in 0..=RESEND_AFTER_TURNS {
                if p.commit_candidate() == Some(1) {
                    sent_again = true;
                    break;
                }
                p.tick();
            }
            prop_assert!(sent_again);
        }

        /// The in-flight deque answers like the ordered set it replaced, with gaps between
        /// offsets and completions that are repeated or of offsets never begun.
        #[test]
        fn in_flight_behaves_like_an_ordered_set(
            ops in prop::collection::vec((0u8..3, 1i64..5, any::<u16>()), 1..500),
        ) {
            let mut p = PartitionOffsets::default();
            let mut model = std::collections::BTreeSet::new();
            let mut next: Offset = 0;
            for (op, step, pick) in ops {
                match op {
                    0 => {
                        next += step;
                        p.begin(next, 0).unwrap();
                        model.insert(next);
                    }
                    1 if !model.is_empty() => {
                        let o = *model.iter().nth(pick as usize % model.len()).unwrap();
                        p.complete(o).unwrap();
                        model.remove(&o);
                    }
                    _ => {
                        // Anything up to one past the newest: done, never begun, or in flight.
                        let o = Offset::from(pick) % (next + 2);
                        prop_assert_eq!(p.complete(o).is_ok(), model.remove(&o));
                    }
                }
                prop_assert_eq!(p.in_flight(), model.len());
                prop_assert_eq!(p.oldest_in_flight(), model.first().copied());
                prop_assert_eq!(p.in_flight_offsets().collect::<Vec<_>>(),
                    model.iter().copied().collect::<Vec<_>>());
                if next > 0 {
                    prop_assert_eq!(p.watermark(), Some(model.first().copied().unwrap_or(next + 1)));
                }
            }
        }

        /// Interleaving begins and completes (the live pattern) keeps the same invariant.
        #[test]
        fn interleaved_begin_and_complete(ops in prop::collection::vec(any::<(bool, u8)>(), 1..400)) {
            let mut p = PartitionOffsets::default();
            let mut next: Offset = 0;
            let mut open: Vec<Offset> = Vec::new();
            for (is_begin, pick) in ops {
                if is_begin || open.is_empty() {
                    p.begin(next, 0).unwrap();
                    open.push(next);
                    next += 1;
                } else {
                    let o = open.remove(pick as usize % open.len());
                    p.complete(o).unwrap();
                }
                let w = p.watermark().unwrap();
                let expected = open.iter().min().copied().unwrap_or(next);
                prop_assert_eq!(w, expected);
            }
        }
    }
}
