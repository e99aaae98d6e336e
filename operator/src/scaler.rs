//! The autoscaler loop: on its own interval (independent of reconciles), for every stage of
//! every pipeline, read the lag from Kafka, decide with [`autoscale::decide`], apply the
//! replica count, and report lag and replicas in the status, in events and as metrics.
//!
//! Pipelines are isolated from each other: a pass works on all of them concurrently, and each
//! pipeline's lag reads share one deadline ([`lag_deadline`], below the interval), so a
//! cluster that does not answer delays only its own pipeline (which then holds its counts and
//! shows `Fallback`), and every other pipeline is still scaled every interval. Each pass's
//! duration is a metric, and each completed pass is recorded for `/healthz`
//! ([`crate::liveness`]). Only the leader ([`crate::leader`]) reads and writes; a standby's
//! passes do nothing.
//!
//! It owns `spec.replicas` of the stage Deployments under its own field manager
//! ([`SCALER_MANAGER`]); the reconciler never sets it, so the two never undo each other.
//! A stage whose lag cannot be read is held at its count (brought within bounds only), and the
//! failure is counted, not fatal.
//!
//! Two ways to keep it away from `spec.replicas`: a stage in `autoscaling.mode: external` (an
//! HPA or KEDA owns the count; the lag is still read and exported for them), and the
//! pipeline annotation [`AUTOSCALING_PAUSED_ANNOTATION`] (everything is left as it is). Either
//! way nothing is written to the Deployment, so the external owner is never fought. The
//! pipeline's `Autoscaling` condition tells which case holds ([`autoscaling_condition`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use sessionflow_worker::commit::lag;
use tokio::sync::Notify;

use crate::autoscale::{self, Decision, History, Policy, Signal};
use crate::crd::{
    autoscaling_paused, AutoscalingMode, SessionPipeline, StageSpec, StageStatus,
    AUTOSCALING_PAUSED_ANNOTATION,
};
use crate::kafka::{Connection, LagReaders};
use crate::leader::Leadership;
use crate::liveness::PassClock;
use crate::metrics::Metrics;
use crate::render;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// Field manager of the replica count.
pub const SCALER_MANAGER: &str = "sessionflow-autoscaler";

type StageKey = (String, String, String);

pub struct Scaler {
    client: Client,
    store: Store<SessionPipeline>,
    metrics: Metrics,
    recorder: Recorder,
    interval: Duration,
    wake: Arc<Notify>,
    started: Instant,
    /// How long one pipeline's lag reads may take in one pass.
    lag_deadline: Duration,
    leadership: Leadership,
    passes: Arc<PassClock>,
    // Shared by the concurrent pipeline passes; held only between awaits.
    histories: Mutex<HashMap<StageKey, History>>,
    /// Stages seen in the last pass, to drop the series of those that are gone.
    stages: HashSet<StageKey>,
    lag_readers: Mutex<LagReaders>,
}

/// The deadline of one pipeline's lag reads for passes every `interval`: two thirds of it (so
/// a pass with an unreachable cluster still ends within the interval), between 0.5 s and 10 s
/// (librdkafka's own timeout of one read).
pub fn lag_deadline(interval: Duration) -> Duration {
    (interval * 2 / 3).clamp(Duration::from_millis(500), Duration::from_secs(10))
}

impl Scaler {
    pub fn new(
        client: Client,
        store: Store<SessionPipeline>,
        metrics: Metrics,
        recorder: Recorder,
        interval: Duration,
        wake: Arc<Notify>,
    ) -> Self {
        Self {
            client,
            store,
            metrics,
            recorder,
            interval,
            wake,
            started: Instant::now(),
            lag_deadline: lag_deadline(interval),
            leadership: Leadership::always(),
            passes: Arc::new(PassClock::new(
                interval,
                lag_deadline(interval),
                Instant::now(),
            )),
            histories: Mutex::default(),
            stages: HashSet::new(),
            lag_readers: Mutex::default(),
        }
    }

