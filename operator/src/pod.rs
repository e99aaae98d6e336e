//! The worker pod of a stage: the worker container (config, credentials, probes), the
//! non-root baseline, and the user's pod template merged in.
//!
//! A platform team needs to shape worker pods (pull secrets, tolerations, a service account,
//! sidecar handlers), and the worker needs the pod to be exactly what its config assumes (the
//! config mounted where it reads it, credentials only from Secrets, probes on its own port, a
//! grace period that outlasts its drain). This module is where the two meet: a stage's
//! `template` is [`merge`]d over the pipeline's `workerTemplate`, each is [`check`]ed with the
//! field named (nothing may replace what the operator sets, or step outside the Pod Security
//! `restricted` profile), and [`WorkerPod::template`] renders the result. Pure, like
//! [`crate::render`], which calls it once per stage.
//!
//! Merge rules (the stage wins): maps (labels, annotations, nodeSelector) merge key by key;
//! single values (serviceAccountName, priorityClassName, affinity) are the stage's when it sets
//! them; lists with a key (env, imagePullSecrets, volumes and sidecars by name, volumeMounts by
//! mountPath) merge by that key, the stage's entry replacing the pipeline's in place; the other
//! lists (envFrom, tolerations, topologySpreadConstraints) are the pipeline's followed by the
//! stage's; securityContext merges field by field.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, ResourceRequirements,
    SeccompProfile, SecretKeySelector, SecretVolumeSource, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use sessionflow_worker::config::{SASL_PASSWORD_ENV, SASL_USERNAME_ENV};

use crate::crd::{KafkaSpec, WorkerTemplate};
use crate::spec_error::SpecError;
use crate::timeouts;

/// Port of the workers' `/metrics`, `/healthz` and `/readyz`.
pub const METRICS_PORT: i32 = 9090;
/// Pod-template annotation with the hash of the worker config: a config change rolls the pods.
pub const CONFIG_HASH: &str = "sessionflow.io/config-hash";
/// Pod-template annotation with the hash of the referenced credential Secrets' versions: a
/// rotated Secret rolls the pods.
pub const SECRETS_HASH: &str = "sessionflow.io/secrets-hash";
/// Where the worker reads its config.
pub const CONFIG_DIR: &str = "/etc/sessionflow";
pub const CONFIG_FILE: &str = "stage.yaml";
/// Where the Kafka TLS Secret is mounted.
pub const TLS_DIR: &str = "/etc/sessionflow/kafka-tls";
/// Name of the worker container.
pub const WORKER_CONTAINER: &str = "worker";
/// The image's non-root user (distroless `nonroot`).
const RUN_AS: i64 = 65532;
/// Volumes the operator mounts itself.
const RESERVED_VOLUMES: [&str; 2] = ["config", "kafka-tls"];
/// Labels the operator sets on every stage object (and selects pods by).
const RESERVED_LABELS: [&str; 4] = [
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
];
/// Volume kinds Pod Security `restricted` allows.
const ALLOWED_VOLUMES: [&str; 8] = [
    "configMap",
    "secret",
    "emptyDir",
    "projected",
    "downwardAPI",
    "persistentVolumeClaim",
    "ephemeral",
    "csi",
];

/// Everything that goes into one stage's pod.
#[derive(Debug, Clone)]
pub struct WorkerPod<'a> {
    /// The stage's ConfigMap, mounted as the worker's config.
    pub config_map: &'a str,
    pub image: &'a str,
    /// The worker's `--log-format`.
    pub log_format: &'a str,
    /// The operator's labels of the stage (the Deployment's selector among them).
    pub labels: BTreeMap<String, String>,
    pub config_hash: &'a str,
    pub grace_period_seconds: i64,
    pub kafka: &'a KafkaSpec,
    pub resources: Option<&'a ResourceRequirements>,
    /// The merged template ([`merge`]), already [`check`]ed.
    pub template: &'a WorkerTemplate,
    /// Hash of the credential Secrets' versions, when known: a rotation rolls the pods.
    pub secrets_hash: Option<&'a str>,
}

