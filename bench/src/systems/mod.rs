//! The four systems a scenario runs against, each in its own child process.
//!
//! Each system gets the same records, the same bench handler ([`crate::handler::Core`]), the
//! same retry policy and the same consumer settings; they differ only in how records travel
//! from librdkafka to the handler:
//! - [`ceiling`]: one librdkafka consumer and a poll loop that only measures — the rate no
//!   consumer design on this broker and machine can beat;
//! - [`sessionflow`]: the engine, in-process through its library API, with the bench handler;
//!   a terminal stage, like the baselines. Selected on request (`--systems sessionflow-output`
//!   or `--sessionflow-output`), *sessionflow + output* is the same engine as a stage with an
//!   output topic (created and deleted per run): the handler returns the input value and the
//!   engine writes it, so the run pays for one output record per input record — and for the
//!   session waiting for its acknowledgement before its next record;
//! - [`sequential`]: the classic design — one task per partition, one record at a time, retries
//!   in place, so a slow or failing record holds up its whole partition;
//! - [`pool`]: the seed's first design — sessions hashed onto a fixed pool of workers, each
//!   working through its queue one record at a time with retries inside the worker, so a
//!   failing session holds up every session that shares its worker;
//! - *sessionflow (exactlyOnce)* and *sessionflow (atLeastOnce, 100 ms)* (on request:
//!   `--systems sessionflow-eos,sessionflow-alo100`): the same terminal stage as
//!   [`sessionflow`] with `delivery: exactlyOnce` (a transactional producer per input partition,
//!   the partition's offsets committed in a transaction) or left at `atLeastOnce`, both at a
//!   100 ms commit interval (sessionflow's own row commits every 1,000 ms), so the cost of
//!   exactlyOnce is read at equal commit intervals;
//! - [`parallel_consumer`] (on request: `--systems …,parallel-consumer`): the Confluent Parallel
//!   Consumer in KEY ordering, a JVM of its own that this child starts and reads its
//!   measurements from (the one system not in the child's own process); and, on request
//!   (`parallel-consumer-tx`), the same in its transactional commit mode at a 100 ms commit
//!   interval, the row to read next to *sessionflow (exactlyOnce)*.

pub mod ceiling;
pub mod parallel_consumer;
pub mod pool;
pub mod sequential;
pub mod sessionflow;

use std::sync::Arc;

use futures::future::BoxFuture;
use rdkafka::config::ClientConfig;
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use sessionflow_worker::session::retry::RetryPolicy;

use crate::handler::Core;

#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
pub enum SystemKind {
    Ceiling,
    Sessionflow,
    /// sessionflow as a stage with an output topic (not in [`SystemKind::ALL`]: on request).
    SessionflowOutput,
    /// sessionflow with `delivery: exactlyOnce` at a 100 ms commit interval (on request).
    SessionflowEos,
    /// sessionflow (atLeastOnce) at a 100 ms commit interval, the exactlyOnce row's yardstick
    /// (on request).
    SessionflowAlo100,
    Sequential,
    Pool,
    /// The Confluent Parallel Consumer, KEY ordering (not in [`SystemKind::ALL`]: on request,
    /// it needs Java and Maven).
    ParallelConsumer,
    /// The Parallel Consumer in its transactional commit mode (`PERIODIC_TRANSACTIONAL_PRODUCER`)
    /// at a 100 ms commit interval (on request), next to sessionflow's exactlyOnce.
    ParallelConsumerTx,
}

impl SystemKind {
    /// The systems every scenario runs by default (`make bench`).
    pub const ALL: [SystemKind; 4] = [
        SystemKind::Ceiling,
        SystemKind::Sessionflow,
        SystemKind::Sequential,
        SystemKind::Pool,
    ];

