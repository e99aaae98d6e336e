//! The four systems a scenario runs against, each in its own child process.
//!
//! Each system gets the same records, the same bench handler ([`crate::handler::Core`]), the
//! same retry policy and the same consumer settings; they differ only in how records travel
//! from librdkafka to the handler:
//! - [`ceiling`]: one librdkafka consumer and a poll loop that only measures — the rate no
//!   consumer design on this broker and machine can beat;
//! - [`sessionflow`]: the engine, in-process through its library API, with the bench handler;
//! - [`sequential`]: the classic design — one task per partition, one record at a time, retries
//!   in place, so a slow or failing record holds up its whole partition;
//! - [`pool`]: the seed's first design — sessions hashed onto a fixed pool of workers, each
//!   working through its queue one record at a time with retries inside the worker, so a
//!   failing session holds up every session that shares its worker.

pub mod ceiling;
pub mod pool;
pub mod sequential;
pub mod sessionflow;

use std::sync::Arc;

use futures::future::BoxFuture;
use rdkafka::config::ClientConfig;
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use sessionflow_worker::retry::RetryPolicy;

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
    Sequential,
    Pool,
}

impl SystemKind {
    pub const ALL: [SystemKind; 4] = [
        SystemKind::Ceiling,
        SystemKind::Sessionflow,
        SystemKind::Sequential,
        SystemKind::Pool,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::Ceiling => "raw consumer (ceiling)",
            Self::Sessionflow => "sessionflow",
            Self::Sequential => "per-partition sequential",
            Self::Pool => "flat worker pool",
        }
    }

    pub fn short(self) -> &'static str {
        match self {
            Self::Ceiling => "ceiling",
            Self::Sessionflow => "sessionflow",
            Self::Sequential => "sequential",
            Self::Pool => "pool",
        }
    }
}

/// Where and how a system consumes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SystemSettings {
    pub brokers: String,
    pub topic: String,
    /// sessionflow's dead-letter topic (nothing goes there: retries are unlimited).
    pub dlq: String,
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

/// librdkafka settings every system's consumer uses (sessionflow gets them as `kafka:` extras).
pub fn common_kafka(settings: &SystemSettings) -> Vec<(&'static str, String)> {
    vec![
        // nisshi's long poll does not wake when records arrive: an empty fetch re-reads after
        // half the time left, then half again…, so this bounds every system's latency floor.
        ("fetch.wait.max.ms", settings.fetch_wait_ms.to_string()),
        ("queued.max.messages.kbytes", "16384".to_string()),
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
    c
}

/// A started system.
pub struct Running {
    stop: Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>,
    /// Session tasks alive (sessionflow only).
    pub active_sessions: Option<Box<dyn Fn() -> i64 + Send + Sync>>,
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
        SystemKind::Sessionflow => sessionflow::start(settings, core).await,
        SystemKind::Sequential => sequential::start(settings, core),
        SystemKind::Pool => pool::start(settings, core),
    }
}