impl WorkerPod<'_> {
    /// The Deployment's pod template.
    pub fn template(&self) -> PodTemplateSpec {
        let t = self.template;
        let mut labels = t.labels.clone();
        labels.extend(self.labels.clone());
        let mut annotations = t.annotations.clone();
        annotations.extend([
            (CONFIG_HASH.to_string(), self.config_hash.to_string()),
            ("prometheus.io/scrape".into(), "true".into()),
            ("prometheus.io/port".into(), METRICS_PORT.to_string()),
            ("prometheus.io/path".into(), "/metrics".into()),
        ]);
        if let Some(h) = self.secrets_hash {
            annotations.insert(SECRETS_HASH.into(), h.into());
        }
        let mut volumes = self.own_volumes();
        volumes.extend(t.volumes.iter().cloned());
        let sidecars: Vec<Container> = t.sidecars.iter().map(sidecar).collect();
        PodTemplateSpec {
            metadata: Some(ObjectMeta {
                labels: Some(labels),
                annotations: Some(annotations),
                ..ObjectMeta::default()
            }),
            spec: Some(PodSpec {
                init_containers: (!sidecars.is_empty()).then_some(sidecars),
                containers: vec![self.worker()],
                volumes: Some(volumes),
                // The pod outlives the worker's own shutdown: a drain under way, the shutdown
                // drain, the final commit, the close ([`timeouts::check`]).
                termination_grace_period_seconds: Some(self.grace_period_seconds),
                automount_service_account_token: Some(false),
                service_account_name: t.service_account_name.clone(),
                image_pull_secrets: non_empty(&t.image_pull_secrets),
                node_selector: (!t.node_selector.is_empty()).then(|| t.node_selector.clone()),
                tolerations: non_empty(&t.tolerations),
                affinity: t.affinity.clone(),
                topology_spread_constraints: non_empty(&t.topology_spread_constraints),
                priority_class_name: t.priority_class_name.clone(),
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
        }
    }

    fn own_volumes(&self) -> Vec<Volume> {
        let mut volumes = vec![Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: self.config_map.to_string(),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        }];
        if let Some(tls) = &self.kafka.tls {
            volumes.push(Volume {
                name: "kafka-tls".into(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(tls.secret_name.clone()),
                    ..SecretVolumeSource::default()
                }),
                ..Volume::default()
            });
        }
        volumes
    }

    fn worker(&self) -> Container {
        let t = self.template;
        let mut env = Vec::new();
        if let Some(sasl) = &self.kafka.sasl {
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
        env.extend(t.env.iter().cloned());
        let mut mounts = vec![VolumeMount {
            name: "config".into(),
            mount_path: CONFIG_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        }];
        if self.kafka.tls.is_some() {
            mounts.push(VolumeMount {
                name: "kafka-tls".into(),
                mount_path: TLS_DIR.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            });
        }
        mounts.extend(t.volume_mounts.iter().cloned());
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
        Container {
            name: WORKER_CONTAINER.into(),
            image: Some(self.image.to_string()),
            args: Some(vec![
                "--log-format".into(),
                self.log_format.to_string(),
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
            env_from: non_empty(&t.env_from),
            resources: self.resources.cloned(),
            // No timeout is bounded by this probe: the worker's drains keep the heartbeat
            // ([`timeouts`]).
            liveness_probe: Some(probe(
                "/healthz",
                timeouts::LIVENESS_PERIOD_SECONDS,
                timeouts::LIVENESS_FAILURE_THRESHOLD,
            )),
            readiness_probe: Some(probe("/readyz", 5, 3)),
            volume_mounts: Some(mounts),
            security_context: Some(security_context(t.security_context.as_ref())),
            ..Container::default()
        }
    }
}

/// A sidecar as a native sidecar: an init container that keeps running (`restartPolicy:
/// Always`), so the kubelet starts it before the worker and stops it after the worker.
fn sidecar(c: &Container) -> Container {
    Container {
        restart_policy: Some("Always".into()),
        security_context: Some(security_context(c.security_context.as_ref())),
        ..c.clone()
    }
}

/// The non-root baseline with `overrides` merged over it, field by field.
fn security_context(overrides: Option<&SecurityContext>) -> SecurityContext {
    let baseline = SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Capabilities::default()
        }),
        ..SecurityContext::default()
    };
    match overrides {
        Some(o) => merged(&baseline, o),
        None => baseline,
    }
}

