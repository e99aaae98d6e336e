//! The stage configuration: one YAML file per worker process.
//!
//! Keys are camelCase and carry the same names as a stage of the `SessionPipeline` custom
//! resource, so the operator can render this file from the resource without translation; the
//! settings a pipeline may also set for all its stages are one type, [`StageSettings`], that
//! both this file and the resource flatten in. A bad
//! file must stop the worker before it touches Kafka, with a message that names the key: parse
//! errors carry their path (`retry.multiplier: invalid type …`) and [`StageConfig::validate`]
//! checks what types cannot (ranges, topic relations).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use crate::record::SessionSource;

/// One stage of a pipeline, as the worker runs it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StageConfig {
    /// Bootstrap servers, `host:port[,host:port…]`. `--brokers` overrides it.
    #[serde(default)]
    pub brokers: String,
    /// Consumer group; defaults to `sessionflow-<stage>`.
    #[serde(default)]
    pub group: Option<String>,
    /// Stage name: used in metrics, DLQ headers and the default group.
    pub stage: String,
    /// Topic this stage consumes.
    pub input: String,
    /// Topic this stage produces results to; none for a terminal stage.
    #[serde(default)]
    pub output: Option<String>,
    /// Dead-letter topic for poison records and records that exhausted their retries.
    pub dlq: String,
    /// What processes a record.
    pub handler: HandlerConfig,
    /// The settings a pipeline may also set for all its stages (`session`, `retry`, `stuck`,
    /// `commitIntervalMs`, `shutdownTimeoutMs`, `delivery`), at this level of the file.
    #[serde(flatten)]
    pub settings: StageSettings,
    /// How partitions move between workers of the group.
    #[serde(default)]
    pub rebalance: RebalanceConfig,
    /// Number of dispatcher tasks the sessions are hashed onto.
    #[serde(default = "defaults::dispatchers")]
    pub dispatchers: usize,
    /// Records handed to each dispatcher and not yet taken by it, at most; full means
    /// backpressure (the records' partitions are held until the dispatcher has room).
    #[serde(default = "defaults::dispatcher_capacity")]
    pub dispatcher_capacity: usize,
    /// A session with nothing to do for this long is forgotten (its order watch and recent
    /// event ids); its task ends sooner, after 250 ms with nothing to do.
    #[serde(default = "defaults::session_idle_ms")]
    pub session_idle_ms: u64,
    /// Records of one partition between the committed watermark and the newest record taken
    /// in (unfinished ones and finished ones above an unfinished one); beyond it the partition
    /// is held (takes no records). It bounds memory and what a crash can replay. The span counts
    /// from the last commit the broker confirmed, so a partition advances at most this many
    /// records per offset-commit round trip (~6 ms on Apache Kafka 4.1 with its default
    /// `group.coordinator.append.linger.ms` of 5 ms): keep it well above that round trip times
    /// the partition's rate (125 held a no-op stage to ~76,000 msg/s over 8 partitions).
    #[serde(default = "defaults::max_in_flight_per_partition")]
    pub max_in_flight_per_partition: usize,
    /// KiB of records librdkafka may fetch ahead for this worker, in total over its assigned
    /// partitions: each partition's queue gets an equal share (at least 64 KiB) by the input
    /// topic's partition count when the worker starts, and a fetch answer carries at most one
    /// share (at least `message.max.bytes`), so the queues hold at most twice this (see
    /// `prefetch`). Replaces
    /// `kafka.queued.max.messages.kbytes`, which librdkafka applies per partition once each
    /// partition has its own queue.
    #[serde(default = "defaults::prefetch_kbytes")]
    pub prefetch_kbytes: u64,
    /// Records librdkafka may fetch ahead for this worker, in total over its assigned
    /// partitions, shared like `prefetchKbytes`: librdkafka keeps a few hundred bytes of its
    /// own per queued record, so for small records this is what bounds the memory. Replaces
    /// `kafka.queued.min.messages` (100,000 per partition queue by default).
    #[serde(default = "defaults::prefetch_records")]
    pub prefetch_records: u64,
    /// How often the lag of the assigned partitions is read from the broker.
    #[serde(default = "defaults::lag_interval_ms")]
    pub lag_interval_ms: u64,
    /// At shutdown, also process the records queued behind each session's current one. By
    /// default a session finishes the record it is working on and releases the rest to the
    /// partition's next owner, so a rolling restart takes about one handler call.
    #[serde(default)]
    pub shutdown_drain_queued: bool,
    /// Address of `/metrics`, `/healthz` and `/readyz`; none disables the server.
    #[serde(default = "defaults::metrics_addr")]
    pub metrics_addr: Option<SocketAddr>,
    /// OTLP/HTTP traces endpoint (e.g. `http://collector:4318/v1/traces`); none: no export.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// Extra librdkafka properties for the consumer and the producers, passed through.
    #[serde(default)]
    pub kafka: BTreeMap<String, String>,
}

