//! `sessionflow-test-kubelet`: a small kubelet that runs the pods bound to its node as local
//! processes, so that a pipeline's workers really run on the local control plane
//! (scripts/cluster.sh) — kwok's fake nodes only pretend.
//!
//! It registers a Node (default `sessionflow-local-0`, labelled and tainted
//! `sessionflow.io/test-kubelet=true`: only pods that select and tolerate it land there; see
//! [`node`]), keeps it Ready and its Lease renewed, watches the pods bound to it, and runs each
//! ([`pod`]): containers as processes ([`container`]: image → local binary, mount paths →
//! local folders, container ports → host ports of their own; volumes and ServiceAccount
//! credentials written as files: [`volumes`]), restarted when they exit, ready
//! when their `httpGet` readiness probe answers ([`probe`]), their status reported
//! ([`status`]). A deleted pod's processes get SIGTERM, its grace period, then SIGKILL, and the
//! pod object is removed. A pod's ServiceAccount token comes as a kubeconfig (`KUBECONFIG`), so
//! the chart's operator Deployment runs here too, with the chart's RBAC. On SIGTERM/SIGINT the
//! kubelet stops every process and deletes its Node.
//!
//! ```text
//! sessionflow-test-kubelet [--node NAME] [--dir DIR] [--entrypoint IMAGE_NAME=PATH]...
//! ```
//! The cluster: `KUBECONFIG` (an identity that may write nodes, leases, pods and their status,
//! read ConfigMaps and Secrets and request ServiceAccount tokens; scripts/cluster.sh's admin
//! kubeconfig, which names the server and its CA inline). The default
//! entrypoint: `sessionflow-worker` → `$SESSIONFLOW_WORKER_BIN`, else the `sessionflow-worker`
//! beside this binary. `--dir` (default `$TMPDIR/sessionflow-test-kubelet-<node>`) holds each
//! pod's volumes and container logs.
//! It prints `test-kubelet: node NAME ready` on stdout once the Node is registered.

mod container;
mod node;
mod pod;
mod probe;
mod status;
mod volumes;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::config::Kubeconfig;
use kube::runtime::watcher::{self, watcher, Event};
use kube::{Api, Client, ResourceExt};

use container::Entrypoints;
use pod::{Kubelet, PodHandle, Stop};

/// The longest a pod's processes get to stop when the kubelet itself exits.
const SHUTDOWN_GRACE_SECS: i64 = 15;

struct Options {
    node: String,
    dir: PathBuf,
    entrypoints: Entrypoints,
}

fn options() -> Result<Options, String> {
    let mut node = "sessionflow-local-0".to_string();
    let mut dir = None;
    let mut entrypoints = Entrypoints::default();
    let worker = std::env::var_os("SESSIONFLOW_WORKER_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            let exe = std::env::current_exe().ok()?;
            Some(exe.parent()?.join("sessionflow-worker"))
        });
    if let Some(worker) = worker {
        entrypoints.0.insert("sessionflow-worker".into(), worker);
    }
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--node" => node = value()?,
            "--dir" => dir = Some(PathBuf::from(value()?)),
            "--entrypoint" => {
                let v = value()?;
                let (name, path) = v
                    .split_once('=')
                    .ok_or(format!("--entrypoint {v}: IMAGE_NAME=PATH"))?;
                entrypoints.0.insert(name.into(), path.into());
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let dir = dir
        .unwrap_or_else(|| std::env::temp_dir().join(format!("sessionflow-test-kubelet-{node}")));
    Ok(Options {
        node,
        dir,
        entrypoints,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let opts = match options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("sessionflow-test-kubelet: {e}");
            return ExitCode::from(2);
        }
    };
    match run(opts).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sessionflow-test-kubelet: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(opts: Options) -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let (server, ca_data) = cluster_of_kubeconfig()?;
    std::fs::create_dir_all(&opts.dir)?;
    node::register(&client, &opts.node).await?;
    println!("test-kubelet: node {} ready", opts.node);
    let heartbeat = tokio::spawn(node::keep_alive(client.clone(), opts.node.clone()));
    let kubelet = Arc::new(Kubelet {
        client: client.clone(),
        dir: opts.dir.clone(),
        entrypoints: opts.entrypoints,
        server,
        ca_data,
    });
    let pods: Api<Pod> = Api::all(client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={}", opts.node));
    let mut events = watcher(pods, config).boxed();
    let mut running: HashMap<String, PodHandle> = HashMap::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        };
        running.retain(|_, h| !h.task.is_finished());
        match event {
            Some(Ok(Event::Apply(pod) | Event::InitApply(pod))) => {
                on_pod(&kubelet, &mut running, pod).await
            }
            Some(Ok(Event::Delete(pod))) => {
                if let Some(h) = running.get(&pod.uid().unwrap_or_default()) {
                    let grace = pod.metadata.deletion_grace_period_seconds.unwrap_or(0);
                    let _ = h.stop.send(Some(Stop::Deleted(grace)));
                }
            }
            Some(Ok(Event::Init | Event::InitDone)) => {}
            Some(Err(e)) => eprintln!("test-kubelet: watching pods: {e}"),
            None => break,
        }
    }
    eprintln!("test-kubelet: stopping {} pod(s)", running.len());
    for h in running.values() {
        let _ = h.stop.send(Some(Stop::Shutdown(SHUTDOWN_GRACE_SECS)));
    }
    for (_, h) in running {
        let _ = h.task.await;
    }
    heartbeat.abort();
    node::deregister(&client, &opts.node).await;
    let _ = std::fs::remove_dir_all(&opts.dir);
    Ok(())
}