fn non_empty<T: Clone>(items: &[T]) -> Option<Vec<T>> {
    (!items.is_empty()).then(|| items.to_vec())
}

/// `over` merged into `base` through their JSON forms: objects key by key (recursively),
/// anything else replaced.
fn merged<T: Serialize + DeserializeOwned>(base: &T, over: &T) -> T {
    fn merge_value(base: &mut Value, over: Value) {
        match (base, over) {
            (Value::Object(b), Value::Object(o)) => {
                for (k, v) in o {
                    match b.get_mut(&k) {
                        Some(slot) => merge_value(slot, v),
                        None => {
                            b.insert(k, v);
                        }
                    }
                }
            }
            (slot, v) => *slot = v,
        }
    }
    let mut base = serde_json::to_value(base).expect("k8s types serialize");
    merge_value(
        &mut base,
        serde_json::to_value(over).expect("k8s types serialize"),
    );
    serde_json::from_value(base).expect("a merge of two valid objects is valid")
}

/// `stage` merged over `pipeline` (the rules are in the module documentation).
pub fn merge(pipeline: Option<&WorkerTemplate>, stage: Option<&WorkerTemplate>) -> WorkerTemplate {
    let (p, s) = match (pipeline, stage) {
        (None, None) => return WorkerTemplate::default(),
        (Some(only), None) | (None, Some(only)) => return only.clone(),
        (Some(p), Some(s)) => (p, s),
    };
    let maps = |a: &BTreeMap<String, String>, b: &BTreeMap<String, String>| {
        let mut m = a.clone();
        m.extend(b.clone());
        m
    };
    WorkerTemplate {
        labels: maps(&p.labels, &s.labels),
        annotations: maps(&p.annotations, &s.annotations),
        service_account_name: s
            .service_account_name
            .clone()
            .or_else(|| p.service_account_name.clone()),
        image_pull_secrets: by_key(&p.image_pull_secrets, &s.image_pull_secrets, |r| {
            r.name.clone()
        }),
        node_selector: maps(&p.node_selector, &s.node_selector),
        tolerations: appended(&p.tolerations, &s.tolerations),
        affinity: s.affinity.clone().or_else(|| p.affinity.clone()),
        topology_spread_constraints: appended(
            &p.topology_spread_constraints,
            &s.topology_spread_constraints,
        ),
        priority_class_name: s
            .priority_class_name
            .clone()
            .or_else(|| p.priority_class_name.clone()),
        env: by_key(&p.env, &s.env, |e| e.name.clone()),
        env_from: appended(&p.env_from, &s.env_from),
        volumes: by_key(&p.volumes, &s.volumes, |v| v.name.clone()),
        volume_mounts: by_key(&p.volume_mounts, &s.volume_mounts, |m| m.mount_path.clone()),
        security_context: match (&p.security_context, &s.security_context) {
            (Some(p), Some(s)) => Some(merged(p, s)),
            (p, s) => s.clone().or_else(|| p.clone()),
        },
        sidecars: by_key(&p.sidecars, &s.sidecars, |c| c.name.clone()),
    }
}

/// `base` with each entry of `over` replacing the entry of the same key in place, or appended.
fn by_key<T: Clone, K: PartialEq>(base: &[T], over: &[T], key: impl Fn(&T) -> K) -> Vec<T> {
    let mut out = base.to_vec();
    for item in over {
        match out.iter().position(|o| key(o) == key(item)) {
            Some(i) => out[i] = item.clone(),
            None => out.push(item.clone()),
        }
    }
    out
}

/// `base` followed by the entries of `over` it does not already hold.
fn appended<T: Clone + PartialEq>(base: &[T], over: &[T]) -> Vec<T> {
    let mut out = base.to_vec();
    out.extend(over.iter().filter(|o| !base.contains(o)).cloned());
    out
}

