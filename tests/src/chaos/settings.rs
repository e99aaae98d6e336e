//! The knobs of a chaos run, read from the environment (`make chaos` passes them through).

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sessionflow_worker::config::Delivery;

use crate::schedule::ClusterKind;

/// Environment variables and their defaults, for `--help`-like messages.
pub const HELP: &str = "\
CHAOS_CLUSTER   kafka (3 nodes of Apache Kafka, scripts/kafka.sh, behind toxiproxy) or mock
                (librdkafka's mock cluster in this process) (default kafka)
CHAOS_KAFKA_PORT  first port of the Kafka cluster: nodes on P..P+11, toxiproxy's API on P+12
                (default 19300)
CHAOS_DELIVERY  the workers' delivery: atLeastOnce (default) or exactlyOnce (Kafka only; the
                verdict then also requires 0 stale ends and no duplicate the input lacks in the committed
                output, which verify reads read_committed)
CHAOS_SEED      seed of the schedule, the load and the handler's faults (default: now, printed)
CHAOS_SECONDS   length of the fault phase (default 120)
CHAOS_RATE      records per second the load generator writes (default 150)
CHAOS_SESSIONS  sessions of the load (default 1000)
CHAOS_SLOW_MS   how long the 1% slow first attempts take, against a 500 ms drain (default 3000;
                0 leaves slowRate/slowMs out of the worker config, for workers without them)
CHAOS_DIR       where configs and worker logs go (default .local/chaos/seed-<seed>, or
                seed-<seed>.2, .3… when an earlier run of the seed is there)
CHAOS_WORKER    the worker binary (default: sessionflow-worker next to this binary)
CHAOS_WORKER_LOG  RUST_LOG of the workers (default info)";

pub struct Settings {
    pub cluster: ClusterKind,
    /// First port of the Kafka cluster (`scripts/kafka.sh --port`).
    pub kafka_port: u16,
    /// The workers' `delivery`.
    pub delivery: Delivery,
    pub seed: u64,
    pub seconds: u64,
    pub rate: f64,
    pub sessions: u64,
    /// Extra time of the slow first attempts; 0: none.
    pub slow_ms: u64,
    pub dir: PathBuf,
    pub worker: PathBuf,
    /// How long the end of the run waits for committed offsets to reach the end offsets.
    pub settle: Duration,
}

impl Settings {
    pub fn from_env() -> anyhow::Result<Self> {
        let seed = match var("CHAOS_SEED") {
            Some(s) => s.parse()?,
            None => SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs(),
        };
        let dir = match var("CHAOS_DIR") {
            Some(d) => PathBuf::from(d),
            None => fresh_dir(&format!(".local/chaos/seed-{seed}")),
        };
        // Absolute, so that the workers' command lines (`run --config <dir>/…`) name this
        // checkout: `make chaos` kills the workers a dead harness left by that path, and no
        // other checkout's.
        let dir = std::path::absolute(&dir)?;
        let worker = match var("CHAOS_WORKER") {
            Some(w) => PathBuf::from(w),
            None => std::env::current_exe()?
                .parent()
                .expect("a binary lives in a directory")
                .join("sessionflow-worker"),
        };
        anyhow::ensure!(
            worker.exists(),
            "{} not found: build it first (`cargo build -p sessionflow-worker`; `make chaos` \
             does) or name it in CHAOS_WORKER",
            worker.display()
        );
        let cluster = match var("CHAOS_CLUSTER") {
            Some(c) => c
                .trim()
                .parse()
                .map_err(|e| anyhow::anyhow!("CHAOS_CLUSTER: {e}"))?,
            None => ClusterKind::Kafka,
        };
        let delivery = match var("CHAOS_DELIVERY").as_deref().map(str::trim) {
            None | Some("atLeastOnce") => Delivery::AtLeastOnce,
            Some("exactlyOnce") => Delivery::ExactlyOnce,
            Some(other) => anyhow::bail!("CHAOS_DELIVERY={other}: atLeastOnce or exactlyOnce"),
        };
        anyhow::ensure!(
            !(delivery == Delivery::ExactlyOnce && cluster == ClusterKind::Mock),
            "CHAOS_DELIVERY=exactlyOnce needs CHAOS_CLUSTER=kafka: the mock cluster has no \
             transactions"
        );
        Ok(Self {
            cluster,
            delivery,
            kafka_port: parse_or("CHAOS_KAFKA_PORT", 19_300)?,
            seed,
            seconds: parse_or("CHAOS_SECONDS", 120)?,
            rate: parse_or("CHAOS_RATE", 150.0)?,
            sessions: parse_or("CHAOS_SESSIONS", 1_000)?,
            slow_ms: parse_or("CHAOS_SLOW_MS", 3_000)?,
            dir,
            worker,
            settle: Duration::from_secs(180),
        })
    }
}

/// `base`, or `base.2`, `base.3`… when a run of the same seed left its logs there.
fn fresh_dir(base: &str) -> PathBuf {
    (1..)
        .map(|n| match n {
            1 => PathBuf::from(base),
            n => PathBuf::from(format!("{base}.{n}")),
        })
        .find(|d| !d.exists())
        .expect("some name is free")
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn parse_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    match var(name) {
        None => Ok(default),
        Some(v) => v
            .trim()
            .parse()
            .map_err(|e| anyhow::anyhow!("{name}={v}: {e}")),
    }
}
