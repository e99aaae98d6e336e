//! The reconciler: makes the cluster hold what [`render::plan`] says for a `SessionPipeline`,
//! and reports how that went in the resource's conditions.
//!
//! One pass: render (a bad spec stops here, as `Degraded` with the field named); list the
//! pipeline's ConfigMaps, Deployments and Services by label; apply with server-side apply only
//! the objects whose rendered hash differs from what the cluster holds (so a pass with nothing
//! to change writes nothing); delete the objects of stages no longer in the spec; create
//! missing topics when asked; then write `observedGeneration`, the conditions and `stagesReady`
//! if they changed. Deployment replicas are not touched here: [`crate::scaler`] owns them.
//!
//! Errors (API, Kafka, Secrets) are reported in `Degraded` and as a Warning event, and the
//! pass is retried with exponential backoff ([`error_policy`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;
use tokio::sync::Notify;

use crate::crd::{SessionPipeline, SessionPipelineStatus};
use crate::kafka::{Connection, CredentialError};
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::render::{self, Defaults, SpecError, StagePlan, MANAGER, PIPELINE_LABEL, STAGE_LABEL};

/// Periodic re-check when nothing happens.
const RESYNC: Duration = Duration::from_secs(300);

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub defaults: Defaults,
    pub metrics: Metrics,
    pub recorder: Recorder,
    /// Woken when a stage Deployment is created, so it gets its replicas without waiting a
    /// whole scaler interval.
    pub scaler_wake: Arc<Notify>,
    /// Pipelines (uid, generation) whose topics were ensured.
    topics_ensured: Mutex<HashSet<(String, i64)>>,
    /// Consecutive failures per pipeline uid, for the backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// Only the leader reconciles ([`crate::leader`]).
    pub leadership: Leadership,
}

impl Context {
    pub fn new(client: Client, defaults: Defaults, metrics: Metrics, reporter: Reporter) -> Self {
        Self {
            client: client.clone(),
            defaults,
            metrics,
            recorder: Recorder::new(client.clone(), reporter),
            scaler_wake: Arc::new(Notify::new()),
            topics_ensured: Mutex::default(),
            failures: Mutex::default(),
            leadership: Leadership::always(),
        }
    }