/// Refuses what a template (at `field`, e.g. `spec.stages[0].template`) must not do: replace
/// what the operator sets, or leave the non-root baseline.
pub fn check(t: &WorkerTemplate, field: &str) -> Result<(), SpecError> {
    let at = |f: String| format!("{field}.{f}");
    for key in t.labels.keys() {
        if key.starts_with("sessionflow.io/") || RESERVED_LABELS.contains(&key.as_str()) {
            return Err(SpecError::new(
                at(format!("labels[{key}]")),
                "this label is set by the operator (it selects the stage's pods)",
            ));
        }
    }
    for key in t.annotations.keys() {
        if key.starts_with("sessionflow.io/") {
            return Err(SpecError::new(
                at(format!("annotations[{key}]")),
                "sessionflow.io/ annotations are set by the operator",
            ));
        }
    }
    for (i, e) in t.env.iter().enumerate() {
        if e.name == SASL_USERNAME_ENV
            || e.name == SASL_PASSWORD_ENV
            || e.name.starts_with("SESSIONFLOW_")
        {
            return Err(SpecError::new(
                at(format!("env[{i}].name")),
                format!(
                    "{} is reserved: the worker's settings and credentials come from the spec",
                    e.name
                ),
            ));
        }
    }
    for (i, v) in t.volumes.iter().enumerate() {
        if RESERVED_VOLUMES.contains(&v.name.as_str()) {
            return Err(SpecError::new(
                at(format!("volumes[{i}].name")),
                format!("volume {:?} is mounted by the operator", v.name),
            ));
        }
        let json = serde_json::to_value(v).expect("k8s types serialize");
        let kinds = json.as_object().into_iter().flatten().map(|(k, _)| k);
        for kind in kinds.filter(|k| *k != "name") {
            if !ALLOWED_VOLUMES.contains(&kind.as_str()) {
                return Err(SpecError::new(
                    at(format!("volumes[{i}].{kind}")),
                    format!(
                        "{kind} volumes are not allowed (Pod Security restricted allows {})",
                        ALLOWED_VOLUMES.join(", ")
                    ),
                ));
            }
        }
    }
    for (i, m) in t.volume_mounts.iter().enumerate() {
        let path = m.mount_path.trim_end_matches('/');
        if path == CONFIG_DIR || path.starts_with(&format!("{CONFIG_DIR}/")) {
            return Err(SpecError::new(
                at(format!("volumeMounts[{i}].mountPath")),
                format!("{CONFIG_DIR} holds the worker's config and credentials"),
            ));
        }
    }
    if let Some(sc) = &t.security_context {
        check_security_context(sc, &at("securityContext".into()))?;
    }
    let mut names = BTreeSet::new();
    for (i, c) in t.sidecars.iter().enumerate() {
        let at = |f: &str| at(format!("sidecars[{i}].{f}"));
        if c.name == WORKER_CONTAINER || !names.insert(c.name.as_str()) {
            return Err(SpecError::new(
                at("name"),
                format!("container name {:?} is taken", c.name),
            ));
        }
        if c.image.as_deref().unwrap_or_default().is_empty() {
            return Err(SpecError::new(at("image"), "a sidecar needs an image"));
        }
        if c.restart_policy.as_deref().is_some_and(|p| p != "Always") {
            return Err(SpecError::new(
                at("restartPolicy"),
                "sidecars run as native sidecars: restartPolicy is Always (or left out)",
            ));
        }
        let ports = c.ports.iter().flatten();
        if let Some(j) = ports
            .enumerate()
            .find(|(_, p)| p.container_port == METRICS_PORT || p.name.as_deref() == Some("metrics"))
            .map(|(j, _)| j)
        {
            return Err(SpecError::new(
                at(&format!("ports[{j}]")),
                format!("port {METRICS_PORT} (\"metrics\") is the worker's"),
            ));
        }
        if let Some(sc) = &c.security_context {
            check_security_context(sc, &at("securityContext"))?;
        }
    }
    Ok(())
}

