//! Timeouts that cannot work are refused (issue 10, item 11).
//!
//! A stage's worker has two deadlines of its own, and each must end before a deadline that
//! someone else enforces:
//!
//! - **`rebalance.drainTimeoutMs`**: a revocation runs inside librdkafka's rebalance callback,
//!   so inside one consumer poll. It waits up to `drainTimeoutMs` for the revoked partitions'
//!   handlers, as long again for results already on their way to the broker, then commits
//!   ([`REVOCATION_COMMIT_ALLOWANCE_MS`]). All of it must end before the group's
//!   **`max.poll.interval.ms`** (librdkafka's default 300 000 ms): a member that does not poll for
//!   that long leaves the group, its final commit fails, and the partitions change hands while
//!   its results are still landing. This is the worker's own rule
//!   (`StageConfig::validate`), checked here first so the message names the resource's fields.
//! - **`shutdownTimeoutMs`**: on SIGTERM the worker may first finish a revocation under way,
//!   then waits up to `shutdownTimeoutMs` for its sessions, up to `drainTimeoutMs` more for
//!   results on their way, commits, and closes (twice [`CLOSE_GRACE_MS`]: session tasks, then the
//!   producer's acknowledgements). All of it must end inside the pod's
//!   `terminationGracePeriodSeconds` ([`worst_shutdown_ms`]). The operator sets that grace
//!   period, from exactly this sum plus [`GRACE_SLACK_MS`], so it always fits; the refusal left
//!   is a sum no grace period can hold.
//!
//! Two deadlines bound neither:
//! - **liveness**: `/healthz` calls the consumer loop stalled after [`LIVENESS_STALE_MS`] without a
//!   turn, and the kubelet restarts the container [`LIVENESS_FAILURE_THRESHOLD`] failed probes,
//!   [`LIVENESS_PERIOD_SECONDS`] apart, later ([`liveness_restart_after_ms`]: 80 s). The worker's
//!   drains (revocation and shutdown) keep the heartbeat while they wait, so no setting can make
//!   the loop look stalled; the only stretch without a beat is a synchronous commit, which
//!   [`REVOCATION_COMMIT_ALLOWANCE_MS`] bounds well below the staleness. Besides, the kubelet
//!   stops liveness probes of a pod being deleted.
//! - **`max.poll.interval.ms` at shutdown**: the shutdown drain keeps polling the consumer.
//!
//! And one librdkafka rule on the same property: `max.poll.interval.ms` must not be below
//! `session.timeout.ms` (default 45 000 ms), or no consumer can be created.
//!
//! [`check`] is the one pure function deciding all of it; [`crate::render`] calls it for every
//! stage, names the field at fault and renders the grace period it returns.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;

pub use sessionflow_worker::config::{
    DEFAULT_MAX_POLL_INTERVAL_MS, DEFAULT_SESSION_TIMEOUT_MS, REVOCATION_COMMIT_ALLOWANCE_MS,
    SHUTDOWN_FENCE_EXTRA_MS,
};

/// `/healthz` turns 503 when the consumer loop has not turned for this long.
pub const LIVENESS_STALE_MS: u64 =
    sessionflow_worker::ops::health::LIVENESS_LIMIT.as_millis() as u64;
