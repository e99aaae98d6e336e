//! From a `SessionPipeline` to the objects of each stage: worker config, ConfigMap,
//! Deployment and metrics Service. Pure: no I/O, so every object the operator writes can be
//! checked in a unit test.
//!
//! The worker config is built by deserializing the spec's values into the worker's own
//! [`StageConfig`] and running its own [`StageConfig::validate`]: a spec the worker would
//! refuse is refused here, with the field named, before any Deployment exists. Every rendered
//! object carries the hash of its own content ([`APPLIED_HASH`]), so the reconciler can tell
//! an object that is already as desired and write nothing.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, SeccompProfile,
    SecretKeySelector, SecretVolumeSource, SecurityContext, Service, ServicePort, ServiceSpec,
    Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde_json::{json, Map, Value};
use sessionflow_worker::config::{StageConfig, SASL_PASSWORD_ENV, SASL_USERNAME_ENV};
use sha2::{Digest, Sha256};

use crate::crd::{KafkaSpec, SessionPipeline, StageSpec};
use crate::timeouts;

/// Label naming the pipeline an object belongs to.
pub const PIPELINE_LABEL: &str = "sessionflow.io/pipeline";
/// Label naming the stage an object belongs to.
pub const STAGE_LABEL: &str = "sessionflow.io/stage";
/// Annotation holding the hash of the object as the operator last rendered it.
pub const APPLIED_HASH: &str = "sessionflow.io/applied-hash";
/// Pod-template annotation with the hash of the worker config: a config change rolls the pods.
pub const CONFIG_HASH: &str = "sessionflow.io/config-hash";
/// Field manager of the reconciler's server-side applies.
pub const MANAGER: &str = "sessionflow-operator";

/// Port of the workers' `/metrics`, `/healthz` and `/readyz`.
pub const METRICS_PORT: i32 = 9090;
const CONFIG_DIR: &str = "/etc/sessionflow";
const CONFIG_FILE: &str = "stage.yaml";
const TLS_DIR: &str = "/etc/sessionflow/kafka-tls";
/// The image's non-root user (distroless `nonroot`).
const RUN_AS: i64 = 65532;

/// Operator-wide settings that fill what a pipeline leaves out.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub worker_image: String,
    /// `text` or `json`, passed to the workers' `--log-format`.
    pub log_format: String,
}

/// A spec the operator cannot run, with the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SpecError {
    pub field: String,
    pub message: String,
}

impl SpecError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Everything the cluster should hold for one stage.
#[derive(Debug, Clone)]
pub struct StagePlan {
    pub stage: String,
    pub config: StageConfig,
    pub config_map: ConfigMap,
    pub deployment: Deployment,
    pub service: Service,
}

/// The consumer group of a stage: unique per namespace, pipeline and stage, and stable.
pub fn group_id(namespace: &str, pipeline: &str, stage: &str) -> String {
    format!("sessionflow.{namespace}.{pipeline}.{stage}")
}

/// Name of a stage's Deployment and ConfigMap.
pub fn stage_object_name(pipeline: &str, stage: &str) -> String {
    format!("{pipeline}-{stage}")
}

/// Name of a stage's metrics Service.
pub fn service_name(pipeline: &str, stage: &str) -> String {
    format!("{pipeline}-{stage}-metrics")
}

/// Labels of every object of a stage; the first two select its pods.
pub fn stage_labels(pipeline: &str, stage: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (PIPELINE_LABEL.to_string(), pipeline.to_string()),
        (STAGE_LABEL.to_string(), stage.to_string()),
        ("app.kubernetes.io/name".into(), "sessionflow-worker".into()),
        ("app.kubernetes.io/instance".into(), pipeline.to_string()),
        ("app.kubernetes.io/component".into(), stage.to_string()),
        ("app.kubernetes.io/managed-by".into(), MANAGER.into()),
    ])
}

fn selector_labels(pipeline: &str, stage: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (PIPELINE_LABEL.to_string(), pipeline.to_string()),
        (STAGE_LABEL.to_string(), stage.to_string()),
    ])
}