/// Checks a merged template: every extra mount names a volume of the pod. `fields` gives the
/// template each mount came from, for the error (`spec.stages[i].template` before
/// `spec.workerTemplate`).
pub fn check_mounts(
    merged: &WorkerTemplate,
    sources: &[(&str, &WorkerTemplate)],
) -> Result<(), SpecError> {
    let volumes: BTreeSet<&str> = merged
        .volumes
        .iter()
        .map(|v| v.name.as_str())
        .chain(RESERVED_VOLUMES)
        .collect();
    for m in &merged.volume_mounts {
        if volumes.contains(m.name.as_str()) {
            continue;
        }
        let field = sources
            .iter()
            .find_map(|(field, t)| {
                t.volume_mounts
                    .iter()
                    .position(|o| o == m)
                    .map(|i| format!("{field}.volumeMounts[{i}].name"))
            })
            .unwrap_or_else(|| "volumeMounts".into());
        return Err(SpecError::new(
            field,
            format!("no volume {:?} in the stage's template", m.name),
        ));
    }
    Ok(())
}

/// Pod Security `restricted`, for a container's security context overrides.
fn check_security_context(sc: &SecurityContext, field: &str) -> Result<(), SpecError> {
    let refuse = |f: &str, why: &str| Err(SpecError::new(format!("{field}.{f}"), why.to_string()));
    if sc.run_as_non_root == Some(false) {
        return refuse(
            "runAsNonRoot",
            "workers run as non-root; it cannot be false",
        );
    }
    if sc.run_as_user == Some(0) {
        return refuse("runAsUser", "0 is root; workers run as non-root");
    }
    if sc.privileged == Some(true) {
        return refuse("privileged", "privileged containers are not allowed");
    }
    if sc.allow_privilege_escalation == Some(true) {
        return refuse(
            "allowPrivilegeEscalation",
            "privilege escalation is not allowed",
        );
    }
    if let Some(caps) = &sc.capabilities {
        if let Some(cap) = caps
            .add
            .iter()
            .flatten()
            .find(|c| c.as_str() != "NET_BIND_SERVICE")
        {
            return refuse(
                "capabilities.add",
                &format!("{cap} cannot be added (only NET_BIND_SERVICE)"),
            );
        }
        if let Some(drop) = &caps.drop {
            if !drop.iter().any(|c| c == "ALL") {
                return refuse("capabilities.drop", "must drop ALL");
            }
        }
    }
    if let Some(profile) = &sc.seccomp_profile {
        if profile.type_ != "RuntimeDefault" && profile.type_ != "Localhost" {
            return refuse("seccompProfile.type", "must be RuntimeDefault or Localhost");
        }
    }
    if sc.proc_mount.as_deref().is_some_and(|m| m != "Default") {
        return refuse("procMount", "must be Default");
    }
    if sc
        .windows_options
        .as_ref()
        .and_then(|w| w.host_process)
        .unwrap_or(false)
    {
        return refuse(
            "windowsOptions.hostProcess",
            "host processes are not allowed",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{LocalObjectReference, Toleration};
    use proptest::prelude::*;

    fn env(name: &str, value: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: Some(value.into()),
            ..EnvVar::default()
        }
    }

    fn toleration(key: &str) -> Toleration {
        Toleration {
            key: Some(key.into()),
            operator: Some("Exists".into()),
            ..Toleration::default()
        }
    }

    #[test]
    fn the_stage_wins_field_by_field() {
        let pipeline = WorkerTemplate {
            labels: BTreeMap::from([("team".into(), "a".into()), ("tier".into(), "x".into())]),
            service_account_name: Some("pipeline-sa".into()),
            priority_class_name: Some("low".into()),
            image_pull_secrets: vec![LocalObjectReference {
                name: "regcred".into(),
            }],
            tolerations: vec![toleration("spot")],
            env: vec![env("A", "1"), env("B", "1")],
            security_context: Some(SecurityContext {
                run_as_user: Some(1000),
                read_only_root_filesystem: Some(false),
                ..SecurityContext::default()
            }),
            ..WorkerTemplate::default()
        };
        let stage = WorkerTemplate {
            labels: BTreeMap::from([("tier".into(), "y".into())]),
            service_account_name: Some("stage-sa".into()),
            tolerations: vec![toleration("gpu"), toleration("spot")],
            env: vec![env("B", "2"), env("C", "2")],
            security_context: Some(SecurityContext {
                run_as_user: Some(2000),
                ..SecurityContext::default()
            }),
            ..WorkerTemplate::default()
        };
        let m = merge(Some(&pipeline), Some(&stage));
        assert_eq!(
            m.labels,
            BTreeMap::from([("team".into(), "a".into()), ("tier".into(), "y".into())])
        );
        assert_eq!(m.service_account_name.as_deref(), Some("stage-sa"));
        assert_eq!(m.priority_class_name.as_deref(), Some("low"), "kept");
        assert_eq!(m.image_pull_secrets, pipeline.image_pull_secrets);
        assert_eq!(
            m.tolerations,
            vec![toleration("spot"), toleration("gpu")],
            "appended, no duplicate"
        );
        assert_eq!(m.env, vec![env("A", "1"), env("B", "2"), env("C", "2")]);
        let sc = m.security_context.unwrap();
        assert_eq!(sc.run_as_user, Some(2000));
        assert_eq!(sc.read_only_root_filesystem, Some(false), "merged by field");
        assert_eq!(merge(None, Some(&stage)), stage);
        assert_eq!(merge(Some(&pipeline), None), pipeline);
        assert_eq!(merge(None, None), WorkerTemplate::default());
    }

    fn names() -> impl Strategy<Value = Vec<(String, String)>> {
        prop::collection::vec(("[a-d]", "[0-9]"), 0..6)
    }

    proptest! {
        /// Keyed merges: every stage entry is in the result with the stage's value; every
        /// pipeline entry the stage does not name is kept; nothing else appears; keys stay
        /// unique when they were.
        #[test]
        fn keyed_merges_keep_the_pipeline_and_let_the_stage_win(p in names(), s in names()) {
            let dedup = |v: Vec<(String, String)>| {
                let mut seen = BTreeSet::new();
                v.into_iter().filter(|(k, _)| seen.insert(k.clone())).collect::<Vec<_>>()
            };
            let (p, s) = (dedup(p), dedup(s));
            let template = |v: &[(String, String)]| WorkerTemplate {
                labels: v.iter().cloned().collect(),
                env: v.iter().map(|(k, val)| env(k, val)).collect(),
                ..WorkerTemplate::default()
            };
            let m = merge(Some(&template(&p)), Some(&template(&s)));
            let expect = |k: &str| {
                s.iter().chain(p.iter()).find(|(key, _)| key == k).map(|(_, v)| v.clone())
            };
            let keys: BTreeSet<&str> = p.iter().chain(s.iter()).map(|(k, _)| k.as_str()).collect();
            prop_assert_eq!(m.labels.len(), keys.len());
            prop_assert_eq!(m.env.len(), keys.len());
            for k in keys {
                prop_assert_eq!(m.labels.get(k).cloned(), expect(k));
                let e = m.env.iter().find(|e| e.name == k).unwrap();
                prop_assert_eq!(e.value.clone(), expect(k));
            }
        }
    }

    #[test]
    fn templates_outside_the_baseline_are_refused_with_the_field_named() {
        type Mutation = Box<dyn Fn(&mut WorkerTemplate)>;
        let sc = |f: fn(&mut SecurityContext)| -> Mutation {
            Box::new(move |t: &mut WorkerTemplate| {
                let mut sc = SecurityContext::default();
                f(&mut sc);
                t.security_context = Some(sc);
            })
        };
        let cases: Vec<(Mutation, &str)> = vec![
            (
                sc(|s| s.run_as_non_root = Some(false)),
                "t.securityContext.runAsNonRoot",
            ),
            (
                sc(|s| s.run_as_user = Some(0)),
                "t.securityContext.runAsUser",
            ),
            (
                sc(|s| s.privileged = Some(true)),
                "t.securityContext.privileged",
            ),
            (
                sc(|s| s.allow_privilege_escalation = Some(true)),
                "t.securityContext.allowPrivilegeEscalation",
            ),
            (
                sc(|s| {
                    s.capabilities = Some(Capabilities {
                        add: Some(vec!["SYS_ADMIN".into()]),
                        ..Capabilities::default()
                    })
                }),
                "t.securityContext.capabilities.add",
            ),
            (
                sc(|s| {
                    s.capabilities = Some(Capabilities {
                        drop: Some(vec!["NET_RAW".into()]),
                        ..Capabilities::default()
                    })
                }),
                "t.securityContext.capabilities.drop",
            ),
            (
                sc(|s| {
                    s.seccomp_profile = Some(SeccompProfile {
                        type_: "Unconfined".into(),
                        ..SeccompProfile::default()
                    })
                }),
                "t.securityContext.seccompProfile.type",
            ),
            (
                Box::new(|t| {
                    t.labels.insert("sessionflow.io/stage".into(), "x".into());
                }),
                "t.labels[sessionflow.io/stage]",
            ),
            (
                Box::new(|t| {
                    t.labels.insert("app.kubernetes.io/name".into(), "x".into());
                }),
                "t.labels[app.kubernetes.io/name]",
            ),
            (
                Box::new(|t| {
                    t.annotations.insert(CONFIG_HASH.into(), "x".into());
                }),
                "t.annotations[sessionflow.io/config-hash]",
            ),
            (
                Box::new(|t| t.env = vec![env("A", "1"), env(SASL_PASSWORD_ENV, "x")]),
                "t.env[1].name",
            ),
            (
                Box::new(|t| {
                    t.volumes = vec![Volume {
                        name: "config".into(),
                        empty_dir: Some(Default::default()),
                        ..Volume::default()
                    }]
                }),
                "t.volumes[0].name",
            ),
            (
                Box::new(|t| {
                    t.volumes = vec![Volume {
                        name: "host".into(),
                        host_path: Some(k8s_openapi::api::core::v1::HostPathVolumeSource {
                            path: "/".into(),
                            ..Default::default()
                        }),
                        ..Volume::default()
                    }]
                }),
                "t.volumes[0].hostPath",
            ),
            (
                Box::new(|t| {
                    t.volume_mounts = vec![VolumeMount {
                        name: "x".into(),
                        mount_path: "/etc/sessionflow/".into(),
                        ..VolumeMount::default()
                    }]
                }),
                "t.volumeMounts[0].mountPath",
            ),
            (
                Box::new(|t| t.sidecars = vec![container("worker")]),
                "t.sidecars[0].name",
            ),
            (
                Box::new(|t| t.sidecars = vec![container("a"), container("a")]),
                "t.sidecars[1].name",
            ),
            (
                Box::new(|t| {
                    let mut c = container("a");
                    c.image = None;
                    t.sidecars = vec![c];
                }),
                "t.sidecars[0].image",
            ),
            (
                Box::new(|t| {
                    let mut c = container("a");
                    c.ports = Some(vec![ContainerPort {
                        container_port: METRICS_PORT,
                        ..ContainerPort::default()
                    }]);
                    t.sidecars = vec![c];
                }),
                "t.sidecars[0].ports[0]",
            ),
            (
                Box::new(|t| {
                    let mut c = container("a");
                    c.security_context = Some(SecurityContext {
                        run_as_user: Some(0),
                        ..SecurityContext::default()
                    });
                    t.sidecars = vec![c];
                }),
                "t.sidecars[0].securityContext.runAsUser",
            ),
        ];
        for (mutate, field) in cases {
            let mut t = WorkerTemplate::default();
            mutate(&mut t);
            let err = check(&t, "t").unwrap_err();
            assert_eq!(err.field, field, "{err}");
        }
        // Within the baseline: accepted.
        let ok = WorkerTemplate {
            security_context: Some(SecurityContext {
                run_as_user: Some(1000),
                read_only_root_filesystem: Some(false),
                capabilities: Some(Capabilities {
                    add: Some(vec!["NET_BIND_SERVICE".into()]),
                    drop: Some(vec!["ALL".into()]),
                }),
                ..SecurityContext::default()
            }),
            sidecars: vec![container("handler")],
            ..WorkerTemplate::default()
        };
        check(&ok, "t").unwrap();
    }

    fn container(name: &str) -> Container {
        Container {
            name: name.into(),
            image: Some("handler:1".into()),
            ..Container::default()
        }
    }
}
