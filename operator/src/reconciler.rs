//! The reconciler: makes the cluster hold what [`render::plan`] says for a `SessionPipeline`,
//! and reports how that went in the resource's conditions.
//!
//! One pass: render (a bad spec stops here, as `Degraded` with the field named); list the
//! pipeline's ConfigMaps, Deployments, Services, PodDisruptionBudgets and Pods by label; apply
//! with server-side apply the objects that are missing, whose rendered hash changed, or whose
//! live fields drifted from the rendered ones (so a pass with nothing to change writes
//! nothing, and an edited or deleted child is repaired on the next pass); leave alone, and
//! report as `Degraded`/`NameConflict`, an object of a wanted name the pipeline does not
//! control; delete the objects of stages no longer in the spec (and the budgets of stages
//! that turned theirs off); create missing topics when asked; then write the conditions,
//! `stagesReady` and — for a pass without a problem — `observedGeneration`, if they changed.
//! A stage whose pods cannot run (image pull, crash loop, config error, a rollout past its
//! deadline) makes the pipeline `Degraded` with the pod and the kubelet's message. Deployment replicas are not touched here: [`crate::scaler`] owns them.
//!
//! Errors (API, Kafka, Secrets) are reported in `Degraded` and as a Warning event, and the
//! pass is retried with exponential backoff ([`error_policy`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
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
use crate::drift;
use crate::health::{self, StageHealth};
use crate::kafka::{self, Connection, CredentialError};
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::render::{self, Defaults, SpecError, StagePlan, MANAGER, PIPELINE_LABEL, STAGE_LABEL};

