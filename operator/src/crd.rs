//! The `SessionPipeline` custom resource (`sessionpipelines.sessionflow.io/v1alpha1`).
//!
//! One resource declares a whole pipeline: the Kafka cluster, its topics, and the ordered
//! stages, each becoming one autoscaled worker Deployment. A stage's worker settings use the
//! worker config's own types and camelCase names (`retry`, `stuck`, `handler`, …), so what a
//! user writes here is what the worker reads, and the CRD schema is generated from the same
//! definitions; the settings a pipeline also sets for all its stages are the worker's
//! [`StageSettings`], flattened into both the spec and each stage. The CRD enforces what it can (OpenAPI bounds and CEL rules, each with a message
//! that names the field); [`crate::render`] re-checks everything a worker would refuse, so a
//! resource that slipped past an older CRD still ends as `Degraded`, not as a crash loop.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Container, EnvFromSource, EnvVar, LocalObjectReference, ResourceRequirements,
    SecurityContext, Toleration, TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sessionflow_worker::config::{HandlerConfig, RebalanceConfig, StageSettings};

/// The CRD's resource name.
pub const CRD_NAME: &str = "sessionpipelines.sessionflow.io";

/// A session-ordered Kafka pipeline: ordered stages, each run by autoscaled workers.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "sessionflow.io",
    version = "v1alpha1",
    kind = "SessionPipeline",
    plural = "sessionpipelines",
    shortname = "sp",
    namespaced,
    status = "SessionPipelineStatus",
    doc = "A session-ordered Kafka pipeline: ordered stages, each run by autoscaled workers.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Stages", type_ = "string", json_path = ".status.stagesReady"),
    printcolumn(name = "Lag", type_ = "integer", json_path = ".status.lag"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("size(self.metadata.name) <= 63")
        .message("metadata.name must not exceed 63 characters (it is a label value on every object of the pipeline)")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.stages.all(s, self.stages.exists_one(t, t.name == s.name))")
        .message("stage names must be unique")
        .field_path(".stages"),
    validation = Rule::new(
        "self.stages.all(s, self.topics.declared.exists(t, t.name == s.input) && (!has(s.output) || self.topics.declared.exists(t, t.name == s.output)))"
    )
    .message("every stage's input and output topic must be listed in topics.declared")
    .field_path(".stages"),
    validation = Rule::new("self.topics.declared.exists(t, t.name == self.topics.dlq)")
        .message("topics.dlq must be listed in topics.declared")
        .field_path(".topics.dlq"),
    validation = Rule::new(
        "self.stages.all(s, s.input != self.topics.dlq && (!has(s.output) || s.output != self.topics.dlq))"
    )
    .message("the DLQ topic cannot be a stage's input or output")
    .field_path(".topics.dlq")
)]
pub struct SessionPipelineSpec {
    /// The Kafka cluster the pipeline runs on.
    pub kafka: KafkaSpec,
    /// The pipeline's topics.
    pub topics: TopicsSpec,
    /// The stages, in pipeline order.
    #[schemars(length(min = 1, max = 32))]
    pub stages: Vec<StageSpec>,
    /// Worker image for stages that set none; defaults to the operator's `--worker-image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_image: Option<String>,
    /// The worker settings of every stage that does not set its own (`session`, `retry`,
    /// `stuck`, `commitIntervalMs`, `shutdownTimeoutMs`).
    #[serde(flatten)]
    pub defaults: StageSettings,
    /// Pod settings of every stage's workers (scheduling, identity, extra env and volumes,
    /// sidecars); a stage's `template` is merged over it, the stage winning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_template: Option<WorkerTemplate>,
    /// PodDisruptionBudget of every stage that sets none (default: one, `maxUnavailable: 1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disruption_budget: Option<DisruptionBudgetSpec>,
}

