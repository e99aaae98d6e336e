//! The nemesis schedule: which faults happen when, drawn from the seed alone.
//!
//! Drawing is pure (no clock, no I/O), so a seed names a run: the same seed and duration give
//! the same schedule, printed before anything starts. Each [`Event`] is one fault as a person
//! would describe it ("broker 2 down for 4 s"); [`Schedule::steps`] expands it into the
//! actions the runner takes, a fault's heal included.

use std::fmt;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

/// Brokers of the mock cluster, numbered 1..=BROKERS as librdkafka's mock numbers them.
pub const BROKERS: i32 = 3;
/// Most worker processes running at once (the input has 8 partitions; 2 cores).
pub const MAX_WORKERS: usize = 4;

/// A retriable Kafka error the mock cluster answers a request with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KafkaErr {
    NotLeaderForPartition,
    LeaderNotAvailable,
    RequestTimedOut,
    NotEnoughReplicas,
    CoordinatorNotAvailable,
    NotCoordinator,
    CoordinatorLoadInProgress,
}

impl KafkaErr {
    /// Errors a broker answers a Produce request with that a producer retries.
    const PRODUCE: [Self; 4] = [
        Self::NotLeaderForPartition,
        Self::LeaderNotAvailable,
        Self::RequestTimedOut,
        Self::NotEnoughReplicas,
    ];
    /// An OffsetCommit refused with this makes librdkafka drop its coordinator connection
    /// and look the coordinator up again.
    fn drops_the_coordinator(self) -> bool {
        matches!(self, Self::CoordinatorNotAvailable | Self::NotCoordinator)
    }

    /// A commit error the client retries on the same connection, in place of one that drops
    /// the coordinator (see [`Schedule::draw`]).
    fn keeping_the_coordinator(self) -> Self {
        match self {
            Self::CoordinatorNotAvailable => Self::CoordinatorLoadInProgress,
            Self::NotCoordinator => Self::RequestTimedOut,
            other => other,
        }
    }

    /// Errors a group coordinator answers an OffsetCommit with that a client retries.
    const COMMIT: [Self; 4] = [
        Self::RequestTimedOut,
        Self::CoordinatorNotAvailable,
        Self::NotCoordinator,
        Self::CoordinatorLoadInProgress,
    ];
}

/// One fault, as the schedule prints it. `pick` chooses among the workers running then.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// SIGKILL a worker (no drain, no final commit); a replacement starts `restart_after`
    /// later, as Kubernetes restarts a crashed pod.
    KillWorker {
        pick: usize,
        restart_after: Duration,
    },
    /// SIGTERM a worker and start a replacement at once: a rolling restart.
    RestartWorker { pick: usize },
    /// One more worker joins the group (scale up).
    JoinWorker,
    /// SIGTERM a worker, no replacement (scale down).
    LeaveWorker { pick: usize },
    /// A broker stops answering, then comes back.
    BrokerDown { broker: i32, lasting: Duration },
    /// The next `count` Produce requests (any client, any broker) fail with `error`.
    ProduceErrors { error: KafkaErr, count: usize },
    /// Every OffsetCommit fails with `error` for a while.
    CommitErrors { error: KafkaErr, lasting: Duration },
    /// The group's coordinator moves to another broker.
    CoordinatorMove { broker: i32 },
    /// Every request to a broker takes `delay` longer, for a while.
    RoundTripDelay {
        broker: i32,
        delay: Duration,
        lasting: Duration,
    },
}

/// The kinds of fault, one of each in every schedule (see [`draw_fault`]).
const KINDS: usize = 9;

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::KillWorker {
                pick,
                restart_after,
            } => write!(
                f,
                "kill -9 a worker (pick {pick}), replacement after {:.1}s",
                restart_after.as_secs_f64()
            ),
            Self::RestartWorker { pick } => {
                write!(f, "SIGTERM a worker (pick {pick}), replacement at once")
            }
            Self::JoinWorker => write!(f, "a worker joins"),
            Self::LeaveWorker { pick } => write!(f, "a worker (pick {pick}) leaves (SIGTERM)"),
            Self::BrokerDown { broker, lasting } => {
                write!(f, "broker {broker} down for {:.1}s", lasting.as_secs_f64())
            }
            Self::ProduceErrors { error, count } => {
                write!(f, "the next {count} Produce requests fail with {error:?}")
            }
            Self::CommitErrors { error, lasting } => write!(
                f,
                "every OffsetCommit fails with {error:?} for {:.1}s",
                lasting.as_secs_f64()
            ),
            Self::CoordinatorMove { broker } => {
                write!(f, "the group coordinator moves to broker {broker}")
            }
            Self::RoundTripDelay {
                broker,
                delay,
                lasting,
            } => write!(
                f,
                "broker {broker} answers {}ms late for {:.1}s",
                delay.as_millis(),
                lasting.as_secs_f64()
            ),
        }
    }
}