/// The API server's URL and CA (base64) from the kubeconfig (`KUBECONFIG`), for the pods'
/// ServiceAccount kubeconfigs.
fn cluster_of_kubeconfig() -> anyhow::Result<(String, String)> {
    let kubeconfig = Kubeconfig::read()?;
    let context = kubeconfig.current_context.clone().unwrap_or_default();
    let cluster_name = kubeconfig
        .contexts
        .iter()
        .find(|c| c.name == context)
        .and_then(|c| Some(c.context.as_ref()?.cluster.clone()))
        .ok_or_else(|| anyhow::anyhow!("kubeconfig: no context {context:?}"))?;
    let cluster = kubeconfig
        .clusters
        .iter()
        .find(|c| c.name == cluster_name)
        .and_then(|c| c.cluster.clone())
        .ok_or_else(|| anyhow::anyhow!("kubeconfig: no cluster {cluster_name:?}"))?;
    let server = cluster.server.unwrap_or_default();
    let ca = cluster.certificate_authority_data.unwrap_or_default();
    anyhow::ensure!(
        !server.is_empty() && !ca.is_empty(),
        "kubeconfig: cluster {cluster_name:?} needs server and certificate-authority-data"
    );
    Ok((server, ca))
}

/// A pod added or changed: start it, or stop it once it is being deleted.
async fn on_pod(kubelet: &Arc<Kubelet>, running: &mut HashMap<String, PodHandle>, pod: Pod) {
    let uid = pod.uid().unwrap_or_default();
    let deleting = pod.metadata.deletion_timestamp.is_some();
    let grace = pod
        .metadata
        .deletion_grace_period_seconds
        .or_else(|| pod.spec.as_ref()?.termination_grace_period_seconds)
        .unwrap_or(30);
    match running.get(&uid) {
        Some(h) if deleting => {
            if h.stop.borrow().is_none() {
                eprintln!(
                    "test-kubelet: pod {} deleted; stopping it (grace {grace} s)",
                    pod.name_any()
                );
                let _ = h.stop.send(Some(Stop::Deleted(grace)));
            }
        }
        Some(_) => {}
        None if deleting => pod::remove(&kubelet.client, &pod).await,
        None => {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if !matches!(phase, Some("Succeeded" | "Failed")) {
                eprintln!(
                    "test-kubelet: pod {}/{} bound here; starting it",
                    pod.namespace().unwrap_or_default(),
                    pod.name_any()
                );
                running.insert(uid, pod::start(kubelet.clone(), pod));
            }
        }
    }
}
