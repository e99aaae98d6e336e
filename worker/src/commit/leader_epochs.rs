//! Which leader epoch wrote each offset taken in: how a rewritten log is told from a replay.
//!
//! Every record carries the leader epoch of the partition leader that appended it (KIP-101,
//! KIP-320), and a new leader always has a higher epoch than every leader before it. When a
//! leader is elected without the old leader's last records (an unclean election, or the old
//! leader's unreplicated tail after an `acks=1` write), the log is *truncated* back to where
//! the two agree and written on from there: the same offsets now hold other records, of a
//! newer epoch. librdkafka notices (the fetch position is validated against the new leader)
//! and moves the fetch position back to the truncation point without a word; the consumer
//! loop then sees offsets it has already taken in. Told apart by epoch:
//!
//! - the same offset at the same (or an older) epoch is a *replay* of a record already taken
//!   in (a refetch): it is never processed twice;
//! - the same offset at a newer epoch is a *rewritten* record: never processed, so skipping it
//!   would lose it — the partition is replayed from there instead.
//!
//! The same fact decides the completed-offset map (see `offset_map`): it records the highest
//! epoch of the records it marks done, and a record at a marked offset but of a newer epoch is
//! not the one that was done. And each commit carries the epoch of the last committed record,
//! so that librdkafka validates a new owner's starting position the same way.
//!
//! Epochs change only when a partition's leader does, so they are kept as runs (epoch, first
//! offset): one per leader change seen, a handful over a process's life.
//!
//! Pure: no Kafka types.

use std::collections::VecDeque;

/// A partition leader epoch; [`UNKNOWN`] where the broker reported none.
pub type Epoch = i32;

/// A Kafka offset (as `offsets::Offset`, which builds on this module).
type Offset = i64;

/// The epoch of a record whose broker reported none (message format before v2): it compares
/// below every known epoch, so records without epochs behave as before epochs were read.
pub const UNKNOWN: Epoch = -1;

/// Runs kept at most; beyond that the oldest are dropped (their offsets' epochs become
/// unknown, and a record fetched again there counts as rewritten: a replay, never a skip).
const MAX_RUNS: usize = 256;

/// Epoch runs of the offsets taken in from one partition, ascending.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EpochRuns {
    /// (epoch, first offset taken in at that epoch); offsets and epochs ascending.
    runs: VecDeque<(Epoch, Offset)>,
}

impl EpochRuns {
    /// `offset`, read at `epoch`, was taken in; offsets arrive ascending.
    pub fn taken(&mut self, offset: Offset, epoch: Epoch) {
        if self.runs.back().is_some_and(|&(e, _)| e == epoch) {
            return;
        }
        if self.runs.len() == MAX_RUNS {
            self.runs.pop_front();
        }
        self.runs.push_back((epoch, offset));
    }

    /// The epoch `offset` was taken in at, if it is within what was taken in (offsets above
    /// the last one taken in get the newest epoch: the caller asks only for those).
    pub fn epoch_of(&self, offset: Offset) -> Option<Epoch> {
        let i = self.runs.partition_point(|&(_, first)| first <= offset);
        i.checked_sub(1).map(|i| self.runs[i].0)
    }

    /// The newest epoch taken in.
    pub fn newest(&self) -> Option<Epoch> {
        self.runs.back().map(|&(e, _)| e)
    }

    /// Whether a record at `offset`, which is below the next offset expected, read at `epoch`,
    /// is another record than the one taken in there: its epoch is newer, or nothing is known
    /// of that offset.
    pub fn rewritten(&self, offset: Offset, epoch: Epoch) -> bool {
        self.epoch_of(offset).is_none_or(|seen| epoch > seen)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn runs_are_kept_per_leader_change() {
        let mut r = EpochRuns::default();
        for o in 10..20 {
            r.taken(o, 3);
        }
        for o in 20..25 {
            r.taken(o, 5);
        }
        assert_eq!(r.epoch_of(9), None);
        assert_eq!(r.epoch_of(10), Some(3));
        assert_eq!(r.epoch_of(19), Some(3));
        assert_eq!(r.epoch_of(20), Some(5));
        assert_eq!(r.epoch_of(24), Some(5));
        assert_eq!(r.newest(), Some(5));
        assert_eq!(r.runs.len(), 2);
    }

    #[test]
    fn a_refetch_at_the_same_epoch_is_a_replay_and_a_newer_epoch_a_rewrite() {
        let mut r = EpochRuns::default();
        (100..150).for_each(|o| r.taken(o, 7));
        // The same records fetched again.
        assert!(!r.rewritten(120, 7));
        // The log truncated at 120 and written on by the leader of epoch 8.
        assert!(r.rewritten(120, 8));
        // Below what this owner took in, nothing is known: replay.
        assert!(r.rewritten(99, 7));
    }

    #[test]
    fn without_epochs_every_refetch_is_a_replay() {
        let mut r = EpochRuns::default();
        (0..10).for_each(|o| r.taken(o, UNKNOWN));
        assert!((0..10).all(|o| !r.rewritten(o, UNKNOWN)));
    }

    #[test]
    fn the_oldest_runs_go_first_when_there_are_too_many() {
        let mut r = EpochRuns::default();
        for e in 0..(MAX_RUNS as Epoch + 10) {
            r.taken(i64::from(e) * 10, e);
        }
        assert_eq!(r.runs.len(), MAX_RUNS);
        assert_eq!(r.epoch_of(0), None);
        assert_eq!(
            r.epoch_of(10 * (MAX_RUNS as i64 + 9) + 5),
            Some(MAX_RUNS as Epoch + 9)
        );
    }

    proptest! {
        /// Against the definition: the epoch of an offset is the epoch of the last record taken
        /// in at or below it.
        #[test]
        fn epoch_of_matches_the_records_taken_in(
            steps in prop::collection::vec((1i64..5, 0i32..3), 1..200),
            probes in prop::collection::vec(0i64..1_000, 1..50),
        ) {
            let mut r = EpochRuns::default();
            let mut taken: Vec<(Offset, Epoch)> = Vec::new();
            let (mut offset, mut epoch) = (0i64, 0i32);
            for (gap, bump) in steps {
                offset += gap;
                epoch += bump;
                r.taken(offset, epoch);
                taken.push((offset, epoch));
            }
            for p in probes {
                let expected = taken.iter().rev().find(|(o, _)| *o <= p).map(|(_, e)| *e);
                prop_assert_eq!(r.epoch_of(p), expected);
            }
        }
    }
}