    /// Works only while `leadership` says this replica leads.
    pub fn with_leadership(self, leadership: Leadership) -> Self {
        Self { leadership, ..self }
    }

    /// Records completed passes in `passes` (what `/healthz` reads).
    pub fn with_pass_clock(self, passes: Arc<PassClock>) -> Self {
        Self { passes, ..self }
    }

    /// One pipeline's lag reads get `deadline` per pass instead of [`lag_deadline`].
    pub fn with_lag_deadline(self, deadline: Duration) -> Self {
        Self {
            lag_deadline: deadline,
            ..self
        }
    }

    /// Runs until the task is dropped: a pass every interval (a pass that took longer is
    /// followed by the next at once), or sooner when woken.
    pub async fn run(mut self) {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = self.wake.notified() => {}
            }
            self.tick().await;
        }
    }

    /// One evaluation of every stage of every pipeline, the pipelines concurrently.
    pub async fn tick(&mut self) {
        let started = Instant::now();
        if self.leadership.is_leader() {
            let now = self.started.elapsed();
            let pipelines = self.store.state();
            let this = &*self;
            let passes = pipelines.iter().map(|sp| async move {
                let mut seen = Vec::new();
                if let Err(error) = this.scale_pipeline(sp, now, &mut seen).await {
                    tracing::warn!(pipeline = %sp.name_any(), %error, "autoscaling pass failed");
                }
                seen
            });
            let seen: HashSet<StageKey> = futures::future::join_all(passes)
                .await
                .into_iter()
                .flatten()
                .collect();
            for key in self.stages.difference(&seen) {
                self.metrics.forget_stage(&key.0, &key.1, &key.2);
            }
            self.histories
                .lock()
                .expect("not poisoned")
                .retain(|k, _| seen.contains(k));
            self.stages = seen;
            self.lag_readers
                .lock()
                .expect("not poisoned")
                .forget_unused();
        } else {
            // A standby: nothing read, nothing written; what it knew is stale once it leads.
            self.histories.lock().expect("not poisoned").clear();
        }
        self.metrics
            .scaler_pass_seconds
            .with_label_values::<&str>(&[])
            .observe(started.elapsed().as_secs_f64());
        self.passes.completed();
    }

    async fn scale_pipeline(
        &self,
        sp: &SessionPipeline,
        now: Duration,
        seen: &mut Vec<StageKey>,
    ) -> Result<(), kube::Error> {
        let namespace = sp.namespace().unwrap_or_default();
        let pipeline = sp.name_any();
        let paused = autoscaling_paused(sp);
        let mut problems = Vec::new();
        let connection = Connection::resolve(&self.client, &namespace, &sp.spec.kafka).await;
        if let Err(error) = &connection {
            tracing::warn!(%pipeline, %error, "cannot connect to Kafka; holding replicas");
            problems.push(format!("kafka credentials: {error}"));
        }
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &namespace);
        let previous = sp.status.clone().unwrap_or_default();
        let deadline = tokio::time::Instant::now() + self.lag_deadline;
        let mut statuses = Vec::new();
        for stage in &sp.spec.stages {
            let key = (namespace.clone(), pipeline.clone(), stage.name.clone());
            seen.push(key.clone());
            let labels = [namespace.as_str(), pipeline.as_str(), stage.name.as_str()];
            let group = render::group_id(&namespace, &pipeline, &stage.name);
            let reader = match &connection {
                Ok(c) => self
                    .lag_readers
                    .lock()
                    .expect("not poisoned")
                    .get(c, &group),
                Err(e) => Err(anyhow::anyhow!("{e}")),
            };
            let lags = match reader {
                Ok(r) => tokio::time::timeout_at(deadline, r.read(&stage.input))
                    .await
                    .unwrap_or_else(|_| {
                        Err(anyhow::anyhow!(
                            "lag read timed out after {:?} (the pipeline's deadline)",
                            self.lag_deadline
                        ))
                    }),
                Err(e) => Err(e),
            };
            let (lag, effective, partitions) = match &lags {
                Ok(l) => (
                    Some(lag::total(l)),
                    Some(lag::total_effective(l)),
                    Some(l.len() as i32),
                ),
                Err(error) => {
                    tracing::warn!(%pipeline, stage = %stage.name, error = %error, "lag read failed");
                    if connection.is_ok() {
                        problems.push(format!("stage {}: {error:#}", stage.name));
                    }
                    self.metrics
                        .lag_read_errors
                        .with_label_values(&labels)
                        .inc();
                    (None, None, None)
                }
            };
            if let (Some(l), Some(e), Some(p)) = (lag, effective, partitions) {
                self.metrics.stage_lag.with_label_values(&labels).set(l);
                self.metrics
                    .stage_effective_lag
                    .with_label_values(&labels)
                    .set(e);
                self.metrics
                    .stage_partitions
                    .with_label_values(&labels)
                    .set(p.into());
            }
            let name = render::stage_object_name(&pipeline, &stage.name);
            let Some(deployment) = deployments.get_opt(&name).await? else {
                // Not created yet: the reconciler will, and wake this loop.
                continue;
            };
            let current = deployment
                .spec
                .as_ref()
                .and_then(|s| s.replicas)
                .unwrap_or(1)
                .max(0) as u32;
            let signal = match (effective, partitions) {
                (Some(e), Some(p)) => Some(Signal {
                    effective_lag: e.max(0) as u64,
                    partitions: p.max(0) as u32,
                }),
                _ => None,
            };
            let decision = if paused || stage.autoscaling.mode == AutoscalingMode::External {
                // Someone else owns the count: record nothing, so that when it comes back the
                // scale-down window starts afresh.
                self.histories.lock().expect("not poisoned").remove(&key);
                Decision {
                    desired: current,
                    recommended: None,
                    reason: autoscale::Reason::Steady,
                }
            } else {
                let mut histories = self.histories.lock().expect("not poisoned");
                let history = histories.entry(key).or_default();
                autoscale::decide(&policy(stage), signal.as_ref(), current, history, now)
            };
            let mut status = previous
                .stages
                .iter()
                .find(|s| s.name == stage.name)
                .cloned()
                .unwrap_or_default();
            if decision.desired != current {
                self.apply_replicas(&deployments, &name, decision.desired)
                    .await?;
                self.announce(sp, stage, current, &decision).await;
                let direction = if decision.desired > current {
                    "up"
                } else {
                    "down"
                };
                self.metrics
                    .scale_events
                    .with_label_values(&[labels[0], labels[1], labels[2], direction])
                    .inc();
                status.last_scale_time = Some(Time(Timestamp::now()));
                status.last_scale_reason = Some(decision.reason.to_string());
            }
            let ready = deployment
                .status
                .as_ref()
                .and_then(|s| s.ready_replicas)
                .unwrap_or(0);
            self.metrics
                .replicas_desired
                .with_label_values(&labels)
                .set(decision.desired.into());
            self.metrics
                .replicas_ready
                .with_label_values(&labels)
                .set(ready.into());
            statuses.push(StageStatus {
                name: stage.name.clone(),
                desired_replicas: Some(decision.desired as i32),
                ready_replicas: Some(ready),
                lag,
                effective_lag: effective,
                partitions,
                paused_partitions: None,
                ..status
            });
        }
        let total = statuses
            .iter()
            .map(|s| s.effective_lag)
            .sum::<Option<i64>>();
        let condition = autoscaling_condition(paused, &problems, &sp.spec.stages);
        let conditions = merge_condition(sp, &previous.conditions, condition);
        if statuses != previous.stages || total != previous.lag || conditions != previous.conditions
        {
            let api: Api<SessionPipeline> = Api::namespaced(self.client.clone(), &namespace);
            let mut patch = json!({ "status": { "stages": statuses, "lag": total } });
            if conditions != previous.conditions {
                // A merge patch replaces the whole list: the reconciler's conditions go along
                // as the cache shows them.
                patch["status"]["conditions"] = json!(conditions);
            }
            api.patch_status(&pipeline, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
        Ok(())
    }

    async fn apply_replicas(
        &self,
        deployments: &Api<Deployment>,
        name: &str,
        replicas: u32,
    ) -> Result<(), kube::Error> {
        let patch = json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": { "name": name },
            "spec": { "replicas": replicas },
        });
        deployments
            .patch(
                name,
                &PatchParams::apply(SCALER_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        Ok(())
    }

    async fn announce(&self, sp: &SessionPipeline, stage: &StageSpec, from: u32, d: &Decision) {
        let reason = if d.desired > from {
            "ScaledUp"
        } else {
            "ScaledDown"
        };
        let event = Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: Some(format!(
                "stage {}: {from} → {} replicas ({})",
                stage.name, d.desired, d.reason
            )),
            action: "Scale".into(),
            secondary: None,
        };
        tracing::info!(pipeline = %sp.name_any(), stage = %stage.name, from, to = d.desired,
            reason = %d.reason, "scaled");
        if let Err(error) = self.recorder.publish(&event, &sp.object_ref(&())).await {
            tracing::warn!(%error, "could not publish the scale event");
        }
    }
}