/// Renders every stage of `sp`, or the first problem found.
pub fn plan(sp: &SessionPipeline, defaults: &Defaults) -> Result<Vec<StagePlan>, SpecError> {
    check_topology(sp)?;
    sp.spec
        .stages
        .iter()
        .enumerate()
        .map(|(i, stage)| plan_stage(sp, i, stage, defaults))
        .collect()
}

/// What the CRD's CEL rules say, checked again for resources admitted by an older CRD.
fn check_topology(sp: &SessionPipeline) -> Result<(), SpecError> {
    let spec = &sp.spec;
    if spec.stages.is_empty() {
        return Err(SpecError::new(
            "spec.stages",
            "at least one stage is required",
        ));
    }
    let declared = |t: &str| spec.topics.declared.iter().any(|d| d.name == t);
    if !declared(&spec.topics.dlq) {
        return Err(SpecError::new(
            "spec.topics.dlq",
            "must be listed in topics.declared",
        ));
    }
    for (i, s) in spec.stages.iter().enumerate() {
        let at = |f: &str| format!("spec.stages[{i}].{f}");
        if spec.stages[..i].iter().any(|o| o.name == s.name) {
            return Err(SpecError::new(
                at("name"),
                format!("duplicate stage name {:?}", s.name),
            ));
        }
        if s.replicas.min > s.replicas.max {
            return Err(SpecError::new(at("replicas"), "min must not exceed max"));
        }
        for (field, topic) in [("input", Some(&s.input)), ("output", s.output.as_ref())] {
            let Some(topic) = topic else { continue };
            if !declared(topic) {
                return Err(SpecError::new(
                    at(field),
                    format!("topic {topic:?} is not listed in topics.declared"),
                ));
            }
            if *topic == spec.topics.dlq {
                return Err(SpecError::new(
                    at(field),
                    "the DLQ topic cannot be a stage topic",
                ));
            }
        }
        if s.output.as_ref() == Some(&s.input) {
            return Err(SpecError::new(
                at("output"),
                "must not be the stage's own input",
            ));
        }
    }
    Ok(())
}

