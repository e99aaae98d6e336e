//! Deleting a pipeline deletes what it owns: the operator sets ownerReferences and the real
//! garbage collector (kube-controller-manager) follows them.

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use sessionflow_operator::render::PIPELINE_LABEL;

use crate::{eventually, Env};

async fn count<K>(env: &Env, pipeline: &str) -> Result<usize, String>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    Ok(Api::<K>::namespaced(env.client.clone(), &env.namespace)
        .list(&ListParams::default().labels(&format!("{PIPELINE_LABEL}={pipeline}")))
        .await
        .map_err(|e| e.to_string())?
        .items
        .iter()
        .filter(|o| o.meta().deletion_timestamp.is_none())
        .count())
}

/// With the operator stopped (so nothing but the garbage collector can delete), deleting the
/// pipeline deletes its Deployments, their ReplicaSets and Pods, and its ConfigMaps. (An
/// object being deleted counts as gone: Pods then wait out their grace period, with kwok too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_pipeline_deletes_its_objects_through_the_garbage_collector() {
    Env::run("gc", |env| async move {
        let mut operator = env.operator(None);
        env.create_pipeline(&env.pipeline("doomed", 1, 1)).await;
        env.wait_ready("doomed", "Ready=True on the pipeline").await;
        assert_eq!(env.pipeline_deployments("doomed").await.len(), 1);
        assert!(count::<ReplicaSet>(env, "doomed").await.unwrap() >= 1);
        assert_eq!(count::<Pod>(env, "doomed").await.unwrap(), 1);
        assert_eq!(count::<ConfigMap>(env, "doomed").await.unwrap(), 1);
        operator.kill();

        env.pipelines()
            .delete("doomed", &DeleteParams::background())
            .await
            .expect("pipeline deleted");
        eventually(
            "the pipeline's Deployments, ReplicaSets, Pods and ConfigMaps gone",
            || async {
                let left = (
                    count::<Deployment>(env, "doomed").await?,
                    count::<ReplicaSet>(env, "doomed").await?,
                    count::<Pod>(env, "doomed").await?,
                    count::<ConfigMap>(env, "doomed").await?,
                );
                (left == (0, 0, 0, 0)).then_some(()).ok_or(format!(
                    "left (deployments, replicasets, pods, configmaps): {left:?}"
                ))
            },
        )
        .await;
    })
    .await;
}
