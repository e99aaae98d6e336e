//! The CRD installs with a plain (client-side) `kubectl apply -f crds/`: kubectl keeps the
//! whole object in the `kubectl.kubernetes.io/last-applied-configuration` annotation, which
//! the API server limits to 256 KiB (issue 36, item 4).

use std::process::Command;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;
use sessionflow_operator::crd::CRD_NAME;

use super::{admin_kubeconfig, client_of, repo_path};

/// kubectl: `SESSIONFLOW_KUBECTL`, else the one `scripts/cluster.sh bin` names.
fn kubectl() -> std::path::PathBuf {
    if let Some(k) = std::env::var_os("SESSIONFLOW_KUBECTL") {
        return k.into();
    }
    let out = Command::new(repo_path("scripts/cluster.sh"))
        .arg("bin")
        .output()
        .expect("scripts/cluster.sh bin runs");
    assert!(out.status.success(), "scripts/cluster.sh bin failed");
    std::path::PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join("kubectl")
}

#[tokio::test]
async fn a_plain_kubectl_apply_installs_the_crd() {
    let Some(kubeconfig) = admin_kubeconfig() else {
        return;
    };
    // The other tests of the tier apply the CRD too (server-side), at the same moment on a
    // fresh cluster: kubectl's get-then-create can meet their create (AlreadyExists) or their
    // update (a conflict). Apply is idempotent: try again, a few times.
    let apply = || {
        Command::new(kubectl())
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["apply", "-f"])
            .arg(repo_path("crds"))
            .output()
            .expect("kubectl runs")
    };
    let mut out = apply();
    for _ in 0..5 {
        if out.status.success() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        out = apply();
    }
    assert!(
        out.status.success(),
        "kubectl apply -f crds/ failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let crds: Api<CustomResourceDefinition> = Api::all(client_of(&kubeconfig).await);
    let crd = crds.get(CRD_NAME).await.expect("the CRD is there");
    let annotations = crd.metadata.annotations.unwrap_or_default();
    let applied = annotations
        .get("kubectl.kubernetes.io/last-applied-configuration")
        .expect("a client-side apply leaves its annotation");
    assert!(applied.len() < 256 * 1024, "{} bytes", applied.len());
}
