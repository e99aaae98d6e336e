//! The replica decision for one stage, from its effective lag. Pure: time comes in as an
//! argument, so every rule below is tested without waiting.
//!
//! - The recommendation is `clamp(ceil(effective lag / lagPerReplica), min, min(max,
//!   partitions))`; `min` wins over the partition cap (idle replicas are what the user asked
//!   for).
//! - Up at once: a recommendation above the current count is applied immediately, by at most
//!   `scale_up_max_step` replicas per evaluation when that is set (bringing the count up to
//!   `min` is never limited), so a lag spike does not start a crowd of pods that each trigger a
//!   rebalance of the group at once.
//! - Down only when stable: the stage scales down to the *highest* recommendation of the last
//!   `scaleDownStabilizationSecs`, and not before it has been watched for a whole window, so a
//!   brief dip in lag never sheds replicas that the next burst needs (no flapping).
//! - No lag reading (broker unreachable): hold, only bringing the count back inside bounds.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

/// A stage's scaling bounds and tuning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub min: u32,
    pub max: u32,
    pub lag_per_replica: u64,
    pub scale_down_window: Duration,
    /// Most replicas one evaluation adds; `None`: no limit.
    pub scale_up_max_step: Option<u32>,
}

/// What was read from Kafka.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signal {
    pub effective_lag: u64,
    pub partitions: u32,
}

/// Recommendations of one stage over the last window.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// When this stage was first watched.
    since: Option<Duration>,
    recent: VecDeque<(Duration, u32)>,
}

/// Why the count is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Nothing to change.
    Steady,
    /// Lag asks for more replicas.
    LagAbove { lag: u64, per_replica: u64 },
    /// Lag asks for `recommended`; this evaluation adds at most `step`.
    StepLimited {
        lag: u64,
        recommended: u32,
        step: u32,
    },
    /// Every recommendation of the window is lower.
    LagBelow { lag: u64, per_replica: u64 },
    /// Fewer replicas would do, but not for a whole window yet.
    Stabilizing { until_highest: u32 },
    /// The count was outside the bounds (spec changed).
    Bounds { min: u32, max: u32 },
    /// No lag reading; the count is held.
    NoSignal,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Steady => write!(f, "steady"),
            Reason::LagAbove { lag, per_replica } => {
                write!(f, "effective lag {lag} above {per_replica} per replica")
            }
            Reason::StepLimited {
                lag,
                recommended,
                step,
            } => write!(
                f,
                "effective lag {lag} asks for {recommended} replicas; scale-up limited to {step} per pass"
            ),
            Reason::LagBelow { lag, per_replica } => write!(
                f,
                "effective lag {lag} below {per_replica} per replica for the whole stabilization window"
            ),
            Reason::Stabilizing { until_highest } => write!(
                f,
                "scale-down held by the stabilization window (highest recent recommendation {until_highest})"
            ),
            Reason::Bounds { min, max } => write!(f, "replicas brought within [{min}, {max}]"),
            Reason::NoSignal => write!(f, "lag unavailable; holding"),
        }
    }
}

/// The outcome of one evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub desired: u32,
    /// What the lag alone asks for now.
    pub recommended: Option<u32>,
    pub reason: Reason,
}

/// Replicas the lag asks for, within the bounds.
pub fn recommend(policy: &Policy, signal: &Signal) -> u32 {
    let per = policy.lag_per_replica.max(1);
    let need = u32::try_from(signal.effective_lag.div_ceil(per)).unwrap_or(u32::MAX);
    let cap = policy.max.min(signal.partitions);
    need.min(cap).max(policy.min)
}

/// Decides the replica count at time `now` (any monotonic clock), recording the
/// recommendation in `history`.
pub fn decide(
    policy: &Policy,
    signal: Option<&Signal>,
    current: u32,
    history: &mut History,
    now: Duration,
) -> Decision {
    let Some(signal) = signal else {
        let desired = current.clamp(policy.min, policy.max.max(policy.min));
        let reason = if desired == current {
            Reason::NoSignal
        } else {
            bounds(policy)
        };
        return Decision {
            desired,
            recommended: None,
            reason,
        };
    };
    let recommended = recommend(policy, signal);
    let since = *history.since.get_or_insert(now);
    history.recent.push_back((now, recommended));
    while let Some((at, _)) = history.recent.front() {
        if now.saturating_sub(*at) >= policy.scale_down_window && history.recent.len() > 1 {
            history.recent.pop_front();
        } else {
            break;
        }
    }
    let decision = |desired, reason| Decision {
        desired,
        recommended: Some(recommended),
        reason,
    };
    let lag = signal.effective_lag;
    let per_replica = policy.lag_per_replica;
    if recommended > current {
        let stepped = scale_up_limit(policy, current).map_or(recommended, |l| recommended.min(l));
        let reason = if current < policy.min && stepped <= policy.min {
            bounds(policy)
        } else if let (true, Some(step)) = (stepped < recommended, policy.scale_up_max_step) {
            Reason::StepLimited {
                lag,
                recommended,
                step,
            }
        } else {
            Reason::LagAbove { lag, per_replica }
        };
        return decision(stepped, reason);
    }
    let upper = policy.max.max(policy.min);
    if current > upper {
        return decision(upper.max(recommended), bounds(policy));
    }
    if recommended == current {
        return decision(current, Reason::Steady);
    }
    let highest = history
        .recent
        .iter()
        .map(|(_, r)| *r)
        .max()
        .unwrap_or(recommended);
    let watched_a_window = now.saturating_sub(since) >= policy.scale_down_window;
    if highest < current && watched_a_window {
        decision(highest, Reason::LagBelow { lag, per_replica })
    } else {
        decision(
            current,
            Reason::Stabilizing {
                until_highest: highest,
            },
        )
    }
}

