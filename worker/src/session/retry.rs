//! How long a session waits before retrying the same message.
//!
//! Exponential backoff with *full jitter* (AWS Architecture Blog, "Exponential Backoff And
//! Jitter"): the ceiling doubles (times `multiplier`) per attempt up to `max`, and the actual
//! delay is drawn uniformly from `[0, ceiling]`, so many sessions failing on the same outage do
//! not retry in lock-step. The policy is pure: the caller supplies the random draw.

use std::time::Duration;

use crate::config::RetryConfig;

/// Retry settings of a stage (`retry:` in the config).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    pub initial: Duration,
    pub max: Duration,
    pub multiplier: f64,
    /// Total attempts allowed for one message, first included; 0 retries transient errors forever.
    pub max_attempts: u32,
}

impl From<RetryConfig> for RetryPolicy {
    fn from(c: RetryConfig) -> Self {
        RetryPolicy {
            initial: Duration::from_millis(c.initial_backoff_ms),
            max: Duration::from_millis(c.max_backoff_ms),
            multiplier: c.multiplier,
            max_attempts: c.max_attempts,
        }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(30),
            multiplier: 2.0,
            max_attempts: 0,
        }
    }
}

impl RetryPolicy {
    /// The largest delay allowed after the `attempt`-th failed attempt (1-based).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(1_000) as i32;
        let secs = self.initial.as_secs_f64() * self.multiplier.powi(exp);
        let capped = secs.min(self.max.as_secs_f64());
        if capped.is_finite() && capped >= 0.0 {
            Duration::from_secs_f64(capped)
        } else {
            self.max
        }
    }

    /// The delay after the `attempt`-th failure, given a uniform draw `unit` in `[0, 1)`.
    pub fn delay(&self, attempt: u32, unit: f64) -> Duration {
        self.ceiling(attempt).mul_f64(unit.clamp(0.0, 1.0))
    }

    /// Whether a message that has failed `attempts` times may be tried again.
    pub fn may_retry(&self, attempts: u32) -> bool {
        self.max_attempts == 0 || attempts < self.max_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(1_000),
            multiplier: 2.0,
            max_attempts: 5,
        }
    }

    #[test]
    fn ceiling_grows_geometrically_then_caps() {
        let p = policy();
        let got: Vec<u128> = (1..=9).map(|a| p.ceiling(a).as_millis()).collect();
        assert_eq!(got, vec![10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        assert_eq!(p.ceiling(u32::MAX), Duration::from_millis(1_000));
    }

    #[test]
    fn attempts_are_bounded_unless_zero() {
        let p = policy();
        assert!(p.may_retry(4));
        assert!(!p.may_retry(5));
        let forever = RetryPolicy {
            max_attempts: 0,
            ..p
        };
        assert!(forever.may_retry(u32::MAX));
    }

    proptest! {
        #[test]
        fn delay_stays_within_zero_and_the_cap(
            initial_ms in 0u64..10_000,
            max_ms in 0u64..120_000,
            multiplier in 1.0f64..10.0,
            attempt in 0u32..10_000,
            unit in 0.0f64..1.0,
        ) {
            let p = RetryPolicy {
                initial: Duration::from_millis(initial_ms),
                max: Duration::from_millis(max_ms),
                multiplier,
                max_attempts: 0,
            };
            let d = p.delay(attempt, unit);
            prop_assert!(d <= p.ceiling(attempt));
            prop_assert!(d <= Duration::from_millis(max_ms));
            prop_assert!(p.ceiling(attempt) <= p.ceiling(attempt.saturating_add(1)).max(p.max));
        }
    }
}
