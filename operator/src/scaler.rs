//! The autoscaler loop: on its own interval (independent of reconciles), for every stage of
//! every pipeline, read the lag from Kafka, decide with [`autoscale::decide`], apply the
//! replica count, and report lag and replicas in the status, in events and as metrics.
//!
//! It owns `spec.replicas` of the stage Deployments under its own field manager
//! ([`SCALER_MANAGER`]); the reconciler never sets it, so the two never undo each other.
//! A stage whose lag cannot be read is held at its count (brought within bounds only), and the
//! failure is counted, not fatal.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use sessionflow_worker::lag;
use tokio::sync::Notify;

use crate::autoscale::{self, Decision, History, Policy, Signal};
use crate::crd::{SessionPipeline, StageSpec, StageStatus};
use crate::kafka::{Connection, LagReaders};
use crate::metrics::Metrics;
use crate::render;

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
    histories: HashMap<StageKey, History>,
    lag_readers: LagReaders,
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
            histories: HashMap::new(),
            lag_readers: LagReaders::default(),
        }
    }

    /// Runs until the task is dropped.
    pub async fn run(mut self) {
        loop {
            self.tick().await;
            tokio::select! {
                _ = tokio::time::sleep(self.interval) => {}
                _ = self.wake.notified() => {}
            }
        }
    }

    /// One evaluation of every stage.
    pub async fn tick(&mut self) {
        let now = self.started.elapsed();
        let mut seen = HashSet::new();
        for sp in self.store.state() {
            if let Err(error) = self.scale_pipeline(&sp, now, &mut seen).await {
                tracing::warn!(pipeline = %sp.name_any(), %error, "autoscaling pass failed");
            }
        }
        let gone: Vec<StageKey> = self
            .histories
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        for key in gone {
            self.metrics.forget_stage(&key.0, &key.1, &key.2);
            self.histories.remove(&key);
        }
        self.lag_readers.forget_unused();
    }

    async fn scale_pipeline(
        &mut self,
        sp: &SessionPipeline,
        now: Duration,
        seen: &mut HashSet<StageKey>,
    ) -> Result<(), kube::Error> {
        let namespace = sp.namespace().unwrap_or_default();
        let pipeline = sp.name_any();
        let connection = Connection::resolve(&self.client, &namespace, &sp.spec.kafka).await;
        if let Err(error) = &connection {
            tracing::warn!(%pipeline, %error, "cannot connect to Kafka; holding replicas");
        }
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &namespace);
        let previous = sp.status.clone().unwrap_or_default();
        let mut statuses = Vec::new();
        for stage in &sp.spec.stages {
            let key = (namespace.clone(), pipeline.clone(), stage.name.clone());
            seen.insert(key.clone());
            let labels = [namespace.as_str(), pipeline.as_str(), stage.name.as_str()];
            let group = render::group_id(&namespace, &pipeline, &stage.name);
            let reader = match &connection {
                Ok(c) => self.lag_readers.get(c, &group),
                Err(e) => Err(anyhow::anyhow!("{e}")),
            };
            let lags = match reader {
                Ok(r) => r.read(&stage.input).await,
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
            let history = self.histories.entry(key).or_default();
            let decision =
                autoscale::decide(&policy(stage), signal.as_ref(), current, history, now);
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
        if statuses != previous.stages || total != previous.lag {
            let api: Api<SessionPipeline> = Api::namespaced(self.client.clone(), &namespace);
            let patch = json!({ "status": { "stages": statuses, "lag": total } });
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

/// The stage's scaling policy from its spec.
pub fn policy(stage: &StageSpec) -> Policy {
    Policy {
        min: stage.replicas.min.max(0) as u32,
        max: stage.replicas.max.max(0) as u32,
        lag_per_replica: stage.autoscaling.lag_per_replica.max(1) as u64,
        scale_down_window: Duration::from_secs(
            stage.autoscaling.scale_down_stabilization_secs.into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::Method;
    use kube::runtime::events::Reporter;
    use kube::runtime::{reflector, watcher};
    use rdkafka::config::ClientConfig;
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    use serde_json::{json, Value};

    use super::*;
    use crate::fixtures::{mock_client, pipeline, Seen};

    const DEP: &str = "/apis/apps/v1/namespaces/shop/deployments/chat-nlu";
    const STATUS: &str =
        "/apis/sessionflow.io/v1alpha1/namespaces/shop/sessionpipelines/chat/status";

    fn deployment(replicas: i32, ready: i32) -> Value {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": { "name": "chat-nlu", "namespace": "shop" },
            "spec": {
                "replicas": replicas,
                "selector": { "matchLabels": { "app": "x" } },
                "template": { "spec": { "containers": [{ "name": "worker" }] } },
            },
            "status": { "replicas": replicas, "readyReplicas": ready },
        })
    }

    /// One autoscaling pass with lag read from a real Kafka-protocol broker (librdkafka's mock
    /// cluster, in process) and a scripted API server: 2,500 records of lag at 1,000 per
    /// replica on 4 partitions → 3 replicas, applied under the autoscaler's own field manager,
    /// announced, and reported in the status. A second pass with nothing new writes nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pass_reads_lag_scales_the_deployment_and_reports_it() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("t0", 4, 1).unwrap();
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", cluster.bootstrap_servers())
            .create()
            .unwrap();
        for i in 0..2_500 {
            let key = format!("s{}", i % 50);
            producer
                .send(BaseRecord::<str, str>::to("t0").key(&key).payload("x"))
                .unwrap();
        }
        producer.flush(Duration::from_secs(10)).unwrap();

        let mut sp = pipeline(&["nlu"]);
        sp.spec.kafka.bootstrap_servers = cluster.bootstrap_servers();
        sp.spec.stages[0].replicas.max = 10;
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitApply(sp.clone()));
        writer.apply_watcher_event(&watcher::Event::InitDone);

        let (client, mut server) = mock_client();
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "sessionflow-operator".into(),
                instance: None,
            },
        );
        let metrics = Metrics::new();
        let mut scaler = Scaler::new(
            client,
            store,
            metrics.clone(),
            recorder,
            Duration::from_secs(15),
            Arc::new(Notify::new()),
        );
        let pass = tokio::spawn(async move {
            scaler.tick().await;
            scaler
        });
        server.expect(Method::GET, DEP, |_| deployment(1, 1)).await;
        let scale = server
            .expect(Method::PATCH, DEP, |_| deployment(3, 1))
            .await;
        assert!(
            scale.query_has("fieldManager=sessionflow-autoscaler"),
            "{}",
            scale.uri
        );
        assert_eq!(
            scale.body["spec"],
            json!({ "replicas": 3 }),
            "only replicas are applied"
        );
        let event = server
            .expect(
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/shop/events",
                |s: &Seen| s.body.clone(),
            )
            .await;
        assert_eq!(event.body["reason"], "ScaledUp");
        assert!(event.body["note"].as_str().unwrap().contains("1 → 3"));
        let status = server
            .expect(Method::PATCH, STATUS, |s: &Seen| {
                let mut sp = serde_json::to_value(pipeline(&["nlu"])).unwrap();
                sp["status"] = s.body["status"].clone();
                sp
            })
            .await;
        let stage = &status.body["status"]["stages"][0];
        assert_eq!(stage["name"], "nlu");
        assert_eq!(stage["lag"], 2_500);
        assert_eq!(stage["effectiveLag"], 2_500);
        assert_eq!(stage["partitions"], 4);
        assert_eq!(stage["desiredReplicas"], 3);
        assert_eq!(stage["readyReplicas"], 1);
        assert!(stage["lastScaleReason"]
            .as_str()
            .unwrap()
            .contains("above 1000 per replica"));
        assert_eq!(status.body["status"]["lag"], 2_500);
        server.expect_silence(Duration::from_millis(200)).await;
        let mut scaler = pass.await.unwrap();
        let rendered = metrics.render();
        assert!(rendered.contains(
            r#"sessionflow_stage_replicas_desired{namespace="shop",pipeline="chat",stage="nlu"} 3"#
        ));
        assert!(rendered.contains(
            r#"sessionflow_stage_effective_lag{namespace="shop",pipeline="chat",stage="nlu"} 2500"#
        ));

        // The status is now what the pipeline shows; the next pass only reads.
        let mut shown = sp.clone();
        shown.status = Some(serde_json::from_value(status.body["status"].clone()).unwrap());
        writer.apply_watcher_event(&watcher::Event::Apply(shown));
        let pass = tokio::spawn(async move {
            scaler.tick().await;
            scaler
        });
        server.expect(Method::GET, DEP, |_| deployment(3, 1)).await;
        server.expect_silence(Duration::from_millis(300)).await;
        let scaler = pass.await.unwrap();
        assert_eq!(
            scaler.lag_readers.created(),
            1,
            "the second pass reads with the first pass's client"
        );
    }
}