/// How a stage's results reach Kafka.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum Delivery {
    /// Each result written once acknowledged; a crash or a handover replays what was in flight.
    #[default]
    AtLeastOnce,
    /// Outputs, dead letters and offsets committed together in a transaction per input
    /// partition; a zombie owner is fenced by the broker. Needs Apache Kafka ≥ 2.5.
    ExactlyOnce,
}

/// The settings a stage and a pipeline's defaults both have, written once: flattened into the
/// worker's [`StageConfig`] and into the `SessionPipeline` resource's stages and spec (same
/// camelCase keys at the same level everywhere). Each is unset unless written, so the
/// operator can lay a stage's own values over its pipeline's ([`StageSettings::over`]); the
/// worker's default fills what neither sets (the accessors, e.g. [`StageSettings::retry`]).
///
/// No schema defaults on purpose: on Kubernetes the API server would fill them in at both
/// levels, and a stage would then always hide its pipeline's value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct StageSettings {
    /// Where the session id of a record comes from (default: the record key). On a stage it
    /// overrides `spec.session`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionSource>,
    /// In-place retries of transient failures. On a stage it overrides `spec.retry`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryConfig>,
    /// What happens to a record whose handler does not finish in time. On a stage it overrides
    /// `spec.stuck`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stuck: Option<StuckConfig>,
    /// How often the contiguous watermark is committed (default 1000). On a stage it overrides
    /// `spec.commitIntervalMs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub commit_interval_ms: Option<u64>,
    /// How long a shutdown waits for sessions to finish before giving up on the rest (default
    /// 20000). On a stage it overrides `spec.shutdownTimeoutMs`. On Kubernetes the pods'
    /// `terminationGracePeriodSeconds` follows it: shutdown timeout + 3 × drain timeout + 50 s
    /// (the shutdown fence, commits, the worker's close, slack).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub shutdown_timeout_ms: Option<u64>,
    /// `atLeastOnce` (the default) or `exactlyOnce`: outputs, dead letters and the input
    /// offsets in one Kafka transaction per input partition (docs/exactly-once.md). On a stage
    /// it overrides `spec.delivery`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Delivery>,
}

impl StageSettings {
    /// `self`, with what it leaves unset taken from `defaults`, field by field: a stage's
    /// settings over its pipeline's, or anything over [`StageSettings::worker_defaults`].
    pub fn over(&self, defaults: &StageSettings) -> StageSettings {
        let StageSettings {
            session,
            retry,
            stuck,
            commit_interval_ms,
            shutdown_timeout_ms,
            delivery,
        } = self;
        StageSettings {
            session: session.clone().or_else(|| defaults.session.clone()),
            retry: retry.or(defaults.retry),
            stuck: stuck.or(defaults.stuck),
            commit_interval_ms: commit_interval_ms.or(defaults.commit_interval_ms),
            shutdown_timeout_ms: shutdown_timeout_ms.or(defaults.shutdown_timeout_ms),
            delivery: delivery.or(defaults.delivery),
        }
    }

    /// Every setting at the worker's default.
    pub fn worker_defaults() -> StageSettings {
        StageSettings {
            session: Some(SessionSource::default()),
            retry: Some(RetryConfig::default()),
            stuck: Some(StuckConfig::default()),
            commit_interval_ms: Some(defaults::commit_interval_ms()),
            shutdown_timeout_ms: Some(defaults::shutdown_timeout_ms()),
            delivery: Some(Delivery::default()),
        }
    }

