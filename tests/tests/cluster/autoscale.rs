//! Lag autoscaling against Apache Kafka, on the real control plane: the operator reads the
//! stage group's lag from the broker itself (committed offsets and watermarks, without joining
//! the group), so a backlog produced into the stage's input stays a backlog here (kwok's pods
//! consume nothing) until the test commits the group's offsets to the end of the topic.
//!
//! - Mode `lag`: the backlog scales the stage's Deployment up (bounded by `replicas.max` and
//!   the partition count), the real controllers and kwok bring the pods up; once the offsets
//!   are committed to the end, the stage goes back to `replicas.min` after the stabilization
//!   window, and the status says why.
//! - Mode `external`: someone else owns `spec.replicas`; with a backlog the operator reads and
//!   reports the lag but never writes the count (no field manager of the operator on it).
//!
//! The operator runs with `--scale-interval-secs 1` ([`Env::operator`]); the status is written
//! in the same pass as the decision, after it, so a status showing a lag means the pass that
//! read it has already decided (and written) the replica count.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Patch, PatchParams};
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;
use sessionflow_operator::crd::{AutoscalingMode, SessionPipeline, StageStatus};
use sessionflow_operator::render::{group_id, stage_object_name};
use sessionflow_operator::scaler::SCALER_MANAGER;

use crate::{brokers, condition, eventually, Env};

/// Partitions of the autoscaled stage's input: above `max`, so `max` is the bound that shows.
const PARTITIONS: i32 = 4;
/// Records of backlog per replica the tests' stages ask for.
const LAG_PER_REPLICA: i64 = 10;

/// A one-stage pipeline scaled in `mode` between `min` and `max`, its input of [`PARTITIONS`],
/// a short stabilization window.
fn autoscaled(env: &Env, name: &str, mode: AutoscalingMode, min: i32, max: i32) -> SessionPipeline {
    let mut sp = env.pipeline(name, min, max);
    let input = sp.spec.stages[0].input.clone();
    let declared = sp.spec.topics.declared.iter_mut();
    for topic in declared.filter(|t| t.name == input) {
        topic.partitions = PARTITIONS;
    }
    let autoscaling = &mut sp.spec.stages[0].autoscaling;
    autoscaling.mode = mode;
    autoscaling.lag_per_replica = LAG_PER_REPLICA;
    autoscaling.scale_down_stabilization_secs = 15;
    sp
}

/// `count` records into `topic`, keyed over many sessions (so every partition gets some).
async fn produce(topic: &str, count: usize) {
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .create()
            .expect("producer");
        for i in 0..count {
            let key = format!("session-{i}");
            let value = format!("backlog {i}");
            producer
                .send(BaseRecord::to(&topic).key(&key).payload(&value))
                .map_err(|(e, _)| e)
                .expect("queued");
            producer.poll(Duration::ZERO);
        }
        producer
            .flush(Duration::from_secs(60))
            .expect("the backlog reaches the broker");
    })
    .await
    .unwrap();
}

/// Commits `group`'s offsets on every partition of `topic` to the partition's end, as if the
/// stage had processed everything. The group has no members (kwok's pods run nothing), so a
/// commit from outside it is accepted.
async fn commit_to_end(group: &str, topic: &str) {
    let (group, topic) = (group.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        let timeout = Duration::from_secs(30);
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            let (_, high) = consumer
                .fetch_watermarks(&topic, p, timeout)
                .expect("watermarks");
            tpl.add_partition_offset(&topic, p, Offset::Offset(high))
                .unwrap();
        }
        consumer
            .commit(&tpl, CommitMode::Sync)
            .expect("the group's offsets committed to the end");
    })
    .await
    .unwrap();
}

/// Deletes the group the test committed for (it has no members), best effort: the namespace's
/// cleanup deletes the topics, not the broker's groups.
async fn delete_group(group: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin client");
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(30)));
    if let Err(e) = admin.delete_groups(&[group], &options).await {
        eprintln!("deleting group {group}: {e}");
    }
}

fn replicas(d: &Deployment) -> Option<i32> {
    d.spec.as_ref()?.replicas
}

/// The stage `work`'s status, once the autoscaler wrote it.
async fn stage_status(env: &Env, pipeline: &str) -> Result<StageStatus, String> {
    let sp = env
        .pipelines()
        .get(pipeline)
        .await
        .map_err(|e| e.to_string())?;
    sp.status
        .and_then(|s| s.stages.into_iter().find(|s| s.name == "work"))
        .ok_or_else(|| "no stage status yet".to_string())
}

/// The field managers that own the Deployment's `spec.replicas`.
fn replica_owners(d: &Deployment) -> Vec<String> {
    d.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| {
            m.fields_v1
                .as_ref()
                .is_some_and(|f| f.0["f:spec"].get("f:replicas").is_some())
        })
        .filter_map(|m| m.manager.clone())
        .collect()
}

/// The stage's input topic has been read by the autoscaler (so the operator created it): the
/// status names its partitions.
async fn wait_for_lag_reading(env: &Env, pipeline: &str) -> StageStatus {
    eventually("the autoscaler reads the stage's lag", || async {
        let s = stage_status(env, pipeline).await?;
        (s.partitions == Some(PARTITIONS) && s.lag == Some(0))
            .then_some(s.clone())
            .ok_or(format!("{s:?}"))
    })
    .await
}

