//! The growth sweeps ("How cost grows", issue 13): the curves a user reads to size a stage.
//!
//! P1–P5 each measure one point; a user sizing a stage needs to know how the cost moves when
//! their numbers differ from those. So this module varies one thing at a time around a middle
//! point (1,000 sessions, 8 partitions, 100-byte values, no-op handler) and drains a backlog at
//! each value: sessions 10 → 1M, partitions 1 → 64, value size 100 B → 10 KB, giving
//! throughput and CPU per record for sessionflow and, as the reference, the per-partition
//! sequential consumer. Then it measures the latency against the offered load: it drains a
//! backlog of P1's (and P2's) records to find the capacity, and offers 25/50/80/95 % of that
//! capacity in paced runs. Every point is an ordinary [`Scenario`] run by
//! [`scenarios::run`], so it is measured exactly as P1–P5 are (same workload, handler, child
//! processes, unique topics and groups, deleted afterwards); this module only chooses the
//! points and keeps their outcomes. The three backlog sweeps share their middle point, which
//! runs once.

use serde::{Deserialize, Serialize};

use crate::scenarios::{
    self, paced, scaled, Backlog, Choice, Options, Outcome, Scenario, ScenarioId,
};
use crate::systems::{self, SystemKind};

/// What one backlog point varies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub sessions: u64,
    pub partitions: i32,
    /// Bytes of each record's value.
    pub value_size: usize,
}

/// The point every backlog sweep passes through.
pub const MIDDLE: Shape = Shape {
    sessions: 1_000,
    partitions: 8,
    value_size: 100,
};
pub const SESSIONS: [u64; 4] = [10, 1_000, 100_000, 1_000_000];
pub const PARTITIONS: [i32; 3] = [1, 8, 64];
pub const VALUE_SIZES: [usize; 2] = [100, 10_000];
/// Offered load, as fractions of the capacity measured in the same run.
pub const LOAD_FRACTIONS: [f64; 4] = [0.25, 0.5, 0.8, 0.95];
/// Length of each paced run of the latency sweep (full size), and the time allowed after it.
const LOAD_SECS: f64 = 10.0;
const LOAD_GRACE_SECS: f64 = 15.0;
/// Time cap of a backlog drain.
const BACKLOG_CAP_SECS: f64 = 120.0;
/// Records of a backlog point (full size): 1M, or fewer when they would hold more than 1 GB of
/// values (10 KB values: 100,000 records).
const BACKLOG_RECORDS: u64 = 1_000_000;
const BACKLOG_BYTES: u64 = 1_000_000_000;

/// A backlog sweep: which of the [`Shape`]'s numbers it varies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Axis {
    Sessions,
    Partitions,
    ValueSize,
}

impl Axis {
    pub const ALL: [Axis; 3] = [Axis::Sessions, Axis::Partitions, Axis::ValueSize];

    /// The shapes of this sweep, in ascending order.
    pub fn shapes(self) -> Vec<Shape> {
        match self {
            Self::Sessions => SESSIONS
                .iter()
                .map(|&sessions| Shape { sessions, ..MIDDLE })
                .collect(),
            Self::Partitions => PARTITIONS
                .iter()
                .map(|&partitions| Shape {
                    partitions,
                    ..MIDDLE
                })
                .collect(),
            Self::ValueSize => VALUE_SIZES
                .iter()
                .map(|&value_size| Shape {
                    value_size,
                    ..MIDDLE
                })
                .collect(),
        }
    }

    /// The value this sweep varies, at `shape`.
    pub fn x(self, shape: &Shape) -> f64 {
        match self {
            Self::Sessions => shape.sessions as f64,
            Self::Partitions => f64::from(shape.partitions),
            Self::ValueSize => shape.value_size as f64,
        }
    }

    /// What the sweep varies, as a column heading.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sessions => "sessions",
            Self::Partitions => "partitions",
            Self::ValueSize => "value size, bytes",
        }
    }

    /// The chart's file name (in the results directory).
    pub fn chart_file(self) -> &'static str {
        match self {
            Self::Sessions => "sweep-sessions.svg",
            Self::Partitions => "sweep-partitions.svg",
            Self::ValueSize => "sweep-value-size.svg",
        }
    }
}