    /// Every system, in the order reports and charts list them.
    pub const EVERY: [SystemKind; 9] = [
        SystemKind::Ceiling,
        SystemKind::Sessionflow,
        SystemKind::SessionflowOutput,
        SystemKind::SessionflowAlo100,
        SystemKind::SessionflowEos,
        SystemKind::Sequential,
        SystemKind::Pool,
        SystemKind::ParallelConsumer,
        SystemKind::ParallelConsumerTx,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::Ceiling => "raw consumer (ceiling)",
            Self::Sessionflow => "sessionflow",
            Self::SessionflowOutput => "sessionflow + output",
            Self::SessionflowEos => "sessionflow (exactlyOnce, 100 ms)",
            Self::SessionflowAlo100 => "sessionflow (atLeastOnce, 100 ms)",
            Self::Sequential => "per-partition sequential",
            Self::Pool => "flat worker pool",
            Self::ParallelConsumer => "Parallel Consumer (KEY)",
            Self::ParallelConsumerTx => "Parallel Consumer (KEY, transactional, 100 ms)",
        }
    }

    /// The commit interval and whether the commits are transactional, of sessionflow's
    /// variants and the Parallel Consumer's: `None` for the others.
    pub fn commit(self) -> Option<(u64, bool)> {
        match self {
            Self::Sessionflow | Self::SessionflowOutput => Some((1_000, false)),
            Self::SessionflowAlo100 => Some((100, false)),
            Self::SessionflowEos | Self::ParallelConsumerTx => Some((100, true)),
            Self::ParallelConsumer => Some((1_000, false)),
            _ => None,
        }
    }

    /// The Parallel Consumer, in either commit mode.
    pub fn is_parallel_consumer(self) -> bool {
        matches!(self, Self::ParallelConsumer | Self::ParallelConsumerTx)
    }

    pub fn short(self) -> &'static str {
        match self {
            Self::Ceiling => "ceiling",
            Self::Sessionflow => "sessionflow",
            Self::SessionflowOutput => "sessionflow-output",
            Self::SessionflowEos => "sessionflow-eos",
            Self::SessionflowAlo100 => "sessionflow-alo100",
            Self::Sequential => "sequential",
            Self::Pool => "pool",
            Self::ParallelConsumer => "parallel-consumer",
            Self::ParallelConsumerTx => "parallel-consumer-tx",
        }
    }
}

/// The systems to run for a scenario whose own are `defaults`: sessionflow + output next to
/// sessionflow when it is asked for (`with_output`, or named in `only`), the Parallel Consumer
/// last when named in `only` and the scenario compares designs (its defaults have the
/// per-partition sequential consumer: not P5's memory probe, which needs session counts), then
/// only those named in `only` (all when empty; `with_output` keeps sessionflow + output in).
pub fn select(defaults: &[SystemKind], only: &[SystemKind], with_output: bool) -> Vec<SystemKind> {
    let output = SystemKind::SessionflowOutput;
    let mut systems = Vec::with_capacity(defaults.len() + 2);
    for &s in defaults {
        systems.push(s);
        if s == SystemKind::Sessionflow
            && (with_output || only.contains(&output))
            && !defaults.contains(&output)
        {
            systems.push(output);
        }
        if s == SystemKind::Sessionflow {
            for v in [SystemKind::SessionflowAlo100, SystemKind::SessionflowEos] {
                if only.contains(&v) && !defaults.contains(&v) {
                    systems.push(v);
                }
            }
        }
    }
    for pc in [SystemKind::ParallelConsumer, SystemKind::ParallelConsumerTx] {
        if only.contains(&pc)
            && defaults.contains(&SystemKind::Sequential)
            && !systems.contains(&pc)
        {
            systems.push(pc);
        }
    }
    if !only.is_empty() {
        systems.retain(|s| only.contains(s) || (with_output && *s == output));
    }
    systems
}

/// Where and how a system consumes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SystemSettings {
    pub brokers: String,
    pub topic: String,
    /// sessionflow's dead-letter topic (nothing goes there: retries are unlimited).
    pub dlq: String,
    /// sessionflow + output's output topic (one per run); `None`: a terminal stage.
    #[serde(default)]
    pub output: Option<String>,
    pub group: String,
    pub partitions: i32,
    pub retry_initial_ms: u64,
    pub retry_max_ms: u64,
    pub pool_workers: usize,
    pub pool_queue: usize,
    pub session_idle_ms: u64,
    /// Install the worker binary's telemetry (tracing subscriber + OpenTelemetry layer).
    pub telemetry: bool,
    /// librdkafka's `fetch.wait.max.ms`, for every system.
    pub fetch_wait_ms: u64,
    /// Extra librdkafka properties for sessionflow's stage (`--sessionflow-kafka`).
    #[serde(default)]
    pub sessionflow_kafka: Vec<(String, String)>,
    /// sessionflow's `commitIntervalMs`, the Parallel Consumer's `commitInterval` (1,000 unless
    /// the variant says otherwise).
    #[serde(default = "default_commit_interval_ms")]
    pub commit_interval_ms: u64,
    /// sessionflow's `delivery: exactlyOnce` (the `sessionflow-eos` variant), the Parallel
    /// Consumer's transactional commit mode (`parallel-consumer-tx`).
    #[serde(default)]
    pub exactly_once: bool,
    /// sessionflow's `maxInFlightPerPartition`, PC's per-partition budget; `None`: the
    /// worker's default.
    #[serde(default)]
    pub max_in_flight_per_partition: Option<usize>,
    /// A cap on the Parallel Consumer's worker threads; `None`: sessionflow's budget.
    #[serde(default)]
    pub pc_max_concurrency: Option<usize>,
}

