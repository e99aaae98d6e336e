//! The test kubelet (tests/src/kubelet/) really runs a pipeline's workers: the pods the real
//! controllers make land on its node (the pipeline's `workerTemplate` selects and tolerates
//! it), each becomes a `sessionflow-worker run` process on this machine with the stage's
//! ConfigMap as its config, Ready only once that worker answers `/readyz`, and a deleted pod's
//! process is stopped before the pod object goes away.
//!
//! Each test starts its own kubelet with a node of its own (the test's namespace in its name),
//! and pins its pods to that node by `kubernetes.io/hostname`, so tests in parallel never run
//! each other's pods. The kubelet is stopped (SIGTERM: it stops its processes and deletes its
//! node) when the test ends.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use kube::ResourceExt;
use serde_json::json;
use sessionflow_operator::render::PIPELINE_LABEL;
use sessionflow_tests::workspace_binary;

use crate::{admin_kubeconfig, eventually, Env};

/// A `sessionflow-test-kubelet` process; SIGTERM when dropped, SIGKILL if it lingers.
struct Kubelet {
    child: Child,
    node: String,
    dir: PathBuf,
}

impl Kubelet {
    fn start(node: &str) -> Kubelet {
        let binary = std::env::var_os("SESSIONFLOW_TEST_KUBELET_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace_binary("sessionflow-test-kubelet"));
        let worker = std::env::var_os("SESSIONFLOW_WORKER_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace_binary("sessionflow-worker"));
        let dir = std::env::temp_dir().join(format!("sessionflow-test-kubelet-{node}"));
        let child = Command::new(binary)
            .args(["--node", node, "--dir"])
            .arg(&dir)
            .arg("--entrypoint")
            .arg(format!("sessionflow-worker={}", worker.display()))
            .env("KUBECONFIG", admin_kubeconfig().expect("a cluster"))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the test kubelet starts");
        Kubelet {
            child,
            node: node.to_string(),
            dir,
        }
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("test kubelet {} did not stop in 30 s: SIGKILL", self.node);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pid of the pod's worker process, from `containerID: local-process://<pid>`, once the
/// pod is Ready.
fn ready_pid(pod: &Pod) -> Option<u32> {
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let c = status.container_statuses.as_ref()?.first()?;
    if !ready || !c.ready || status.pod_ip.as_deref() != Some("127.0.0.1") {
        return None;
    }
    c.container_id
        .as_deref()?
        .strip_prefix("local-process://")?
        .parse()
        .ok()
}

/// The command line of a live process (a reaped one has no /proc entry).
fn cmdline(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(String::from_utf8_lossy(&raw).replace('\0', " "))
}

/// Two worker pods of a pipeline run as `sessionflow-worker` processes with the stage's config,
/// become Ready from their own `/readyz`, and are reported with podIP 127.0.0.1 on the test
/// kubelet's node; deleting one stops its process (and the ReplicaSet's replacement runs a new
/// one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelines_pods_run_as_worker_processes_and_stop_when_deleted() {
    Env::run("kubelet", |env| async move {
        let node = format!("sessionflow-local-{}", env.namespace);
        let kubelet = Kubelet::start(&node);
        let nodes: Api<Node> = Api::all(env.client.clone());
        eventually("the test kubelet's node Ready", || async {
            let n = nodes.get_opt(&node).await.map_err(|e| e.to_string())?;
            let ready = n
                .as_ref()
                .and_then(|n| n.status.as_ref()?.conditions.clone())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            if ready {
                Ok(())
            } else {
                Err(format!("{n:?}"))
            }
        })
        .await;

        let _operator = env.operator(None);
        let mut sp = serde_json::to_value(env.pipeline("live", 2, 2)).unwrap();
        sp["spec"]["workerTemplate"] = json!({
            "nodeSelector": { "sessionflow.io/test-kubelet": "true", "kubernetes.io/hostname": node },
            "tolerations": [{ "key": "sessionflow.io/test-kubelet", "operator": "Equal",
                              "value": "true", "effect": "NoSchedule" }],
        });
        env.create_pipeline(&serde_json::from_value(sp).unwrap())
            .await;

        let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.namespace);
        let selector = ListParams::default().labels(&format!("{PIPELINE_LABEL}=live"));
        let running = eventually("two worker pods Ready, each a live process", || async {
            let list = pods.list(&selector).await.map_err(|e| e.to_string())?;
            let seen: Vec<(String, Option<String>, Option<u32>)> = list
                .items
                .iter()
                .map(|p| {
                    let on = p.spec.as_ref().and_then(|s| s.node_name.clone());
                    (p.name_any(), on, ready_pid(p))
                })
                .collect();
            let live: Vec<(String, u32)> = seen
                .iter()
                .filter(|(_, on, _)| on.as_deref() == Some(node.as_str()))
                .filter_map(|(name, _, pid)| Some((name.clone(), (*pid)?)))
                .filter(|(_, pid)| cmdline(*pid).is_some())
                .collect();
            if live.len() == 2 && seen.len() == 2 {
                Ok(live)
            } else {
                Err(format!("{seen:?}"))
            }
        })
        .await;

        for (name, pid) in &running {
            let cmd = cmdline(*pid).expect("running");
            assert!(
                cmd.contains("sessionflow-worker") && cmd.contains(" run --config "),
                "pod {name}: the worker runs its stage (`{cmd}`)"
            );
            // The ConfigMap was written under the kubelet's folder, its bind address moved to a
            // port of the pod's own.
            let config = cmd
                .split_whitespace()
                .skip_while(|a| *a != "--config")
                .nth(1)
                .expect("--config PATH");
            assert!(
                config.starts_with(kubelet.dir.to_str().unwrap()),
                "pod {name}: config at {config}"
            );
            let text = std::fs::read_to_string(config).expect("the mounted config");
            assert!(
                text.contains("127.0.0.1:") && !text.contains("0.0.0.0:9090"),
                "pod {name}: metricsAddr mapped to a port of its own: {text}"
            );
        }

        let (victim, pid) = running[0].clone();
        pods.delete(&victim, &DeleteParams::default())
            .await
            .expect("pod deleted");
        eventually("the deleted pod's process stopped and the pod gone", || async {
            let alive = cmdline(pid).is_some();
            let present = pods.get_opt(&victim).await.map_err(|e| e.to_string())?;
            if !alive && present.is_none() {
                Ok(())
            } else {
                Err(format!("process alive: {alive}, pod present: {}", present.is_some()))
            }
        })
        .await;
        eventually("the replacement pod Ready as a new process", || async {
            let list = pods.list(&selector).await.map_err(|e| e.to_string())?;
            let pids: Vec<u32> = list.items.iter().filter_map(ready_pid).collect();
            let fresh = pids
                .iter()
                .any(|p| *p != pid && *p != running[1].1 && cmdline(*p).is_some());
            if pids.len() == 2 && fresh {
                Ok(())
            } else {
                Err(format!("{pids:?}"))
            }
        })
        .await;
        drop(kubelet);
    })
    .await;
}