/// Every distinct shape of the three sweeps, in the order they run.
pub fn shapes() -> Vec<Shape> {
    let mut all: Vec<Shape> = Vec::new();
    for shape in Axis::ALL.iter().flat_map(|a| a.shapes()) {
        if !all.contains(&shape) {
            all.push(shape);
        }
    }
    all
}

/// The records of a backlog point at `scale`.
pub fn backlog_records(shape: &Shape, scale: f64) -> u64 {
    let records = BACKLOG_RECORDS.min(BACKLOG_BYTES / shape.value_size.max(1) as u64);
    scaled(records, scale)
}

/// The scenario of one backlog point: the shape's records, round-robin over its sessions (each
/// session gets the same share), drained by sessionflow and the per-partition sequential
/// consumer. Sessions stay alive for the whole drain (sessionIdleMs 30 s, as in P1).
pub fn backlog_scenario(shape: &Shape, scale: f64) -> Scenario {
    let records = backlog_records(shape, scale);
    Scenario {
        id: ScenarioId::Sweeps,
        title: format!(
            "backlog: {} sessions, {} partitions, {}-byte values",
            shape.sessions, shape.partitions, shape.value_size
        ),
        what: "A growth-sweep point: a backlog drained with a no-op handler.".into(),
        partitions: shape.partitions,
        sessions: shape.sessions,
        choice: Choice::RoundRobin,
        seed: 21,
        handler: Default::default(),
        retry_initial_ms: 1,
        retry_max_ms: 100,
        session_idle_ms: 30_000,
        backlog: Some(Backlog {
            records,
            cap_secs: BACKLOG_CAP_SECS,
            rounds: 1,
        }),
        paced: None,
        fault_free: None,
        systems: vec![SystemKind::Sessionflow, SystemKind::Sequential],
        memory: false,
        value_size: shape.value_size,
        point: Some(format!(
            "s{}-p{}-v{}",
            shape.sessions, shape.partitions, shape.value_size
        )),
    }
}

/// The latency sweep's base scenarios: P1 (no-op) and P2 (5 ms I/O) as `make bench` runs them.
fn load_bases(scale: f64) -> Vec<Scenario> {
    scenarios::all(scale)
        .into_iter()
        .filter(|s| matches!(s.id, ScenarioId::P1 | ScenarioId::P2))
        .collect()
}

/// `base`'s backlog, drained by sessionflow alone: the capacity the offered loads are
/// fractions of.
pub fn capacity_scenario(base: &Scenario) -> Scenario {
    Scenario {
        id: ScenarioId::Sweeps,
        title: format!("capacity: {:?}'s backlog", base.id),
        paced: None,
        fault_free: None,
        systems: vec![SystemKind::Sessionflow],
        point: Some(format!("{:?}-capacity", base.id).to_lowercase()),
        ..base.clone()
    }
}

/// The capacity runs of `base`: sessionflow's, and the Parallel Consumer's when `--systems`
/// asks for it, so that its latency is measured at fractions of its own capacity on the same
/// axes. PC's is one round, not `base`'s five: it drains P1's backlog at ~1 % of sessionflow's
/// rate, and five rounds would hit the 120 s cap five times.
pub fn capacity_scenarios(base: &Scenario, only: &[SystemKind]) -> Vec<Scenario> {
    let sessionflow = capacity_scenario(base);
    if !only.contains(&SystemKind::ParallelConsumer) {
        return vec![sessionflow];
    }
    let pc = Scenario {
        systems: vec![SystemKind::ParallelConsumer],
        point: Some(format!("{:?}-capacity-pc", base.id).to_lowercase()),
        backlog: sessionflow.backlog.as_ref().map(|b| Backlog {
            rounds: 1,
            ..b.clone()
        }),
        ..sessionflow.clone()
    };
    vec![sessionflow, pc]
}

/// `base`'s records offered by `system` at `fraction` of `capacity`, for `LOAD_SECS` (scaled).
pub fn load_scenario(
    base: &Scenario,
    system: SystemKind,
    capacity: f64,
    fraction: f64,
    scale: f64,
) -> Scenario {
    let pct = (fraction * 100.0).round() as u32;
    Scenario {
        id: ScenarioId::Sweeps,
        title: format!("{:?} at {pct} % of its capacity", base.id),
        backlog: None,
        paced: Some(paced(
            fraction * capacity,
            LOAD_SECS,
            LOAD_GRACE_SECS,
            scale,
        )),
        fault_free: None,
        systems: vec![system],
        point: Some(format!("{:?}-load-{pct}", base.id).to_lowercase()),
        ..base.clone()
    }
}