/// The pipeline's `Autoscaling` condition (without its transition time): `False`/`Paused`
/// when the annotation pauses it, `False`/`Fallback` when a lag cannot be read (`problems`
/// name the stage or the credentials, and the error), `True`/`Active` otherwise.
pub fn autoscaling_condition(paused: bool, problems: &[String], stages: &[StageSpec]) -> Condition {
    let external = stages
        .iter()
        .filter(|s| s.autoscaling.mode == AutoscalingMode::External)
        .count();
    let by_lag = stages.len() - external;
    let (status, reason, message) = if paused {
        (
            "False",
            "Paused",
            format!(
                "{AUTOSCALING_PAUSED_ANNOTATION} is \"true\": replica counts are left as they are"
            ),
        )
    } else if !problems.is_empty() {
        (
            "False",
            "Fallback",
            format!(
                "lag cannot be read, replicas are held: {}",
                problems.join("; ")
            ),
        )
    } else {
        (
            "True",
            "Active",
            format!(
                "lag read for every stage; {by_lag} scaled by lag, {external} by an external autoscaler"
            ),
        )
    };
    Condition {
        type_: AUTOSCALING_CONDITION.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time: Time(Timestamp::UNIX_EPOCH),
        observed_generation: None,
    }
}

/// The condition type the autoscaler owns.
pub const AUTOSCALING_CONDITION: &str = "Autoscaling";

