//! The test kubelet's Node: registered with a label and a taint of its own, kept Ready, its
//! Lease renewed.
//!
//! kwok manages only the nodes annotated `kwok.x-k8s.io/node=fake` (scripts/cluster.sh), so it
//! leaves this one alone. The taint `sessionflow.io/test-kubelet=true:NoSchedule` keeps every
//! pod that did not ask for it off this node (the cluster tier's other pipelines stay on kwok's
//! fake nodes); a pipeline whose pods should really run says so in its `workerTemplate`:
//! `nodeSelector: {sessionflow.io/test-kubelet: "true"}` and a toleration of the taint. The node controller marks a node NotReady when its Lease is not renewed
//! within the grace period (40 s), so both the Lease and the Ready condition are renewed every
//! [`HEARTBEAT`].

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::Client;
use serde_json::json;

/// The label the node carries and worker pods select.
pub const LABEL: &str = "sessionflow.io/test-kubelet";
/// How often the Lease and the Ready condition are renewed.
pub const HEARTBEAT: Duration = Duration::from_secs(10);
const MANAGER: &str = "sessionflow-test-kubelet";

/// Now as a `metav1.Time` (seconds).
pub fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Now as a `metav1.MicroTime`.
fn now_micros() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string()
}

/// Creates (or takes over) the Node `name`.
pub async fn register(client: &Client, name: &str) -> kube::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                LABEL: "true",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
        },
        "spec": {
            "taints": [{ "key": LABEL, "value": "true", "effect": "NoSchedule" }],
        },
    });
    nodes
        .patch(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&node),
        )
        .await?;
    heartbeat(client, name).await
}

/// Renews the Lease and the node's status (Ready, capacity, addresses).
pub async fn heartbeat(client: &Client, name: &str) -> kube::Result<()> {
    let t = now();
    let capacity = json!({ "cpu": "32", "memory": "256Gi", "pods": "110" });
    let condition = |type_: &str, status: &str, reason: &str| {
        json!({ "type": type_, "status": status, "reason": reason, "message": reason,
                "lastHeartbeatTime": t, "lastTransitionTime": t })
    };
    let status = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [
                { "type": "InternalIP", "address": "127.0.0.1" },
                { "type": "Hostname", "address": name },
            ],
            "daemonEndpoints": { "kubeletEndpoint": { "Port": 0 } },
            "nodeInfo": {
                "architecture": "amd64", "operatingSystem": "linux",
                "kubeletVersion": "sessionflow-test-kubelet", "kubeProxyVersion": "",
                "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "",
                "osImage": "", "containerRuntimeVersion": "local-process://0",
            },
            "conditions": [
                condition("Ready", "True", "KubeletReady"),
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID"),
            ],
        },
    });
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch_status(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&status),
        )
        .await?;
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": { "name": name, "namespace": "kube-node-lease" },
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": 40,
            "renewTime": now_micros(),
        },
    });
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    leases
        .patch(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&lease),
        )
        .await?;
    Ok(())
}

/// Heartbeats until the task is dropped; a failed one is logged and tried again next time.
pub async fn keep_alive(client: Client, name: String) {
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        if let Err(e) = heartbeat(&client, &name).await {
            eprintln!("test-kubelet: heartbeat of node {name}: {e}");
        }
    }
}

/// Deletes the Node (at exit): the pod garbage collector then removes what was bound to it.
pub async fn deregister(client: &Client, name: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    if let Err(e) = nodes.delete(name, &DeleteParams::default()).await {
        eprintln!("test-kubelet: deleting node {name}: {e}");
    }
}