    /// Where the session id comes from, the default if unset.
    pub fn session(&self) -> SessionSource {
        self.session.clone().unwrap_or_default()
    }

    /// The retry policy, the default if unset.
    pub fn retry(&self) -> RetryConfig {
        self.retry.unwrap_or_default()
    }

    /// The stuck-record policy, the default if unset.
    pub fn stuck(&self) -> StuckConfig {
        self.stuck.unwrap_or_default()
    }

    /// How results reach Kafka, `atLeastOnce` if unset.
    pub fn delivery(&self) -> Delivery {
        self.delivery.unwrap_or_default()
    }

    /// The commit interval, the default if unset.
    pub fn commit_interval_ms(&self) -> u64 {
        self.commit_interval_ms
            .unwrap_or_else(defaults::commit_interval_ms)
    }

    /// The shutdown timeout, the default if unset.
    pub fn shutdown_timeout_ms(&self) -> u64 {
        self.shutdown_timeout_ms
            .unwrap_or_else(defaults::shutdown_timeout_ms)
    }
}

/// The stage's handler: exactly one of `http` or `builtin`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum HandlerConfig {
    Http(HttpHandlerConfig),
    Builtin(BuiltinHandlerConfig),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpHandlerConfig {
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub url: String,
    #[serde(default = "defaults::http_timeout_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub timeout_ms: u64,
}

/// Pass-through with deterministic fault injection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BuiltinHandlerConfig {
    /// Fraction of attempts that fail transiently, in [0, 1).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 1.0)))]
    pub transient_rate: f64,
    /// Fraction of records that are poison, in [0, 1].
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 1.0)))]
    pub poison_rate: f64,
    /// Simulated work per attempt.
    #[serde(default)]
    pub latency_ms: u64,
    /// Fraction of records whose *first* attempt is slow (an LLM call that outlasts a
    /// rebalance drain), in [0, 1]; drawn per event id and worker process, so a record
    /// redone by another worker is usually quick.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 1.0)))]
    pub slow_rate: f64,
    /// How long a slow first attempt takes (on top of `latencyMs`).
    #[serde(default)]
    pub slow_ms: u64,
    /// Seed of the fault draws; the same seed gives the same faults for the same records.
    #[serde(default)]
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RetryConfig {
    /// Delay before the first retry; each next one is `multiplier` times longer (full jitter).
    #[serde(default = "defaults::initial_backoff_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub initial_backoff_ms: u64,
    /// Longest delay between two attempts.
    #[serde(default = "defaults::max_backoff_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_backoff_ms: u64,
    /// Growth of the delay from one retry to the next.
    #[serde(default = "defaults::multiplier")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1.0)))]
    pub multiplier: f64,
    /// Attempts per record, the first included; 0 retries transient errors forever.
    #[serde(default)]
    pub max_attempts: u32,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            initial_backoff_ms: defaults::initial_backoff_ms(),
            max_backoff_ms: defaults::max_backoff_ms(),
            multiplier: defaults::multiplier(),
            max_attempts: 0,
        }
    }
}

/// `stuck:` — the per-record handler timeout (from the first attempt, across retries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StuckConfig {
    /// Time from a record's first attempt after which it counts as stuck.
    #[serde(default = "defaults::stuck_timeout_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub timeout_ms: u64,
    #[serde(default)]
    pub action: StuckActionConfig,
}

impl Default for StuckConfig {
    fn default() -> Self {
        Self {
            timeout_ms: defaults::stuck_timeout_ms(),
            action: StuckActionConfig::Log,
        }
    }
}

/// `stuck.action`: `log` reports and keeps waiting; `dlq` cancels and dead-letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum StuckActionConfig {
    #[default]
    Log,
    Dlq,
}

/// `rebalance:` — the group protocol and how long a revoked partition may drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RebalanceConfig {
    #[serde(default)]
    pub strategy: RebalanceStrategy,
    /// Longest wait for a revoked partition's in-flight records before its final commit. Past
    /// it, handler calls still running write nothing; results already sent get as long again to
    /// land. A revocation runs inside one consumer poll, so 2 × this + 5 s must stay below the
    /// group's `max.poll.interval.ms` (refused otherwise).
    #[serde(default = "defaults::drain_timeout_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub drain_timeout_ms: u64,
}

