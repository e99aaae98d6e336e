//! The chart as a platform team installs it: a real `helm install` (every test of the tier
//! starts from one, [`Env::run`]) makes the release's objects with the chart's labels; the
//! operator, as the release's ServiceAccount, reconciles a pipeline under the release's RBAC;
//! `helm uninstall` removes every object of the release, and with the ServiceAccount gone its
//! token is refused. (The pipeline and what the operator made for it are not the release's:
//! they stay.)

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, ListParams};
use kube::ResourceExt;
use sessionflow_operator::crd::SessionPipeline;
use sessionflow_operator::render::stage_object_name;

use crate::{client_of, eventually, Env, INSTANCE_LABEL, RELEASE};

/// Names of the objects of kind `K` labelled as the release's.
async fn release_objects<K>(env: &Env) -> Result<Vec<String>, String>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(env.client.clone(), &env.namespace);
    let list = api
        .list(&ListParams::default().labels(&format!("{INSTANCE_LABEL}={RELEASE}")))
        .await
        .map_err(|e| e.to_string())?;
    Ok(list
        .items
        .iter()
        .filter(|o| o.meta().deletion_timestamp.is_none())
        .map(|o| o.name_any())
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_install_runs_the_operator_and_helm_uninstall_removes_it() {
    Env::run("helm", |env| async move {
        // The release as helm sees it.
        let listed = env.helm(&["list", "--short"]).run("helm list");
        assert_eq!(listed.trim(), RELEASE, "helm list: {listed}");
        let status = env
            .helm(&["status", RELEASE, "--output", "json"])
            .run("helm status");
        let status: serde_json::Value = serde_json::from_str(&status).unwrap();
        assert_eq!(status["info"]["status"], "deployed", "{status}");

        // Its objects, each with the chart's labels.
        let fullname = format!("{RELEASE}-sessionflow");
        let deployment = env.deployments().get(&fullname).await.unwrap();
        let labels = deployment.labels();
        assert_eq!(
            labels
                .get("app.kubernetes.io/managed-by")
                .map(String::as_str),
            Some("Helm")
        );
        assert_eq!(
            labels.get("app.kubernetes.io/name").map(String::as_str),
            Some("sessionflow")
        );
        assert!(
            labels
                .get("helm.sh/chart")
                .is_some_and(|c| c.starts_with("sessionflow-")),
            "{labels:?}"
        );
        let args = deployment
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0]
            .args
            .clone()
            .unwrap_or_default();
        assert!(
            args.contains(&format!("--namespace={}", env.namespace)),
            "the chart's operator watches the namespace: {args:?}"
        );
        assert_eq!(
            release_objects::<ServiceAccount>(env).await.unwrap(),
            vec![fullname.clone()]
        );
        assert_eq!(release_objects::<Role>(env).await.unwrap().len(), 2);
        assert_eq!(release_objects::<RoleBinding>(env).await.unwrap().len(), 2);
        assert_eq!(
            release_objects::<Service>(env).await.unwrap(),
            vec![format!("{fullname}-metrics")]
        );
        // The real controllers take the chart's Deployment (kwok fakes its pod).
        eventually("the chart's operator Deployment available", || async {
            let d = env
                .deployments()
                .get(&fullname)
                .await
                .map_err(|e| e.to_string())?;
            let available = d.status.as_ref().and_then(|s| s.available_replicas);
            (available == Some(1))
                .then_some(())
                .ok_or(format!("available {available:?}"))
        })
        .await;

        // The operator as the release's ServiceAccount reconciles a pipeline.
        let _operator = env.operator(None);
        env.create_pipeline(&env.pipeline("charted", 1, 1)).await;
        let stage = stage_object_name("charted", "work");
        env.wait_ready(
            "charted",
            "the pipeline Ready=True under the release's RBAC",
        )
        .await;
        assert!(env.deployments().get_opt(&stage).await.unwrap().is_some());
        let as_operator = client_of(env.operator_kubeconfig().to_str().unwrap()).await;
        let pipelines: Api<SessionPipeline> = Api::namespaced(as_operator, &env.namespace);
        pipelines
            .list(&ListParams::default())
            .await
            .expect("the operator's token works while the release is installed");

        // Uninstalled: every object of the release gone, the token refused.
        env.helm(&["uninstall", RELEASE, "--wait"])
            .run("helm uninstall");
        let listed = env.helm(&["list", "--short"]).run("helm list");
        assert_eq!(listed.trim(), "", "helm list after uninstall: {listed}");
        eventually("the release's objects gone", || async {
            let left = [
                release_objects::<Deployment>(env).await?,
                release_objects::<ServiceAccount>(env).await?,
                release_objects::<Role>(env).await?,
                release_objects::<RoleBinding>(env).await?,
                release_objects::<Service>(env).await?,
            ]
            .concat();
            let owner = format!("owner=helm,name={RELEASE}");
            let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.namespace);
            let records = secrets
                .list(&ListParams::default().labels(&owner))
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            (left.is_empty() && records == 0)
                .then_some(())
                .ok_or(format!("left: {left:?}, {records} release records"))
        })
        .await;
        eventually("the operator's token refused", || async {
            match pipelines.list(&ListParams::default()).await {
                Err(kube::Error::Api(e)) if e.code == 401 || e.code == 403 => Ok(()),
                other => Err(format!("{:?}", other.map(|l| l.items.len()))),
            }
        })
        .await;
        // What the operator made for the pipeline is not the release's.
        assert!(env.deployments().get_opt(&stage).await.unwrap().is_some());
    })
    .await;
}