/// Connection to the Kafka cluster. Credentials come from Secrets only, and only from Secrets
/// labelled `sessionflow.io/credentials: "true"`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(
        "!has(self.sasl) || self.sasl.mechanism != 'PLAIN' || has(self.tls) || (has(self.sasl.allowPlainWithoutTls) && self.sasl.allowPlainWithoutTls)"
    )
    .message("SASL PLAIN without TLS sends the password in clear text: add kafka.tls, or set kafka.sasl.allowPlainWithoutTls: true")
    .field_path(".sasl")
)]
pub struct KafkaSpec {
    /// `host:port[,host:port…]`.
    #[schemars(length(min = 1))]
    pub bootstrap_servers: String,
    /// Extra librdkafka properties for every client of the pipeline. `max.poll.interval.ms`
    /// (not below `session.timeout.ms`) bounds every stage's `rebalance.drainTimeoutMs`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[x_kube(
        validation = Rule::new(
            "self.all(k, !(k in ['bootstrap.servers', 'group.id', 'enable.auto.commit', 'enable.auto.offset.store', 'enable.idempotence', 'partition.assignment.strategy', 'security.protocol']))"
        )
        .message("this property is set by sessionflow (bootstrap servers, group, commits, idempotence, assignment and security protocol come from the spec)"),
        validation = Rule::new(
            "self.all(k, !(k in ['sasl.username', 'sasl.password', 'ssl.key.pem', 'ssl.key.password', 'ssl.certificate.pem', 'ssl.ca.pem', 'sasl.oauthbearer.client.secret']))"
        )
        .message("credentials must not be inline: reference a Secret with kafka.sasl or kafka.tls")
    )]
    pub properties: BTreeMap<String, String>,
    /// SASL authentication; the user name and password are read from a Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl: Option<SaslSpec>,
    /// TLS; the CA (and a client certificate for mutual TLS) are read from a Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
}

/// SASL credentials by Secret reference.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SaslSpec {
    pub mechanism: SaslMechanism,
    /// Secret in the pipeline's namespace.
    #[schemars(length(min = 1))]
    pub secret_name: String,
    #[serde(default = "defaults::username_key")]
    pub username_key: String,
    #[serde(default = "defaults::password_key")]
    pub password_key: String,
    /// PLAIN sends the password as it is: without `kafka.tls` it is refused unless this is
    /// `true` (a broker on a trusted network, or TLS terminated by a sidecar).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_plain_without_tls: bool,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaslMechanism {
    #[serde(rename = "PLAIN")]
    Plain,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl KafkaSpec {
    /// The spec's extra properties plus `security.protocol` and `sasl.mechanisms`: what every
    /// client of the cluster (the workers, the operator's lag reader) is given, credentials
    /// and certificate paths aside.
    pub fn security_properties(&self) -> BTreeMap<String, String> {
        let mut props = self.properties.clone();
        let protocol = match (&self.sasl, &self.tls) {
            (Some(_), Some(_)) => Some("SASL_SSL"),
            (Some(_), None) => Some("SASL_PLAINTEXT"),
            (None, Some(_)) => Some("SSL"),
            (None, None) => None,
        };
        if let Some(protocol) = protocol {
            props.insert("security.protocol".into(), protocol.into());
        }
        if let Some(sasl) = &self.sasl {
            props.insert("sasl.mechanisms".into(), sasl.mechanism.as_str().into());
        }
        props
    }

    /// SASL PLAIN over a connection without TLS, not explicitly allowed by the spec.
    pub fn insecure_plain(&self) -> bool {
        self.sasl.as_ref().is_some_and(|s| {
            s.mechanism == SaslMechanism::Plain && self.tls.is_none() && !s.allow_plain_without_tls
        })
    }
}

impl SaslMechanism {
    /// librdkafka's `sasl.mechanisms` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// TLS material by Secret reference (PEM entries).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.certKey) == has(self.keyKey)")
        .message("tls.certKey and tls.keyKey go together (mutual TLS needs both)")
)]
pub struct TlsSpec {
    /// Secret in the pipeline's namespace.
    #[schemars(length(min = 1))]
    pub secret_name: String,
    /// Entry holding the CA certificate that signed the brokers' certificates.
    #[serde(default = "defaults::ca_key")]
    pub ca_key: String,
    /// Entry holding the client certificate, for mutual TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_key: Option<String>,
    /// Entry holding the client private key, for mutual TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_key: Option<String>,
}