impl Default for RebalanceConfig {
    fn default() -> Self {
        Self {
            strategy: RebalanceStrategy::default(),
            drain_timeout_ms: defaults::drain_timeout_ms(),
        }
    }
}

/// `rebalance.strategy`: the group protocol and, for the classic protocol, its assignor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum RebalanceStrategy {
    /// Classic protocol, incremental: only the partitions that move are revoked
    /// (cooperative-sticky).
    #[default]
    Cooperative,
    /// Classic protocol, stop-the-world: every partition is revoked and reassigned
    /// (range,roundrobin).
    Eager,
    /// The consumer group protocol of KIP-848 (`group.protocol=consumer`, Apache Kafka 4.0+):
    /// the broker assigns, incrementally, and owns the session timeout and heartbeat interval
    /// (`group.consumer.*` on the broker), so `kafka.session.timeout.ms` and
    /// `kafka.heartbeat.interval.ms` are refused with it.
    Consumer,
}

impl RebalanceStrategy {
    /// librdkafka's `group.protocol`.
    pub fn group_protocol(self) -> &'static str {
        match self {
            Self::Cooperative | Self::Eager => "classic",
            Self::Consumer => "consumer",
        }
    }

    /// librdkafka's `partition.assignment.strategy`; `None` under KIP-848, where the broker
    /// assigns (librdkafka refuses the property with `group.protocol=consumer`).
    pub fn assignment_strategy(self) -> Option<&'static str> {
        match self {
            Self::Cooperative => Some("cooperative-sticky"),
            Self::Eager => Some("range,roundrobin"),
            Self::Consumer => None,
        }
    }
}

/// Classic-protocol properties that KIP-848 moves to the broker: refused with
/// `rebalance.strategy: consumer` (librdkafka would refuse or ignore them).
pub const CLASSIC_ONLY_KAFKA_KEYS: &[&str] = &[
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "group.protocol.type",
];

/// The broker's default `group.consumer.session.timeout.ms` (KIP-848), used when the broker's
/// own value cannot be read.
pub const DEFAULT_CONSUMER_SESSION_TIMEOUT_MS: u64 = 45_000;

/// librdkafka's default `max.poll.interval.ms`.
pub const DEFAULT_MAX_POLL_INTERVAL_MS: u64 = 300_000;
/// librdkafka's default `session.timeout.ms`.
pub const DEFAULT_SESSION_TIMEOUT_MS: u64 = 45_000;
/// The producers' `message.timeout.ms` in `exactlyOnce`: the longest a commit's write barrier
/// waits for a write (at-least-once waits 300 s; a transaction must outlast it).
pub const EXACTLY_ONCE_MESSAGE_TIMEOUT_MS: u64 = 30_000;
/// The producers' `transaction.timeout.ms` in `exactlyOnce` (the broker allows 15 min by default).
pub const EXACTLY_ONCE_TRANSACTION_TIMEOUT_MS: u64 = 120_000;
/// What a revocation allows for its synchronous commit, on top of its two drain deadlines.
pub const REVOCATION_COMMIT_ALLOWANCE_MS: u64 = 5_000;
/// At shutdown, how much longer than `rebalance.drainTimeoutMs` the worker waits for results
/// already on their way to the broker before it gives them up. A produce retried through a
/// broker restart or a burst of refusals takes seconds, and the worker must not leave the
/// group with it still out: it could land after the next owner's results.
pub const SHUTDOWN_FENCE_EXTRA_MS: u64 = 10_000;

