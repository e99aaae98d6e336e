//! A pipeline becomes running Deployments through the real controllers, the operator repairs
//! what is changed behind its back, and leaves alone what is not its own.

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use sessionflow_operator::render::{stage_object_name, PIPELINE_LABEL};

use crate::{condition, eventually, Env};

fn replicas(d: &Deployment) -> Option<i32> {
    d.spec.as_ref()?.replicas
}

fn ready_replicas(d: &Deployment) -> i32 {
    d.status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0)
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pipeline gets one Deployment per stage, controlled by the pipeline; the Deployment and
/// ReplicaSet controllers make ReplicaSets and Pods of it, kwok makes them Ready, and the
/// operator reports `Ready=True`. A Deployment scaled by hand is scaled back (the autoscaler
/// owns `replicas`); a deleted one is created again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_runs_and_its_deployments_are_repaired() {
    Env::run("run", |env| async move {
        let _operator = env.operator(None);
        let sp = env.create_pipeline(&env.pipeline("chat", 2, 2)).await;
        let uid = sp.uid().unwrap();
        let name = stage_object_name("chat", "work");

        // Ready=True and Degraded=False, as the operator (with the chart's RBAC only) reports.
        eventually("Ready=True, Degraded=False on the pipeline", || async {
            let sp = env
                .pipelines()
                .get("chat")
                .await
                .map_err(|e| e.to_string())?;
            let ready = condition(&sp, "Ready");
            let degraded = condition(&sp, "Degraded");
            match (&ready, &degraded) {
                (Some((r, _, _)), Some((d, _, _))) if r == "True" && d == "False" => Ok(()),
                _ => Err(format!("Ready={ready:?}, Degraded={degraded:?}")),
            }
        })
        .await;

        let deployments = env.pipeline_deployments("chat").await;
        assert_eq!(
            deployments.iter().map(|d| d.name_any()).collect::<Vec<_>>(),
            vec![name.clone()],
            "one Deployment per stage"
        );
        let owner = deployments[0]
            .owner_references()
            .iter()
            .find(|o| o.uid == uid)
            .cloned()
            .expect("the Deployment is owned by the pipeline");
        assert_eq!(owner.kind, "SessionPipeline");
        assert_eq!(owner.controller, Some(true));

        // The real controllers: ReplicaSet of the Deployment, Pods of the ReplicaSet, Ready.
        let dep_uid = deployments[0].uid().unwrap();
        let pods_ready = eventually("2 Pods of the stage Ready", || async {
            let rs: Vec<ReplicaSet> =
                Api::<ReplicaSet>::namespaced(env.client.clone(), &env.namespace)
                    .list(&ListParams::default().labels(&format!("{PIPELINE_LABEL}=chat")))
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .into_iter()
                    .filter(|r| r.owner_references().iter().any(|o| o.uid == dep_uid))
                    .collect();
            let rs_uids: Vec<String> = rs.iter().filter_map(|r| r.uid()).collect();
            let pods: Vec<Pod> = Api::<Pod>::namespaced(env.client.clone(), &env.namespace)
                .list(&ListParams::default().labels(&format!("{PIPELINE_LABEL}=chat")))
                .await
                .map_err(|e| e.to_string())?
                .items
                .into_iter()
                .filter(|p| {
                    p.owner_references()
                        .iter()
                        .any(|o| rs_uids.contains(&o.uid))
                })
                .collect();
            let ready = pods.iter().filter(|p| pod_ready(p)).count();
            if !rs.is_empty() && ready == 2 {
                Ok(pods)
            } else {
                Err(format!(
                    "{} ReplicaSets, {} pods, {ready} ready",
                    rs.len(),
                    pods.len()
                ))
            }
        })
        .await;
        assert!(pods_ready.iter().all(|p| p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .is_some_and(|n| n.starts_with("kwok-node-"))));

        // Scaled by hand to 5: back to 2 (the bounds).
        env.hand_scale(&name, 5).await;
        eventually("the hand-scaled Deployment back at 2 replicas", || async {
            let d = env
                .deployments()
                .get(&name)
                .await
                .map_err(|e| e.to_string())?;
            (replicas(&d) == Some(2))
                .then_some(())
                .ok_or(format!("replicas {:?}", replicas(&d)))
        })
        .await;

        // Deleted: created again (a new object), owned by the pipeline, its pods Ready.
        env.deployments()
            .delete(&name, &DeleteParams::background())
            .await
            .expect("deleted");
        let again = eventually("the deleted Deployment created again", || async {
            match env
                .deployments()
                .get_opt(&name)
                .await
                .map_err(|e| e.to_string())?
            {
                Some(d) if d.uid() != Some(dep_uid.clone()) => Ok(d),
                Some(_) => Err("the old one (still being deleted)".to_string()),
                None => Err("missing".to_string()),
            }
        })
        .await;
        assert!(again
            .owner_references()
            .iter()
            .any(|o| o.uid == uid && o.controller == Some(true)));
        eventually("the recreated Deployment's 2 pods ready", || async {
            let d = env
                .deployments()
                .get(&name)
                .await
                .map_err(|e| e.to_string())?;
            (ready_replicas(&d) == 2 && replicas(&d) == Some(2))
                .then_some(())
                .ok_or(format!(
                    "replicas {:?}, ready {}",
                    replicas(&d),
                    ready_replicas(&d)
                ))
        })
        .await;
    })
    .await;
}