/// The pipeline's topics. Topics are never deleted by the operator.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TopicsSpec {
    /// Create declared topics that do not exist yet (existing ones are left as they are).
    #[serde(default)]
    pub create: bool,
    /// Dead-letter topic shared by the stages.
    #[schemars(length(min = 1, max = 249))]
    pub dlq: String,
    /// Every topic the pipeline reads or writes, the DLQ included.
    #[schemars(length(min = 1, max = 64))]
    pub declared: Vec<TopicSpec>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TopicSpec {
    #[schemars(length(min = 1, max = 249), regex(pattern = r"^[a-zA-Z0-9._-]+$"))]
    pub name: String,
    #[schemars(range(min = 1))]
    pub partitions: i32,
    /// Replication factor when the operator creates the topic; the broker's default otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub replication_factor: Option<i32>,
}

/// One stage: a consumer group of workers reading `input` and writing `output`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.output) || self.output != self.input")
        .message("a stage's output must not be its own input")
        .field_path(".output")
)]
pub struct StageSpec {
    /// DNS label; names the Deployment `<pipeline>-<stage>`.
    #[schemars(
        length(min = 1, max = 40),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,
    /// Topic the stage consumes.
    #[schemars(length(min = 1, max = 249))]
    pub input: String,
    /// Topic the stage produces to; none for the last stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 249))]
    pub output: Option<String>,
    /// What processes a record: `http: {url, timeoutMs}` or `builtin: {…}` (pass-through with
    /// fault injection, for trials).
    pub handler: HandlerConfig,
    /// Worker image for this stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// CPU and memory of each worker pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Bounds of the autoscaler.
    #[serde(default)]
    pub replicas: ReplicasSpec,
    /// How the replica count follows the lag.
    #[serde(default)]
    pub autoscaling: AutoscalingSpec,
    /// This stage's own `session`, `retry`, `stuck`, `commitIntervalMs` and
    /// `shutdownTimeoutMs`, each over the pipeline's (`spec.*`).
    #[serde(flatten)]
    pub settings: StageSettings,
    /// Group protocol (`cooperative`, `eager` or `consumer`, KIP-848) and drain timeout on
    /// revocation. A revocation holds the consumer's poll for up to 2 × `drainTimeoutMs` + 5000 ms, which must stay below
    /// `max.poll.interval.ms` of `kafka.properties` (librdkafka's default 300000): with the
    /// default, `drainTimeoutMs` can be at most 147499.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<RebalanceConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Dispatcher tasks per worker that sessions are hashed onto (worker default 8).
    #[schemars(range(min = 1, max = 1024))]
    pub dispatchers: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Records a dispatcher queues before its partitions are held (worker default 1024).
    #[schemars(range(min = 1))]
    pub dispatcher_capacity: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// An idle session is forgotten after this long (its order watch and recent event ids);
    /// its task ends sooner, after 250 ms with nothing to do.
    #[schemars(range(min = 1))]
    pub session_idle_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Records between a partition's committed watermark and its newest record taken in;
    /// beyond it the partition is held. Bounds memory and replay after a crash. The span counts
    /// from the last commit the broker confirmed, so a partition advances at most this many
    /// records per offset-commit round trip (~6 ms on Apache Kafka 4.1 with its default
    /// `group.coordinator.append.linger.ms` of 5 ms): keep it well above that round trip times
    /// the partition's rate (125 held a no-op stage to ~76,000 msg/s over 8 partitions).
    #[schemars(range(min = 1))]
    pub max_in_flight_per_partition: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// KiB of records a worker's consumer may fetch ahead, in total over its partitions
    /// (shared equally by the input topic's partitions). Bounds the worker's memory with the
    /// in-flight cap; too small a total starves the stage of records.
    #[schemars(range(min = 1))]
    pub prefetch_kbytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Records a worker's consumer may fetch ahead, in total over its partitions (shared like
    /// `prefetchKbytes`). For small records this, not the bytes, bounds the memory: the Kafka
    /// client keeps a few hundred bytes of its own per record it holds.
    #[schemars(range(min = 1))]
    pub prefetch_records: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// How often workers report their partitions' lag as a metric.
    #[schemars(range(min = 1))]
    pub lag_interval_ms: Option<u64>,
    /// OTLP/HTTP traces endpoint of the stage's workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// Pod settings of this stage, merged over `spec.workerTemplate` (this stage wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<WorkerTemplate>,
    /// Overrides `spec.disruptionBudget`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disruption_budget: Option<DisruptionBudgetSpec>,
}