/// `conditions` with `c` in place of its type; the transition time is kept while the status
/// does not change.
fn merge_condition(
    sp: &SessionPipeline,
    conditions: &[Condition],
    mut c: Condition,
) -> Vec<Condition> {
    let mut merged = conditions.to_vec();
    c.observed_generation = sp.metadata.generation;
    let old = merged.iter().position(|o| o.type_ == c.type_);
    c.last_transition_time = match old.map(|i| &merged[i]) {
        Some(o) if o.status == c.status => o.last_transition_time.clone(),
        _ => Time(Timestamp::now()),
    };
    match old {
        Some(i) if merged[i] == c => {}
        Some(i) => merged[i] = c,
        None => merged.push(c),
    }
    merged
}

/// The stage's scaling policy from its spec.
pub fn policy(stage: &StageSpec) -> Policy {
    Policy {
        min: stage.replicas.min.max(0) as u32,
        max: stage.replicas.max.max(0) as u32,
        lag_per_replica: stage.autoscaling.lag_per_replica.max(1) as u64,
        scale_down_window: Duration::from_secs(
            stage.autoscaling.scale_down_stabilization_secs.into(),
        ),
        scale_up_max_step: stage.autoscaling.scale_up_max_step,
    }
}

#[cfg(test)]
#[path = "scaler_tests.rs"]
mod scenarios;
