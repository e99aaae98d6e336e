//! The ordering watchdog: a live check of guarantee 1 on records that carry `sessionflow-seq`.
//!
//! Within one assignment of a partition, a session's records must reach the session (intake)
//! and the handler in increasing `sessionflow-seq` order. The watchdog counts every record that
//! arrives after a higher number of its session *and was not seen before* — a record that
//! overtook an earlier one. Seeing a recent number again is a replay (an upstream stage
//! restarted), not a violation. A new assignment starts over, since a partition that comes back
//! after a rebalance legitimately replays from its committed offset.

use std::collections::VecDeque;

/// How many recent numbers a session remembers to tell replays from violations.
const RECENT: usize = 64;

/// Per-session sequence tracking.
#[derive(Debug, Default, Clone)]
pub struct SeqWatch {
    epoch: u64,
    max: Option<u64>,
    recent: VecDeque<u64>,
}

impl SeqWatch {
    /// Notes `seq` of a record taken under assignment `epoch`; true when it is a violation.
    pub fn observe(&mut self, epoch: u64, seq: Option<u64>) -> bool {
        let Some(seq) = seq else {
            return false;
        };
        if epoch != self.epoch {
            *self = Self {
                epoch,
                ..Self::default()
            };
        }
        // `recent` holds nothing above `max`: a new highest number (the usual case) is no replay,
        // without a scan.
        let replay = self.max.is_some_and(|m| seq <= m) && self.recent.contains(&seq);
        let violation = !replay && self.max.is_some_and(|m| seq < m && m - seq < RECENT as u64);
        if !replay {
            if self.recent.len() == RECENT {
                self.recent.pop_front();
            }
            self.recent.push_back(seq);
        }
        self.max = Some(self.max.map_or(seq, |m| m.max(seq)));
        violation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn violations(epochs_and_seqs: &[(u64, u64)]) -> usize {
        let mut w = SeqWatch::default();
        epochs_and_seqs
            .iter()
            .filter(|(e, s)| w.observe(*e, Some(*s)))
            .count()
    }

    #[test]
    fn increasing_is_fine_and_gaps_are_allowed() {
        assert_eq!(violations(&[(1, 1), (1, 2), (1, 5), (1, 9)]), 0);
    }

    #[test]
    fn overtaking_is_counted() {
        assert_eq!(violations(&[(1, 1), (1, 3), (1, 2)]), 1);
    }

    #[test]
    fn replays_are_not_violations() {
        assert_eq!(
            violations(&[(1, 1), (1, 2), (1, 3), (1, 2), (1, 3), (1, 4)]),
            0
        );
    }

    #[test]
    fn a_new_assignment_starts_over() {
        assert_eq!(violations(&[(1, 5), (1, 6), (2, 3), (2, 4)]), 0);
    }

    #[test]
    fn records_without_seq_are_ignored() {
        let mut w = SeqWatch::default();
        assert!(!w.observe(1, None));
        assert!(!w.observe(1, Some(2)));
        assert!(!w.observe(1, None));
    }
}
