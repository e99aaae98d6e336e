//! The scenarios (P1–P5) and how each is run against every system.
//!
//! A scenario fixes the records (sessions, their distribution, partitions, seed), the handler's
//! work and faults, and the runs: a *backlog* run (the records are produced first, then each
//! system drains them: throughput) and a *paced* run (each system is started first, then the
//! records are produced at a fixed rate while it runs: latency at that offered load). Every
//! system reads identical records — the same seeded workload — on the same broker, in one
//! invocation; each run uses fresh topics (deleted afterwards) and its own consumer group.
//! Record counts and durations below are the full-size ones; `--scale` shrinks them for
//! development.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sessionflow_tools::loadgen::SessionChoice;
use sessionflow_worker::kafka::topics;

use crate::handler::HandlerSpec;
use crate::measurement::{now_us, process_cpu_seconds};
use crate::run::{ChildRun, RunResult, RunSpec};
use crate::systems::{SystemKind, SystemSettings};
use crate::workload::{Load, Producer, VALUE_SIZE};

/// The seed article's synthetic test: 14,027 msg/s with a median latency of 11.7 ms.
pub const SEED_RATE: f64 = 14_027.0;
pub const SEED_P50_MS: f64 = 11.7;

#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
pub enum ScenarioId {
    P1,
    P2,
    P3,
    P4,
    P5,
    /// Not a scenario of its own: the growth sweeps ([`crate::sweeps`]), whose points are
    /// scenarios with this id (`--only sweeps` runs them alone).
    Sweeps,
}

/// How records are spread over sessions (loadgen's choices).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Choice {
    RoundRobin,
    Uniform,
    Zipf(f64),
}

impl Choice {
    pub fn loadgen(self) -> SessionChoice {
        match self {
            Self::RoundRobin => SessionChoice::RoundRobin,
            Self::Uniform => SessionChoice::Uniform,
            Self::Zipf(e) => SessionChoice::Zipf(e),
        }
    }

    pub fn describe(self) -> String {
        match self {
            Self::RoundRobin => "round-robin".into(),
            Self::Uniform => "uniform".into(),
            Self::Zipf(e) => format!("Zipf (s = {e})"),
        }
    }
}

/// How many times P1's backlog is drained per system (its row is the median round): one drain
/// per system moved P1's ratio by ±30 % between runs on a 2-core VM, three by ±10 %.
pub const P1_ROUNDS: u32 = 5;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Backlog {
    pub records: u64,
    pub cap_secs: f64,
    /// Drains of the same backlog, each system in turn each round, each by a new group; the
    /// round with the median rate is the system's measurement. A ratio of two systems' rates
    /// from one drain each moved by ±30 % between runs on a shared machine (see the notes).
    #[serde(default = "one_round")]
    pub rounds: u32,
}