fn plan_stage(
    sp: &SessionPipeline,
    index: usize,
    stage: &StageSpec,
    defaults: &Defaults,
) -> Result<StagePlan, SpecError> {
    let field = format!("spec.stages[{index}]");
    let config = stage_config(sp, stage).map_err(|e| SpecError::new(&field, e.to_string()))?;
    let budget = check_timeouts(sp, index, stage, &config)?;
    config
        .validate()
        .map_err(|e| SpecError::new(format!("{field}.{}", e.key), e.message))?;
    let yaml = serde_saphyr::to_string(&config)
        .map_err(|e| SpecError::new(&field, format!("cannot render the worker config: {e}")))?;
    let pipeline = sp.name_any();
    let namespace = sp.namespace().unwrap_or_default();
    let name = stage_object_name(&pipeline, &stage.name);
    let meta = |name: String| ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.clone()),
        labels: Some(stage_labels(&pipeline, &stage.name)),
        owner_references: sp.controller_owner_ref(&()).map(|o| vec![o]),
        ..ObjectMeta::default()
    };

    let config_map = ConfigMap {
        metadata: meta(name.clone()),
        data: Some(BTreeMap::from([(CONFIG_FILE.to_string(), yaml.clone())])),
        ..ConfigMap::default()
    };
    let image = stage
        .image
        .clone()
        .or_else(|| sp.spec.worker_image.clone())
        .unwrap_or_else(|| defaults.worker_image.clone());
    let deployment = Deployment {
        metadata: meta(name.clone()),
        spec: Some(deployment_spec(
            sp,
            stage,
            budget,
            &image,
            &hash(&yaml),
            defaults,
        )),
        ..Deployment::default()
    };
    let service = Service {
        metadata: meta(service_name(&pipeline, &stage.name)),
        spec: Some(ServiceSpec {
            selector: Some(selector_labels(&pipeline, &stage.name)),
            ports: Some(vec![ServicePort {
                name: Some("metrics".into()),
                port: METRICS_PORT,
                target_port: Some(IntOrString::String("metrics".into())),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    };
    Ok(StagePlan {
        stage: stage.name.clone(),
        config,
        config_map: stamp(config_map),
        deployment: stamp(deployment),
        service: stamp(service),
    })
}

/// [`timeouts::check`] on a stage's resolved worker config, with the field at fault named where
/// the user set it (or, when the worker's default is at fault, where the stage would set it).
fn check_timeouts(
    sp: &SessionPipeline,
    index: usize,
    stage: &StageSpec,
    config: &StageConfig,
) -> Result<timeouts::Budget, SpecError> {
    let property = |key: &str| format!("spec.kafka.properties[{key}]");
    let t = timeouts::Timeouts::from_config(
        config.rebalance.drain_timeout_ms,
        config.shutdown_timeout_ms,
        &config.kafka,
    )
    .map_err(|(key, message)| SpecError::new(property(key), message))?;
    let refusal = match timeouts::check(t) {
        Ok(budget) => return Ok(budget),
        Err(refusal) => refusal,
    };
    let (field, set) = match refusal.setting() {
        timeouts::Setting::DrainTimeout => (
            format!("spec.stages[{index}].rebalance.drainTimeoutMs"),
            stage.rebalance.is_some(),
        ),
        timeouts::Setting::ShutdownTimeout => {
            match (stage.shutdown_timeout_ms, sp.spec.shutdown_timeout_ms) {
                (None, Some(_)) => ("spec.shutdownTimeoutMs".to_string(), true),
                (own, _) => (
                    format!("spec.stages[{index}].shutdownTimeoutMs"),
                    own.is_some(),
                ),
            }
        }
        timeouts::Setting::MaxPollInterval => (
            property(timeouts::MAX_POLL_INTERVAL_KEY),
            t.max_poll_interval_ms.is_some(),
        ),
    };
    Err(SpecError::new(field, refusal.message(!set)))
}

/// The worker config of a stage: stage settings over pipeline defaults over worker defaults.
fn stage_config(sp: &SessionPipeline, stage: &StageSpec) -> Result<StageConfig, serde_json::Error> {
    let spec = &sp.spec;
    let namespace = sp.namespace().unwrap_or_default();
    let mut v = Map::new();
    v.insert("brokers".into(), json!(spec.kafka.bootstrap_servers));
    v.insert(
        "group".into(),
        json!(group_id(&namespace, &sp.name_any(), &stage.name)),
    );
    v.insert("stage".into(), json!(stage.name));
    v.insert("input".into(), json!(stage.input));
    v.insert("dlq".into(), json!(spec.topics.dlq));
    v.insert("handler".into(), serde_json::to_value(&stage.handler)?);
    v.insert(
        "metricsAddr".into(),
        json!(format!("0.0.0.0:{METRICS_PORT}")),
    );
    v.insert("kafka".into(), json!(worker_kafka_properties(&spec.kafka)));
    let mut put = |key: &str, value: Option<Value>| {
        if let Some(value) = value {
            v.insert(key.into(), value);
        }
    };
    put("output", stage.output.as_ref().map(|o| json!(o)));
    put(
        "session",
        to_value(stage.session.as_ref().or(spec.session.as_ref()))?,
    );
    put(
        "retry",
        to_value(stage.retry.as_ref().or(spec.retry.as_ref()))?,
    );
    put(
        "stuck",
        to_value(stage.stuck.as_ref().or(spec.stuck.as_ref()))?,
    );
    put("rebalance", to_value(stage.rebalance.as_ref())?);
    put(
        "commitIntervalMs",
        to_value(
            stage
                .commit_interval_ms
                .or(spec.commit_interval_ms)
                .as_ref(),
        )?,
    );
    put(
        "shutdownTimeoutMs",
        to_value(
            stage
                .shutdown_timeout_ms
                .or(spec.shutdown_timeout_ms)
                .as_ref(),
        )?,
    );
    put("dispatchers", to_value(stage.dispatchers.as_ref())?);
    put(
        "dispatcherCapacity",
        to_value(stage.dispatcher_capacity.as_ref())?,
    );
    put("sessionIdleMs", to_value(stage.session_idle_ms.as_ref())?);
    put(
        "maxInFlightPerPartition",
        to_value(stage.max_in_flight_per_partition.as_ref())?,
    );
    put("lagIntervalMs", to_value(stage.lag_interval_ms.as_ref())?);
    put("otlpEndpoint", to_value(stage.otlp_endpoint.as_ref())?);
    serde_json::from_value(Value::Object(v))
}

fn to_value<T: Serialize>(v: Option<&T>) -> Result<Option<Value>, serde_json::Error> {
    v.map(serde_json::to_value).transpose()
}

/// librdkafka properties of the workers: the spec's extras plus what its security settings
/// imply. Credentials stay out: SASL ones arrive as environment variables, TLS files as a
/// mounted Secret.
pub fn worker_kafka_properties(kafka: &KafkaSpec) -> BTreeMap<String, String> {
    let mut props = security_properties(kafka);
    if let Some(tls) = &kafka.tls {
        props.insert(
            "ssl.ca.location".into(),
            format!("{TLS_DIR}/{}", tls.ca_key),
        );
        if let (Some(cert), Some(key)) = (&tls.cert_key, &tls.key_key) {
            props.insert(
                "ssl.certificate.location".into(),
                format!("{TLS_DIR}/{cert}"),
            );
            props.insert("ssl.key.location".into(), format!("{TLS_DIR}/{key}"));
        }
    }
    props
}

/// The spec's extra properties plus `security.protocol` and `sasl.mechanisms`.
pub fn security_properties(kafka: &KafkaSpec) -> BTreeMap<String, String> {
    let mut props = kafka.properties.clone();
    let protocol = match (&kafka.sasl, &kafka.tls) {
        (Some(_), Some(_)) => Some("SASL_SSL"),
        (Some(_), None) => Some("SASL_PLAINTEXT"),
        (None, Some(_)) => Some("SSL"),
        (None, None) => None,
    };
    if let Some(protocol) = protocol {
        props.insert("security.protocol".into(), protocol.into());
    }
    if let Some(sasl) = &kafka.sasl {
        props.insert("sasl.mechanisms".into(), sasl.mechanism.as_str().into());
    }
    props
}

fn deployment_spec(
    sp: &SessionPipeline,
    stage: &StageSpec,
    budget: timeouts::Budget,
    image: &str,
    config_hash: &str,
    defaults: &Defaults,
) -> DeploymentSpec {
    let pipeline = sp.name_any();
    let kafka = &sp.spec.kafka;
    let mut env = Vec::new();
    if let Some(sasl) = &kafka.sasl {
        for (var, key) in [
            (SASL_USERNAME_ENV, &sasl.username_key),
            (SASL_PASSWORD_ENV, &sasl.password_key),
        ] {
            env.push(EnvVar {
                name: var.into(),
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: sasl.secret_name.clone(),
                        key: key.clone(),
                        optional: Some(false),
                    }),
                    ..EnvVarSource::default()
                }),
                ..EnvVar::default()
            });
        }
    }
    let mut volumes = vec![Volume {
        name: "config".into(),
        config_map: Some(ConfigMapVolumeSource {
            name: stage_object_name(&pipeline, &stage.name),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    }];
    let mut mounts = vec![VolumeMount {
        name: "config".into(),
        mount_path: CONFIG_DIR.into(),
        read_only: Some(true),
        ..VolumeMount::default()
    }];
    if let Some(tls) = &kafka.tls {
        volumes.push(Volume {
            name: "kafka-tls".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(tls.secret_name.clone()),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: "kafka-tls".into(),
            mount_path: TLS_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }
    let probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("metrics".into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Probe::default()
    };
    let container = Container {
        name: "worker".into(),
        image: Some(image.to_string()),
        args: Some(vec![
            "--log-format".into(),
            defaults.log_format.clone(),
            "run".into(),
            "--config".into(),
            format!("{CONFIG_DIR}/{CONFIG_FILE}"),
        ]),
        ports: Some(vec![ContainerPort {
            name: Some("metrics".into()),
            container_port: METRICS_PORT,
            ..ContainerPort::default()
        }]),
        env: (!env.is_empty()).then_some(env),
        resources: stage.resources.clone(),
        // No timeout is bounded by this probe: the worker's drains keep the heartbeat
        // ([`timeouts`]).
        liveness_probe: Some(probe(
            "/healthz",
            timeouts::LIVENESS_PERIOD_SECONDS,
            timeouts::LIVENESS_FAILURE_THRESHOLD,
        )),
        readiness_probe: Some(probe("/readyz", 5, 3)),
        volume_mounts: Some(mounts),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };
    let annotations = BTreeMap::from([
        (CONFIG_HASH.to_string(), config_hash.to_string()),
        ("prometheus.io/scrape".into(), "true".into()),
        ("prometheus.io/port".into(), METRICS_PORT.to_string()),
        ("prometheus.io/path".into(), "/metrics".into()),
    ]);
    DeploymentSpec {
        // `replicas` is left out on purpose: the autoscaler owns it under its own field manager.
        selector: LabelSelector {
            match_labels: Some(selector_labels(&pipeline, &stage.name)),
            ..LabelSelector::default()
        },
        strategy: Some(DeploymentStrategy {
            type_: Some("RollingUpdate".into()),
            rolling_update: Some(RollingUpdateDeployment {
                max_surge: Some(IntOrString::Int(1)),
                max_unavailable: Some(IntOrString::Int(0)),
            }),
        }),
        template: PodTemplateSpec {
            metadata: Some(ObjectMeta {
                labels: Some(stage_labels(&pipeline, &stage.name)),
                annotations: Some(annotations),
                ..ObjectMeta::default()
            }),
            spec: Some(PodSpec {
                containers: vec![container],
                volumes: Some(volumes),
                // The pod outlives the worker's own shutdown: a drain under way, the shutdown
                // drain, the final commit, the close ([`timeouts::check`]).
                termination_grace_period_seconds: Some(budget.termination_grace_period_seconds),
                automount_service_account_token: Some(false),
                security_context: Some(PodSecurityContext {
                    run_as_non_root: Some(true),
                    run_as_user: Some(RUN_AS),
                    run_as_group: Some(RUN_AS),
                    seccomp_profile: Some(SeccompProfile {
                        type_: "RuntimeDefault".into(),
                        ..SeccompProfile::default()
                    }),
                    ..PodSecurityContext::default()
                }),
                ..PodSpec::default()
            }),
        },
        ..DeploymentSpec::default()
    }
}

/// Short content hash (hex).
fn hash(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Adds [`APPLIED_HASH`]: the hash of the object as rendered, annotation excluded.
fn stamp<K: Resource + Serialize>(mut obj: K) -> K {
    let h = hash(&serde_json::to_string(&obj).expect("objects serialize"));
    obj.annotations_mut().insert(APPLIED_HASH.into(), h);
    obj
}

/// The [`APPLIED_HASH`] an object carries, if any.
pub fn applied_hash<K: Resource>(obj: &K) -> Option<&str> {
    obj.meta()
        .annotations
        .as_ref()
        .and_then(|a| a.get(APPLIED_HASH))
        .map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{SaslMechanism, SaslSpec, TlsSpec};
    use crate::fixtures::pipeline;

    fn defaults() -> Defaults {
        Defaults {
            worker_image: "worker:1".into(),
            log_format: "json".into(),
        }
    }

    fn pod(plan: &StagePlan) -> &PodSpec {
        plan.deployment
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
    }

    fn container(plan: &StagePlan) -> &Container {
        &pod(plan).containers[0]
    }

    #[test]
    fn stage_settings_override_pipeline_defaults_which_override_worker_defaults() {
        let mut sp = pipeline(&["nlu", "llm"]);
        sp.spec.retry = Some(sessionflow_worker::config::RetryConfig {
            max_attempts: 3,
            ..Default::default()
        });
        sp.spec.shutdown_timeout_ms = Some(20_000);
        sp.spec.stages[1].retry = Some(sessionflow_worker::config::RetryConfig {
            max_attempts: 9,
            ..Default::default()
        });
        sp.spec.stages[1].dispatchers = Some(3);
        let plans = plan(&sp, &defaults()).unwrap();
        assert_eq!(plans[0].config.retry.max_attempts, 3);
        assert_eq!(plans[1].config.retry.max_attempts, 9);
        assert_eq!(plans[0].config.dispatchers, 8, "worker default");
        assert_eq!(plans[1].config.dispatchers, 3);
        assert_eq!(plans[1].config.shutdown_timeout_ms, 20_000);
        // The pod outlives the worker's own shutdown (drain + shutdown timeout + close).
        let grace = pod(&plans[1]).termination_grace_period_seconds.unwrap();
        let worker_ms = timeouts::worst_shutdown_ms(
            plans[1].config.rebalance.drain_timeout_ms,
            plans[1].config.shutdown_timeout_ms,
        )
        .unwrap();
        assert!(
            grace * 1000 > worker_ms as i64,
            "grace {grace}s ≤ worker {worker_ms}ms"
        );
        // 25 s revocation + 20 s shutdown + 20 s fence + 5 s commit + 20 s close + 10 s slack.
        assert_eq!(grace, 100);
        // What the ConfigMap holds is what the worker parses.
        let yaml = &plans[1].config_map.data.as_ref().unwrap()["stage.yaml"];
        let parsed = StageConfig::from_yaml(yaml).unwrap();
        assert_eq!(parsed.retry, plans[1].config.retry);
        assert_eq!(parsed.group_id(), group_id("shop", "chat", "llm"));
    }

    #[test]
    fn a_config_change_changes_the_pod_template_and_nothing_else_does() {
        let sp = pipeline(&["nlu"]);
        let hash_of = |sp: &SessionPipeline| {
            let p = &plan(sp, &defaults()).unwrap()[0];
            let t = &p.deployment.spec.as_ref().unwrap().template;
            t.metadata.as_ref().unwrap().annotations.as_ref().unwrap()[CONFIG_HASH].clone()
        };
        let before = hash_of(&sp);
        assert_eq!(before, hash_of(&sp.clone()), "rendering is deterministic");
        let mut changed = sp.clone();
        changed.spec.stages[0].commit_interval_ms = Some(250);
        assert_ne!(before, hash_of(&changed));
        let p1 = &plan(&sp, &defaults()).unwrap()[0];
        let p2 = &plan(&changed, &defaults()).unwrap()[0];
        assert_ne!(applied_hash(&p1.deployment), applied_hash(&p2.deployment));
        assert_eq!(applied_hash(&p1.service), applied_hash(&p2.service));
    }

    #[test]
    fn credentials_come_from_secrets_never_from_the_config() {
        let mut sp = pipeline(&["nlu"]);
        sp.spec.kafka.sasl = Some(SaslSpec {
            mechanism: SaslMechanism::ScramSha512,
            secret_name: "kafka-user".into(),
            username_key: "user".into(),
            password_key: "pass".into(),
        });
        sp.spec.kafka.tls = Some(TlsSpec {
            secret_name: "kafka-tls".into(),
            ca_key: "ca.crt".into(),
            cert_key: Some("tls.crt".into()),
            key_key: Some("tls.key".into()),
        });
        let p = &plan(&sp, &defaults()).unwrap()[0];
        let kafka = &p.config.kafka;
        assert_eq!(kafka["security.protocol"], "SASL_SSL");
        assert_eq!(kafka["sasl.mechanisms"], "SCRAM-SHA-512");
        assert_eq!(
            kafka["ssl.ca.location"],
            "/etc/sessionflow/kafka-tls/ca.crt"
        );
        assert_eq!(
            kafka["ssl.key.location"],
            "/etc/sessionflow/kafka-tls/tls.key"
        );
        assert!(!kafka.contains_key("sasl.password"));
        let yaml = &p.config_map.data.as_ref().unwrap()["stage.yaml"];
        assert!(!yaml.contains("sasl.password") && !yaml.contains("sasl.username"));

        let env = container(p).env.as_ref().unwrap();
        let from_secret = |name: &str| {
            let var = env.iter().find(|e| e.name == name).unwrap();
            let r = var
                .value_from
                .as_ref()
                .unwrap()
                .secret_key_ref
                .as_ref()
                .unwrap();
            (r.name.clone(), r.key.clone())
        };
        assert_eq!(
            from_secret(SASL_USERNAME_ENV),
            ("kafka-user".into(), "user".into())
        );
        assert_eq!(
            from_secret(SASL_PASSWORD_ENV),
            ("kafka-user".into(), "pass".into())
        );
        let tls = pod(p)
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == "kafka-tls")
            .unwrap();
        assert_eq!(
            tls.secret.as_ref().unwrap().secret_name.as_deref(),
            Some("kafka-tls")
        );
    }

    #[test]
    fn the_grace_period_and_the_liveness_probe_follow_the_timeouts() {
        let mut sp = pipeline(&["nlu", "llm"]);
        sp.spec.shutdown_timeout_ms = Some(120_000);
        sp.spec.stages[1].rebalance = Some(crate::fixtures::rebalance(45_000));
        sp.spec.stages[1].shutdown_timeout_ms = Some(1_500);
        let plans = plan(&sp, &defaults()).unwrap();
        let grace = |p: &StagePlan| pod(p).termination_grace_period_seconds.unwrap();
        // shutdown + 3 × drain + 10 s fence + 2 × 5 s commits + 2 × 10 s close + 10 s slack.
        assert_eq!(grace(&plans[0]), 120 + 30 + 50);
        assert_eq!(grace(&plans[1]), 2 + 135 + 50, "rounded up");
        let liveness = container(&plans[1]).liveness_probe.as_ref().unwrap();
        assert_eq!(
            liveness.http_get.as_ref().unwrap().path.as_deref(),
            Some("/healthz")
        );
        let period = liveness.period_seconds.unwrap();
        let failures = liveness.failure_threshold.unwrap();
        assert_eq!((period, failures), (10, 3));
        // The kubelet restarts a stalled worker this long after /healthz calls it stalled.
        let after_ms = u64::try_from((failures - 1) * period * 1000).unwrap();
        assert_eq!(
            timeouts::LIVENESS_STALE_MS + after_ms,
            timeouts::liveness_restart_after_ms()
        );
    }

    #[test]
    fn timeouts_that_cannot_work_name_the_field() {
        use crate::fixtures::{kafka_property as set, rebalance};
        type Mutation = Box<dyn Fn(&mut SessionPipeline)>;
        let cases: Vec<(Mutation, &str, &str)> = vec![
            (
                Box::new(|sp| {
                    set(sp, "max.poll.interval.ms", "60000");
                    sp.spec.stages[1].rebalance = Some(rebalance(30_000));
                }),
                "spec.stages[1].rebalance.drainTimeoutMs",
                "30000 ms cannot finish before max.poll.interval.ms 60000:",
            ),
            (
                // The setting: a 10 s poll interval with the default 10 s drain.
                Box::new(|sp| {
                    set(sp, "max.poll.interval.ms", "10000");
                    set(sp, "session.timeout.ms", "6000");
                }),
                "spec.stages[0].rebalance.drainTimeoutMs",
                "10000 ms (the default) cannot finish before max.poll.interval.ms 10000:",
            ),
            (
                Box::new(|sp| sp.spec.stages[1].rebalance = Some(rebalance(147_500))),
                "spec.stages[1].rebalance.drainTimeoutMs",
                "147500 ms cannot finish before max.poll.interval.ms 300000:",
            ),
            (
                Box::new(|sp| set(sp, "max.poll.interval.ms", "10000")),
                "spec.kafka.properties[max.poll.interval.ms]",
                "10000 ms is below session.timeout.ms 45000:",
            ),
            (
                Box::new(|sp| set(sp, "session.timeout.ms", "400000")),
                "spec.kafka.properties[max.poll.interval.ms]",
                "300000 ms (the default) is below session.timeout.ms 400000:",
            ),
            (
                Box::new(|sp| set(sp, "max.poll.interval.ms", "10s")),
                "spec.kafka.properties[max.poll.interval.ms]",
                "\"10s\" is not a number of milliseconds in [1, 86400000]",
            ),
            (
                Box::new(|sp| set(sp, "session.timeout.ms", "0")),
                "spec.kafka.properties[session.timeout.ms]",
                "\"0\" is not a number of milliseconds in [1, 3600000]",
            ),
            (
                Box::new(|sp| sp.spec.shutdown_timeout_ms = Some(u64::MAX)),
                "spec.shutdownTimeoutMs",
                "18446744073709551615 ms cannot finish before any pod grace period",
            ),
            (
                Box::new(|sp| sp.spec.stages[1].shutdown_timeout_ms = Some(u64::MAX - 1)),
                "spec.stages[1].shutdownTimeoutMs",
                "18446744073709551614 ms cannot finish before any pod grace period",
            ),
        ];
        for (mutate, field, message) in cases {
            let mut sp = pipeline(&["nlu", "llm"]);
            mutate(&mut sp);
            let err = plan(&sp, &defaults()).unwrap_err();
            assert_eq!(err.field, field, "{err}");
            assert!(err.message.starts_with(message), "{err}");
        }
        // Just inside every deadline is fine: 2 × 27 499 + 5000 < 60 000.
        let mut sp = pipeline(&["nlu", "llm"]);
        set(&mut sp, "max.poll.interval.ms", "60000");
        sp.spec.stages[0].rebalance = Some(rebalance(27_499));
        sp.spec.shutdown_timeout_ms = Some(3_600_000);
        plan(&sp, &defaults()).unwrap();
    }

    proptest::proptest! {
        /// The operator renders no config the worker refuses for its drain, and refuses none
        /// the worker would run (when librdkafka itself accepts the properties).
        #[test]
        fn the_operator_and_the_worker_agree_on_the_drain(
            drain in 1u64..200_000,
            max_poll in proptest::option::of(6_000u64..400_000),
        ) {
            let mut sp = pipeline(&["nlu"]);
            crate::fixtures::kafka_property(&mut sp, "session.timeout.ms", "6000");
            if let Some(ms) = max_poll {
                crate::fixtures::kafka_property(&mut sp, "max.poll.interval.ms", &ms.to_string());
            }
            sp.spec.stages[0].rebalance = Some(crate::fixtures::rebalance(drain));
            let config = stage_config(&sp, &sp.spec.stages[0]).unwrap();
            let worker = config.validate();
            let operator = plan(&sp, &defaults());
            proptest::prop_assert_eq!(worker.is_ok(), operator.is_ok(), "{:?} / {:?}", worker, operator);
            if let (Err(w), Err(o)) = (worker, operator) {
                proptest::prop_assert_eq!(w.key, "rebalance.drainTimeoutMs");
                proptest::prop_assert_eq!(o.field, "spec.stages[0].rebalance.drainTimeoutMs");
            }
        }
    }

    #[test]
    fn topology_errors_name_the_field() {
        type Mutation = Box<dyn Fn(&mut SessionPipeline)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (
                Box::new(|sp| sp.spec.stages[1].name = "nlu".into()),
                "spec.stages[1].name",
            ),
            (
                Box::new(|sp| sp.spec.stages[0].input = "nowhere".into()),
                "spec.stages[0].input",
            ),
            (
                Box::new(|sp| sp.spec.stages[1].output = Some("dlq".into())),
                "spec.stages[1].output",
            ),
            (
                Box::new(|sp| sp.spec.stages[0].output = Some("t0".into())),
                "spec.stages[0].output",
            ),
            (
                Box::new(|sp| sp.spec.topics.dlq = "gone".into()),
                "spec.topics.dlq",
            ),
            (
                Box::new(|sp| {
                    sp.spec.stages[0].replicas.min = 5;
                    sp.spec.stages[0].replicas.max = 2;
                }),
                "spec.stages[0].replicas",
            ),
            (
                Box::new(|sp| {
                    sp.spec.retry = Some(sessionflow_worker::config::RetryConfig {
                        initial_backoff_ms: 500,
                        max_backoff_ms: 100,
                        ..Default::default()
                    })
                }),
                "spec.stages[0].retry.maxBackoffMs",
            ),
        ];
        for (mutate, field) in cases {
            let mut sp = pipeline(&["nlu", "llm"]);
            mutate(&mut sp);
            let err = plan(&sp, &defaults()).unwrap_err();
            assert_eq!(err.field, field, "{err}");
        }
    }
}