/// `periodSeconds` of the liveness probe the operator renders.
pub const LIVENESS_PERIOD_SECONDS: i32 = 10;
/// `failureThreshold` of the liveness probe the operator renders.
pub const LIVENESS_FAILURE_THRESHOLD: i32 = 3;
/// The worker's `CLOSE_GRACE`: after the consumer loop ends it waits up to this long for its
/// session tasks, then up to this long again for the producer's acknowledgements.
pub const CLOSE_GRACE_MS: u64 = sessionflow_worker::stage::CLOSE_GRACE.as_millis() as u64;
/// Room in the grace period beyond the worker's own deadlines: the unsubscribe (≤ 0.5 s), the
/// lag reader's last read (≤ 5 s), process exit.
pub const GRACE_SLACK_MS: u64 = 10_000;
/// The librdkafka property bounding the time between two polls of a group member.
pub const MAX_POLL_INTERVAL_KEY: &str = "max.poll.interval.ms";
/// The values librdkafka accepts for `max.poll.interval.ms`.
pub const MAX_POLL_INTERVAL_RANGE: RangeInclusive<u64> = 1..=86_400_000;
/// The librdkafka property after which the broker drops a member that sent no heartbeat.
pub const SESSION_TIMEOUT_KEY: &str = "session.timeout.ms";
/// The values librdkafka accepts for `session.timeout.ms`.
pub const SESSION_TIMEOUT_RANGE: RangeInclusive<u64> = 1..=3_600_000;

/// The resolved timeouts of one stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// `rebalance.drainTimeoutMs`.
    pub drain_ms: u64,
    /// `shutdownTimeoutMs`.
    pub shutdown_ms: u64,
    /// `max.poll.interval.ms` when set; librdkafka's default otherwise.
    pub max_poll_interval_ms: Option<u64>,
    /// `session.timeout.ms` when set; librdkafka's default otherwise.
    pub session_timeout_ms: Option<u64>,
}

impl Timeouts {
    /// The timeouts of a worker config: its drain and shutdown timeouts and its librdkafka
    /// properties. An error names the property librdkafka would refuse, and why.
    pub fn from_config(
        drain_ms: u64,
        shutdown_ms: u64,
        kafka: &BTreeMap<String, String>,
    ) -> Result<Self, (&'static str, String)> {
        Ok(Self {
            drain_ms,
            shutdown_ms,
            max_poll_interval_ms: property(kafka, MAX_POLL_INTERVAL_KEY, MAX_POLL_INTERVAL_RANGE)?,
            session_timeout_ms: property(kafka, SESSION_TIMEOUT_KEY, SESSION_TIMEOUT_RANGE)?,
        })
    }
}

/// What the pod needs for timeouts that work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// The pod's `terminationGracePeriodSeconds`: [`worst_shutdown_ms`] plus
    /// [`GRACE_SLACK_MS`], rounded up to whole seconds.
    pub termination_grace_period_seconds: i64,
}

/// A timeout that cannot work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// librdkafka creates no consumer whose poll interval is below its session timeout.
    MaxPollVsSessionTimeout {
        max_poll_interval_ms: u64,
        session_timeout_ms: u64,
    },
    /// A revocation holds the poll until the group drops the member.
    DrainVsMaxPollInterval {
        drain_ms: u64,
        max_poll_interval_ms: u64,
    },
    /// No grace period can be rendered for a shutdown this long.
    ShutdownVsGracePeriod { drain_ms: u64, shutdown_ms: u64 },
}

/// Which setting a [`Refusal`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    DrainTimeout,
    ShutdownTimeout,
    MaxPollInterval,
}

impl Refusal {
    /// The setting to change.
    pub fn setting(&self) -> Setting {
        match self {
            Self::MaxPollVsSessionTimeout { .. } => Setting::MaxPollInterval,
            Self::DrainVsMaxPollInterval { .. } => Setting::DrainTimeout,
            Self::ShutdownVsGracePeriod { .. } => Setting::ShutdownTimeout,
        }
    }

