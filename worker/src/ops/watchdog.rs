//! The ordering watchdog: a live check of guarantee 1 on records that carry `sessionflow-seq`.
//!
//! Within one assignment of a partition, a session's records must reach the session (intake)
//! and the handler in increasing `sessionflow-seq` order. The watchdog counts every record that
//! arrives after a higher number of its session *and was not seen before* — a record that
//! overtook an earlier one. Seeing a number again is a replay (an upstream stage restarted),
//! not a violation. A new assignment starts over, since a partition that comes back after a
//! rebalance legitimately replays from its committed offset.
//!
//! Only the 64 numbers up to a session's highest are judged, so what a session keeps is one
//! word of bits beside its highest number: every session has two watches (intake and handler
//! entry), and a million idle sessions keep them all.

/// How far below a session's highest number a record is still judged: older ones are too old
/// to tell an overtaken record from a replay, and are let through.
const WINDOW: u64 = u64::BITS as u64;

/// Per-session sequence tracking.
#[derive(Debug, Default, Clone)]
pub struct SeqWatch {
    epoch: u64,
    /// The highest number seen in this assignment.
    max: Option<u64>,
    /// Which of the `WINDOW` numbers up to `max` were seen: bit `i` stands for `max - i`.
    seen: u64,
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
        let max = match self.max {
            Some(max) if seq <= max => max,
            // A new highest number (the usual case): the window slides up to it.
            higher => {
                let rise = higher.map_or(WINDOW, |max| seq - max);
                let kept = if rise < WINDOW { self.seen << rise } else { 0 };
                self.seen = kept | 1;
                self.max = Some(seq);
                return false;
            }
        };
        let below = max - seq;
        if below >= WINDOW {
            return false;
        }
        let bit = 1 << below;
        let overtaken = self.seen & bit == 0;
        self.seen |= bit;
        overtaken
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
    fn a_number_counts_once_and_far_below_the_highest_is_not_judged() {
        // 3 overtaken once (then a replay); 1 is 64 below 65, out of the window.
        assert_eq!(
            violations(&[(1, 2), (1, 4), (1, 3), (1, 3), (1, 65), (1, 1)]),
            1
        );
        // A jump of more than the window forgets everything below it.
        assert_eq!(violations(&[(1, 1), (1, 3), (1, 200), (1, 199)]), 1);
        // Also a jump too far for a shift's width (2^32 + 1 is not a shift by 1).
        let far = (1 << 32) + 3;
        assert_eq!(violations(&[(1, 2), (1, 3), (1, far), (1, far - 1)]), 1);
    }

    #[test]
    fn records_without_seq_are_ignored() {
        let mut w = SeqWatch::default();
        assert!(!w.observe(1, None));
        assert!(!w.observe(1, Some(2)));
        assert!(!w.observe(1, None));
    }

    proptest::proptest! {
        /// Against the definition, with every number remembered: a violation is a number not
        /// seen before in this assignment, below the highest one by less than the window.
        #[test]
        fn matches_the_definition(
            records in proptest::collection::vec((0u64..40, 0u64..300), 0..400),
        ) {
            let mut watch = SeqWatch::default();
            let (mut epoch, mut max, mut seen) = (0, None::<u64>, std::collections::HashSet::new());
            for (e, seq) in records {
                // Epochs only grow, ~40 records per assignment.
                let e = epoch + u64::from(e == 0);
                if e != epoch {
                    (epoch, max) = (e, None);
                    seen.clear();
                }
                let expected = max.is_some_and(|m| seq < m && m - seq < WINDOW) && !seen.contains(&seq);
                seen.insert(seq);
                max = Some(max.map_or(seq, |m| m.max(seq)));
                proptest::prop_assert_eq!(watch.observe(e, Some(seq)), expected, "seq {}", seq);
            }
        }
    }
}