/// A fault and when it starts, from the start of the run.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub at: Duration,
    pub fault: Fault,
}

/// What the runner does at one instant: a fault's start or its heal.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Kill { pick: usize },
    Terminate { pick: usize, replace: bool },
    Spawn,
    BrokerDown(i32),
    BrokerUp(i32),
    ProduceErrors { error: KafkaErr, count: usize },
    CommitErrors(KafkaErr),
    EndCommitErrors,
    CoordinatorMove(i32),
    Delay { broker: i32, delay: Duration },
    EndDelay { broker: i32, delay: Duration },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Kill { pick } => write!(f, "kill -9 a worker (pick {pick})"),
            Self::Terminate { pick, replace } => write!(
                f,
                "SIGTERM a worker (pick {pick}){}",
                if *replace {
                    ", replacement at once"
                } else {
                    " (leaves)"
                }
            ),
            Self::Spawn => write!(f, "start a worker"),
            Self::BrokerDown(b) => write!(f, "broker {b} down"),
            Self::BrokerUp(b) => write!(f, "broker {b} up"),
            Self::ProduceErrors { error, count } => {
                write!(f, "the next {count} Produce requests fail with {error:?}")
            }
            Self::CommitErrors(error) => write!(f, "OffsetCommit fails with {error:?} from now"),
            Self::EndCommitErrors => write!(f, "the OffsetCommit errors end"),
            Self::CoordinatorMove(b) => write!(f, "group coordinator moved to broker {b}"),
            Self::Delay { broker, delay } => {
                write!(f, "broker {broker} answers {}ms late", delay.as_millis())
            }
            Self::EndDelay { broker, delay } => {
                write!(f, "broker {broker}: the {}ms delay ends", delay.as_millis())
            }
        }
    }
}

/// An action and when to take it.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub at: Duration,
    pub action: Action,
}

/// Every event of one run, in time order, and the workers it starts with.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub initial_workers: usize,
    /// The group protocol of the run: `cooperative` or `eager` (`rebalance.strategy`).
    pub rebalance: &'static str,
    pub events: Vec<Event>,
}

impl Schedule {
    /// Draws the schedule of a run of `seconds` from `seed`: every kind of fault once, then
    /// more random ones (about one every 6 s in all), starting after the workers have joined
    /// and healed before the last tenth of the run.
    pub fn draw(seed: u64, seconds: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let total = Duration::from_secs(seconds.max(10));
        let start = (total / 10).max(Duration::from_secs(6));
        let last_start = total * 7 / 10;
        let heal_by = total * 9 / 10;
        let window = last_start.saturating_sub(start).as_secs();
        let count = ((window / 6) as usize).max(KINDS);
        let mut kinds: Vec<usize> = (0..KINDS)
            .chain((KINDS..count).map(|_| rng.random_range(0..KINDS)))
            .collect();
        kinds.shuffle(&mut rng);
        let mut times: Vec<Duration> = (0..count)
            .map(|_| start + Duration::from_millis(rng.random_range(0..=window * 1_000)))
            .collect();
        times.sort();
        let initial_workers = rng.random_range(2..=3);
        let rebalance = if rng.random_bool(0.5) {
            "cooperative"
        } else {
            "eager"
        };
        let mut events: Vec<Event> = Vec::new();
        for (at, kind) in times.into_iter().zip(kinds) {
            let room = heal_by.saturating_sub(at).max(Duration::from_secs(1));
            let workers = Workers::at(initial_workers, &events, at);
            let fault = draw_fault(&mut rng, kind, workers, room);
            events.push(Event { at, fault });
        }
        keep_the_coordinator_through_rebalances(&mut events);
        Self {
            initial_workers,
            rebalance,
            events,
        }
    }