/// The default of every optional key.
pub mod defaults {
    use std::net::SocketAddr;
    pub fn commit_interval_ms() -> u64 {
        1_000
    }
    pub fn dispatchers() -> usize {
        8
    }
    pub fn dispatcher_capacity() -> usize {
        1_024
    }
    pub fn session_idle_ms() -> u64 {
        30_000
    }
    pub fn max_in_flight_per_partition() -> usize {
        10_000
    }
    pub fn prefetch_kbytes() -> u64 {
        16 * 1_024
    }
    pub fn prefetch_records() -> u64 {
        16_384
    }
    pub fn lag_interval_ms() -> u64 {
        5_000
    }
    pub fn stuck_timeout_ms() -> u64 {
        300_000
    }
    pub fn drain_timeout_ms() -> u64 {
        10_000
    }
    pub fn shutdown_timeout_ms() -> u64 {
        20_000
    }
    pub fn metrics_addr() -> Option<SocketAddr> {
        Some(SocketAddr::from(([0, 0, 0, 0], 9464)))
    }
    pub fn http_timeout_ms() -> u64 {
        10_000
    }
    pub fn initial_backoff_ms() -> u64 {
        100
    }
    pub fn max_backoff_ms() -> u64 {
        30_000
    }
    pub fn multiplier() -> f64 {
        2.0
    }
}

/// A configuration problem, naming the key at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid config: {key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// `text` as a `T`, or the error with the path of the key at fault (none for the document).
fn parse_tracked<T: serde::de::DeserializeOwned>(
    text: &str,
) -> Result<T, (Option<String>, String)> {
    let mut path = None;
    serde_saphyr::with_deserializer_from_str(text, |de| {
        serde_path_to_error::deserialize::<_, T>(de).map_err(|e| {
            path = Some(e.path().to_string());
            <serde_saphyr::Error as serde::de::Error>::custom(e.into_inner())
        })
    })
    .map_err(|e| {
        let key = path.filter(|p| !matches!(p.as_str(), "." | ""));
        (key, e.to_string())
    })
}