fn default_commit_interval_ms() -> u64 {
    1_000
}

impl SystemSettings {
    pub fn retry(&self) -> RetryPolicy {
        RetryPolicy {
            initial: std::time::Duration::from_millis(self.retry_initial_ms),
            max: std::time::Duration::from_millis(self.retry_max_ms),
            multiplier: 2.0,
            max_attempts: 0,
        }
    }

    /// Every partition of the topic, from the beginning.
    pub fn assignment(&self) -> anyhow::Result<TopicPartitionList> {
        let mut tpl = TopicPartitionList::new();
        for p in 0..self.partitions {
            tpl.add_partition_offset(&self.topic, p, Offset::Beginning)?;
        }
        Ok(tpl)
    }
}

/// What each baseline may prefetch per partition queue, KiB (librdkafka's
/// `queued.max.messages.kbytes` applies to each split queue). sessionflow does not take it: its
/// `prefetchKbytes` is a total per worker, left at its default.
pub const PREFETCH_KBYTES: u64 = 16_384;
pub const PREFETCH_KEY: &str = "queued.max.messages.kbytes";
/// Left at librdkafka's default (100,000 per queue) for the baselines; for sessionflow,
/// `--sessionflow-kafka queued.min.messages=N` sets `prefetchRecords`.
pub const PREFETCH_RECORDS_KEY: &str = "queued.min.messages";

/// librdkafka settings every system's consumer uses (sessionflow gets them as `kafka:` extras).
pub fn common_kafka(settings: &SystemSettings) -> Vec<(&'static str, String)> {
    vec![
        // nisshi's long poll does not wake when records arrive: an empty fetch re-reads after
        // half the time left, then half again…, so this bounds every system's latency floor.
        ("fetch.wait.max.ms", settings.fetch_wait_ms.to_string()),
        (PREFETCH_KEY, PREFETCH_KBYTES.to_string()),
    ]
}

/// A baseline consumer: manual assignment of every partition, nothing auto-stored.
pub fn baseline_consumer(settings: &SystemSettings, auto_commit: bool) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &settings.brokers)
        .set("group.id", &settings.group)
        .set("auto.offset.reset", "earliest")
        .set(
            "enable.auto.commit",
            if auto_commit { "true" } else { "false" },
        )
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false");
    for (k, v) in common_kafka(settings) {
        c.set(k, v);
    }
    for (k, v) in baseline_queue_settings(settings.partitions) {
        c.set(k, v);
    }
    c
}