/// Bounds of a stage's replica count.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.min <= self.max").message("replicas.min must not exceed replicas.max")
)]
pub struct ReplicasSpec {
    /// 0 lets an idle stage scale to zero (lag is read from Kafka, not from the workers).
    #[serde(default = "defaults::min_replicas")]
    #[schemars(range(min = 0, max = 1000))]
    pub min: i32,
    /// Replicas beyond the input's partition count would idle, so the partition count also caps.
    #[serde(default = "defaults::max_replicas")]
    #[schemars(range(min = 1, max = 1000))]
    pub max: i32,
}

impl Default for ReplicasSpec {
    fn default() -> Self {
        Self {
            min: defaults::min_replicas(),
            max: defaults::max_replicas(),
        }
    }
}

/// How the stage follows its lag.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.mode) || self.mode == 'lag' || !has(self.scaleUpMaxStep)")
        .message("autoscaling.scaleUpMaxStep applies to mode lag only (in mode external the external autoscaler sets the pace)")
        .field_path(".scaleUpMaxStep")
)]
pub struct AutoscalingSpec {
    /// Who sets the stage's replica count.
    #[serde(default)]
    pub mode: AutoscalingMode,
    /// Records of effective lag one replica is expected to absorb.
    #[serde(default = "defaults::lag_per_replica")]
    #[schemars(range(min = 1))]
    pub lag_per_replica: i64,
    /// A scale-down happens only once every recommendation in this window is lower.
    #[serde(default = "defaults::scale_down_stabilization_secs")]
    #[schemars(range(min = 0, max = 86400))]
    pub scale_down_stabilization_secs: u32,
    /// Most replicas one autoscaling pass adds; unset: up to the recommendation at once.
    /// Bringing the count up to `replicas.min` is not limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub scale_up_max_step: Option<u32>,
}

impl Default for AutoscalingSpec {
    fn default() -> Self {
        Self {
            mode: AutoscalingMode::default(),
            lag_per_replica: defaults::lag_per_replica(),
            scale_down_stabilization_secs: defaults::scale_down_stabilization_secs(),
            scale_up_max_step: None,
        }
    }
}

/// Who owns a stage Deployment's `spec.replicas`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum AutoscalingMode {
    /// The operator's autoscaler, from the lag it reads (`replicas`, `lagPerReplica`, …).
    #[default]
    Lag,
    /// An external autoscaler (an HPA or a KEDA ScaledObject on the stage's Deployment, e.g.
    /// on the metric `sessionflow_stage_effective_lag`): the operator never writes
    /// `spec.replicas`, and still reads and exports the lag.
    External,
}

/// Annotation on a SessionPipeline: `"true"` pauses the built-in autoscaler for that pipeline
/// (replica counts are left as they are; lag is still read and exported).
pub const AUTOSCALING_PAUSED_ANNOTATION: &str = "sessionflow.io/autoscaling-paused";

/// Whether `sp` carries the pause annotation.
pub fn autoscaling_paused(sp: &SessionPipeline) -> bool {
    sp.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(AUTOSCALING_PAUSED_ANNOTATION))
        .is_some_and(|v| v == "true")
}