fn one_round() -> u32 {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Paced {
    /// Records per second offered; `None`: as fast as the broker takes them.
    pub rate: Option<f64>,
    pub records: u64,
    /// Longest run after the load starts.
    pub cap_secs: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Scenario {
    pub id: ScenarioId,
    pub title: String,
    pub what: String,
    pub partitions: i32,
    pub sessions: u64,
    pub choice: Choice,
    pub seed: u64,
    pub handler: HandlerSpec,
    pub retry_initial_ms: u64,
    pub retry_max_ms: u64,
    pub session_idle_ms: u64,
    pub backlog: Option<Backlog>,
    pub paced: Option<Paced>,
    /// P4: the same paced load without the failing session's fault.
    pub fault_free: Option<Paced>,
    pub systems: Vec<SystemKind>,
    pub memory: bool,
    /// Bytes of each record's value.
    #[serde(default = "default_value_size")]
    pub value_size: usize,
    /// A sweep point's name (e.g. `sessions-1000`), which tells its topics, groups and logs
    /// apart from the other points'; `None` for P1–P5.
    #[serde(default)]
    pub point: Option<String>,
}

fn default_value_size() -> usize {
    VALUE_SIZE
}

impl Scenario {
    /// The name in topics, groups and log files: `p1`, or `sweeps-sessions-1000`.
    pub fn slug(&self) -> String {
        let id = format!("{:?}", self.id).to_lowercase();
        match &self.point {
            Some(point) => format!("{id}-{point}"),
            None => id,
        }
    }
}

pub fn scaled(n: u64, scale: f64) -> u64 {
    ((n as f64 * scale).round() as u64).max(1_000)
}

/// A paced load of `secs` (scaled) at `rate`.
pub fn paced(rate: f64, secs: f64, grace_secs: f64, scale: f64) -> Paced {
    let secs = secs * scale;
    Paced {
        rate: Some(rate),
        records: scaled((rate * secs) as u64, 1.0),
        cap_secs: secs + grace_secs,
    }
}

/// The five scenarios at `scale` (1.0 = the full `make bench`).
pub fn all(scale: f64) -> Vec<Scenario> {
    let s = scale;
    let every = SystemKind::ALL.to_vec();
    let retry = (1, 100);
    let p4_fault = (3_000.0 * s) as u64;
    let p4_fault_for = (10_000.0 * s) as u64;
    vec![
        Scenario {
            id: ScenarioId::P1,
            title: "no-op handler, 1,000 Zipf sessions".into(),
            what:
                "Raw overhead: a handler that does nothing, 1,000 sessions with Zipf-distributed \
                   traffic (the busiest session has ~13% of the records), 8 partitions."
                    .into(),
            partitions: 8,
            sessions: 1_000,
            choice: Choice::Zipf(1.0),
            seed: 11,
            handler: HandlerSpec::default(),
            retry_initial_ms: retry.0,
            retry_max_ms: retry.1,
            session_idle_ms: 30_000,
            backlog: Some(Backlog {
                records: scaled(1_000_000, s),
                cap_secs: 120.0,
                rounds: P1_ROUNDS,
            }),
            paced: Some(paced(25_000.0, 8.0, 15.0, s)),
            fault_free: None,
            systems: every.clone(),
            memory: false,
            value_size: VALUE_SIZE,
            point: None,
        },
        Scenario {
            id: ScenarioId::P2,
            title: "5 ms simulated I/O, 1,000 sessions".into(),
            what: "A handler that waits 5 ms per record (simulated I/O: a timer the runtime's \
                   reactor reports, as it would a reply), 1,000 sessions receiving records in \
                   turn (round-robin), 8 partitions. Ideal: 1,000 sessions ÷ 5 ms = 200,000 \
                   msg/s, capped by the ceiling."
                .into(),
            partitions: 8,
            sessions: 1_000,
            choice: Choice::RoundRobin,
            seed: 12,
            handler: HandlerSpec {
                io_ms: 5,
                ..Default::default()
            },
            retry_initial_ms: retry.0,
            retry_max_ms: retry.1,
            session_idle_ms: 30_000,
            backlog: Some(Backlog {
                records: scaled(200_000, s),
                cap_secs: 12.0,
                rounds: 1,
            }),
            paced: Some(paced(10_000.0, 8.0, 10.0, s)),
            fault_free: None,
            systems: every.clone(),
            memory: false,
            value_size: VALUE_SIZE,
            point: None,
        },
        Scenario {
            id: ScenarioId::P3,
            title: "the seed's synthetic test: 10 sessions, 10% transient faults".into(),
            what: format!(
                "50,000 records over 10 sessions (uniform), 8 partitions, 10% of attempts fail \
                 transiently and are retried in place (backoff 1 ms initial, ×2, full jitter, \
                 max 100 ms). The seed article reports {SEED_RATE} msg/s with p50 \
                 {SEED_P50_MS} ms for this test; the paced run offers 2 × {SEED_RATE} msg/s."
            ),
            partitions: 8,
            sessions: 10,
            choice: Choice::Uniform,
            seed: 13,
            handler: HandlerSpec {
                transient_rate: 0.1,
                seed: 13,
                ..Default::default()
            },
            retry_initial_ms: retry.0,
            retry_max_ms: retry.1,
            session_idle_ms: 30_000,
            backlog: Some(Backlog {
                records: scaled(50_000, s),
                cap_secs: 60.0,
                rounds: 1,
            }),
            paced: Some(Paced {
                rate: Some(2.0 * SEED_RATE),
                records: scaled(50_000, s),
                cap_secs: 50_000.0 * s / (2.0 * SEED_RATE) + 10.0,
            }),
            fault_free: None,
            systems: every.clone(),
            memory: false,
            value_size: VALUE_SIZE,
            point: None,
        },
        Scenario {
            id: ScenarioId::P4,
            title: "isolation: one session failing for 10 s".into(),
            what: format!(
                "1,000 sessions (uniform), 8 partitions, a no-op handler, 4,000 msg/s offered for \
                 {:.0} s; session 0 fails every attempt (transient, retried in place, backoff 1 ms \
                 → 100 ms) from {:.0} s to {:.0} s after the load starts. Compared: the p99 of the \
                 other 999 sessions with and without that fault (fault-free run: the same load, \
                 {:.0} s).",
                20.0 * s,
                p4_fault as f64 / 1e3,
                (p4_fault + p4_fault_for) as f64 / 1e3,
                20.0 * s
            ),
            partitions: 8,
            sessions: 1_000,
            choice: Choice::Uniform,
            seed: 14,
            handler: HandlerSpec {
                fail_sid: Some(0),
                fail_from_ms: p4_fault,
                fail_for_ms: p4_fault_for,
                ..Default::default()
            },
            retry_initial_ms: retry.0,
            retry_max_ms: retry.1,
            session_idle_ms: 30_000,
            backlog: None,
            paced: Some(paced(4_000.0, 20.0, 15.0, s)),
            // As long as the faulty run: latencies drift with a run's length on a small broker.
            fault_free: Some(paced(4_000.0, 20.0, 15.0, s)),
            systems: every,
            memory: false,
            value_size: VALUE_SIZE,
            point: None,
        },
        Scenario {
            id: ScenarioId::P5,
            title: "memory: 1M distinct sessions".into(),
            what: "1,000,000 records, each for a session of its own, produced as fast as the \
                   broker takes them while the engine runs; sessionIdleMs 2,000. RSS at rest \
                   before the load, its peak, and at rest after every session was reaped. \
                   sessionflow only: the baselines keep no per-session state. Every RSS \
                   includes the harness's order check, 8 bytes per session written before the \
                   baseline (8 MiB at 1M sessions); the ratio leaves it out of both readings \
                   (before 6 Dec it did not, and read lower)."
                .into(),
            partitions: 8,
            sessions: scaled(1_000_000, s),
            choice: Choice::RoundRobin,
            seed: 15,
            handler: HandlerSpec::default(),
            retry_initial_ms: retry.0,
            retry_max_ms: retry.1,
            session_idle_ms: 2_000,
            backlog: None,
            paced: Some(Paced {
                rate: None,
                records: scaled(1_000_000, s),
                cap_secs: 180.0,
            }),
            fault_free: None,
            systems: vec![SystemKind::Sessionflow],
            memory: true,
            value_size: VALUE_SIZE,
            point: None,
        },
    ]
}

/// How the runs are made.
#[derive(Debug, Clone)]
pub struct Options {
    pub brokers: String,
    /// This binary, started again as `child`.
    pub exe: PathBuf,
    pub pool_workers: usize,
    pub pool_queue: usize,
    pub telemetry: bool,
    pub fetch_wait_ms: u64,
    /// Extra librdkafka properties for sessionflow's stage.
    pub sessionflow_kafka: Vec<(String, String)>,
    /// The commit interval of `sessionflow-eos` and `sessionflow-alo100` instead of their 100 ms.
    pub variant_commit_interval_ms: Option<u64>,
    /// sessionflow's `maxInFlightPerPartition` (and PC's budget) instead of the default.
    pub max_in_flight_per_partition: Option<usize>,
    /// A cap on the Parallel Consumer's worker threads (`--pc-max-concurrency`).
    pub pc_max_concurrency: Option<usize>,
    /// Where each child's stderr goes.
    pub log_dir: PathBuf,
    /// The broker's process, when it runs on this machine (its CPU time is read).
    pub broker_pid: Option<u32>,
}

/// One run's measurements.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Measured {
    pub expected: u64,
    pub expected_healthy: u64,
    /// The run's time cap (from the first record, or from the start of a paced load).
    pub cap_secs: f64,
    pub result: RunResult,
    pub broker_cpu_s: Option<f64>,
    pub wall_s: f64,
    /// Offered rate of a paced run (`None`: unpaced or backlog).
    pub offered_rate: Option<f64>,
    /// The rate the producer achieved (paced runs).
    pub produced_rate: Option<f64>,
    /// Every round of a backlog drained in rounds (this measurement is the median's), in the
    /// order they ran; empty for a single run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rounds: Vec<Round>,
}

/// One round of a backlog drained in rounds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Round {
    pub rate: Option<f64>,
    pub cpu_s: f64,
    pub peak_rss: u64,
}