/// A backlog of 200 records (20 replicas' worth) scales the stage from 1 up to its max of 3
/// (under the 4 partitions), and the pods follow; committed to the end, the backlog is gone
/// and, after the 15 s stabilization window, the stage is back at 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_scales_a_stage_up_and_its_drain_back_down() {
    Env::run("lag", |env| async move {
        let _operator = env.operator(None);
        let sp = autoscaled(env, "lagged", AutoscalingMode::Lag, 1, 3);
        let input = sp.spec.stages[0].input.clone();
        env.create_pipeline(&sp).await;
        let name = stage_object_name("lagged", "work");
        let group = group_id(&env.namespace, "lagged", "work");
        let status = wait_for_lag_reading(env, "lagged").await;
        assert_eq!(status.desired_replicas, Some(1), "{status:?}");

        produce(&input, 200).await;
        let up = eventually("scaled up to the max, 3", || async {
            let d = env
                .deployments()
                .get(&name)
                .await
                .map_err(|e| e.to_string())?;
            let r = replicas(&d);
            assert!(r <= Some(3), "scaled beyond replicas.max: {r:?}");
            let s = stage_status(env, "lagged").await?;
            (r == Some(3) && s.desired_replicas == Some(3) && s.lag == Some(200))
                .then_some((d.clone(), s.clone()))
                .ok_or(format!("replicas {r:?}, status {s:?}"))
        })
        .await;
        let (deployment, status) = up;
        let reason = status.last_scale_reason.unwrap_or_default();
        assert!(
            reason.contains("effective lag 200 above 10 per replica"),
            "{reason}"
        );
        assert_eq!(
            replica_owners(&deployment),
            vec![SCALER_MANAGER.to_string()],
            "the autoscaler owns spec.replicas"
        );
        eventually("3 pods of the stage ready", || async {
            let d = env
                .deployments()
                .get(&name)
                .await
                .map_err(|e| e.to_string())?;
            let ready = d.status.as_ref().and_then(|s| s.ready_replicas);
            let r = replicas(&d);
            assert!(r <= Some(3), "scaled beyond replicas.max: {r:?}");
            (ready == Some(3))
                .then_some(())
                .ok_or(format!("ready {ready:?}, replicas {r:?}"))
        })
        .await;

        commit_to_end(&group, &input).await;
        let status = eventually("back down to the min, 1, with no lag", || async {
            let d = env
                .deployments()
                .get(&name)
                .await
                .map_err(|e| e.to_string())?;
            let s = stage_status(env, "lagged").await?;
            let r = replicas(&d);
            (r == Some(1) && s.desired_replicas == Some(1))
                .then_some(s.clone())
                .ok_or(format!("replicas {r:?}, status {s:?}"))
        })
        .await;
        assert_eq!((status.lag, status.effective_lag), (Some(0), Some(0)));
        let reason = status.last_scale_reason.unwrap_or_default();
        assert!(
            reason.contains("below 10 per replica for the whole stabilization window"),
            "scaled down for another reason: {reason}"
        );
        delete_group(&group).await;
    })
    .await;
}

/// In mode `external` the count is someone else's: set to 2 by hand (as an HPA would), it stays
/// 2 through a backlog of 20 replicas' worth, read twice by the autoscaler, and no field manager
/// of the operator ever owns `spec.replicas`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_external_mode_the_operator_never_writes_replicas() {
    Env::run("external", |env| async move {
        let _operator = env.operator(None);
        let sp = autoscaled(env, "outside", AutoscalingMode::External, 1, 3);
        let input = sp.spec.stages[0].input.clone();
        env.create_pipeline(&sp).await;
        let name = stage_object_name("outside", "work");
        wait_for_lag_reading(env, "outside").await;
        // A patch of the Deployment, not of its scale subresource: the API server does not
        // record a field manager for `spec.replicas` set through /scale while nobody owned it
        // (it was defaulted), and the check below wants the owner on record.
        env.deployments()
            .patch(
                &name,
                &PatchParams {
                    field_manager: Some("external-autoscaler".into()),
                    ..Default::default()
                },
                &Patch::Merge(json!({ "spec": { "replicas": 2 } })),
            )
            .await
            .expect("scaled by the external autoscaler");

        // Each lag seen in the status was read by a pass that had already decided the count.
        for (more, lag) in [(200, 200), (100, 300)] {
            produce(&input, more).await;
            let status = eventually(&format!("the autoscaler reads a lag of {lag}"), || async {
                let s = stage_status(env, "outside").await?;
                (s.lag == Some(lag))
                    .then_some(s.clone())
                    .ok_or(format!("{s:?}"))
            })
            .await;
            assert_eq!(status.desired_replicas, Some(2), "{status:?}");
            assert_eq!(status.last_scale_reason, None, "{status:?}");
            let d = env.deployments().get(&name).await.unwrap();
            assert_eq!(replicas(&d), Some(2), "the operator changed the count");
            assert_eq!(
                replica_owners(&d),
                vec!["external-autoscaler".to_string()],
                "spec.replicas owned by someone else"
            );
            let entries = d.metadata.managed_fields.iter().flatten();
            let managers: Vec<_> = entries.filter_map(|m| m.manager.as_deref()).collect();
            assert!(!managers.contains(&SCALER_MANAGER), "{managers:?}");
        }
        let sp = env.pipelines().get("outside").await.unwrap();
        let (status, _, message) = condition(&sp, "Autoscaling").expect("Autoscaling condition");
        assert_eq!(status, "True", "{message}");
        assert!(
            message.contains("0 scaled by lag, 1 by an external autoscaler"),
            "{message}"
        );
    })
    .await;
}