/// What the operator observed. The reconciler writes `observedGeneration`, `conditions` and
/// `stagesReady`; the autoscaler writes `stages` and `lag`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SessionPipelineStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Progressing`, `Degraded` (the reconciler); `Autoscaling` (the autoscaler:
    /// `True`/`Active`, or `False` with reason `Fallback` (lag cannot be read; the message
    /// names the stage and the error) or `Paused`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Ready stages over all stages, e.g. `3/4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages_ready: Option<String>,
    /// Total effective lag over the stages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageStatus>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StageStatus {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// Records above the group's committed offsets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<i64>,
    /// Records not yet done (lag minus those the completed-offset map marks done).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective_lag: Option<i64>,
    /// Partitions of the stage's input topic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<i32>,
    /// Partitions held for backpressure, when known (workers export it as a metric; Kafka
    /// does not tell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_partitions: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_reason: Option<String>,
}

/// Pod settings of a stage's workers. What the operator sets itself (the worker container,
/// its config volume, probes, the non-root baseline) cannot be replaced from here; see
/// [`crate::pod`] for how a stage's template is merged over the pipeline's and what is refused.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(
        "!has(self.securityContext) || ((!has(self.securityContext.runAsNonRoot) || self.securityContext.runAsNonRoot) && (!has(self.securityContext.runAsUser) || self.securityContext.runAsUser != 0))"
    )
    .message("securityContext: workers run as non-root (runAsNonRoot cannot be false, runAsUser cannot be 0)")
    .field_path(".securityContext"),
    validation = Rule::new(
        "!has(self.securityContext) || ((!has(self.securityContext.privileged) || !self.securityContext.privileged) && (!has(self.securityContext.allowPrivilegeEscalation) || !self.securityContext.allowPrivilegeEscalation))"
    )
    .message("securityContext: privileged containers and privilege escalation are not allowed")
    .field_path(".securityContext")
)]
pub struct WorkerTemplate {
    /// Extra pod labels (`sessionflow.io/*` and the `app.kubernetes.io/*` labels the operator
    /// sets are refused).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Extra pod annotations (`sessionflow.io/*` is refused).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// ServiceAccount of the pods. Its token is still not mounted unless a volume asks for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Secrets to pull the images with (core/v1 LocalObjectReference).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// Node labels the pods must run on.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the pods tolerate (core/v1 Toleration).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Scheduling constraints of the pods (core/v1 Affinity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// How the pods spread across topology domains (core/v1 TopologySpreadConstraint).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// PriorityClass of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Extra environment variables of the worker container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Extra environment of the worker container from ConfigMaps and Secrets (core/v1 EnvFromSource).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env_from: Vec<EnvFromSource>,
    /// Extra pod volumes (the kinds Pod Security `restricted` allows: configMap, secret,
    /// emptyDir, projected, downwardAPI, persistentVolumeClaim, ephemeral, csi).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
    /// Extra mounts of the worker container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
    /// Overrides of the worker container's security context, within the non-root baseline
    /// (Pod Security `restricted`): what would run as root, escalate privileges, add a
    /// capability other than `NET_BIND_SERVICE` or drop the seccomp profile is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_context: Option<SecurityContext>,
    /// Containers run beside the worker as native sidecars (init containers with
    /// `restartPolicy: Always`): started before the worker, stopped after it. A handler here
    /// is reached on `http://localhost:<port>`, and scales with the stage.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sidecars: Vec<Container>,
}

/// A stage's PodDisruptionBudget, so that a node drain cannot evict the whole stage at once.
/// (The CEL rule checks only the `%` of a percentage — a regular expression over a string of
/// unbounded length exceeds the API server's cost budget; the operator checks the digits, with
/// the field named.)
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(
        "!has(self.maxUnavailable) || (type(self.maxUnavailable) == int ? int(self.maxUnavailable) >= 0 : self.maxUnavailable.endsWith('%'))"
    )
    .message("maxUnavailable must be a number ≥ 0 or a percentage such as \"25%\"")
    .field_path(".maxUnavailable")
)]
pub struct DisruptionBudgetSpec {
    /// `false`: no PodDisruptionBudget for the stage.
    #[serde(default = "defaults::enabled")]
    pub enabled: bool,
    /// Pods of the stage a voluntary disruption may take down at once (a number or a
    /// percentage).
    #[serde(default = "defaults::max_unavailable")]
    pub max_unavailable: IntOrString,
}