impl Round {
    fn of(m: &Measured) -> Self {
        Self {
            rate: m.result.throughput(),
            cpu_s: m.result.cpu_s,
            peak_rss: m.result.peak_rss,
        }
    }
}

/// The round with the median rate (the lower middle one of an even count), all rounds
/// recorded in it.
fn median_round(mut runs: Vec<Measured>) -> Option<Measured> {
    let rounds: Vec<Round> = runs.iter().map(Round::of).collect();
    runs.sort_by(|a, b| {
        let rate = |m: &Measured| m.result.throughput().unwrap_or(0.0);
        rate(a).total_cmp(&rate(b))
    });
    let mut median = runs.into_iter().nth((rounds.len().max(1) - 1) / 2)?;
    if rounds.len() > 1 {
        median.rounds = rounds;
    }
    Some(median)
}

impl Measured {
    /// The measurements of `spec`'s run, started at `started` with the broker's CPU at `cpu0`.
    fn of(
        opts: &Options,
        sc: &Scenario,
        spec: &RunSpec,
        result: RunResult,
        started: Instant,
        cpu0: Option<f64>,
    ) -> Self {
        Self {
            expected: spec.expected,
            expected_healthy: expected_healthy(sc, spec),
            cap_secs: spec.cap_secs,
            result,
            broker_cpu_s: cpu0.zip(broker_cpu(opts)).map(|(a, b)| b - a),
            wall_s: started.elapsed().as_secs_f64(),
            offered_rate: None,
            produced_rate: None,
            rounds: Vec::new(),
        }
    }