/// One backlog point's outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BacklogPoint {
    pub shape: Shape,
    pub outcome: Outcome,
}

/// One paced run of the latency sweep.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadPoint {
    /// Fraction of the capacity offered.
    pub fraction: f64,
    pub outcome: Outcome,
}

/// Latency against offered load, for one base scenario and one system.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadCurve {
    pub base: ScenarioId,
    pub system: SystemKind,
    /// Backlog throughput of the capacity run, msg/s.
    pub capacity: Option<f64>,
    pub points: Vec<LoadPoint>,
}

/// Everything the sweeps measured (results.json's `sweeps`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Sweeps {
    pub scale: f64,
    pub backlog: Vec<BacklogPoint>,
    /// The capacity runs (sessionflow's backlog of P1's and P2's records).
    pub capacity_runs: Vec<Outcome>,
    pub latency: Vec<LoadCurve>,
    /// Points that failed, with their error.
    pub failures: Vec<String>,
    pub wall_s: f64,
}

impl Sweeps {
    /// The points of `axis`, ascending.
    pub fn axis(&self, axis: Axis) -> Vec<&BacklogPoint> {
        let shapes = axis.shapes();
        let mut points: Vec<&BacklogPoint> = self
            .backlog
            .iter()
            .filter(|p| shapes.contains(&p.shape))
            .collect();
        points.sort_by(|a, b| axis.x(&a.shape).total_cmp(&axis.x(&b.shape)));
        points
    }
}

/// Which systems run a point whose own are `defaults` (`--systems`, `--sessionflow-output`).
pub struct Selection<'a> {
    pub only: &'a [SystemKind],
    pub with_output: bool,
}

impl Selection<'_> {
    fn apply(&self, mut sc: Scenario) -> Option<Scenario> {
        sc.systems = systems::select(&sc.systems, self.only, self.with_output);
        (!sc.systems.is_empty()).then_some(sc)
    }
}

async fn run_one(opts: &Options, sc: &Scenario, failures: &mut Vec<String>) -> Option<Outcome> {
    eprintln!("== sweeps: {}", sc.title);
    match scenarios::run(opts, sc).await {
        Ok(o) => Some(o),
        Err(e) => {
            eprintln!("sweep point {} failed: {e:#}", sc.slug());
            failures.push(format!("{}: {e:#}", sc.slug()));
            None
        }
    }
}