/// A Deployment of the name the operator would give a stage, made by someone else, is not
/// taken over: the pipeline is `Degraded` with reason `NameConflict`, and the object keeps
/// its spec, labels and owners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_deployment_of_a_stage_name_is_a_conflict_and_left_alone() {
    Env::run("conflict", |env| async move {
        let name = stage_object_name("taken", "work");
        let foreign: Deployment = serde_json::from_value(json!({
            "metadata": { "name": name, "labels": { "app": "someone-else" } },
            "spec": {
                "replicas": 1,
                "selector": { "matchLabels": { "app": "someone-else" } },
                "template": {
                    "metadata": { "labels": { "app": "someone-else" } },
                    "spec": { "containers": [{ "name": "main", "image": "example.com/other:1" }] },
                },
            },
        }))
        .unwrap();
        let foreign = env
            .deployments()
            .create(&PostParams::default(), &foreign)
            .await
            .expect("foreign Deployment created");
        let _operator = env.operator(None);
        env.create_pipeline(&env.pipeline("taken", 1, 1)).await;

        let (_, _, message) = eventually("Degraded=True NameConflict on the pipeline", || async {
            let sp = env
                .pipelines()
                .get("taken")
                .await
                .map_err(|e| e.to_string())?;
            match condition(&sp, "Degraded") {
                Some((s, r, m)) if s == "True" && r == "NameConflict" => Ok((s, r, m)),
                other => Err(format!("Degraded={other:?}")),
            }
        })
        .await;
        assert!(message.contains(&format!("Deployment {name}")), "{message}");
        let sp = env.pipelines().get("taken").await.unwrap();
        assert_ne!(
            condition(&sp, "Ready").map(|c| c.0).as_deref(),
            Some("True")
        );

        // Give the operator a few more passes, then the object is as it was made.
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        let now = env.deployments().get(&name).await.unwrap();
        assert!(
            now.owner_references().is_empty(),
            "{:?}",
            now.owner_references()
        );
        assert_eq!(now.labels(), foreign.labels());
        assert_eq!(
            now.metadata.generation, foreign.metadata.generation,
            "spec untouched"
        );
        assert_eq!(now.spec, foreign.spec);
        let managers: Vec<String> = now
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .filter_map(|m| m.manager.clone())
            .collect();
        assert!(
            !managers.iter().any(|m| m.starts_with("sessionflow")),
            "the operator wrote to it: {managers:?}"
        );
    })
    .await;
}