/// Periodic re-check when nothing happens.
const RESYNC: Duration = Duration::from_secs(300);
/// Re-check of a pipeline with credential Secrets, to see a rotation.
const RESYNC_WITH_SECRETS: Duration = Duration::from_secs(60);
/// Re-check while a stage is not ready or a name is taken: pods are not watched, so a pod
/// that starts failing after its Deployment last changed is seen within this.
const RETRY_UNHEALTHY: Duration = Duration::from_secs(15);

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
    /// `namespace/name` of each stage Deployment → its generation after the operator last
    /// applied it: the pod template the stage must run ([`health::stage_health`]).
    template_generations: Mutex<HashMap<String, i64>>,
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
            template_generations: Mutex::default(),
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
    /// An error already written to the status by the pass itself.
    #[error(transparent)]
    Reported(Box<Error>),
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
            if matches!(error, Error::Reported(_)) {
                // Already in the status, with the stages' state.
            } else if let Err(e) = report_error(&sp, &ctx, error).await {
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
    // A spec that cannot run is refused before anything is read (Secrets included).
    if let Err(spec) = render::plan(sp, &ctx.defaults) {
        report_invalid_spec(sp, ctx, &spec).await?;
        // Nothing to retry until the spec changes.
        return Ok(Action::await_change());
    }
    // The credential Secrets' versions go on the pod template: a rotation rolls the stages.
    // Secrets are not watched (that would need list/watch on every Secret), so a pipeline
    // with credentials is looked at again every RESYNC_WITH_SECRETS.
    let secrets = kafka::credential_secrets(&ctx.client, &namespace, &sp.spec.kafka).await?;
    let secret_versions: Vec<(String, String)> = secrets
        .iter()
        .map(|s| (s.name_any(), s.resource_version().unwrap_or_default()))
        .collect();
    let plans = match render::plan_with_secrets(sp, &ctx.defaults, &secret_versions) {
        Ok(plans) => plans,
        Err(spec) => {
            report_invalid_spec(sp, ctx, &spec).await?;
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
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &namespace);
    let existing_budgets = budgets
        .list(&owned)
        .await
        .map_err(api_error(format!(
            "listing PodDisruptionBudgets in {namespace}"
        )))?
        .items;

    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let existing_pods = pods
        .list(&owned)
        .await
        .map_err(api_error(format!("listing Pods in {namespace}")))?
        .items;

    let uid = sp.uid().unwrap_or_default();
    let mut rolled = HashSet::new();
    let mut conflicts = Vec::new();
    for plan in &plans {
        // Every object of the stage must be the pipeline's before any is written: a Deployment
        // must not mount a ConfigMap someone else wrote.
        let cm = live(&config_maps, &existing_config_maps, &plan.config_map, &uid).await?;
        let dep = live(&deployments, &existing_deployments, &plan.deployment, &uid).await?;
        let svc = live(&services, &existing_services, &plan.service, &uid).await?;
        let pdb = match &plan.disruption_budget {
            Some(budget) => Some((
                live(&budgets, &existing_budgets, budget, &uid).await?,
                budget,
            )),
            None => None,
        };
        let stage_conflicts: Vec<String> = [cm.conflict(), dep.conflict(), svc.conflict()]
            .into_iter()
            .chain(pdb.as_ref().map(|(l, _)| l.conflict()))
            .flatten()
            .collect();
        if !stage_conflicts.is_empty() {
            conflicts.extend(stage_conflicts);
            continue;
        }
        apply_unless_current(&config_maps, &cm, &plan.config_map).await?;
        if let Some(generation) = apply_unless_current(&deployments, &dep, &plan.deployment).await?
        {
            rolled.insert(plan.stage.clone());
            ctx.template_generations
                .lock()
                .expect("not poisoned")
                .insert(
                    format!("{namespace}/{}", plan.deployment.name_any()),
                    generation,
                );
            if matches!(dep, Live::Missing) {
                ctx.scaler_wake.notify_one();
            }
        }
        apply_unless_current(&services, &svc, &plan.service).await?;
        if let Some((live, budget)) = &pdb {
            apply_unless_current(&budgets, live, budget).await?;
        }
    }

    // Kept by name, not by stage: an object of a stage still in the spec but under another
    // name (the names an older operator rendered) is deleted too.
    let names = |f: &dyn Fn(&StagePlan) -> Option<String>| -> HashSet<String> {
        plans.iter().filter_map(f).collect()
    };
    let keep_cms = names(&|p| p.config_map.metadata.name.clone());
    let keep_deployments = names(&|p| p.deployment.metadata.name.clone());
    let keep_services = names(&|p| p.service.metadata.name.clone());
    // A stage whose budget was turned off keeps its other objects but loses its budget.
    let keep_budgets = names(&|p| {
        p.disruption_budget
            .as_ref()
            .and_then(|b| b.metadata.name.clone())
    });
    delete_stale(&config_maps, &existing_config_maps, &keep_cms, &uid).await?;
    let removed =
        delete_stale(&deployments, &existing_deployments, &keep_deployments, &uid).await?;
    delete_stale(&services, &existing_services, &keep_services, &uid).await?;
    delete_stale(&budgets, &existing_budgets, &keep_budgets, &uid).await?;
    let stages: HashSet<&str> = plans.iter().map(|p| p.stage.as_str()).collect();
    for stage in removed.iter().filter(|s| !stages.contains(s.as_str())) {
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
    // (workers wait for their topics themselves); the failure still shows as Degraded, in a
    // status that also tells how the stages are.
    let topics = ensure_topics(sp, ctx, &namespace).await;

    let healths: Vec<(String, StageHealth)> = plans
        .iter()
        .map(|p| {
            let health = if rolled.contains(&p.stage) {
                StageHealth::Progressing
            } else {
                let name = p.deployment.name_any();
                let live = existing_deployments.iter().find(|d| d.name_any() == name);
                let stage_pods: Vec<&Pod> = existing_pods
                    .iter()
                    .filter(|pod| pod.labels().get(STAGE_LABEL) == Some(&p.stage))
                    .collect();
                let generation = ctx
                    .template_generations
                    .lock()
                    .expect("not poisoned")
                    .get(&format!("{namespace}/{name}"))
                    .copied();
                health::stage_health(live, &stage_pods, generation)
            };
            (p.stage.clone(), health)
        })
        .collect();
    let problem = match (&topics, conflicts.first()) {
        (_, Some(_)) => Some(Problem {
            reason: "NameConflict".into(),
            message: format!(
                "{} not created by this SessionPipeline; the operator does not take it over \
                 (delete or rename it)",
                conflicts.join(", ")
            ),
        }),
        (Err(e), None) => Some(Problem {
            reason: "TopicsFailed".into(),
            message: e.to_string(),
        }),
        (Ok(()), None) => None,
    };
    let status = converged_status(sp, &healths, problem.as_ref(), now());
    let all_ready = healths.iter().all(|(_, h)| *h == StageHealth::Ready);
    let degraded_now = degraded(Some(&status));
    let newly_degraded = degraded_now
        .filter(|(reason, _)| degraded(sp.status.as_ref()).map(|(r, _)| r) != Some(reason.clone()));
    write_status(sp, ctx, status).await?;
    if let Some((reason, message)) = newly_degraded {
        publish(sp, ctx, EventType::Warning, &reason, message).await;
    }
    topics.map_err(|e| Error::Reported(Box::new(e)))?;
    if !conflicts.is_empty() {
        return Ok(Action::requeue(RETRY_UNHEALTHY));
    }
    // Pods are not watched: look again soon while a stage is not ready.
    Ok(Action::requeue(if !all_ready {
        RETRY_UNHEALTHY
    } else if !secret_versions.is_empty() {
        RESYNC_WITH_SECRETS
    } else {
        RESYNC
    }))
}

/// Why the pipeline is `Degraded` after a pass that ran to the end.
struct Problem {
    reason: String,
    message: String,
}

/// The reason and message of a `Degraded: True` condition.
fn degraded(status: Option<&SessionPipelineStatus>) -> Option<(String, String)> {
    status?
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded" && c.status == "True")
        .map(|c| (c.reason.clone(), c.message.clone()))
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

/// The live object of a name the pipeline wants.
#[derive(Debug)]
enum Live<K> {
    Missing,
    /// Controlled by the pipeline.
    Ours(Box<K>),
    /// Held by something else (named `Kind name`): never written.
    Foreign(String),
}

impl<K> Live<K> {
    fn conflict(&self) -> Option<String> {
        match self {
            Live::Foreign(what) => Some(what.clone()),
            _ => None,
        }
    }
}

fn kind_of<K: Resource>() -> String
where
    K::DynamicType: Default,
{
    K::kind(&K::DynamicType::default()).to_string()
}

/// The live object named as `desired`. `existing` are the objects listed by the pipeline's
/// label; a name not among them is looked up, since an object without the label can hold it.
async fn live<K>(
    api: &Api<K>,
    existing: &[K],
    desired: &K,
    owner_uid: &str,
) -> Result<Live<K>, Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let name = desired.name_any();
    let found = match existing.iter().find(|e| e.name_any() == name) {
        Some(live) => Some(live.clone()),
        None => api
            .get_opt(&name)
            .await
            .map_err(api_error(format!("reading {} {name}", kind_of::<K>())))?,
    };
    Ok(match found {
        None => Live::Missing,
        Some(obj) if drift::owned_by(&obj, owner_uid) => Live::Ours(Box::new(obj)),
        Some(_) => Live::Foreign(format!("{} {name}", kind_of::<K>())),
    })
}

/// Applies `desired` (server-side apply) when it is missing, its rendered hash changed, or the
/// live object drifted from it ([`drift::drifted`]); returns the generation after the write,
/// or `None` when nothing was written. A [`Live::Foreign`] object is never written.
async fn apply_unless_current<K>(
    api: &Api<K>,
    live: &Live<K>,
    desired: &K,
) -> Result<Option<i64>, Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
    K::DynamicType: Default,
{
    match live {
        Live::Foreign(_) => return Ok(None),
        Live::Ours(live)
            if render::applied_hash(live.as_ref()) == render::applied_hash(desired)
                && !drift::drifted(desired, live.as_ref()) =>
        {
            return Ok(None)
        }
        _ => {}
    }
    let name = desired.name_any();
    let applied = api
        .patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(desired),
        )
        .await
        .map_err(api_error(format!("applying {} {name}", kind_of::<K>())))?;
    Ok(Some(applied.meta().generation.unwrap_or(0)))
}

/// Deletes the objects of stages not in `keep` that this pipeline owns; returns their stages.
async fn delete_stale<K>(
    api: &Api<K>,
    existing: &[K],
    keep: &HashSet<String>,
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
        if keep.contains(&obj.name_any()) || !owned {
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

fn now() -> Time {
    Time(Timestamp::now())
}

/// The reconciler's part of the status after a pass that ran to the end: `Ready` when every
/// stage is, `Degraded` with the first stage that cannot run (its pod or Deployment and the
/// message) or the pass's `problem`. `observedGeneration` advances only without a problem.
fn converged_status(
    sp: &SessionPipeline,
    healths: &[(String, StageHealth)],
    problem: Option<&Problem>,
    now: Time,
) -> SessionPipelineStatus {
    let total = healths.len();
    let ready = healths
        .iter()
        .filter(|(_, h)| *h == StageHealth::Ready)
        .count();
    let all_ready = ready == total;
    let summary = format!("{ready}/{total} stages ready");
    let failing = healths.iter().find_map(|(stage, h)| match h {
        StageHealth::Failing {
            reason,
            subject,
            message,
        } => Some((
            reason.as_str(),
            format!("stage {stage}: {subject}: {message}"),
        )),
        _ => None,
    });
    let degraded = match (problem, &failing) {
        (Some(p), _) => condition("Degraded", true, &p.reason, &p.message),
        (None, Some((reason, message))) => condition("Degraded", true, reason, message),
        (None, None) => condition(
            "Degraded",
            false,
            "ReconcileSucceeded",
            "the spec is applied",
        ),
    };
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
        degraded,
    ];
    status_with(
        sp,
        conditions.to_vec(),
        Some(format!("{ready}/{total}")),
        problem.is_none(),
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
    advance_generation: bool,
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
        observed_generation: if advance_generation {
            generation
        } else {
            previous.observed_generation
        },
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
    // The generation was judged to the end (it cannot run): it counts as observed.
    let status = status_with(sp, conditions, None, true, now());
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
        false,
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