    /// The actions of the run in time order, each fault's heal included.
    pub fn steps(&self) -> Vec<Step> {
        let mut steps = Vec::new();
        for Event { at, fault } in &self.events {
            let at = *at;
            let mut step = |after: Duration, action| {
                steps.push(Step {
                    at: at + after,
                    action,
                })
            };
            match fault {
                Fault::KillWorker {
                    pick,
                    restart_after,
                } => {
                    step(Duration::ZERO, Action::Kill { pick: *pick });
                    step(*restart_after, Action::Spawn);
                }
                Fault::RestartWorker { pick } => step(
                    Duration::ZERO,
                    Action::Terminate {
                        pick: *pick,
                        replace: true,
                    },
                ),
                Fault::JoinWorker => step(Duration::ZERO, Action::Spawn),
                Fault::LeaveWorker { pick } => step(
                    Duration::ZERO,
                    Action::Terminate {
                        pick: *pick,
                        replace: false,
                    },
                ),
                Fault::BrokerDown { broker, lasting } => {
                    step(Duration::ZERO, Action::BrokerDown(*broker));
                    step(*lasting, Action::BrokerUp(*broker));
                }
                Fault::ProduceErrors { error, count } => step(
                    Duration::ZERO,
                    Action::ProduceErrors {
                        error: *error,
                        count: *count,
                    },
                ),
                Fault::CommitErrors { error, lasting } => {
                    step(Duration::ZERO, Action::CommitErrors(*error));
                    step(*lasting, Action::EndCommitErrors);
                }
                Fault::CoordinatorMove { broker } => {
                    step(Duration::ZERO, Action::CoordinatorMove(*broker))
                }
                Fault::RoundTripDelay {
                    broker,
                    delay,
                    lasting,
                } => {
                    let (broker, delay) = (*broker, *delay);
                    step(Duration::ZERO, Action::Delay { broker, delay });
                    step(*lasting, Action::EndDelay { broker, delay });
                }
            }
        }
        // Stable: a fault's start stays before its heal when both fall on the same instant.
        steps.sort_by_key(|s| s.at);
        steps
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  {:>6.1}s  start {} workers ({} rebalancing)",
            0.0, self.initial_workers, self.rebalance
        )?;
        for e in &self.events {
            writeln!(f, "  {:>6.1}s  {}", e.at.as_secs_f64(), e.fault)?;
        }
        Ok(())
    }
}

/// How long after a change of membership its rebalance may still hold a JoinGroup or a
/// SyncGroup at the mock: the mock waits `session.timeout.ms` − 1 s for members, and a killed
/// worker's session times out [`SESSION_TIMEOUT`] after the kill.
const REBALANCE_AFTER: Duration = Duration::from_secs(12);
/// `session.timeout.ms` of the run's workers (their config takes it from here): a killed
/// worker's session ends this long after.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(6);

impl Fault {
    /// From when until when a fault starting at `at` may have a rebalance under way, for the
    /// changes of membership; `None` for the others.
    fn rebalance_window(&self, at: Duration) -> Option<(Duration, Duration)> {
        match self {
            Fault::KillWorker { restart_after, .. } => Some((
                at,
                at + (*restart_after).max(SESSION_TIMEOUT) + REBALANCE_AFTER,
            )),
            Fault::RestartWorker { .. } | Fault::JoinWorker | Fault::LeaveWorker { .. } => {
                Some((at, at + REBALANCE_AFTER))
            }
            _ => None,
        }
    }
}

/// The mock cluster dies on its own assertion (`!member->resp`, RELIABILITY.md, "Limits of the
/// mock cluster") when an OffsetCommit refused with an error that drops the coordinator makes
/// a client send its parked JoinGroup or SyncGroup again on a new connection. Every run whose
/// commit refusals overlapped a rebalance in this way died with no verdict (five of six on
/// 3 Dec, three in a row in one `.ci/run`). So a commit-error window that meets a change of
/// membership (from the change until [`REBALANCE_AFTER`], the replacement of a killed worker
/// included) refuses with an error the client retries on the same connection instead; the
/// schedule is otherwise unchanged, and such windows away from rebalances keep their error.
fn keep_the_coordinator_through_rebalances(events: &mut [Event]) {
    let rebalances: Vec<(Duration, Duration)> = events
        .iter()
        .filter_map(|e| e.fault.rebalance_window(e.at))
        .collect();
    for e in events.iter_mut() {
        if let Fault::CommitErrors { error, lasting } = &mut e.fault {
            let (from, to) = (e.at, e.at + *lasting);
            if error.drops_the_coordinator()
                && rebalances.iter().any(|&(a, b)| a <= to && from <= b)
            {
                *error = error.keeping_the_coordinator();
            }
        }
    }
}

/// Workers at one instant of a schedule: running, and running once every killed one has been
/// replaced.
#[derive(Debug, Clone, Copy)]
struct Workers {
    running: usize,
    eventually: usize,
}

impl Workers {
    /// The workers at `t`, after `events` (all at or before `t`).
    fn at(initial: usize, events: &[Event], t: Duration) -> Self {
        let (mut running, mut eventually) = (initial as i64, initial as i64);
        for e in events {
            match e.fault {
                Fault::JoinWorker => {
                    running += 1;
                    eventually += 1;
                }
                Fault::LeaveWorker { .. } => {
                    running -= 1;
                    eventually -= 1;
                }
                Fault::KillWorker { restart_after, .. } if e.at + restart_after > t => running -= 1,
                _ => {}
            }
        }
        Self {
            running: running.max(0) as usize,
            eventually: eventually.max(0) as usize,
        }
    }
}