impl Default for DisruptionBudgetSpec {
    fn default() -> Self {
        Self {
            enabled: defaults::enabled(),
            max_unavailable: defaults::max_unavailable(),
        }
    }
}

/// The fields whose schemas come from Kubernetes' own types (k8s-openapi): inside them the
/// CRD carries no `description`s (they are Kubernetes' API reference, hundreds of KB of it,
/// which would push the CRD past the 256 KiB last-applied annotation of a plain
/// `kubectl apply`). The field's own description, sessionflow's, is kept.
pub const KUBERNETES_TYPED_FIELDS: &[&str] = &[
    "resources",
    "imagePullSecrets",
    "tolerations",
    "affinity",
    "topologySpreadConstraints",
    "env",
    "envFrom",
    "volumes",
    "volumeMounts",
    "securityContext",
    "sidecars",
    "conditions",
];

/// The CustomResourceDefinition as installed: [`SessionPipeline::crd`] with the descriptions
/// inside [`KUBERNETES_TYPED_FIELDS`] stripped.
pub fn crd(
) -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    let mut json = serde_json::to_value(SessionPipeline::crd()).expect("the CRD serializes");
    for version in json["spec"]["versions"]
        .as_array_mut()
        .expect("the CRD has versions")
    {
        strip_kubernetes_descriptions(&mut version["schema"]["openAPIV3Schema"]);
    }
    serde_json::from_value(json).expect("the stripped CRD deserializes")
}

/// Walks sessionflow's own schema; below a [`KUBERNETES_TYPED_FIELDS`] property, removes
/// every `description`.
fn strip_kubernetes_descriptions(schema: &mut serde_json::Value) {
    let serde_json::Value::Object(map) = schema else {
        return;
    };
    for (key, value) in map.iter_mut() {
        match key.as_str() {
            "properties" => {
                if let serde_json::Value::Object(props) = value {
                    for (name, prop) in props.iter_mut() {
                        if KUBERNETES_TYPED_FIELDS.contains(&name.as_str()) {
                            let own = prop.get("description").cloned();
                            remove_descriptions(prop);
                            if let (Some(own), serde_json::Value::Object(p)) = (own, prop) {
                                p.insert("description".into(), own);
                            }
                        } else {
                            strip_kubernetes_descriptions(prop);
                        }
                    }
                }
            }
            "items" | "additionalProperties" => strip_kubernetes_descriptions(value),
            "allOf" | "anyOf" | "oneOf" => {
                if let serde_json::Value::Array(items) = value {
                    items.iter_mut().for_each(strip_kubernetes_descriptions);
                }
            }
            _ => {}
        }
    }
}

fn remove_descriptions(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.remove("description");
            // A property may itself be called `description`: only schema keywords go.
            for (key, v) in map.iter_mut() {
                if key == "properties" {
                    if let serde_json::Value::Object(props) = v {
                        props.values_mut().for_each(remove_descriptions);
                    }
                } else {
                    remove_descriptions(v);
                }
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(remove_descriptions),
        _ => {}
    }
}

/// The CRD as YAML, as `sessionflow-operator crd` prints it and `crds/` holds it.
pub fn crd_yaml() -> String {
    let crd = crd();
    // One space per level: the schema nests ~20 deep, and with two spaces most of the file
    // would be indentation (242 KB instead of ~160 KB).
    let options = serde_saphyr::ser_options! { indent_step: 1 };
    let mut yaml = serde_saphyr::to_string_with_options(&crd, options).expect("the CRD serializes");
    if !yaml.ends_with('\n') {
        yaml.push('\n');
    }
    yaml
}

