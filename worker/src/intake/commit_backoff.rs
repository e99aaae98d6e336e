//! How long early commits wait after the broker refused one.
//!
//! A partition whose replay span reaches half its cap asks for a commit before the interval's
//! (`Book::commit_urgent`), and the consumer loop sends one as soon as the last was answered.
//! While the coordinator refuses commits (loading or moving the group, a rebalance under way),
//! the span stays above half the cap, and on one host a refusal comes back within a
//! millisecond: the loop sent ~3,000 `OffsetCommit` requests a second to a coordinator that was
//! refusing them (`commit_outage::a_crash_after_a_commit_outage_…`, on Apache Kafka, counted
//! 5,000 in under two seconds). So after a refusal, early commits wait: 100 ms, doubling with
//! each refusal in a row up to a second — librdkafka's own `retry.backoff.ms` and
//! `retry.backoff.max.ms` — and a confirmed commit ends the wait. The interval's commit is not
//! held back: it still goes every `commitIntervalMs`.

use std::time::Duration;

use crate::session::retry::RetryPolicy;

/// The wait's growth: from 100 ms, doubling, at most a second.
const POLICY: RetryPolicy = RetryPolicy {
    initial: Duration::from_millis(100),
    max: Duration::from_secs(1),
    multiplier: 2.0,
    max_attempts: 0,
};

/// Refused commits in a row, and the wait they put before the next early one.
#[derive(Debug, Default)]
pub struct CommitBackoff {
    refused_in_a_row: u32,
}

impl CommitBackoff {
    /// A commit was answered: `refused` if any partition of it was refused.
    pub fn answered(&mut self, refused: bool) {
        self.refused_in_a_row = if refused {
            self.refused_in_a_row.saturating_add(1)
        } else {
            0
        };
    }

    /// How long after the last answer an early commit may go.
    pub fn early_wait(&self) -> Duration {
        match self.refused_in_a_row {
            0 => Duration::ZERO,
            n => POLICY.ceiling(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_commits_wait_only_after_refusals_and_doubling_up_to_a_second() {
        let mut backoff = CommitBackoff::default();
        assert_eq!(backoff.early_wait(), Duration::ZERO);
        let mut waits = Vec::new();
        for _ in 0..8 {
            backoff.answered(true);
            waits.push(backoff.early_wait().as_millis());
        }
        assert_eq!(waits, [100, 200, 400, 800, 1_000, 1_000, 1_000, 1_000]);
    }

    #[test]
    fn a_confirmed_commit_ends_the_wait() {
        let mut backoff = CommitBackoff::default();
        for _ in 0..3 {
            backoff.answered(true);
        }
        backoff.answered(false);
        assert_eq!(backoff.early_wait(), Duration::ZERO);
        backoff.answered(true);
        assert_eq!(backoff.early_wait(), Duration::from_millis(100));
    }

    #[test]
    fn refusals_without_end_keep_the_wait_at_a_second() {
        let mut backoff = CommitBackoff {
            refused_in_a_row: u32::MAX - 1,
        };
        backoff.answered(true);
        backoff.answered(true);
        assert_eq!(backoff.early_wait(), Duration::from_secs(1));
    }
}
