//! From a `SessionPipeline` to the objects of each stage: worker config, ConfigMap,
//! Deployment (its pod from [`crate::pod`]), metrics Service and PodDisruptionBudget. Pure: no
//! I/O, so every object the operator writes can be checked in a unit test, and
//! `sessionflow-operator render` prints them without a cluster.
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
use k8s_openapi::api::core::v1::{ConfigMap, PodTemplateSpec, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde_json::{json, Map, Value};
use sessionflow_worker::config::{StageConfig, StageSettings};
use sha2::{Digest, Sha256};

use crate::crd::{DisruptionBudgetSpec, KafkaSpec, SessionPipeline, StageSpec, WorkerTemplate};
use crate::pod::{self, WorkerPod, CONFIG_FILE, TLS_DIR};
pub use crate::pod::{CONFIG_HASH, METRICS_PORT, SECRETS_HASH};
pub use crate::spec_error::SpecError;
use crate::timeouts;

/// Label naming the pipeline an object belongs to.
pub const PIPELINE_LABEL: &str = "sessionflow.io/pipeline";
/// Label naming the stage an object belongs to.
pub const STAGE_LABEL: &str = "sessionflow.io/stage";
/// Annotation holding the hash of the object as the operator last rendered it.
pub const APPLIED_HASH: &str = "sessionflow.io/applied-hash";
/// Field manager of the reconciler's server-side applies.
pub const MANAGER: &str = "sessionflow-operator";

/// Operator-wide settings that fill what a pipeline leaves out.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub worker_image: String,
    /// `text` or `json`, passed to the workers' `--log-format`.
    pub log_format: String,
    /// Image prefixes the pods may run (worker and sidecars); empty: any image.
    pub allowed_images: Vec<String>,
}