    /// Reconciles only while `leadership` says this replica leads.
    pub fn with_leadership(self, leadership: Leadership) -> Self {
        Self { leadership, ..self }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{action}: {source}")]
    Api {
        action: String,
        #[source]
        source: kube::Error,
    },
    #[error("kafka credentials: {0}")]
    Credentials(#[from] CredentialError),
    #[error("creating topics: {0}")]
    Topics(String),
    #[error("{0} has no namespace")]
    NoNamespace(String),
}

/// One reconcile of `sp`.
pub async fn reconcile(sp: Arc<SessionPipeline>, ctx: Arc<Context>) -> Result<Action, Error> {
    if !ctx.leadership.is_leader() {
        // A standby: no call at all. Gaining the lease reconciles every pipeline.
        return Ok(Action::await_change());
    }
    let started = Instant::now();
    let result = converge(&sp, &ctx).await;
    ctx.metrics
        .reconcile_seconds
        .with_label_values::<&str>(&[])
        .observe(started.elapsed().as_secs_f64());
    let uid = sp.uid().unwrap_or_default();
    match &result {
        Ok(_) => {
            ctx.metrics.reconciles.with_label_values(&["ok"]).inc();
            ctx.failures.lock().expect("not poisoned").remove(&uid);
        }
        Err(error) => {
            ctx.metrics.reconciles.with_label_values(&["error"]).inc();
            tracing::warn!(pipeline = %sp.name_any(), %error, "reconcile failed");
            // Best effort: the error itself is what the controller acts on.
            if let Err(e) = report_error(&sp, &ctx, error).await {
                tracing::warn!(pipeline = %sp.name_any(), error = %e, "could not report the failure");
            }
        }
    }
    result
}

/// Requeue after a failure, backing off per pipeline.
pub fn error_policy(sp: Arc<SessionPipeline>, _error: &Error, ctx: Arc<Context>) -> Action {
    let mut failures = ctx.failures.lock().expect("not poisoned");
    let n = failures.entry(sp.uid().unwrap_or_default()).or_insert(0);
    *n += 1;
    Action::requeue(backoff(*n))
}

/// 1 s, 2 s, 4 s, … capped at 5 minutes.
pub fn backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    Duration::from_secs((1u64 << exp).min(300))
}

/// Wraps an API error with what was being done.
fn api_error(action: impl std::fmt::Display) -> impl FnOnce(kube::Error) -> Error {
    move |source| Error::Api {
        action: action.to_string(),
        source,
    }
}

async fn converge(sp: &SessionPipeline, ctx: &Context) -> Result<Action, Error> {
    let namespace = sp
        .namespace()
        .ok_or_else(|| Error::NoNamespace(sp.name_any()))?;
    let plans = match render::plan(sp, &ctx.defaults) {
        Ok(plans) => plans,
        Err(spec) => {
            report_invalid_spec(sp, ctx, &spec).await?;
            // Nothing to retry until the spec changes.
            return Ok(Action::await_change());
        }
    };

    let client = &ctx.client;
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &namespace);
    let services: Api<Service> = Api::namespaced(client.clone(), &namespace);
    let owned = ListParams::default().labels(&format!("{PIPELINE_LABEL}={}", sp.name_any()));
    let existing_config_maps = config_maps
        .list(&owned)
        .await
        .map_err(api_error(format!("listing ConfigMaps in {namespace}")))?
        .items;
    let existing_deployments = deployments
        .list(&owned)
        .await
        .map_err(api_error(format!("listing Deployments in {namespace}")))?
        .items;
    let existing_services = services
        .list(&owned)
        .await
        .map_err(api_error(format!("listing Services in {namespace}")))?
        .items;

    let mut rolled = HashSet::new();
    for plan in &plans {
        apply_if_changed(&config_maps, &existing_config_maps, &plan.config_map).await?;
        let created = !existing_deployments
            .iter()
            .any(|d| d.name_any() == plan.deployment.name_any());
        if apply_if_changed(&deployments, &existing_deployments, &plan.deployment).await? {
            rolled.insert(plan.stage.clone());
        }
        if created {
            ctx.scaler_wake.notify_one();
        }
        apply_if_changed(&services, &existing_services, &plan.service).await?;
    }

    let keep: HashSet<&str> = plans.iter().map(|p| p.stage.as_str()).collect();
    let uid = sp.uid().unwrap_or_default();
    delete_stale(&config_maps, &existing_config_maps, &keep, &uid).await?;
    let removed = delete_stale(&deployments, &existing_deployments, &keep, &uid).await?;
    delete_stale(&services, &existing_services, &keep, &uid).await?;
    for stage in &removed {
        ctx.metrics.forget_stage(&namespace, &sp.name_any(), stage);
        publish(
            sp,
            ctx,
            EventType::Normal,
            "StageRemoved",
            format!("stage {stage} is no longer in the spec; its objects were deleted"),
        )
        .await;
    }

    // After the objects: a broker that cannot be reached must not hold back other changes
    // (workers wait for their topics themselves); the failure still shows as Degraded.
    ensure_topics(sp, ctx, &namespace).await?;

    let ready = count_ready(&plans, &existing_deployments, &rolled);
    let status = converged_status(sp, ready, plans.len(), !rolled.is_empty(), now());
    write_status(sp, ctx, status).await?;
    Ok(Action::requeue(RESYNC))
}