    /// Healthy records never done within the cap: they count as slower than every one seen.
    pub fn censored_healthy(&self) -> u64 {
        self.expected_healthy
            .saturating_sub(self.result.healthy_handled)
    }
}

/// Records of the run that belong to a healthy session (all but the failing one's).
fn expected_healthy(sc: &Scenario, spec: &RunSpec) -> u64 {
    match spec.handler.fail_sid {
        None => spec.expected,
        Some(sid) => {
            let order = sessionflow_tools::loadgen::session_sequence(
                spec.expected,
                sc.sessions,
                sc.choice.loadgen(),
                sc.seed,
            );
            order.iter().filter(|s| **s != u64::from(sid)).count() as u64
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SystemOutcome {
    pub system: SystemKind,
    pub backlog: Option<Measured>,
    pub paced: Option<Measured>,
    pub fault_free: Option<Measured>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    pub scenario: Scenario,
    pub systems: Vec<SystemOutcome>,
    /// How fast the backlog was produced.
    pub backlog_produce_rate: Option<f64>,
    /// For a handler that waits: what tasks doing nothing but its wait reach on this machine,
    /// one per session (see `simulated_io::ceiling`).
    #[serde(default, alias = "timer_ceiling")]
    pub io_ceiling: Option<f64>,
    pub wall_s: f64,
}

impl Outcome {
    pub fn system(&self, kind: SystemKind) -> Option<&SystemOutcome> {
        self.systems.iter().find(|s| s.system == kind)
    }
}

fn unique_tag() -> String {
    format!("{}-{:x}", std::process::id(), now_us() & 0xff_ffff_ffff)
}

/// Runs one scenario against its systems.
pub async fn run(opts: &Options, sc: &Scenario) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let tag = unique_tag();
    let id = sc.slug();
    let dlq = format!("bench-{id}-dlq-{tag}");
    topics::create(&opts.brokers, &[&dlq], 1).await?;
    let mut systems: Vec<SystemOutcome> = sc
        .systems
        .iter()
        .map(|s| SystemOutcome {
            system: *s,
            backlog: None,
            paced: None,
            fault_free: None,
        })
        .collect();
    let mut backlog_produce_rate = None;
    let mut io_ceiling = None;
    let result = async {
        if let Some(b) = &sc.backlog {
            let topic = format!("bench-{id}-backlog-{tag}");
            topics::create(&opts.brokers, &[&topic], sc.partitions).await?;
            let produced = Producer::new(&opts.brokers, false)?
                .produce(&load(sc, &topic, b.records, None))
                .await?;
            let rate = b.records as f64 / produced.elapsed.as_secs_f64();
            eprintln!(
                "[{id}] backlog: {} records produced in {:.1} s ({rate:.0} msg/s)",
                b.records,
                produced.elapsed.as_secs_f64()
            );
            backlog_produce_rate = Some(rate);
            let mut runs: Vec<Vec<Measured>> = systems.iter().map(|_| Vec::new()).collect();
            for round in 1..=b.rounds.max(1) {
                // A group of its own per round: each drains the whole backlog.
                let kind = match round {
                    1 => "backlog".to_string(),
                    n => format!("backlog-{n}"),
                };
                for (s, runs) in systems.iter().zip(runs.iter_mut()) {
                    let spec = spec(opts, sc, s.system, &topic, &dlq, &tag, &kind, &sc.handler)
                        .with(b.records, false, b.cap_secs);
                    let m = run_backlog(opts, sc, &spec, &id, &kind).await?;
                    report_progress(&id, s.system, &kind, &m);
                    runs.push(m);
                }
            }
            for (s, runs) in systems.iter_mut().zip(runs) {
                s.backlog = median_round(runs);
            }
            let _ = topics::delete(&opts.brokers, &[&topic]).await;
            if sc.handler.io_ms > 0 {
                let waits = (b.records / sc.sessions.max(1)).max(1);
                let rate = crate::simulated_io::ceiling(
                    sc.sessions,
                    waits,
                    Duration::from_millis(sc.handler.io_ms),
                )
                .await;
                eprintln!(
                    "[{id}] I/O ceiling: {} tasks waiting {} ms {waits} times: {rate:.0}/s",
                    sc.sessions, sc.handler.io_ms
                );
                io_ceiling = Some(rate);
            }
        }
        // Each system's paced runs back to back (with the fault, then without), so the
        // fault-free p99 a system is compared with was measured under the same conditions.
        let fault_free_handler = HandlerSpec {
            fail_for_ms: 0,
            ..sc.handler.clone()
        };
        for s in systems.iter_mut() {
            for (kind, paced, handler) in [
                ("paced", &sc.paced, &sc.handler),
                ("fault-free", &sc.fault_free, &fault_free_handler),
            ] {
                let Some(p) = paced else { continue };
                let topic = format!("bench-{id}-{kind}-{}-{tag}", s.system.short());
                let spec = spec(opts, sc, s.system, &topic, &dlq, &tag, kind, handler)
                    .with(p.records, true, p.cap_secs);
                let m = run_paced(opts, sc, &spec, p, &id).await;
                let _ = topics::delete(&opts.brokers, &[&topic]).await;
                let m = m?;
                report_progress(&id, s.system, kind, &m);
                match kind {
                    "paced" => s.paced = Some(m),
                    _ => s.fault_free = Some(m),
                }
            }
        }
        anyhow::Ok(())
    }
    .await;
    let _ = topics::delete(&opts.brokers, &[&dlq]).await;
    result?;
    Ok(Outcome {
        scenario: sc.clone(),
        systems,
        backlog_produce_rate,
        io_ceiling,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

fn load(sc: &Scenario, topic: &str, records: u64, rate: Option<f64>) -> Load {
    Load {
        topic: topic.to_string(),
        records,
        sessions: sc.sessions,
        choice: sc.choice.loadgen(),
        seed: sc.seed,
        rate,
        value_size: sc.value_size,
    }
}

#[allow(clippy::too_many_arguments)]
fn spec(
    opts: &Options,
    sc: &Scenario,
    system: SystemKind,
    topic: &str,
    dlq: &str,
    tag: &str,
    kind: &str,
    handler: &HandlerSpec,
) -> RunSpec {
    let id = sc.slug();
    RunSpec {
        system,
        settings: SystemSettings {
            brokers: opts.brokers.clone(),
            topic: topic.to_string(),
            dlq: dlq.to_string(),
            output: (system == SystemKind::SessionflowOutput)
                .then(|| format!("bench-{id}-{kind}-out-{}-{tag}", system.short())),
            group: format!("bench-{id}-{kind}-{}-{tag}", system.short()),
            partitions: sc.partitions,
            retry_initial_ms: sc.retry_initial_ms,
            retry_max_ms: sc.retry_max_ms,
            pool_workers: opts.pool_workers,
            pool_queue: opts.pool_queue,
            session_idle_ms: sc.session_idle_ms,
            telemetry: opts.telemetry,
            fetch_wait_ms: opts.fetch_wait_ms,
            sessionflow_kafka: opts.sessionflow_kafka.clone(),
            commit_interval_ms: match system {
                SystemKind::SessionflowEos
                | SystemKind::SessionflowAlo100
                | SystemKind::ParallelConsumerTx => opts.variant_commit_interval_ms,
                _ => None,
            }
            .or(system.commit().map(|(ms, _)| ms))
            .unwrap_or(1_000),
            exactly_once: system.commit().is_some_and(|(_, eos)| eos),
            max_in_flight_per_partition: opts.max_in_flight_per_partition,
            pc_max_concurrency: opts.pc_max_concurrency,
        },
        // The ceiling does no processing: no simulated I/O, no faults.
        handler: if system == SystemKind::Ceiling {
            HandlerSpec {
                fail_sid: handler.fail_sid,
                ..Default::default()
            }
        } else {
            handler.clone()
        },
        sessions: sc.sessions,
        expected: 0,
        paced: false,
        cap_secs: 0.0,
        memory: sc.memory,
    }
}

impl RunSpec {
    fn with(mut self, expected: u64, paced: bool, cap_secs: f64) -> Self {
        self.expected = expected;
        self.paced = paced;
        self.cap_secs = cap_secs;
        self
    }
}

fn log_path(opts: &Options, id: &str, spec: &RunSpec, kind: &str) -> PathBuf {
    opts.log_dir
        .join(format!("{id}-{kind}-{}.log", spec.system.short()))
}

fn broker_cpu(opts: &Options) -> Option<f64> {
    opts.broker_pid.and_then(process_cpu_seconds)
}

/// Runs `run` with the run's output topic (sessionflow + output) created first and deleted
/// afterwards, whatever the run's fate.
async fn with_output_topic<T>(
    opts: &Options,
    sc: &Scenario,
    spec: &RunSpec,
    run: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let Some(output) = &spec.settings.output else {
        return run.await;
    };
    topics::create(&opts.brokers, &[output], sc.partitions).await?;
    let result = run.await;
    let _ = topics::delete(&opts.brokers, &[output]).await;
    result
}

async fn run_backlog(
    opts: &Options,
    sc: &Scenario,
    spec: &RunSpec,
    id: &str,
    kind: &str,
) -> anyhow::Result<Measured> {
    with_output_topic(opts, sc, spec, async {
        let started = Instant::now();
        let cpu0 = broker_cpu(opts);
        let child = ChildRun::spawn(&opts.exe, spec, &log_path(opts, id, spec, kind))?;
        let result = child.result().await?;
        Ok(Measured::of(opts, sc, spec, result, started, cpu0))
    })
    .await
}

async fn run_paced(
    opts: &Options,
    sc: &Scenario,
    spec: &RunSpec,
    paced: &Paced,
    id: &str,
) -> anyhow::Result<Measured> {
    let started = Instant::now();
    let topic = &spec.settings.topic;
    topics::create(&opts.brokers, &[topic], sc.partitions).await?;
    let producer = Producer::new(&opts.brokers, paced.rate.is_some())?;
    producer.warmups(topic, sc.partitions).await?;
    let kind = if spec.handler.fail_for_ms == 0 && sc.fault_free.is_some() {
        "fault-free"
    } else {
        "paced"
    };
    with_output_topic(opts, sc, spec, async {
        let mut child = ChildRun::spawn(&opts.exe, spec, &log_path(opts, id, spec, kind))?;
        child.ready().await?;
        let cpu0 = broker_cpu(opts);
        child.go(now_us()).await?;
        let produced = producer
            .produce(&load(sc, topic, paced.records, paced.rate))
            .await?;
        let result = child.result().await?;
        Ok(Measured {
            offered_rate: paced.rate,
            produced_rate: Some(paced.records as f64 / produced.elapsed.as_secs_f64()),
            ..Measured::of(opts, sc, spec, result, started, cpu0)
        })
    })
    .await
}

fn report_progress(id: &str, system: SystemKind, kind: &str, m: &Measured) {
    let r = &m.result;
    let p = |q| {
        r.healthy
            .quantile(q, m.censored_healthy())
            .map_or("> cap".to_string(), |us| format!("{:.2} ms", us / 1e3))
    };
    eprintln!(
        "[{id}] {:<12} {kind:<10} {}/{} records{} | {:>9.0} msg/s | p50 {} p99 {} | order violations {} | cpu {:.1} s | rss {:.0} MiB | {:.1} s",
        system.short(),
        r.handled,
        m.expected,
        if r.capped { " (capped)" } else { "" },
        r.throughput().unwrap_or(0.0),
        p(0.5),
        p(0.99),
        r.order_violations,
        r.cpu_s,
        r.peak_rss as f64 / 1048576.0,
        m.wall_s,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_size_scenarios_match_the_brief() {
        let all = all(1.0);
        let p = |id| all.iter().find(|s| s.id == id).unwrap();
        let p1 = p(ScenarioId::P1);
        assert!(p1.backlog.as_ref().unwrap().records >= 1_000_000);
        assert_eq!((p1.sessions, p1.partitions), (1_000, 8));
        assert_eq!(p1.choice, Choice::Zipf(1.0));
        assert_eq!(p(ScenarioId::P2).handler.io_ms, 5);
        let p3 = p(ScenarioId::P3);
        assert_eq!(p3.backlog.as_ref().unwrap().records, 50_000);
        assert_eq!((p3.sessions, p3.handler.transient_rate), (10, 0.1));
        assert_eq!(p3.retry_initial_ms, 1);
        let p4 = p(ScenarioId::P4);
        assert_eq!(p4.handler.fail_for_ms, 10_000);
        assert_eq!(p4.sessions, 1_000);
        let p5 = p(ScenarioId::P5);
        assert_eq!(p5.sessions, 1_000_000);
        assert_eq!(p5.systems, vec![SystemKind::Sessionflow]);
    }

    #[test]
    fn censoring_counts_only_healthy_records_never_done() {
        let result = RunResult {
            handled: 90,
            healthy_handled: 85,
            ..Default::default()
        };
        // 95 healthy records, 85 of them done.
        assert_eq!(measured(100, 95, result).censored_healthy(), 10);
    }

    /// A run's measurements: `result` of `expected` records, `healthy` of them healthy.
    fn measured(expected: u64, healthy: u64, result: RunResult) -> Measured {
        Measured {
            expected,
            expected_healthy: healthy,
            cap_secs: 60.0,
            result,
            broker_cpu_s: None,
            wall_s: 0.0,
            offered_rate: None,
            produced_rate: None,
            rounds: Vec::new(),
        }
    }

    /// A drain of 1,000 records over `secs`, with `rss` as its peak.
    fn drained(secs: u64, rss: u64) -> Measured {
        let result = RunResult {
            handled: 1_000,
            first_us: Some(0),
            last_us: Some(secs * 1_000_000),
            peak_rss: rss,
            ..Default::default()
        };
        measured(1_000, 1_000, result)
    }

    #[test]
    fn the_median_round_by_rate_stands_for_all_and_keeps_them_in_order() {
        let m = median_round(vec![drained(2, 20), drained(4, 40), drained(1, 10)]).unwrap();
        assert_eq!(
            m.result.peak_rss, 20,
            "the 500 msg/s round, between 250 and 1,000"
        );
        let rates: Vec<f64> = m.rounds.iter().map(|r| r.rate.unwrap()).collect();
        assert_eq!(rates, [500.0, 250.0, 1_000.0]);
        let two = median_round(vec![drained(1, 10), drained(2, 20)]).unwrap();
        assert_eq!(two.result.peak_rss, 20, "of two, the slower");
        let one = median_round(vec![drained(1, 10)]).unwrap();
        assert!(one.rounds.is_empty(), "a single run lists no rounds");
        assert!(median_round(Vec::new()).is_none());
    }
}
