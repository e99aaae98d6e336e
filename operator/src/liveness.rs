//! Whether the autoscaler loop is still alive, for `/healthz`.
//!
//! The process can serve HTTP while its autoscaler is wedged (a read that never returns, a
//! task that died): then no stage is ever scaled again and nothing says so. The loop records
//! every pass it completes in a [`PassClock`]; `/healthz` fails once no pass has completed for
//! [`STALE_PASSES`] intervals plus one lag-read deadline, so the kubelet restarts the operator.
//! A standby replica (not the leader) completes empty passes, so it stays healthy. Pure apart
//! from the clock read in [`PassClock::healthy`]: the rule is tested with explicit instants.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Intervals without a completed pass after which the operator is unhealthy.
pub const STALE_PASSES: u32 = 3;

/// When the autoscaler loop last completed a pass (or started, before the first one).
#[derive(Debug)]
pub struct PassClock {
    last: Mutex<Instant>,
    allowed: Duration,
}

impl PassClock {
    /// A clock for passes every `interval`, each allowed `deadline` for its lag reads; it
    /// counts from `start` (the first pass has the same allowance).
    pub fn new(interval: Duration, deadline: Duration, start: Instant) -> Self {
        Self {
            last: Mutex::new(start),
            allowed: interval * STALE_PASSES + deadline,
        }
    }

    /// A pass completed at `at`.
    pub fn completed_at(&self, at: Instant) {
        let mut last = self.last.lock().expect("not poisoned");
        *last = (*last).max(at);
    }

    /// A pass completed now.
    pub fn completed(&self) {
        self.completed_at(Instant::now());
    }

    /// Whether a pass completed recently enough, as of `now`.
    pub fn healthy_at(&self, now: Instant) -> bool {
        let last = *self.last.lock().expect("not poisoned");
        now.saturating_duration_since(last) <= self.allowed
    }

    /// Whether a pass completed recently enough.
    pub fn healthy(&self) -> bool {
        self.healthy_at(Instant::now())
    }

    /// How long without a pass is tolerated.
    pub fn allowed(&self) -> Duration {
        self.allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn healthy_until_three_intervals_and_a_deadline_pass_without_a_pass() {
        let t0 = Instant::now();
        let clock = PassClock::new(15 * SEC, 10 * SEC, t0);
        assert_eq!(clock.allowed(), 55 * SEC);
        assert!(
            clock.healthy_at(t0 + 55 * SEC),
            "the first pass has the same allowance"
        );
        assert!(!clock.healthy_at(t0 + 56 * SEC));
        clock.completed_at(t0 + 50 * SEC);
        assert!(clock.healthy_at(t0 + 105 * SEC));
        assert!(!clock.healthy_at(t0 + 106 * SEC));
        // A late report of an older pass does not move the clock back.
        clock.completed_at(t0 + 10 * SEC);
        assert!(clock.healthy_at(t0 + 105 * SEC));
    }
}