async fn ensure_topics(sp: &SessionPipeline, ctx: &Context, namespace: &str) -> Result<(), Error> {
    if !sp.spec.topics.create {
        return Ok(());
    }
    let key = (
        sp.uid().unwrap_or_default(),
        sp.metadata.generation.unwrap_or(0),
    );
    if ctx
        .topics_ensured
        .lock()
        .expect("not poisoned")
        .contains(&key)
    {
        return Ok(());
    }
    let connection = Connection::resolve(&ctx.client, namespace, &sp.spec.kafka).await?;
    let created = connection
        .ensure_topics(&sp.spec.topics)
        .await
        .map_err(|e| Error::Topics(format!("{e:#}")))?;
    if !created.is_empty() {
        publish(
            sp,
            ctx,
            EventType::Normal,
            "TopicsCreated",
            format!("created topics {}", created.join(", ")),
        )
        .await;
    }
    ctx.topics_ensured.lock().expect("not poisoned").insert(key);
    Ok(())
}

/// Applies `desired` unless an object of that name already carries its hash. Returns whether
/// it wrote.
async fn apply_if_changed<K>(api: &Api<K>, existing: &[K], desired: &K) -> Result<bool, Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
    K::DynamicType: Default,
{
    let name = desired.name_any();
    let current = existing.iter().find(|e| e.name_any() == name);
    if current.and_then(render::applied_hash) == render::applied_hash(desired) {
        return Ok(false);
    }
    let kind = K::kind(&K::DynamicType::default()).to_string();
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(desired),
    )
    .await
    .map_err(api_error(format!("applying {kind} {name}")))?;
    Ok(true)
}

/// Deletes the objects of stages not in `keep` that this pipeline owns; returns their stages.
async fn delete_stale<K>(
    api: &Api<K>,
    existing: &[K],
    keep: &HashSet<&str>,
    owner_uid: &str,
) -> Result<Vec<String>, Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut removed = Vec::new();
    for obj in existing {
        let Some(stage) = obj.labels().get(STAGE_LABEL) else {
            continue;
        };
        let owned = obj.owner_references().iter().any(|o| o.uid == owner_uid);
        if keep.contains(stage.as_str()) || !owned {
            continue;
        }
        match api
            .delete(&obj.name_any(), &DeleteParams::background())
            .await
        {
            Ok(_) => removed.push(stage.clone()),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(api_error(format!("deleting {}", obj.name_any()))(e)),
        }
    }
    Ok(removed)
}

/// Stages whose Deployment has rolled out all its replicas (and was not changed just now).
fn count_ready(plans: &[StagePlan], deployments: &[Deployment], rolled: &HashSet<String>) -> usize {
    plans
        .iter()
        .filter(|p| !rolled.contains(&p.stage))
        .filter(|p| {
            deployments
                .iter()
                .find(|d| d.name_any() == p.deployment.name_any())
                .is_some_and(deployment_ready)
        })
        .count()
}

/// A Deployment is ready when its controller saw the latest spec and every wanted replica is
/// updated and ready.
pub fn deployment_ready(d: &Deployment) -> bool {
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let Some(status) = d.status.as_ref() else {
        return false;
    };
    let seen = status.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(0);
    seen && status.updated_replicas.unwrap_or(0) >= want
        && status.ready_replicas.unwrap_or(0) >= want
}

fn now() -> Time {
    Time(Timestamp::now())
}

/// The reconciler's part of the status after a successful pass.
fn converged_status(
    sp: &SessionPipeline,
    ready: usize,
    total: usize,
    rolling: bool,
    now: Time,
) -> SessionPipelineStatus {
    let all_ready = ready == total && !rolling;
    let summary = format!("{ready}/{total} stages ready");
    let conditions = [
        if all_ready {
            condition("Ready", true, "AllStagesReady", &summary)
        } else {
            condition("Ready", false, "StagesNotReady", &summary)
        },
        if all_ready {
            condition("Progressing", false, "Stable", "every stage is rolled out")
        } else {
            condition("Progressing", true, "RollingOut", &summary)
        },
        condition(
            "Degraded",
            false,
            "ReconcileSucceeded",
            "the spec is applied",
        ),
    ];
    status_with(
        sp,
        conditions.to_vec(),
        Some(format!("{ready}/{total}")),
        now,
    )
}