impl StageConfig {
    /// Reads a config file without validating it (so command-line overrides can apply first).
    pub fn parse_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new("--config", format!("{}: {e}", path.display())))?;
        Self::parse(&text)
    }

    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let config = Self::parse(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses YAML text without validating it.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        parse_tracked::<StageConfig>(text).map_err(|(key, message)| match key {
            Some(key) => ConfigError::new(key, message),
            // An error in the flattened settings comes without a path: serde reads a
            // flattened struct from a buffer the path tracking cannot see into. Read the
            // settings again on their own (they ignore the other keys) to name the key.
            None => match parse_tracked::<StageSettings>(text) {
                Err((Some(key), message)) => ConfigError::new(key, message),
                _ => ConfigError::new("(document)", message),
            },
        })
    }

    /// Checks what the types alone cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn non_empty(key: &str, value: &str) -> Result<(), ConfigError> {
            if value.trim().is_empty() {
                Err(ConfigError::new(key, "must not be empty"))
            } else {
                Ok(())
            }
        }
        fn positive(key: &str, value: u64) -> Result<(), ConfigError> {
            if value == 0 {
                Err(ConfigError::new(key, "must be greater than 0"))
            } else {
                Ok(())
            }
        }
        non_empty("brokers", &self.brokers)?;
        non_empty("stage", &self.stage)?;
        non_empty("input", &self.input)?;
        non_empty("dlq", &self.dlq)?;
        if let Some(group) = &self.group {
            non_empty("group", group)?;
        }
        if let Some(output) = &self.output {
            non_empty("output", output)?;
            if output == &self.input {
                return Err(ConfigError::new(
                    "output",
                    "must differ from input (a stage cannot feed itself)",
                ));
            }
        }
        if self.dlq == self.input {
            return Err(ConfigError::new("dlq", "must differ from input"));
        }
        let (retry, stuck) = (self.settings.retry(), self.settings.stuck());
        if let Some(SessionSource::Header { name }) = &self.settings.session {
            non_empty("session.name", name)?;
        }
        match &self.handler {
            HandlerConfig::Http(h) => {
                if !(h.url.starts_with("http://") || h.url.starts_with("https://")) {
                    return Err(ConfigError::new(
                        "handler.http.url",
                        format!("must be an http:// or https:// URL, got {:?}", h.url),
                    ));
                }
                positive("handler.http.timeoutMs", h.timeout_ms)?;
            }
            HandlerConfig::Builtin(b) => {
                if !(0.0..1.0).contains(&b.transient_rate) {
                    return Err(ConfigError::new(
                        "handler.builtin.transientRate",
                        "must be in [0, 1)",
                    ));
                }
                if !(0.0..=1.0).contains(&b.poison_rate) {
                    return Err(ConfigError::new(
                        "handler.builtin.poisonRate",
                        "must be in [0, 1]",
                    ));
                }
                if !(0.0..=1.0).contains(&b.slow_rate) {
                    return Err(ConfigError::new(
                        "handler.builtin.slowRate",
                        "must be in [0, 1]",
                    ));
                }
            }
        }
        positive("retry.initialBackoffMs", retry.initial_backoff_ms)?;
        if retry.max_backoff_ms < retry.initial_backoff_ms {
            return Err(ConfigError::new(
                "retry.maxBackoffMs",
                "must be at least retry.initialBackoffMs",
            ));
        }
        if !(retry.multiplier.is_finite() && retry.multiplier >= 1.0) {
            return Err(ConfigError::new("retry.multiplier", "must be at least 1.0"));
        }
        positive("stuck.timeoutMs", stuck.timeout_ms)?;
        positive("rebalance.drainTimeoutMs", self.rebalance.drain_timeout_ms)?;
        positive("commitIntervalMs", self.settings.commit_interval_ms())?;
        positive("lagIntervalMs", self.lag_interval_ms)?;
        positive("dispatchers", self.dispatchers as u64)?;
        positive("dispatcherCapacity", self.dispatcher_capacity as u64)?;
        positive("sessionIdleMs", self.session_idle_ms)?;
        positive(
            "maxInFlightPerPartition",
            self.max_in_flight_per_partition as u64,
        )?;
        positive("prefetchKbytes", self.prefetch_kbytes)?;
        positive("prefetchRecords", self.prefetch_records)?;
        positive("shutdownTimeoutMs", self.settings.shutdown_timeout_ms())?;
        self.validate_deadlines()?;
        for key in self.kafka.keys() {
            if OWNED_KAFKA_KEYS.contains(&key.as_str()) {
                return Err(ConfigError::new(
                    format!("kafka.{key}"),
                    "is managed by sessionflow and cannot be overridden",
                ));
            }
            if self.rebalance.strategy == RebalanceStrategy::Consumer
                && CLASSIC_ONLY_KAFKA_KEYS.contains(&key.as_str())
            {
                return Err(ConfigError::new(
                    format!("kafka.{key}"),
                    "cannot be set with rebalance.strategy: consumer (KIP-848: the broker's \
                     group.consumer.* settings decide it)",
                ));
            }
        }
        Ok(())
    }

    /// Refuses a drain deadline that cannot be met. A revocation runs inside one consumer poll:
    /// it waits up to `rebalance.drainTimeoutMs` for handlers, as long again for results
    /// already on their way to the broker, then commits; librdkafka leaves the group if that
    /// takes longer than `max.poll.interval.ms`, and the partitions' commits then fail. (The
    /// shutdown drain keeps polling, and every drain keeps the liveness heartbeat, so neither
    /// is bounded by these; the pod's grace period is checked by the operator, which sets it.)
    fn validate_deadlines(&self) -> Result<(), ConfigError> {
        let key = "max.poll.interval.ms";
        let max_poll: u64 = match self.kafka.get(key) {
            Some(v) => v.trim().parse().map_err(|_| {
                ConfigError::new(
                    format!("kafka.{key}"),
                    format!("must be a number of milliseconds, got {v:?}"),
                )
            })?,
            None => DEFAULT_MAX_POLL_INTERVAL_MS,
        };
        let session_key = "session.timeout.ms";
        let session_timeout: u64 = match self.kafka.get(session_key) {
            Some(v) => v.trim().parse().map_err(|_| {
                ConfigError::new(
                    format!("kafka.{session_key}"),
                    format!("must be a number of milliseconds, got {v:?}"),
                )
            })?,
            None => DEFAULT_SESSION_TIMEOUT_MS,
        };
        if max_poll < session_timeout {
            // librdkafka refuses to create such a consumer; say so with the key named.
            return Err(ConfigError::new(
                format!("kafka.{key}"),
                format!(
                    "{max_poll} ms must be at least kafka.{session_key} ({session_timeout} ms)"
                ),
            ));
        }
        let drain = self.rebalance.drain_timeout_ms;
        let revocation = drain
            .saturating_mul(2)
            .saturating_add(REVOCATION_COMMIT_ALLOWANCE_MS);
        if revocation >= max_poll {
            return Err(ConfigError::new(
                "rebalance.drainTimeoutMs",
                format!(
                    "{drain} ms cannot finish before kafka.{key} ({max_poll} ms): a revocation \
                     may take 2 × drainTimeoutMs + {REVOCATION_COMMIT_ALLOWANCE_MS} ms inside one \
                     poll; lower drainTimeoutMs below {} ms or raise kafka.{key}",
                    max_poll.saturating_sub(REVOCATION_COMMIT_ALLOWANCE_MS) / 2
                ),
            ));
        }
        Ok(())
    }

    /// `max.poll.interval.ms` of the group (the kafka map's, or librdkafka's default).
    pub fn max_poll_interval_ms(&self) -> u64 {
        self.kafka
            .get("max.poll.interval.ms")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_MAX_POLL_INTERVAL_MS)
    }

    /// `session.timeout.ms` of the group (the kafka map's, or librdkafka's default).
    pub fn session_timeout_ms(&self) -> u64 {
        self.kafka
            .get("session.timeout.ms")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_SESSION_TIMEOUT_MS)
    }

    /// How long a revocation waits, after its drain, for results already on their way: what
    /// is left of the poll budget once the drain and the commit are counted (at least the
    /// drain timeout; `validate` makes sure it fits).
    pub fn write_fence_ms(&self) -> u64 {
        let drain = self.rebalance.drain_timeout_ms;
        self.max_poll_interval_ms()
            .saturating_sub(drain)
            .saturating_sub(REVOCATION_COMMIT_ALLOWANCE_MS)
            .saturating_sub(1_000)
            .max(drain)
    }

    /// How long shutdown waits, once sessions have stopped, for results already on their way
    /// (see [`SHUTDOWN_FENCE_EXTRA_MS`]). It serves the consumer meanwhile, so the poll budget
    /// does not bound it; the pod's grace period, which the operator derives, does.
    pub fn shutdown_fence_ms(&self) -> u64 {
        self.rebalance
            .drain_timeout_ms
            .saturating_add(SHUTDOWN_FENCE_EXTRA_MS)
    }

    /// Adds SASL credentials found in the environment ([`SASL_USERNAME_ENV`],
    /// [`SASL_PASSWORD_ENV`]) to the librdkafka properties. On Kubernetes the operator fills
    /// those variables from a Secret, so credentials never sit in the config file.
    pub fn add_credentials(&mut self, lookup: impl Fn(&str) -> Option<String>) {
        for (env, key) in [
            (SASL_USERNAME_ENV, "sasl.username"),
            (SASL_PASSWORD_ENV, "sasl.password"),
        ] {
            if let Some(value) = lookup(env) {
                self.kafka.insert(key.to_string(), value);
            }
        }
    }

    /// The consumer group: `group`, or `sessionflow-<stage>`.
    pub fn group_id(&self) -> String {
        self.group
            .clone()
            .unwrap_or_else(|| format!("sessionflow-{}", self.stage))
    }
}

/// Environment variable holding the SASL user name (`sasl.username`).
pub const SASL_USERNAME_ENV: &str = "SESSIONFLOW_SASL_USERNAME";
/// Environment variable holding the SASL password (`sasl.password`).
pub const SASL_PASSWORD_ENV: &str = "SESSIONFLOW_SASL_PASSWORD";

/// librdkafka properties whose value the engine's guarantees depend on.
pub const OWNED_KAFKA_KEYS: &[&str] = &[
    "partition.assignment.strategy",
    // `rebalance.strategy` picks the protocol.
    "group.protocol",
    // A new group starts at the earliest offset (a later one would skip what was produced
    // before the stage first ran), and reads only committed records.
    "auto.offset.reset",
    "isolation.level",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "enable.idempotence",
    "group.id",
    "bootstrap.servers",
    // Set per partition from `prefetchKbytes` and `prefetchRecords`, totals (see `prefetch`).
    "queued.max.messages.kbytes",
    "queued.min.messages",
];

#[cfg(test)]
mod tests;