    /// Why it cannot work, starting with the value at fault (the caller puts the field and
    /// `: ` before it); `default` when the spec left the setting to its default (the
    /// worker's, or librdkafka's).
    pub fn message(&self, default: bool) -> String {
        let value = |ms: u64| {
            if default {
                format!("{ms} ms (the default)")
            } else {
                format!("{ms} ms")
            }
        };
        match *self {
            Self::MaxPollVsSessionTimeout {
                max_poll_interval_ms,
                session_timeout_ms,
            } => format!(
                "{} is below {SESSION_TIMEOUT_KEY} {session_timeout_ms}: librdkafka creates no \
                 consumer with a poll interval below its session timeout; raise it or lower \
                 {SESSION_TIMEOUT_KEY}",
                value(max_poll_interval_ms)
            ),
            Self::DrainVsMaxPollInterval {
                drain_ms,
                max_poll_interval_ms,
            } => {
                let fix = match max_drain_ms(max_poll_interval_ms) {
                    Some(max) => format!("set it to at most {max}"),
                    None => "no drain fits".to_string(),
                };
                format!(
                    "{} cannot finish before {MAX_POLL_INTERVAL_KEY} {max_poll_interval_ms}: a \
                     revocation waits up to 2 × drainTimeoutMs for handlers and writes, plus \
                     {REVOCATION_COMMIT_ALLOWANCE_MS} ms for its commit, inside one consumer poll, \
                     and the group drops a member that does not poll for \
                     {MAX_POLL_INTERVAL_KEY}; {fix}, or raise {MAX_POLL_INTERVAL_KEY} in \
                     spec.kafka.properties",
                    value(drain_ms)
                )
            }
            Self::ShutdownVsGracePeriod {
                drain_ms,
                shutdown_ms,
            } => format!(
                "{} cannot finish before any pod grace period: a shutdown (with \
                 rebalance.drainTimeoutMs {drain_ms}) does not fit in \
                 terminationGracePeriodSeconds",
                value(shutdown_ms)
            ),
        }
    }
}

/// Longest a revocation holds the consumer's poll: the handlers' drain, the writes' drain,
/// the commit. `None` past `u64`.
pub fn revocation_ms(drain_ms: u64) -> Option<u64> {
    drain_ms
        .checked_mul(2)?
        .checked_add(REVOCATION_COMMIT_ALLOWANCE_MS)
}

/// The longest drain whose revocation ends before `max_poll_interval_ms`; `None` when none
/// does.
pub fn max_drain_ms(max_poll_interval_ms: u64) -> Option<u64> {
    // 2d + allowance < max  ⇔  d ≤ (max − allowance − 1) / 2
    max_poll_interval_ms
        .checked_sub(REVOCATION_COMMIT_ALLOWANCE_MS + 1)
        .map(|room| room / 2)
        .filter(|&d| d >= 1)
}

/// Longest a worker takes from SIGTERM to exit when every deadline is reached: a revocation
/// under way (or served by the shutdown drain), the shutdown drain, the wait for results on
/// their way (the shutdown fence: `drainTimeoutMs` + [`SHUTDOWN_FENCE_EXTRA_MS`]), the final
/// commit, then the two close graces. `None` past `u64`.
pub fn worst_shutdown_ms(drain_ms: u64, shutdown_ms: u64) -> Option<u64> {
    revocation_ms(drain_ms)?
        .checked_add(shutdown_ms)?
        .checked_add(drain_ms)?
        .checked_add(SHUTDOWN_FENCE_EXTRA_MS)?
        .checked_add(REVOCATION_COMMIT_ALLOWANCE_MS)?
        .checked_add(2 * CLOSE_GRACE_MS)
}

/// The earliest the kubelet restarts a worker whose loop stopped turning: `/healthz` turns
/// stale, then [`LIVENESS_FAILURE_THRESHOLD`] probes in a row fail, [`LIVENESS_PERIOD_SECONDS`]
/// apart (the first may come right when it turns stale).
pub fn liveness_restart_after_ms() -> u64 {
    let further_probes = u64::try_from(LIVENESS_FAILURE_THRESHOLD - 1).unwrap_or(0);
    let period_ms = u64::try_from(LIVENESS_PERIOD_SECONDS).unwrap_or(0) * 1000;
    LIVENESS_STALE_MS + further_probes * period_ms
}