/// The highest count one evaluation may reach from `current`: `current + step`, but never
/// below `min` (reaching the lower bound is not a scale-up the policy limits).
fn scale_up_limit(policy: &Policy, current: u32) -> Option<u32> {
    policy
        .scale_up_max_step
        .map(|step| current.saturating_add(step.max(1)).max(policy.min))
}

fn bounds(policy: &Policy) -> Reason {
    Reason::Bounds {
        min: policy.min,
        max: policy.max.max(policy.min),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn policy(min: u32, max: u32) -> Policy {
        Policy {
            min,
            max,
            lag_per_replica: 100,
            scale_down_window: 60 * SEC,
            scale_up_max_step: None,
        }
    }

    fn signal(lag: u64, partitions: u32) -> Signal {
        Signal {
            effective_lag: lag,
            partitions,
        }
    }

    #[test]
    fn recommendation_examples() {
        let p = policy(1, 10);
        assert_eq!(recommend(&p, &signal(0, 8)), 1);
        assert_eq!(recommend(&p, &signal(1, 8)), 1);
        assert_eq!(recommend(&p, &signal(100, 8)), 1);
        assert_eq!(recommend(&p, &signal(101, 8)), 2);
        assert_eq!(recommend(&p, &signal(750, 8)), 8, "capped by partitions");
        assert_eq!(recommend(&p, &signal(5_000, 12)), 10, "capped by max");
        assert_eq!(recommend(&policy(0, 4), &signal(0, 8)), 0, "scale to zero");
        assert_eq!(
            recommend(&policy(3, 4), &signal(0, 2)),
            3,
            "min wins over partitions"
        );
        assert_eq!(recommend(&p, &signal(u64::MAX, 8)), 8);
    }

    #[test]
    fn scales_up_at_once_and_down_after_a_quiet_window() {
        let p = policy(1, 8);
        let mut h = History::default();
        let d = decide(&p, Some(&signal(650, 8)), 1, &mut h, Duration::ZERO);
        assert_eq!(
            (d.desired, d.reason),
            (
                7,
                Reason::LagAbove {
                    lag: 650,
                    per_replica: 100
                }
            )
        );
        // Lag drains: the window holds the count.
        let d = decide(&p, Some(&signal(0, 8)), 7, &mut h, 10 * SEC);
        assert_eq!(d.desired, 7);
        assert!(matches!(d.reason, Reason::Stabilizing { until_highest: 7 }));
        let d = decide(&p, Some(&signal(0, 8)), 7, &mut h, 59 * SEC);
        assert_eq!(d.desired, 7);
        // The 650-lag recommendation is a full window old now: down to the highest of the rest.
        let d = decide(&p, Some(&signal(150, 8)), 7, &mut h, 60 * SEC);
        assert_eq!(d.desired, 2);
        assert!(matches!(d.reason, Reason::LagBelow { .. }));
    }

    #[test]
    fn a_fresh_history_waits_a_window_before_scaling_down() {
        // After an operator restart nothing is known about the last window.
        let p = policy(1, 8);
        let mut h = History::default();
        assert_eq!(
            decide(&p, Some(&signal(0, 8)), 5, &mut h, 100 * SEC).desired,
            5
        );
        assert_eq!(
            decide(&p, Some(&signal(0, 8)), 5, &mut h, 159 * SEC).desired,
            5
        );
        assert_eq!(
            decide(&p, Some(&signal(0, 8)), 5, &mut h, 160 * SEC).desired,
            1
        );
    }

    #[test]
    fn bounds_apply_at_once_even_without_lag() {
        let mut h = History::default();
        let d = decide(&policy(2, 4), None, 6, &mut h, Duration::ZERO);
        assert_eq!(
            (d.desired, d.reason),
            (4, Reason::Bounds { min: 2, max: 4 })
        );
        let d = decide(&policy(2, 4), None, 1, &mut h, Duration::ZERO);
        assert_eq!(d.desired, 2);
        let d = decide(&policy(2, 4), None, 3, &mut h, Duration::ZERO);
        assert_eq!((d.desired, d.reason), (3, Reason::NoSignal));
        // With lag known, a lowered max applies at once too.
        let d = decide(
            &policy(1, 3),
            Some(&signal(10_000, 8)),
            6,
            &mut h,
            Duration::ZERO,
        );
        assert_eq!(d.desired, 3);
    }

    #[test]
    fn a_scale_up_step_limits_each_pass_but_not_the_way_to_min() {
        let p = Policy {
            scale_up_max_step: Some(2),
            ..policy(1, 10)
        };
        let mut h = History::default();
        let d = decide(&p, Some(&signal(900, 10)), 1, &mut h, Duration::ZERO);
        assert_eq!(
            (d.desired, d.recommended, d.reason),
            (
                3,
                Some(9),
                Reason::StepLimited {
                    lag: 900,
                    recommended: 9,
                    step: 2
                }
            )
        );
        let d = decide(&p, Some(&signal(900, 10)), 3, &mut h, SEC);
        assert_eq!(d.desired, 5);
        let d = decide(&p, Some(&signal(900, 10)), 7, &mut h, 2 * SEC);
        assert_eq!(
            (d.desired, d.reason),
            (
                9,
                Reason::LagAbove {
                    lag: 900,
                    per_replica: 100
                }
            ),
            "the last step reaches the recommendation"
        );
        // Below min (a raised min, or a count changed by hand): straight to min, then stepped.
        let p = Policy {
            scale_up_max_step: Some(1),
            ..policy(4, 10)
        };
        let d = decide(&p, Some(&signal(0, 10)), 0, &mut h, 3 * SEC);
        assert_eq!(
            (d.desired, d.reason),
            (4, Reason::Bounds { min: 4, max: 10 })
        );
        let d = decide(&p, Some(&signal(900, 10)), 0, &mut h, 4 * SEC);
        assert_eq!(
            (d.desired, d.reason),
            (4, Reason::Bounds { min: 4, max: 10 })
        );
        let d = decide(&p, Some(&signal(900, 10)), 4, &mut h, 5 * SEC);
        assert_eq!(d.desired, 5);
        assert!(
            matches!(d.reason, Reason::StepLimited { step: 1, .. }),
            "{:?}",
            d.reason
        );
    }

    fn arb_policy() -> impl Strategy<Value = Policy> {
        (
            0u32..5,
            1u32..12,
            1u64..500,
            0u64..120,
            prop::option::of(1u32..4),
        )
            .prop_map(|(min, span, per, window, step)| Policy {
                min,
                max: min.max(1) + span - 1,
                lag_per_replica: per,
                scale_down_window: Duration::from_secs(window),
                scale_up_max_step: step,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// Whatever the lag and the past, the count stays within the bounds, goes up at once
        /// when the lag asks for more (by at most the scale-up step, except to reach `min`),
        /// and never goes down while any recommendation of the last window (or a window not
        /// yet watched in full) asks for more.
        #[test]
        fn decisions_are_bounded_immediate_up_and_stable_down(
            p in arb_policy(),
            partitions in 1u32..16,
            steps in prop::collection::vec((0u64..5_000, 1u64..30), 1..60),
            start in 0u32..20,
        ) {
            let mut h = History::default();
            let mut now = Duration::ZERO;
            let mut current = start;
            let mut log: Vec<(Duration, u32)> = Vec::new();
            let mut first = None;
            for (lag, dt) in steps {
                now += Duration::from_secs(dt);
                let first = *first.get_or_insert(now);
                let s = signal(lag, partitions);
                let d = decide(&p, Some(&s), current, &mut h, now);
                let r = recommend(&p, &s);
                log.push((now, r));
                let upper = p.max.max(p.min);
                prop_assert!(d.desired >= p.min && d.desired <= upper,
                    "desired {} outside [{}, {}]", d.desired, p.min, upper);
                prop_assert!(d.desired <= p.min.max(p.max.min(partitions)) || d.desired <= current,
                    "scaled above the partition cap");
                if r > current {
                    let limit = p.scale_up_max_step.map_or(u32::MAX, |s| (current + s).max(p.min));
                    prop_assert_eq!(d.desired, r.min(limit));
                }
                if let Some(step) = p.scale_up_max_step {
                    prop_assert!(d.desired <= (current + step).max(p.min).max(current),
                        "added {} replicas to {} with a step of {}", d.desired - current, current, step);
                }
                if d.desired < current && current <= upper {
                    prop_assert!(now - first >= p.scale_down_window,
                        "scaled down before a whole window was watched");
                    for (at, rec) in &log {
                        if now - *at < p.scale_down_window {
                            prop_assert!(*rec <= d.desired,
                                "scaled down to {} with a recommendation of {} in the window", d.desired, rec);
                        }
                    }
                }
                current = d.desired;
            }
        }

        /// A steady lag converges to its recommendation within one window.
        #[test]
        fn steady_lag_converges(p in arb_policy(), partitions in 1u32..16, lag in 0u64..5_000, start in 0u32..20) {
            let mut h = History::default();
            let s = signal(lag, partitions);
            let mut current = start;
            let mut now = Duration::ZERO;
            for _ in 0..200 {
                current = decide(&p, Some(&s), current, &mut h, now).desired;
                now += Duration::from_secs(1);
            }
            prop_assert_eq!(current, recommend(&p, &s));
        }
    }
}