/// The fault of kind `kind` given the `workers`: a kill or a leave that would leave no worker
/// running becomes a join, a join beyond [`MAX_WORKERS`] becomes a leave. Timed faults
/// heal within `room`.
fn draw_fault(rng: &mut StdRng, kind: usize, workers: Workers, room: Duration) -> Fault {
    let secs = |rng: &mut StdRng, lo: u64, hi: u64| {
        Duration::from_millis(rng.random_range(lo * 1_000..=hi * 1_000)).min(room)
    };
    let pick = rng.random_range(0..MAX_WORKERS);
    let broker = rng.random_range(1..=BROKERS);
    match kind {
        0 | 3 if workers.running <= 1 => Fault::JoinWorker,
        1 if workers.running == 0 => Fault::JoinWorker,
        2 if workers.eventually >= MAX_WORKERS && workers.running > 1 => {
            Fault::LeaveWorker { pick }
        }
        0 => Fault::KillWorker {
            pick,
            restart_after: secs(rng, 2, 8),
        },
        1 => Fault::RestartWorker { pick },
        2 => Fault::JoinWorker,
        3 => Fault::LeaveWorker { pick },
        4 => Fault::BrokerDown {
            broker,
            lasting: secs(rng, 2, 6),
        },
        5 => Fault::ProduceErrors {
            error: *KafkaErr::PRODUCE.choose(rng).expect("not empty"),
            count: rng.random_range(10..=60),
        },
        6 => Fault::CommitErrors {
            error: *KafkaErr::COMMIT.choose(rng).expect("not empty"),
            lasting: secs(rng, 5, 20),
        },
        7 => Fault::CoordinatorMove { broker },
        _ => Fault::RoundTripDelay {
            broker,
            delay: Duration::from_millis(rng.random_range(200..=1_500)),
            lasting: secs(rng, 3, 12),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(f: &Fault) -> usize {
        match f {
            Fault::KillWorker { .. } => 0,
            Fault::RestartWorker { .. } => 1,
            Fault::JoinWorker => 2,
            Fault::LeaveWorker { .. } => 3,
            Fault::BrokerDown { .. } => 4,
            Fault::ProduceErrors { .. } => 5,
            Fault::CommitErrors { .. } => 6,
            Fault::CoordinatorMove { .. } => 7,
            Fault::RoundTripDelay { .. } => 8,
        }
    }

    #[test]
    fn commit_errors_that_drop_the_coordinator_never_meet_a_rebalance() {
        let mut kept = 0;
        for seed in 0..500 {
            let s = Schedule::draw(seed, 90);
            for c in &s.events {
                let Fault::CommitErrors { error, lasting } = c.fault else {
                    continue;
                };
                if !error.drops_the_coordinator() {
                    continue;
                }
                kept += 1;
                for m in &s.events {
                    let Some((_, until)) = m.fault.rebalance_window(m.at) else {
                        continue;
                    };
                    assert!(
                        until < c.at || c.at + lasting < m.at,
                        "seed {seed}: {:?} at {:?} meets {:?} at {:?}",
                        c.fault,
                        c.at,
                        m.fault,
                        m.at
                    );
                }
            }
        }
        assert!(
            kept > 0,
            "no schedule keeps an error that drops the coordinator"
        );
    }

    #[test]
    fn a_seed_names_one_schedule() {
        assert_eq!(Schedule::draw(42, 120), Schedule::draw(42, 120));
        assert_ne!(Schedule::draw(42, 120), Schedule::draw(43, 120));
    }

    #[test]
    fn schedules_keep_their_promises() {
        for seed in 0..500 {
            for seconds in [30, 90, 120, 600] {
                let s = Schedule::draw(seed, seconds);
                let total = Duration::from_secs(seconds);
                let mut kinds: Vec<usize> = s.events.iter().map(|e| kind(&e.fault)).collect();
                kinds.sort();
                kinds.dedup();
                // Every fault of the cluster; the worker ones unless a kill or a leave would
                // have left no worker running (it became a join).
                assert!(kinds.len() >= KINDS - 2, "seed {seed}: kinds {kinds:?}");
                assert!((4..KINDS).all(|k| kinds.contains(&k)), "seed {seed}");
                let steps = s.steps();
                assert!(steps.windows(2).all(|w| w[0].at <= w[1].at));
                assert!(
                    steps.iter().all(|st| st.at <= total * 9 / 10),
                    "seed {seed}: a fault outlasts the run"
                );
                let mut running = s.initial_workers as i64;
                for st in &steps {
                    match st.action {
                        Action::Spawn => running += 1,
                        Action::Kill { .. } | Action::Terminate { replace: false, .. } => {
                            running -= 1
                        }
                        _ => {}
                    }
                    assert!(
                        (1..=MAX_WORKERS as i64).contains(&running),
                        "seed {seed} at {:?}: {running} workers",
                        st.at
                    );
                }
            }
        }
    }
}