/// Accepts `t` with the grace period its pod needs, or says which timeout cannot work.
pub fn check(t: Timeouts) -> Result<Budget, Refusal> {
    let max_poll_interval_ms = t
        .max_poll_interval_ms
        .unwrap_or(DEFAULT_MAX_POLL_INTERVAL_MS);
    let session_timeout_ms = t.session_timeout_ms.unwrap_or(DEFAULT_SESSION_TIMEOUT_MS);
    if max_poll_interval_ms < session_timeout_ms {
        return Err(Refusal::MaxPollVsSessionTimeout {
            max_poll_interval_ms,
            session_timeout_ms,
        });
    }
    if revocation_ms(t.drain_ms).is_none_or(|ms| ms >= max_poll_interval_ms) {
        return Err(Refusal::DrainVsMaxPollInterval {
            drain_ms: t.drain_ms,
            max_poll_interval_ms,
        });
    }
    let too_long = Refusal::ShutdownVsGracePeriod {
        drain_ms: t.drain_ms,
        shutdown_ms: t.shutdown_ms,
    };
    let grace_ms = worst_shutdown_ms(t.drain_ms, t.shutdown_ms)
        .and_then(|ms| ms.checked_add(GRACE_SLACK_MS))
        .ok_or(too_long)?;
    let termination_grace_period_seconds =
        i64::try_from(grace_ms.div_ceil(1000)).map_err(|_| too_long)?;
    Ok(Budget {
        termination_grace_period_seconds,
    })
}

