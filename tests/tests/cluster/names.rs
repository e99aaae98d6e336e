//! Object names for any pipeline name the API server takes. A pipeline's name is a DNS
//! subdomain (it may start with a digit and hold dots); the Service of each stage must be a
//! label without dots (and a letter first where the API server does not relax Service names:
//! the names are made so, see `render::unique_name`). The objects are created with a
//! server-side dry run: the API server checks their names as on a real create, and keeps
//! nothing.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, PostParams};
use kube::Resource;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;
use sessionflow_operator::crd::SessionPipeline;
use sessionflow_operator::render::{plan, Defaults};

use super::{admin_kubeconfig, client_of};

/// Creates `object` in `default` with `dryRun=All`, or says why the API server refused it.
async fn dry_run_create<K>(client: &kube::Client, object: &K) -> Result<(), String>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + Serialize
        + DeserializeOwned,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(client.clone(), "default");
    let params = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let name = object.meta().name.clone().unwrap_or_default();
    api.create(&params, object)
        .await
        .map(|_| ())
        .map_err(|e| format!("{} {name:?}: {e}", K::kind(&K::DynamicType::default())))
}

#[tokio::test]
async fn every_object_of_a_pipeline_named_like_a_subdomain_is_accepted() {
    let Some(kubeconfig) = admin_kubeconfig() else {
        return;
    };
    let client = client_of(&kubeconfig).await;
    let defaults = Defaults {
        worker_image: "ghcr.io/sessionflow/sessionflow-worker:test".into(),
        log_format: "text".into(),
        allowed_images: Vec::new(),
    };
    let mut refused = Vec::new();
    for pipeline in ["2026.chat", "chat.v2", "9", "a"] {
        let sp: SessionPipeline = serde_json::from_value(json!({
            "apiVersion": "sessionflow.io/v1alpha1",
            "kind": "SessionPipeline",
            "metadata": { "name": pipeline, "namespace": "default", "uid": "0-0-0" },
            "spec": {
                "kafka": { "bootstrapServers": "kafka:9092" },
                "topics": {
                    "dlq": "dead",
                    "declared": [
                        { "name": "in", "partitions": 1 },
                        { "name": "out", "partitions": 1 },
                        { "name": "dead", "partitions": 1 },
                    ],
                },
                "stages": [{ "name": "0nlu", "input": "in", "output": "out",
                             "handler": { "builtin": {} } }],
            },
        }))
        .expect("a SessionPipeline");
        for stage in plan(&sp, &defaults).expect("the pipeline renders") {
            let results = [
                dry_run_create::<ConfigMap>(&client, &stage.config_map).await,
                dry_run_create::<Deployment>(&client, &stage.deployment).await,
                dry_run_create::<Service>(&client, &stage.service).await,
            ];
            refused.extend(results.into_iter().filter_map(Result::err));
            if let Some(budget) = &stage.disruption_budget {
                refused.extend(
                    dry_run_create::<PodDisruptionBudget>(&client, budget)
                        .await
                        .err(),
                );
            }
        }
    }
    assert!(refused.is_empty(), "refused:\n{}", refused.join("\n"));
}