mod defaults {
    pub fn username_key() -> String {
        "username".into()
    }
    pub fn password_key() -> String {
        "password".into()
    }
    pub fn ca_key() -> String {
        "ca.crt".into()
    }
    pub fn min_replicas() -> i32 {
        1
    }
    pub fn max_replicas() -> i32 {
        1
    }
    pub fn lag_per_replica() -> i64 {
        1_000
    }
    pub fn scale_down_stabilization_secs() -> u32 {
        300
    }
    pub fn enabled() -> bool {
        true
    }
    pub fn max_unavailable() -> super::IntOrString {
        super::IntOrString::Int(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checked_in_crd_is_what_the_binary_prints() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/sessionpipeline.yaml");
        let checked_in = std::fs::read_to_string(path).expect("crds/sessionpipeline.yaml exists");
        assert!(
            checked_in == crd_yaml(),
            "crds/sessionpipeline.yaml is stale: regenerate it with `make crd`"
        );
    }

    /// A plain (client-side) `kubectl apply` keeps the whole object in the
    /// last-applied-configuration annotation, limited to 256 KiB: 200 KB leaves room.
    #[test]
    fn the_crd_stays_under_200_kb_and_keeps_sessionflows_descriptions() {
        let yaml = crd_yaml();
        let json = serde_json::to_string(&crd()).unwrap();
        assert!(
            yaml.len() <= 200_000,
            "the CRD is {} bytes of YAML",
            yaml.len()
        );
        assert!(
            json.len() <= 200_000,
            "the CRD is {} bytes of JSON",
            json.len()
        );
        let crd = serde_json::to_value(crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let stage = &spec["properties"]["stages"]["items"];
        let described =
            |v: &serde_json::Value| v["description"].as_str().is_some_and(|d| !d.is_empty());
        // sessionflow's own fields, also those whose type is Kubernetes'.
        for field in [
            &spec["properties"]["kafka"],
            &spec["properties"]["topics"],
            &stage["properties"]["handler"],
            &stage["properties"]["replicas"],
            &stage["properties"]["input"],
        ] {
            assert!(described(field), "no description: {field}");
        }
        let pod = &stage["properties"]["template"]["properties"];
        assert!(
            pod.is_object(),
            "stage.template is where the pod template lives"
        );
        for name in KUBERNETES_TYPED_FIELDS {
            let field = [
                &stage["properties"][name],
                &pod[name],
                &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
                    ["properties"][name],
            ]
            .into_iter()
            .find(|f| f.is_object())
            .unwrap_or_else(|| panic!("{name} is not a field of a stage, its pod or the status"));
            assert!(described(field), "{name} lost its own description");
            let mut inner = field.clone();
            inner.as_object_mut().unwrap().remove("description");
            let text = inner.to_string();
            assert!(
                !text.contains("\"description\""),
                "{name} still carries Kubernetes' descriptions"
            );
        }
    }

    #[test]
    fn crd_names_and_columns() {
        let crd = SessionPipeline::crd();
        assert_eq!(crd.metadata.name.as_deref(), Some(CRD_NAME));
        assert_eq!(crd.spec.names.short_names, Some(vec!["sp".to_string()]));
        let version = &crd.spec.versions[0];
        assert!(version.subresources.as_ref().unwrap().status.is_some());
        let columns: Vec<&str> = version
            .additional_printer_columns
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(columns, ["Ready", "Stages", "Lag", "Age"]);
    }

    #[test]
    fn every_rule_has_a_message() {
        let json = serde_json::to_value(SessionPipeline::crd()).unwrap();
        let mut rules = Vec::new();
        collect_rules(&json, &mut rules);
        assert!(rules.len() >= 8, "found only {} rules", rules.len());
        for rule in rules {
            assert!(
                rule.get("message").and_then(|m| m.as_str()).is_some(),
                "rule without message: {rule}"
            );
        }
    }

    fn collect_rules<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    if k == "x-kubernetes-validations" {
                        out.extend(v.as_array().unwrap());
                    } else {
                        collect_rules(v, out);
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|i| collect_rules(i, out)),
            _ => {}
        }
    }
}