/// What sessionflow gives librdkafka for each partition queue besides the bytes, given to the
/// baselines too: the comparison is of what each system does with the records, not of
/// librdkafka's defaults. With them (a second's fetch back-off at a full queue, 100,000 records
/// per queue), the sequential consumer drained P1 at ~500k msg/s with a 210–290 MiB peak; with
/// these, at ~640k with ~135 MiB (see the notes).
pub fn baseline_queue_settings(partitions: i32) -> [(&'static str, String); 2] {
    use sessionflow_worker::config::defaults;
    use sessionflow_worker::intake::prefetch::{Prefetch, FETCH_QUEUE_BACKOFF_MS};
    // The engine's own share, as its consumer gets it for this many partitions.
    let engine = Prefetch::new(
        defaults::prefetch_kbytes(),
        defaults::prefetch_records(),
        usize::try_from(partitions).ok(),
    );
    [
        ("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS.to_string()),
        ("queued.min.messages", engine.share_records().to_string()),
    ]
}

/// A started system.
pub struct Running {
    stop: Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>,
    /// Sessions known, with a task or parked, until reaped (sessionflow only).
    pub sessions: Option<Box<dyn Fn() -> i64 + Send + Sync>>,
    /// The process the system runs in when it is not this one (the Parallel Consumer's JVM):
    /// its CPU and RSS are the run's.
    pub pid: Option<u32>,
    /// Tells a system in another process when the paced load started (µs since the epoch).
    pub go: Option<Box<dyn Fn(u64) + Send + Sync>>,
}

impl Running {
    pub async fn stop(self) {
        (self.stop)().await
    }
}

pub async fn start(
    kind: SystemKind,
    settings: &SystemSettings,
    core: Arc<Core>,
) -> anyhow::Result<Running> {
    match kind {
        SystemKind::Ceiling => ceiling::start(settings, core),
        SystemKind::Sessionflow
        | SystemKind::SessionflowOutput
        | SystemKind::SessionflowEos
        | SystemKind::SessionflowAlo100 => sessionflow::start(settings, core).await,
        SystemKind::Sequential => sequential::start(settings, core),
        SystemKind::Pool => pool::start(settings, core),
        SystemKind::ParallelConsumer | SystemKind::ParallelConsumerTx => {
            parallel_consumer::start(settings, core).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SystemKind::*;

    #[test]
    fn sessionflow_output_runs_only_on_request_next_to_sessionflow() {
        let all = SystemKind::ALL;
        assert_eq!(select(&all, &[], false), all.to_vec());
        assert_eq!(
            select(&all, &[], true),
            vec![Ceiling, Sessionflow, SessionflowOutput, Sequential, Pool]
        );
        assert_eq!(
            select(&all, &[SessionflowOutput], false),
            vec![SessionflowOutput]
        );
        assert_eq!(select(&all, &[Sessionflow], false), vec![Sessionflow]);
        assert_eq!(
            select(&all, &[Sessionflow], true),
            vec![Sessionflow, SessionflowOutput]
        );
        assert_eq!(
            select(&all, &[Sessionflow, SessionflowOutput], false),
            vec![Sessionflow, SessionflowOutput]
        );
        // P5 runs sessionflow only; a scenario without sessionflow gets no output variant.
        assert_eq!(
            select(&[Sessionflow], &[], true),
            vec![Sessionflow, SessionflowOutput]
        );
        assert_eq!(select(&[Pool], &[SessionflowOutput], false), vec![]);
    }

    #[test]
    fn the_parallel_consumer_runs_only_on_request_and_never_in_the_memory_probe() {
        let all = SystemKind::ALL;
        assert!(!select(&all, &[], false).contains(&ParallelConsumer));
        assert!(!select(&all, &[], true).contains(&ParallelConsumer));
        assert_eq!(
            select(&all, &[Sessionflow, Sequential, ParallelConsumer], false),
            vec![Sessionflow, Sequential, ParallelConsumer]
        );
        assert_eq!(
            select(&[Sessionflow, Sequential], &[ParallelConsumer], false),
            vec![ParallelConsumer]
        );
        // P5 (sessionflow only, a memory probe) does not get it.
        assert_eq!(
            select(&[Sessionflow], &[Sessionflow, ParallelConsumer], false),
            vec![Sessionflow]
        );
    }

    #[test]
    fn the_commit_interval_variants_run_only_on_request_next_to_sessionflow() {
        let all = SystemKind::ALL;
        assert!(!select(&all, &[], true).contains(&SessionflowEos));
        assert!(!select(&all, &[], true).contains(&SessionflowAlo100));
        assert_eq!(
            select(
                &all,
                &[Sessionflow, SessionflowEos, SessionflowAlo100],
                false
            ),
            vec![Sessionflow, SessionflowAlo100, SessionflowEos]
        );
        assert_eq!(select(&all, &[SessionflowEos], false), vec![SessionflowEos]);
        assert_eq!(select(&[Pool], &[SessionflowEos], false), vec![]);
        assert_eq!(SessionflowEos.commit(), Some((100, true)));
        assert_eq!(SessionflowAlo100.commit(), Some((100, false)));
        assert_eq!(Sessionflow.commit(), Some((1_000, false)));
        assert_eq!(ParallelConsumer.commit(), Some((1_000, false)));
        assert_eq!(ParallelConsumerTx.commit(), Some((100, true)));
        assert_eq!(Pool.commit(), None);
    }
}