/// A condition without its transition time (filled in by [`status_with`]).
fn condition(type_: &str, status: bool, reason: &str, message: &str) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: Time(Timestamp::UNIX_EPOCH),
        observed_generation: None,
    }
}

/// Status with `conditions` replacing those of the same type; a condition whose status did not
/// change keeps its transition time.
fn status_with(
    sp: &SessionPipeline,
    conditions: Vec<Condition>,
    stages_ready: Option<String>,
    now: Time,
) -> SessionPipelineStatus {
    let previous = sp.status.clone().unwrap_or_default();
    let generation = sp.metadata.generation;
    let mut merged = previous.conditions.clone();
    for mut c in conditions {
        c.observed_generation = generation;
        let old = merged.iter().position(|o| o.type_ == c.type_);
        c.last_transition_time = match old.map(|i| &merged[i]) {
            Some(o) if o.status == c.status => o.last_transition_time.clone(),
            _ => now.clone(),
        };
        match old {
            Some(i) => merged[i] = c,
            None => merged.push(c),
        }
    }
    SessionPipelineStatus {
        observed_generation: generation,
        conditions: merged,
        stages_ready: stages_ready.or(previous.stages_ready),
        ..previous
    }
}

/// Writes the reconciler's fields of `status` unless the resource already shows them.
async fn write_status(
    sp: &SessionPipeline,
    ctx: &Context,
    status: SessionPipelineStatus,
) -> Result<(), Error> {
    let previous = sp.status.clone().unwrap_or_default();
    if previous.observed_generation == status.observed_generation
        && previous.conditions == status.conditions
        && previous.stages_ready == status.stages_ready
    {
        return Ok(());
    }
    let api: Api<SessionPipeline> =
        Api::namespaced(ctx.client.clone(), &sp.namespace().unwrap_or_default());
    let patch = json!({ "status": {
        "observedGeneration": status.observed_generation,
        "conditions": status.conditions,
        "stagesReady": status.stages_ready,
    }});
    api.patch_status(
        &sp.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .map_err(api_error(format!(
        "writing the status of {}",
        sp.name_any()
    )))?;
    Ok(())
}

async fn report_invalid_spec(
    sp: &SessionPipeline,
    ctx: &Context,
    spec: &SpecError,
) -> Result<(), Error> {
    let message = spec.to_string();
    let conditions = vec![
        condition("Ready", false, "InvalidSpec", &message),
        condition(
            "Progressing",
            false,
            "InvalidSpec",
            "nothing is applied until the spec is fixed",
        ),
        condition("Degraded", true, "InvalidSpec", &message),
    ];
    let status = status_with(sp, conditions, None, now());
    let changed = sp.status.as_ref().map(|s| &s.conditions) != Some(&status.conditions);
    write_status(sp, ctx, status).await?;
    if changed {
        publish(sp, ctx, EventType::Warning, "InvalidSpec", message).await;
    }
    Ok(())
}

async fn report_error(sp: &SessionPipeline, ctx: &Context, error: &Error) -> Result<(), Error> {
    let message = error.to_string();
    let status = status_with(
        sp,
        vec![condition("Degraded", true, "ReconcileFailed", &message)],
        None,
        now(),
    );
    write_status(sp, ctx, status).await?;
    publish(sp, ctx, EventType::Warning, "ReconcileFailed", message).await;
    Ok(())
}

/// Publishes an event about `sp`. Best effort: a cluster that refuses events (RBAC, or an API
/// server without the events API) must not stop reconciles, so a failure is only logged.
pub async fn publish(
    sp: &SessionPipeline,
    ctx: &Context,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &sp.object_ref(&())).await {
        tracing::warn!(pipeline = %sp.name_any(), reason, %error, "could not publish an event");
    }
}

#[cfg(test)]
#[path = "reconciler_tests.rs"]
mod scenarios;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_five_minutes() {
        let secs: Vec<u64> = (1..=11).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(backoff(u32::MAX).as_secs(), 300);
    }
}