/// Runs every sweep at `scale`; a point that fails is recorded and the others still run.
pub async fn run(opts: &Options, scale: f64, selection: &Selection<'_>) -> Sweeps {
    let started = std::time::Instant::now();
    let mut out = Sweeps {
        scale,
        ..Default::default()
    };
    for shape in shapes() {
        let Some(sc) = selection.apply(backlog_scenario(&shape, scale)) else {
            continue;
        };
        if let Some(outcome) = run_one(opts, &sc, &mut out.failures).await {
            out.backlog.push(BacklogPoint { shape, outcome });
        }
    }
    let capacity_runs = load_bases(scale).into_iter().flat_map(|base| {
        capacity_scenarios(&base, selection.only)
            .into_iter()
            .map(move |sc| (base.clone(), sc))
    });
    for (base, sc) in capacity_runs {
        let Some(sc) = selection.apply(sc) else {
            continue;
        };
        let Some(capacity_run) = run_one(opts, &sc, &mut out.failures).await else {
            continue;
        };
        for s in &capacity_run.systems {
            let capacity = s.backlog.as_ref().and_then(|m| m.result.throughput());
            let mut curve = LoadCurve {
                base: base.id,
                system: s.system,
                capacity,
                points: Vec::new(),
            };
            let Some(capacity) = capacity else {
                out.failures.push(format!(
                    "{:?} capacity of {}: nothing drained",
                    base.id,
                    s.system.short()
                ));
                continue;
            };
            for fraction in LOAD_FRACTIONS {
                let sc = load_scenario(&base, s.system, capacity, fraction, scale);
                if let Some(outcome) = run_one(opts, &sc, &mut out.failures).await {
                    curve.points.push(LoadPoint { fraction, outcome });
                }
            }
            out.latency.push(curve);
        }
        out.capacity_runs.push(capacity_run);
    }
    out.wall_s = started.elapsed().as_secs_f64();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweeps_cover_the_issue_and_share_the_middle_point() {
        let all = shapes();
        // 4 session counts + 2 more partition counts + 1 more value size.
        assert_eq!(all.len(), 7);
        for axis in Axis::ALL {
            assert!(axis.shapes().contains(&MIDDLE), "{axis:?}");
        }
        let xs = |a: Axis| a.shapes().iter().map(|s| a.x(s)).collect::<Vec<_>>();
        assert_eq!(xs(Axis::Sessions), vec![10.0, 1e3, 1e5, 1e6]);
        assert_eq!(xs(Axis::Partitions), vec![1.0, 8.0, 64.0]);
        assert_eq!(xs(Axis::ValueSize), vec![100.0, 10_000.0]);
    }

    #[test]
    fn backlog_points_are_scenarios_with_names_of_their_own() {
        let sc = backlog_scenario(&MIDDLE, 1.0);
        assert_eq!(sc.backlog.as_ref().unwrap().records, 1_000_000);
        assert_eq!(sc.slug(), "sweeps-s1000-p8-v100");
        assert_eq!(
            sc.systems,
            vec![SystemKind::Sessionflow, SystemKind::Sequential]
        );
        let big = Shape {
            value_size: 10_000,
            ..MIDDLE
        };
        assert_eq!(backlog_records(&big, 1.0), 100_000);
        // --scale shrinks every point (never below 1,000 records).
        assert_eq!(backlog_records(&MIDDLE, 0.02), 20_000);
        assert_eq!(backlog_records(&big, 0.001), 1_000);
    }

    #[test]
    fn the_parallel_consumer_gets_a_capacity_run_of_its_own_only_when_asked() {
        let p1 = load_bases(1.0).remove(0);
        assert_eq!(p1.id, ScenarioId::P1);
        let alone = capacity_scenarios(&p1, &[]);
        assert_eq!(alone.len(), 1);
        assert_eq!(alone[0].systems, vec![SystemKind::Sessionflow]);
        let both = capacity_scenarios(
            &p1,
            &[SystemKind::Sessionflow, SystemKind::ParallelConsumer],
        );
        assert_eq!(both.len(), 2);
        let pc = &both[1];
        assert_eq!(pc.systems, vec![SystemKind::ParallelConsumer]);
        assert_eq!(pc.backlog.as_ref().unwrap().rounds, 1);
        assert_ne!(pc.slug(), both[0].slug());
        // Its records are P1's, as sessionflow's are; sessionflow keeps P1's rounds.
        let records = |s: &Scenario| s.backlog.as_ref().unwrap().records;
        assert_eq!(records(pc), records(&both[0]));
        assert_eq!(
            both[0].backlog.as_ref().unwrap().rounds,
            p1.backlog.as_ref().unwrap().rounds
        );
        // The selection runs each on its own: PC is not added to sessionflow's run.
        let selection = Selection {
            only: &[SystemKind::Sessionflow, SystemKind::ParallelConsumer],
            with_output: false,
        };
        let systems: Vec<_> = both
            .into_iter()
            .filter_map(|sc| selection.apply(sc))
            .map(|sc| sc.systems)
            .collect();
        assert_eq!(
            systems,
            vec![
                vec![SystemKind::Sessionflow],
                vec![SystemKind::ParallelConsumer]
            ]
        );
    }

    #[test]
    fn offered_loads_are_fractions_of_the_capacity() {
        let bases = load_bases(1.0);
        assert_eq!(bases.len(), 2);
        let p2 = bases.iter().find(|b| b.id == ScenarioId::P2).unwrap();
        let cap = capacity_scenario(p2);
        assert!(cap.paced.is_none() && cap.backlog.is_some());
        assert_eq!(cap.handler.io_ms, 5);
        let sc = load_scenario(p2, SystemKind::Sessionflow, 100_000.0, 0.8, 1.0);
        let p = sc.paced.unwrap();
        assert_eq!(p.rate, Some(80_000.0));
        assert_eq!(p.records, 800_000);
        assert!(sc.backlog.is_none());
        assert_eq!(sc.point.as_deref(), Some("p2-load-80"));
    }
}
