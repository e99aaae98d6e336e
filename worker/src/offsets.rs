//! Which offsets of a partition are safe to commit.
//!
//! Sessions finish out of order: offset 104 may complete while 102 is still retrying. Committing
//! the highest completed offset would let a crash skip 102 forever, so the commit point is the
//! *contiguous watermark*: the lowest offset that was handed out and has not finished yet (or,
//! when nothing is unfinished, one past the highest offset handed out). Offsets that Kafka never
//! delivers (compaction, transaction markers) are simply never begun, so gaps in the offset space
//! need no special case.
//!
//! This module is pure bookkeeping — no Kafka, no tokio — so it can be tested exhaustively.

use std::collections::{BTreeSet, HashMap};

/// Kafka partition number.
pub type Partition = i32;
/// Kafka offset.
pub type Offset = i64;

/// In-flight and completed offsets of one partition.
#[derive(Debug, Default, Clone)]
pub struct PartitionOffsets {
    /// Offsets begun and not yet completed.
    in_flight: BTreeSet<Offset>,
    /// One past the highest offset begun; `None` until the first record.
    next: Option<Offset>,
    /// The last watermark handed to the broker, to skip commits that would change nothing.
    committed: Option<Offset>,
    /// Something completed since the last commit (the completed-offset map changed).
    dirty: bool,
}

impl PartitionOffsets {
    /// Records that `offset` was handed out for processing. Offsets must be begun in increasing
    /// order (the order the partition delivers them); an offset at or below one already begun is
    /// a replay of the same fetch and is rejected.
    pub fn begin(&mut self, offset: Offset) -> Result<(), OffsetError> {
        if let Some(next) = self.next {
            if offset < next {
                return Err(OffsetError::NotIncreasing { offset, next });
            }
        }
        self.in_flight.insert(offset);
        self.next = Some(offset + 1);
        Ok(())
    }

    /// Marks `offset` done (processed, or written to the DLQ). Completing an offset that is not
    /// in flight is reported, not ignored: it means two owners for one record.
    pub fn complete(&mut self, offset: Offset) -> Result<(), OffsetError> {
        if self.in_flight.remove(&offset) {
            self.dirty = true;
            Ok(())
        } else {
            Err(OffsetError::NotInFlight { offset })
        }
    }

    /// The offset to commit: every offset below it is done. `None` before the first record.
    pub fn watermark(&self) -> Option<Offset> {
        self.in_flight.first().copied().or(self.next)
    }

    /// The watermark if it, or the set of completed offsets above it, changed since the last
    /// [`mark_committed`](Self::mark_committed).
    pub fn commit_candidate(&self) -> Option<Offset> {
        let watermark = self.watermark()?;
        (self.committed != Some(watermark) || self.dirty).then_some(watermark)
    }

    /// Remembers that `offset` was committed.
    pub fn mark_committed(&mut self, offset: Offset) {
        self.committed = Some(offset);
        self.dirty = false;
    }

    /// Offsets from the watermark to the newest one begun: what a crash now could replay.
    pub fn span(&self) -> usize {
        match (self.watermark(), self.next) {
            (Some(w), Some(n)) => usize::try_from(n - w).unwrap_or(0),
            _ => 0,
        }
    }

    /// One past the highest offset begun.
    pub fn next(&self) -> Option<Offset> {
        self.next
    }

    /// Unfinished offsets, ascending.
    pub fn in_flight_offsets(&self) -> impl Iterator<Item = Offset> + '_ {
        self.in_flight.iter().copied()
    }

    /// Forgets the last commit (it failed), so the watermark is committed again.
    pub fn forget_committed(&mut self) {
        self.committed = None;
    }

    /// The last committed watermark, if any.
    pub fn committed(&self) -> Option<Offset> {
        self.committed
    }

    /// Number of offsets begun and not completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The oldest unfinished offset.
    pub fn oldest_in_flight(&self) -> Option<Offset> {
        self.in_flight.first().copied()
    }
}

/// Offsets of every partition this worker owns.
#[derive(Debug, Default)]
pub struct OffsetTracker {
    partitions: HashMap<Partition, PartitionOffsets>,
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

    pub fn begin(&mut self, partition: Partition, offset: Offset) -> Result<(), OffsetError> {
        self.partitions.entry(partition).or_default().begin(offset)
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

    /// Total offsets in flight over all partitions.
    pub fn in_flight(&self) -> usize {
        self.partitions.values().map(|p| p.in_flight()).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffsetError {
    #[error("offset {offset} begun after offset {} (offsets must increase)", .next - 1)]
    NotIncreasing { offset: Offset, next: Offset },
    #[error("offset {offset} completed but it is not in flight")]
    NotInFlight { offset: Offset },
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn watermark_stops_at_the_first_unfinished_offset() {
        let mut p = PartitionOffsets::default();
        assert_eq!(p.watermark(), None);
        for o in 100..=104 {
            p.begin(o).unwrap();
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
        p.begin(10).unwrap();
        p.begin(15).unwrap(); // 11..14 compacted away
        p.complete(10).unwrap();
        assert_eq!(p.watermark(), Some(15));
        p.complete(15).unwrap();
        assert_eq!(p.watermark(), Some(16));
    }

    #[test]
    fn misuse_is_reported() {
        let mut p = PartitionOffsets::default();
        p.begin(5).unwrap();
        assert_eq!(
            p.begin(5),
            Err(OffsetError::NotIncreasing { offset: 5, next: 6 })
        );
        assert_eq!(p.complete(7), Err(OffsetError::NotInFlight { offset: 7 }));
        p.complete(5).unwrap();
        assert_eq!(p.complete(5), Err(OffsetError::NotInFlight { offset: 5 }));
    }

    #[test]
    fn commit_candidate_only_when_the_watermark_moved() {
        let mut t = OffsetTracker::new();
        t.begin(0, 0).unwrap();
        t.begin(1, 7).unwrap();
        assert_eq!(t.commit_candidates(), vec![(0, 0), (1, 7)]);
        t.partition_mut(0).unwrap().mark_committed(0);
        t.partition_mut(1).unwrap().mark_committed(7);
        assert!(t.commit_candidates().is_empty());
        t.complete(1, 7).unwrap();
        assert_eq!(t.commit_candidates(), vec![(1, 8)]);
    }

    #[test]
    fn completions_after_revoke_are_ignored() {
        let mut t = OffsetTracker::new();
        t.begin(3, 1).unwrap();
        assert!(t.revoke(3).is_some());
        assert_eq!(t.complete(3, 1), Ok(false));
        assert!(t.commit_candidates().is_empty());
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
                p.begin(o).unwrap();
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

        /// Interleaving begins and completes (the live pattern) keeps the same invariant.
        #[test]
        fn interleaved_begin_and_complete(ops in prop::collection::vec(any::<(bool, u8)>(), 1..400)) {
            let mut p = PartitionOffsets::default();
            let mut next: Offset = 0;
            let mut open: Vec<Offset> = Vec::new();
            for (is_begin, pick) in ops {
                if is_begin || open.is_empty() {
                    p.begin(next).unwrap();
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