/// A millisecond property as librdkafka reads it: `Ok(None)` when unset, `Err((key, why))`
/// when librdkafka would refuse it.
fn property(
    properties: &BTreeMap<String, String>,
    key: &'static str,
    range: RangeInclusive<u64>,
) -> Result<Option<u64>, (&'static str, String)> {
    let Some(raw) = properties.get(key) else {
        return Ok(None);
    };
    match raw.trim().parse::<u64>() {
        Ok(ms) if range.contains(&ms) => Ok(Some(ms)),
        _ => Err((
            key,
            format!(
                "{raw:?} is not a number of milliseconds in [{}, {}]",
                range.start(),
                range.end()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t(drain_ms: u64, shutdown_ms: u64, max_poll_interval_ms: Option<u64>) -> Timeouts {
        Timeouts {
            drain_ms,
            shutdown_ms,
            max_poll_interval_ms,
            session_timeout_ms: Some(6_000),
        }
    }

    #[test]
    fn the_worker_defaults_work_with_a_hundred_seconds_of_grace() {
        // drainTimeoutMs 10 s, shutdownTimeoutMs 20 s, librdkafka's 300 s poll interval and 45 s
        // session timeout: 25 s revocation + 20 s + 20 s fence + 5 s commit + 20 s close + 10 s.
        let defaults = Timeouts {
            drain_ms: 10_000,
            shutdown_ms: 20_000,
            max_poll_interval_ms: None,
            session_timeout_ms: None,
        };
        assert_eq!(
            check(defaults).unwrap().termination_grace_period_seconds,
            100
        );
    }

    #[test]
    fn a_revocation_must_end_before_max_poll_interval() {
        // The setting: max.poll.interval.ms 10 000 with the default 10 s drain.
        assert_eq!(
            check(t(10_000, 20_000, Some(10_000))),
            Err(Refusal::DrainVsMaxPollInterval {
                drain_ms: 10_000,
                max_poll_interval_ms: 10_000
            })
        );
        // 2 × 2499 + 5000 = 9998 < 10 000; 2 × 2500 + 5000 is not.
        assert!(check(t(2_499, 20_000, Some(10_000))).is_ok());
        assert!(check(t(2_500, 20_000, Some(10_000))).is_err());
        assert_eq!(max_drain_ms(10_000), Some(2_499));
        assert_eq!(max_drain_ms(10_001), Some(2_500));
        assert_eq!(max_drain_ms(10_002), Some(2_500));
        assert_eq!(max_drain_ms(10_003), Some(2_501));
        assert_eq!(max_drain_ms(5_002), None);
        assert_eq!(max_drain_ms(5_003), Some(1));
        // The default poll interval: up to 147 499 ms.
        assert!(check(t(147_499, 1, None)).is_ok());
        assert!(check(t(147_500, 1, None)).is_err());
        let refusal = check(t(30_000, 20_000, Some(10_000))).unwrap_err();
        assert_eq!(refusal.setting(), Setting::DrainTimeout);
        let message = refusal.message(false);
        assert!(
            message.starts_with("30000 ms cannot finish before max.poll.interval.ms 10000:"),
            "{message}"
        );
        assert!(message.contains("set it to at most 2499"), "{message}");
        assert!(refusal
            .message(true)
            .starts_with("30000 ms (the default) cannot finish"));
        let hopeless = check(Timeouts {
            session_timeout_ms: Some(1_000),
            ..t(1, 1, Some(5_002))
        })
        .unwrap_err();
        assert!(hopeless.message(false).contains("no drain fits"));
    }

    #[test]
    fn max_poll_interval_must_not_be_below_the_session_timeout() {
        let refusal = check(Timeouts {
            session_timeout_ms: None,
            ..t(1_000, 1_000, Some(10_000))
        })
        .unwrap_err();
        assert_eq!(
            refusal,
            Refusal::MaxPollVsSessionTimeout {
                max_poll_interval_ms: 10_000,
                session_timeout_ms: 45_000
            }
        );
        assert_eq!(refusal.setting(), Setting::MaxPollInterval);
        assert!(refusal
            .message(false)
            .starts_with("10000 ms is below session.timeout.ms 45000"));
        // Equal is fine (librdkafka's own rule is `>=`).
        assert!(check(Timeouts {
            session_timeout_ms: Some(10_000),
            ..t(1_000, 1_000, Some(10_000))
        })
        .is_ok());
    }

    #[test]
    fn a_long_shutdown_gets_a_long_grace_period_until_none_can_hold_it() {
        let budget = check(t(10_000, 3_600_000, None)).unwrap();
        assert_eq!(budget.termination_grace_period_seconds, 3_600 + 80);
        // Rounded up, never down.
        let budget = check(t(1, 1, None)).unwrap();
        assert_eq!(
            budget.termination_grace_period_seconds,
            5 + 5 + 10 + 20 + 10 + 1
        );
        let refusal = check(t(10_000, u64::MAX, None)).unwrap_err();
        assert_eq!(refusal.setting(), Setting::ShutdownTimeout);
        assert!(refusal.message(false).starts_with(&format!(
            "{} ms cannot finish before any pod grace period",
            u64::MAX
        )));
    }

    #[test]
    fn no_setting_can_make_the_loop_look_stalled() {
        // The kubelet restarts a stalled worker 20 s after /healthz turns stale; the drains
        // beat, and the one stretch without a beat (a synchronous commit) is far shorter.
        assert_eq!(liveness_restart_after_ms(), 80_000);
        const { assert!(REVOCATION_COMMIT_ALLOWANCE_MS < LIVENESS_STALE_MS) };
    }

    #[test]
    fn properties_are_read_as_librdkafka_would() {
        let props = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        let of = |p: &BTreeMap<String, String>| Timeouts::from_config(1, 1, p);
        assert_eq!(of(&BTreeMap::new()).unwrap().max_poll_interval_ms, None);
        let ok = of(&props(MAX_POLL_INTERVAL_KEY, " 10000 ")).unwrap();
        assert_eq!(ok.max_poll_interval_ms, Some(10_000));
        let ok = of(&props(SESSION_TIMEOUT_KEY, "6000")).unwrap();
        assert_eq!(ok.session_timeout_ms, Some(6_000));
        for bad in ["0", "86400001", "-1", "10s", "", "1e4"] {
            let (key, why) = of(&props(MAX_POLL_INTERVAL_KEY, bad)).unwrap_err();
            assert_eq!(key, MAX_POLL_INTERVAL_KEY);
            assert!(why.contains("[1, 86400000]"), "{bad}: {why}");
        }
        let (key, why) = of(&props(SESSION_TIMEOUT_KEY, "3600001")).unwrap_err();
        assert_eq!(key, SESSION_TIMEOUT_KEY);
        assert!(why.contains("[1, 3600000]"), "{why}");
    }

    fn max_poll() -> impl Strategy<Value = Option<u64>> {
        prop_oneof![
            Just(None),
            (1u64..=120_000).prop_map(Some),
            MAX_POLL_INTERVAL_RANGE.prop_map(Some),
        ]
    }

    fn millis() -> impl Strategy<Value = u64> {
        prop_oneof![0u64..=200_000, any::<u64>(), Just(u64::MAX)]
    }

    proptest! {
        #[test]
        fn accepted_exactly_when_every_deadline_is_met(
            drain in millis(), shutdown in millis(), max_poll in max_poll(),
            session in prop::option::of(SESSION_TIMEOUT_RANGE),
        ) {
            let poll = max_poll.unwrap_or(DEFAULT_MAX_POLL_INTERVAL_MS) as u128;
            let session_ms = session.unwrap_or(DEFAULT_SESSION_TIMEOUT_MS) as u128;
            let (d, s) = (drain as u128, shutdown as u128);
            let needed = 3 * d + s + SHUTDOWN_FENCE_EXTRA_MS as u128
                + 2 * REVOCATION_COMMIT_ALLOWANCE_MS as u128
                + 2 * CLOSE_GRACE_MS as u128 + GRACE_SLACK_MS as u128;
            let fits = needed <= u64::MAX as u128;
            let result = check(Timeouts {
                drain_ms: drain,
                shutdown_ms: shutdown,
                max_poll_interval_ms: max_poll,
                session_timeout_ms: session,
            });
            let revocation_fits = 2 * d + (REVOCATION_COMMIT_ALLOWANCE_MS as u128) < poll;
            prop_assert_eq!(
                result.is_ok(),
                poll >= session_ms && revocation_fits && fits,
                "{:?}", result
            );
            match result {
                Ok(budget) => {
                    // The whole shutdown fits in the grace period, slack included, and the
                    // grace period is that rounded up to a second, no more.
                    let grace_ms = budget.termination_grace_period_seconds as u128 * 1000;
                    prop_assert!(grace_ms >= needed);
                    prop_assert!(grace_ms < needed + 1000);
                    if let Some(max) = max_drain_ms(poll as u64) {
                        prop_assert!(drain <= max);
                    }
                }
                Err(Refusal::MaxPollVsSessionTimeout { .. }) => prop_assert!(poll < session_ms),
                Err(Refusal::DrainVsMaxPollInterval { drain_ms, max_poll_interval_ms }) => {
                    prop_assert_eq!((drain_ms, max_poll_interval_ms as u128), (drain, poll));
                    prop_assert!(poll >= session_ms && !revocation_fits);
                    prop_assert!(max_drain_ms(poll as u64).is_none_or(|max| drain > max));
                }
                Err(Refusal::ShutdownVsGracePeriod { .. }) => {
                    prop_assert!(poll >= session_ms && revocation_fits && !fits);
                }
            }
        }

        #[test]
        fn shorter_timeouts_never_turn_an_accepted_spec_into_a_refused_one(
            drain in millis(), shutdown in millis(), max_poll in max_poll(),
            less_drain in any::<u64>(), less_shutdown in any::<u64>(),
        ) {
            if check(t(drain, shutdown, max_poll)).is_ok() {
                let shorter = t(drain.min(less_drain), shutdown.min(less_shutdown), max_poll);
                prop_assert!(check(shorter).is_ok());
            }
        }
    }
}