impl Defaults {
    fn image_allowed(&self, image: &str) -> bool {
        self.allowed_images.is_empty() || self.allowed_images.iter().any(|p| image.starts_with(p))
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
    /// None when the spec turns the stage's PodDisruptionBudget off.
    pub disruption_budget: Option<PodDisruptionBudget>,
}

/// The consumer group of a stage: unique per namespace, pipeline and stage, and stable.
pub fn group_id(namespace: &str, pipeline: &str, stage: &str) -> String {
    format!("sessionflow.{namespace}.{pipeline}.{stage}")
}

/// Name of a stage's Deployment, ConfigMap and PodDisruptionBudget:
/// `<pipeline>-<stage>-<hash>`, where the hash (8 hex digits of FNV-1a over the pipeline and
/// stage names) keeps pipeline `a-b` with stage `c` apart from pipeline `a` with stage `b-c`.
pub fn stage_object_name(pipeline: &str, stage: &str) -> String {
    unique_name(pipeline, stage, "")
}

/// Name of a stage's metrics Service: `<pipeline>-<stage>-<hash>-metrics`.
pub fn service_name(pipeline: &str, stage: &str) -> String {
    unique_name(pipeline, stage, "-metrics")
}

/// A DNS-1035 label (at most 63 characters, a letter first: what a Service name must be)
/// unique per (pipeline, stage). The readable part is the pipeline and stage names, with the
/// pipeline's dots made dashes and `sf-` before a leading digit (a pipeline's name is a DNS
/// subdomain), shortened when needed; the hash, of the names as they are, and the suffix never
/// are.
fn unique_name(pipeline: &str, stage: &str, suffix: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in pipeline.bytes().chain([0]).chain(stage.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let hash = format!("{:08x}", (hash ^ (hash >> 32)) as u32);
    let room = 63 - 1 - hash.len() - suffix.len();
    let mut readable = format!("{pipeline}-{stage}").replace('.', "-");
    if !readable.starts_with(|c: char| c.is_ascii_lowercase()) {
        readable.insert_str(0, "sf-");
    }
    let readable = readable[..readable.len().min(room)].trim_end_matches('-');
    format!("{readable}-{hash}{suffix}")
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
    plan_with_secrets(sp, defaults, &[])
}

/// [`plan`], with the `(name, resourceVersion)` of the credential Secrets the pods use: their
/// hash goes on the pod template ([`SECRETS_HASH`]), so a rotation rolls every stage.
pub fn plan_with_secrets(
    sp: &SessionPipeline,
    defaults: &Defaults,
    secret_versions: &[(String, String)],
) -> Result<Vec<StagePlan>, SpecError> {
    check_topology(sp)?;
    check_security(sp)?;
    let secrets_hash = (!secret_versions.is_empty()).then(|| {
        let text: Vec<String> = secret_versions
            .iter()
            .map(|(name, version)| format!("{name}@{version}"))
            .collect();
        hash(&text.join(","))
    });
    sp.spec
        .stages
        .iter()
        .enumerate()
        .map(|(i, stage)| plan_stage(sp, i, stage, defaults, secrets_hash.as_deref()))
        .collect()
}

/// What the CRD's rules say about credentials, checked again.
fn check_security(sp: &SessionPipeline) -> Result<(), SpecError> {
    if sp.spec.kafka.insecure_plain() {
        return Err(SpecError::new(
            "spec.kafka.sasl.mechanism",
            "SASL PLAIN without TLS sends the password in clear text: add kafka.tls, or set \
             kafka.sasl.allowPlainWithoutTls: true",
        ));
    }
    Ok(())
}

/// Refuses an image outside `--allowed-images`.
fn check_image(defaults: &Defaults, image: &str, field: &str) -> Result<(), SpecError> {
    if defaults.image_allowed(image) {
        return Ok(());
    }
    Err(SpecError::new(
        field,
        format!(
            "image {image:?} is not allowed here (the operator runs only images starting with {})",
            defaults.allowed_images.join(", ")
        ),
    ))
}

/// Every object [`plan`] renders for `sp`, as a multi-document YAML stream in apply order
/// (per stage: ConfigMap, Deployment, Service, PodDisruptionBudget).
pub fn manifests(sp: &SessionPipeline, defaults: &Defaults) -> Result<String, SpecError> {
    fn doc<K: Serialize>(out: &mut String, obj: &K) {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(obj).expect("objects serialize"));
        if !out.ends_with('\n') {
            out.push('\n');
        }
    }
    let mut out = String::new();
    for p in plan(sp, defaults)? {
        doc(&mut out, &p.config_map);
        doc(&mut out, &p.deployment);
        doc(&mut out, &p.service);
        if let Some(budget) = &p.disruption_budget {
            doc(&mut out, budget);
        }
    }
    Ok(out)
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
    secrets_hash: Option<&str>,
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
    let template = pod::merge(sp.spec.worker_template.as_ref(), stage.template.as_ref());
    let sources = [
        (format!("{field}.template"), stage.template.as_ref()),
        (
            "spec.workerTemplate".to_string(),
            sp.spec.worker_template.as_ref(),
        ),
    ];
    let sources: Vec<(&str, &WorkerTemplate)> = sources
        .iter()
        .filter_map(|(f, t)| t.map(|t| (f.as_str(), t)))
        .collect();
    let image_field = match (&stage.image, &sp.spec.worker_image) {
        (Some(_), _) => format!("{field}.image"),
        (None, Some(_)) => "spec.workerImage".to_string(),
        (None, None) => format!("{field}.image (the operator's --worker-image)"),
    };
    check_image(defaults, &image, &image_field)?;
    for (f, t) in &sources {
        pod::check(t, f)?;
        for (j, c) in t.sidecars.iter().enumerate() {
            let image = c.image.as_deref().unwrap_or_default();
            check_image(defaults, image, &format!("{f}.sidecars[{j}].image"))?;
        }
    }
    pod::check_mounts(&template, &sources)?;
    let selector = selector_labels(&pipeline, &stage.name);
    let worker_pod = WorkerPod {
        config_map: &name,
        image: &image,
        log_format: &defaults.log_format,
        labels: stage_labels(&pipeline, &stage.name),
        config_hash: &hash(&yaml),
        grace_period_seconds: budget.termination_grace_period_seconds,
        kafka: &sp.spec.kafka,
        resources: stage.resources.as_ref(),
        template: &template,
        secrets_hash,
    };
    let deployment = Deployment {
        metadata: meta(name.clone()),
        spec: Some(deployment_spec(selector.clone(), worker_pod.template())),
        ..Deployment::default()
    };
    let disruption_budget =
        disruption_budget(sp, index, stage, meta(name.clone()), selector.clone())?;
    let service = Service {
        metadata: meta(service_name(&pipeline, &stage.name)),
        spec: Some(ServiceSpec {
            selector: Some(selector),
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
        disruption_budget: disruption_budget.map(stamp),
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
        config.settings.shutdown_timeout_ms(),
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
            match (
                stage.settings.shutdown_timeout_ms,
                sp.spec.defaults.shutdown_timeout_ms,
            ) {
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
/// What a stage and its pipeline both may set is one typed [`StageSettings`], laid over field
/// by field ([`StageSettings::over`]); the stage-only keys are copied over by name.
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
    put("rebalance", to_value(stage.rebalance.as_ref())?);
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
    put("prefetchKbytes", to_value(stage.prefetch_kbytes.as_ref())?);
    put(
        "prefetchRecords",
        to_value(stage.prefetch_records.as_ref())?,
    );
    put("lagIntervalMs", to_value(stage.lag_interval_ms.as_ref())?);
    put("otlpEndpoint", to_value(stage.otlp_endpoint.as_ref())?);
    let mut config: StageConfig = serde_json::from_value(Value::Object(v))?;
    config.settings = stage
        .settings
        .over(&spec.defaults)
        .over(&StageSettings::worker_defaults());
    Ok(config)
}

fn to_value<T: Serialize>(v: Option<&T>) -> Result<Option<Value>, serde_json::Error> {
    v.map(serde_json::to_value).transpose()
}

/// librdkafka properties of the workers: the spec's extras plus what its security settings
/// imply. Credentials stay out: SASL ones arrive as environment variables, TLS files as a
/// mounted Secret.
pub fn worker_kafka_properties(kafka: &KafkaSpec) -> BTreeMap<String, String> {
    let mut props = kafka.security_properties();
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

fn deployment_spec(
    selector: BTreeMap<String, String>,
    template: PodTemplateSpec,
) -> DeploymentSpec {
    DeploymentSpec {
        // `replicas` is left out on purpose: the autoscaler owns it under its own field manager.
        selector: LabelSelector {
            match_labels: Some(selector),
            ..LabelSelector::default()
        },
        strategy: Some(DeploymentStrategy {
            type_: Some("RollingUpdate".into()),
            rolling_update: Some(RollingUpdateDeployment {
                max_surge: Some(IntOrString::Int(1)),
                max_unavailable: Some(IntOrString::Int(0)),
            }),
        }),
        template,
        ..DeploymentSpec::default()
    }
}

/// The stage's PodDisruptionBudget, unless the spec turns it off.
fn disruption_budget(
    sp: &SessionPipeline,
    index: usize,
    stage: &StageSpec,
    metadata: ObjectMeta,
    selector: BTreeMap<String, String>,
) -> Result<Option<PodDisruptionBudget>, SpecError> {
    let (budget, field) = match (&stage.disruption_budget, &sp.spec.disruption_budget) {
        (Some(b), _) => (b.clone(), format!("spec.stages[{index}].disruptionBudget")),
        (None, Some(b)) => (b.clone(), "spec.disruptionBudget".to_string()),
        (None, None) => (DisruptionBudgetSpec::default(), String::new()),
    };
    if !budget.enabled {
        return Ok(None);
    }
    let valid = match &budget.max_unavailable {
        IntOrString::Int(n) => *n >= 0,
        IntOrString::String(s) => s
            .strip_suffix('%')
            .and_then(|n| n.parse::<u8>().ok())
            .is_some_and(|n| n <= 100),
    };
    if !valid {
        return Err(SpecError::new(
            format!("{field}.maxUnavailable"),
            "must be a number ≥ 0 or a percentage such as \"25%\"",
        ));
    }
    Ok(Some(PodDisruptionBudget {
        metadata,
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(budget.max_unavailable),
            selector: Some(LabelSelector {
                match_labels: Some(selector),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    }))
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
    use k8s_openapi::api::core::v1::{Container, PodSpec};
    use serde_json::Value;
    use sessionflow_worker::config::{SASL_PASSWORD_ENV, SASL_USERNAME_ENV};

    fn defaults() -> Defaults {
        Defaults {
            worker_image: "worker:1".into(),
            log_format: "json".into(),
            allowed_images: Vec::new(),
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
    fn delivery_comes_from_the_pipeline_unless_the_stage_sets_it() {
        use sessionflow_worker::config::Delivery;
        let mut sp = pipeline(&["nlu", "llm"]);
        let plans = plan(&sp, &defaults()).unwrap();
        assert_eq!(plans[0].config.settings.delivery(), Delivery::AtLeastOnce);
        sp.spec.defaults.delivery = Some(Delivery::ExactlyOnce);
        sp.spec.stages[1].settings.delivery = Some(Delivery::AtLeastOnce);
        let plans = plan(&sp, &defaults()).unwrap();
        assert_eq!(plans[0].config.settings.delivery(), Delivery::ExactlyOnce);
        assert_eq!(plans[1].config.settings.delivery(), Delivery::AtLeastOnce);
        // The ConfigMap carries it to the worker.
        for (p, want) in plans
            .iter()
            .zip([Delivery::ExactlyOnce, Delivery::AtLeastOnce])
        {
            let yaml = &p.config_map.data.as_ref().unwrap()["stage.yaml"];
            assert_eq!(
                StageConfig::from_yaml(yaml).unwrap().settings.delivery(),
                want
            );
        }
    }

    #[test]
    fn stage_settings_override_pipeline_defaults_which_override_worker_defaults() {
        let mut sp = pipeline(&["nlu", "llm"]);
        sp.spec.defaults.retry = Some(sessionflow_worker::config::RetryConfig {
            max_attempts: 3,
            ..Default::default()
        });
        sp.spec.defaults.shutdown_timeout_ms = Some(20_000);
        sp.spec.stages[1].settings.retry = Some(sessionflow_worker::config::RetryConfig {
            max_attempts: 9,
            ..Default::default()
        });
        sp.spec.stages[1].dispatchers = Some(3);
        sp.spec.stages[1].prefetch_kbytes = Some(8_192);
        sp.spec.stages[1].prefetch_records = Some(4_096);
        let plans = plan(&sp, &defaults()).unwrap();
        assert_eq!(plans[0].config.settings.retry().max_attempts, 3);
        assert_eq!(plans[1].config.settings.retry().max_attempts, 9);
        assert_eq!(plans[0].config.dispatchers, 8, "worker default");
        assert_eq!(plans[1].config.dispatchers, 3);
        assert_eq!(
            plans[0].config.prefetch_kbytes,
            16 * 1_024,
            "worker default"
        );
        assert_eq!(plans[1].config.prefetch_kbytes, 8_192);
        assert_eq!(plans[0].config.prefetch_records, 16_384, "worker default");
        assert_eq!(plans[1].config.prefetch_records, 4_096);
        assert_eq!(plans[1].config.settings.shutdown_timeout_ms(), 20_000);
        // The pod outlives the worker's own shutdown (drain + shutdown timeout + close).
        let grace = pod(&plans[1]).termination_grace_period_seconds.unwrap();
        let worker_ms = timeouts::worst_shutdown_ms(
            plans[1].config.rebalance.drain_timeout_ms,
            plans[1].config.settings.shutdown_timeout_ms(),
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
        assert_eq!(parsed.settings.retry, plans[1].config.settings.retry);
        assert_eq!(parsed.prefetch_kbytes, 8_192);
        assert_eq!(parsed.prefetch_records, 4_096);
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
        changed.spec.stages[0].settings.commit_interval_ms = Some(250);
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
            allow_plain_without_tls: false,
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
        sp.spec.defaults.shutdown_timeout_ms = Some(120_000);
        sp.spec.stages[1].rebalance = Some(crate::fixtures::rebalance(45_000));
        sp.spec.stages[1].settings.shutdown_timeout_ms = Some(1_500);
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
                // The issue's setting: a 10 s poll interval with the default 10 s drain.
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
                Box::new(|sp| sp.spec.defaults.shutdown_timeout_ms = Some(u64::MAX)),
                "spec.shutdownTimeoutMs",
                "18446744073709551615 ms cannot finish before any pod grace period",
            ),
            (
                Box::new(|sp| sp.spec.stages[1].settings.shutdown_timeout_ms = Some(u64::MAX - 1)),
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
        sp.spec.defaults.shutdown_timeout_ms = Some(3_600_000);
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

    fn yaml<T: serde::de::DeserializeOwned>(text: &str) -> T {
        serde_saphyr::from_str(text).unwrap()
    }

    #[test]
    fn the_merged_template_reaches_the_pod_and_the_operator_keeps_its_own() {
        let mut sp = pipeline(&["nlu", "llm"]);
        sp.spec.worker_template = Some(yaml(
            r#"
labels: { team: search }
annotations: { owner: search@example.com }
serviceAccountName: pipeline-sa
imagePullSecrets: [{ name: regcred }]
nodeSelector: { pool: workers }
tolerations: [{ key: spot, operator: Exists, effect: NoSchedule }]
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms: [{ matchExpressions: [{ key: zone, operator: In, values: [a] }] }]
topologySpreadConstraints:
  - { maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: ScheduleAnyway }
priorityClassName: pipelines
env: [{ name: RUST_LOG, value: info }]
envFrom: [{ configMapRef: { name: common } }]
volumes: [{ name: scratch, emptyDir: {} }]
volumeMounts: [{ name: scratch, mountPath: /scratch }]
securityContext: { runAsUser: 1000 }
"#,
        ));
        sp.spec.stages[1].template = Some(yaml(
            r#"
serviceAccountName: llm-sa
nodeSelector: { pool: gpu }
env: [{ name: RUST_LOG, value: debug }]
"#,
        ));
        let plans = plan(&sp, &defaults()).unwrap();
        let (nlu, llm) = (&plans[0], &plans[1]);
        let meta = |p: &StagePlan| {
            p.deployment
                .spec
                .as_ref()
                .unwrap()
                .template
                .metadata
                .clone()
                .unwrap()
        };
        let labels = meta(nlu).labels.unwrap();
        assert_eq!(labels["team"], "search");
        assert_eq!(labels[STAGE_LABEL], "nlu", "the operator's labels stay");
        let annotations = meta(nlu).annotations.unwrap();
        assert_eq!(annotations["owner"], "search@example.com");
        assert!(annotations.contains_key(CONFIG_HASH));
        let pod_nlu = pod(nlu);
        assert_eq!(pod_nlu.service_account_name.as_deref(), Some("pipeline-sa"));
        assert_eq!(pod(llm).service_account_name.as_deref(), Some("llm-sa"));
        assert_eq!(pod_nlu.automount_service_account_token, Some(false));
        assert_eq!(
            pod_nlu.image_pull_secrets.as_ref().unwrap()[0].name,
            "regcred"
        );
        assert_eq!(pod_nlu.node_selector.as_ref().unwrap()["pool"], "workers");
        assert_eq!(pod(llm).node_selector.as_ref().unwrap()["pool"], "gpu");
        assert_eq!(
            pod_nlu.tolerations.as_ref().unwrap()[0].key.as_deref(),
            Some("spot")
        );
        assert!(pod_nlu.affinity.as_ref().unwrap().node_affinity.is_some());
        assert_eq!(
            pod_nlu.topology_spread_constraints.as_ref().unwrap().len(),
            1
        );
        assert_eq!(pod_nlu.priority_class_name.as_deref(), Some("pipelines"));
        let volumes: Vec<&str> = pod_nlu
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(volumes, ["config", "scratch"]);
        let c = container(nlu);
        let mounts: Vec<&str> = c
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .map(|m| m.mount_path.as_str())
            .collect();
        assert_eq!(mounts, ["/etc/sessionflow", "/scratch"]);
        let env = |p: &StagePlan| container(p).env.clone().unwrap();
        assert_eq!(env(nlu)[0].value.as_deref(), Some("info"));
        assert_eq!(env(llm)[0].value.as_deref(), Some("debug"));
        assert_eq!(c.env_from.as_ref().unwrap().len(), 1);
        // The override is merged over the baseline, which stays.
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.run_as_user, Some(1000));
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(
            sc.capabilities.as_ref().unwrap().drop.as_deref(),
            Some(&["ALL".to_string()][..])
        );
        // A template change rolls the pods (the pod template changes), not the config.
        let before = plan(&pipeline(&["nlu", "llm"]), &defaults()).unwrap();
        assert_ne!(
            applied_hash(&before[0].deployment),
            applied_hash(&nlu.deployment)
        );
        assert_eq!(
            applied_hash(&before[0].config_map),
            applied_hash(&nlu.config_map)
        );
    }

    #[test]
    fn template_refusals_name_the_template_they_come_from() {
        let mut sp = pipeline(&["nlu", "llm"]);
        sp.spec.stages[1].template = Some(yaml("securityContext: { privileged: true }"));
        let err = plan(&sp, &defaults()).unwrap_err();
        assert_eq!(
            err.field,
            "spec.stages[1].template.securityContext.privileged"
        );
        let mut sp = pipeline(&["nlu"]);
        sp.spec.worker_template = Some(yaml("volumes: [{ name: h, hostPath: { path: / } }]"));
        let err = plan(&sp, &defaults()).unwrap_err();
        assert_eq!(err.field, "spec.workerTemplate.volumes[0].hostPath");
        // A mount of a volume no template declares.
        let mut sp = pipeline(&["nlu"]);
        sp.spec.worker_template = Some(yaml("volumes: [{ name: a, emptyDir: {} }]"));
        sp.spec.stages[0].template = Some(yaml(
            "volumeMounts: [{ name: a, mountPath: /a }, { name: b, mountPath: /b }]",
        ));
        let err = plan(&sp, &defaults()).unwrap_err();
        assert_eq!(
            err.field, "spec.stages[0].template.volumeMounts[1].name",
            "{err}"
        );
    }

    #[test]
    fn sidecars_run_as_native_sidecars_beside_the_worker() {
        let mut sp = pipeline(&["nlu"]);
        sp.spec.stages[0].handler = sessionflow_worker::config::HandlerConfig::Http(
            sessionflow_worker::config::HttpHandlerConfig {
                url: "http://localhost:8080/handle".into(),
                timeout_ms: 1000,
            },
        );
        sp.spec.stages[0].template = Some(yaml(
            r#"
sidecars:
  - name: handler
    image: example/nlu:1
    ports: [{ name: http, containerPort: 8080 }]
    readinessProbe: { httpGet: { path: /ready, port: 8080 } }
    securityContext: { readOnlyRootFilesystem: false }
"#,
        ));
        let p = &plan(&sp, &defaults()).unwrap()[0];
        let pod = pod(p);
        assert_eq!(
            pod.containers.len(),
            1,
            "the worker is the only main container"
        );
        let init = pod.init_containers.as_ref().unwrap();
        assert_eq!(init.len(), 1);
        let handler = &init[0];
        assert_eq!(handler.name, "handler");
        assert_eq!(handler.restart_policy.as_deref(), Some("Always"));
        assert!(handler.readiness_probe.is_some());
        let sc = handler.security_context.as_ref().unwrap();
        assert_eq!(
            sc.read_only_root_filesystem,
            Some(false),
            "its own override"
        );
        assert_eq!(sc.run_as_non_root, Some(true), "the baseline");
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(p.config.handler, sp.spec.stages[0].handler);
        // Without sidecars there are no init containers at all.
        assert!(
            super::tests::pod(&plan(&pipeline(&["nlu"]), &defaults()).unwrap()[0])
                .init_containers
                .is_none()
        );
    }

    #[test]
    fn every_stage_gets_a_disruption_budget_unless_turned_off() {
        let mut sp = pipeline(&["nlu", "llm", "tts"]);
        sp.spec.stages[1].disruption_budget = Some(yaml("maxUnavailable: 25%"));
        sp.spec.stages[2].disruption_budget = Some(yaml("enabled: false"));
        let plans = plan(&sp, &defaults()).unwrap();
        let budget = plans[0].disruption_budget.as_ref().unwrap();
        assert_eq!(budget.metadata.name.as_deref(), Some("chat-nlu-bb263a2d"));
        let spec = budget.spec.as_ref().unwrap();
        assert_eq!(
            spec.max_unavailable,
            Some(IntOrString::Int(1)),
            "the default"
        );
        assert_eq!(spec.min_available, None);
        assert_eq!(
            spec.selector.as_ref().unwrap().match_labels,
            plans[0]
                .deployment
                .spec
                .as_ref()
                .unwrap()
                .selector
                .match_labels,
            "it selects exactly the stage's pods"
        );
        let spec = plans[1]
            .disruption_budget
            .as_ref()
            .unwrap()
            .spec
            .as_ref()
            .unwrap();
        assert_eq!(
            spec.max_unavailable,
            Some(IntOrString::String("25%".into()))
        );
        assert!(plans[2].disruption_budget.is_none());
        // The pipeline-wide setting applies to stages that set none.
        sp.spec.disruption_budget = Some(yaml("maxUnavailable: 2"));
        let plans = plan(&sp, &defaults()).unwrap();
        let max = |p: &StagePlan| {
            p.disruption_budget
                .as_ref()
                .map(|b| b.spec.clone().unwrap().max_unavailable)
        };
        assert_eq!(max(&plans[0]), Some(Some(IntOrString::Int(2))));
        assert_eq!(
            max(&plans[1]),
            Some(Some(IntOrString::String("25%".into())))
        );
        sp.spec.stages[1].disruption_budget = Some(yaml("maxUnavailable: most"));
        let err = plan(&sp, &defaults()).unwrap_err();
        assert_eq!(err.field, "spec.stages[1].disruptionBudget.maxUnavailable");
    }

    fn rendered_names(pipeline_name: &str, stage: &str) -> Vec<String> {
        let mut sp = pipeline(&[stage]);
        sp.metadata.name = Some(pipeline_name.into());
        let plan = plan(&sp, &defaults()).unwrap().remove(0);
        let pdb = plan.disruption_budget.expect("a budget by default");
        [
            plan.config_map.metadata.name,
            plan.deployment.metadata.name,
            plan.service.metadata.name,
            pdb.metadata.name,
        ]
        .into_iter()
        .map(Option::unwrap)
        .collect()
    }

    /// Issue 36, item 5: pipeline `a-b` with stage `c` and pipeline `a` with stage `b-c`.
    #[test]
    fn the_collision_pair_renders_distinct_names_for_every_object() {
        let one = rendered_names("a-b", "c");
        let two = rendered_names("a", "b-c");
        for (a, b) in one.iter().zip(&two) {
            assert_ne!(a, b);
            assert!(
                a.starts_with("a-b-c-") && b.starts_with("a-b-c-"),
                "{a} {b}: readable"
            );
        }
        assert_eq!(one[0], stage_object_name("a-b", "c"));
        assert_eq!(one[2], service_name("a-b", "c"));
    }

    proptest::proptest! {
        #[test]
        fn names_are_dns_1035_labels_unique_per_pipeline_and_stage(
            // Pipelines are DNS subdomains (dots, a leading digit), stages DNS-1123 labels.
            p1 in "[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?",
            s1 in "[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?",
            p2 in "[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?",
            s2 in "[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?",
        ) {
            let label = is_dns_1035_label;
            for name in [stage_object_name(&p1, &s1), service_name(&p1, &s1)] {
                proptest::prop_assert!(label(&name), "{name}");
            }
            if (&p1, &s1) != (&p2, &s2) {
                proptest::prop_assert_ne!(stage_object_name(&p1, &s1), stage_object_name(&p2, &s2));
                proptest::prop_assert_ne!(service_name(&p1, &s1), service_name(&p2, &s2));
            }
        }
    }

    /// A DNS-1035 label, what a Service name must be (and a DNS-1123 label too).
    fn is_dns_1035_label(name: &str) -> bool {
        let bytes = name.as_bytes();
        !name.is_empty()
            && name.len() <= 63
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
            && bytes[0].is_ascii_lowercase()
            && bytes[bytes.len() - 1].is_ascii_alphanumeric()
    }

    #[test]
    fn long_names_are_shortened_and_keep_their_hash() {
        let (p, s) = ("p".repeat(60), "s".repeat(60));
        let name = stage_object_name(&p, &s);
        assert_eq!(name.len(), 63);
        assert!(is_dns_1035_label(&service_name(&p, &s)));
        assert!(service_name(&p, &s).ends_with("-metrics"));
        assert_ne!(name, stage_object_name(&p, &"s".repeat(59)));
    }

    #[test]
    fn manifests_are_every_object_in_apply_order() {
        let sp = pipeline(&["nlu"]);
        let text = manifests(&sp, &defaults()).unwrap();
        let kinds: Vec<String> = text
            .split("---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| yaml::<Value>(d)["kind"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            kinds,
            ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget"]
        );
    }

    #[test]
    fn sasl_plain_without_tls_is_refused_unless_allowed() {
        let mut sp = pipeline(&["nlu"]);
        sp.spec.kafka.sasl = Some(SaslSpec {
            mechanism: SaslMechanism::Plain,
            secret_name: "kafka-user".into(),
            username_key: "username".into(),
            password_key: "password".into(),
            allow_plain_without_tls: false,
        });
        let err = plan(&sp, &defaults()).unwrap_err();
        assert_eq!(err.field, "spec.kafka.sasl.mechanism");
        assert!(err.message.contains("clear text"), "{err}");
        sp.spec.kafka.sasl.as_mut().unwrap().allow_plain_without_tls = true;
        plan(&sp, &defaults()).unwrap();
        sp.spec.kafka.sasl.as_mut().unwrap().allow_plain_without_tls = false;
        sp.spec.kafka.tls = Some(TlsSpec {
            secret_name: "kafka-tls".into(),
            ca_key: "ca.crt".into(),
            cert_key: None,
            key_key: None,
        });
        plan(&sp, &defaults()).unwrap();
    }

    #[test]
    fn images_outside_the_allowed_prefixes_are_refused_where_they_are_named() {
        let allowed = Defaults {
            worker_image: "registry.example.com/sessionflow/worker:1".into(),
            log_format: "json".into(),
            allowed_images: vec![
                "registry.example.com/sessionflow/".into(),
                "registry.example.com/handlers/".into(),
            ],
        };
        let mut sp = pipeline(&["nlu", "llm"]);
        plan(&sp, &allowed).unwrap();
        sp.spec.stages[0].template = Some(yaml(
            "sidecars: [{ name: h, image: registry.example.com/handlers/nlu:2 }]",
        ));
        plan(&sp, &allowed).unwrap();
        sp.spec.worker_template = Some(yaml(
            "sidecars: [{ name: x, image: docker.io/attacker/x:1 }]",
        ));
        let err = plan(&sp, &allowed).unwrap_err();
        assert_eq!(err.field, "spec.workerTemplate.sidecars[0].image", "{err}");
        sp.spec.worker_template = None;
        sp.spec.worker_image = Some("docker.io/library/busybox".into());
        let err = plan(&sp, &allowed).unwrap_err();
        assert_eq!(err.field, "spec.workerImage", "{err}");
        sp.spec.worker_image = None;
        sp.spec.stages[1].image = Some("registry.example.com/sessionflowx/w:1".into());
        let err = plan(&sp, &allowed).unwrap_err();
        assert_eq!(err.field, "spec.stages[1].image", "{err}");
        let mut strict = allowed.clone();
        strict.worker_image = "ghcr.io/sessionflow/worker:1".into();
        let err = plan(&pipeline(&["nlu"]), &strict).unwrap_err();
        assert_eq!(
            err.field, "spec.stages[0].image (the operator's --worker-image)",
            "{err}"
        );
    }

    #[test]
    fn the_secrets_versions_roll_the_pods_and_only_the_pods() {
        let sp = pipeline(&["nlu"]);
        let at = |versions: &[(String, String)]| {
            plan_with_secrets(&sp, &defaults(), versions)
                .unwrap()
                .remove(0)
        };
        let v1 = at(&[("kafka-user".into(), "41".into())]);
        let v2 = at(&[("kafka-user".into(), "97".into())]);
        let annotation = |p: &StagePlan| {
            p.deployment
                .spec
                .as_ref()
                .unwrap()
                .template
                .metadata
                .as_ref()
                .unwrap()
                .annotations
                .as_ref()
                .unwrap()
                .get(SECRETS_HASH)
                .cloned()
        };
        assert!(annotation(&v1).is_some());
        assert_ne!(annotation(&v1), annotation(&v2));
        assert_eq!(annotation(&at(&[])), None);
        assert_eq!(applied_hash(&v1.config_map), applied_hash(&v2.config_map));
        assert_ne!(applied_hash(&v1.deployment), applied_hash(&v2.deployment));
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
                    sp.spec.defaults.retry = Some(sessionflow_worker::config::RetryConfig {
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
