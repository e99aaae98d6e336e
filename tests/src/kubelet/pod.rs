//! One pod on the test kubelet, from binding to removal: its volumes written, its containers
//! run as local processes and restarted when they exit, their readiness probed, its status
//! reported, and on deletion its processes stopped (SIGTERM, the grace period, SIGKILL) before
//! the pod object is removed (a delete with grace 0, as a kubelet finishes a deletion).
//!
//! Each pod gets a folder of its own (`<kubelet dir>/<namespace>_<name>_<uid>/`): its volumes
//! (`volumes/<name>/`, ConfigMaps and Secrets written as files, emptyDirs empty) and each
//! container's output (`<container>.log`). How images, mount paths and ports are mapped onto
//! the host: [`super::container`]; what is written into the folder: [`super::volumes`].

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::sync::watch;

use super::container::{Entrypoints, LocalContainer, PortMap};
use super::node::now;
use super::probe;
use super::status::{ContainerView, PodView, State};
use super::volumes::PodFiles;

/// How often containers are checked and probed.
const TICK: Duration = Duration::from_secs(1);
/// The longest wait between two restarts of a crashing container (the kubelet's is 5 min; a
/// test wants it back soon).
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What every pod runner shares.
pub struct Kubelet {
    pub client: Client,
    pub dir: PathBuf,
    pub entrypoints: Entrypoints,
    /// The API server's URL and CA (base64 PEM), for the pods' ServiceAccount kubeconfigs.
    pub server: String,
    pub ca_data: String,
}

/// Why a pod's processes stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The pod is being deleted (grace seconds): stop, then remove the pod object.
    Deleted(i64),
    /// The kubelet is exiting: stop within this grace, leave the pod object.
    Shutdown(i64),
}

/// A running pod: tell it to stop, or wait for it.
pub struct PodHandle {
    pub stop: watch::Sender<Option<Stop>>,
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts running `pod`.
pub fn start(kubelet: Arc<Kubelet>, pod: Pod) -> PodHandle {
    let (stop, stopped) = watch::channel(None);
    let task = tokio::spawn(async move {
        let name = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        let mut runner = Runner::new(kubelet, pod, stopped);
        let why = runner.run().await;
        eprintln!("test-kubelet: pod {name} stopped ({why:?})");
    });
    PodHandle { stop, task }
}

/// Finishes the deletion of a pod this kubelet is not running (e.g. bound while it was down).
pub async fn remove(client: &Client, pod: &Pod) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match pods.delete(&pod.name_any(), &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
        Err(e) => eprintln!("test-kubelet: removing pod {}: {e}", pod.name_any()),
    }
}

/// One container's process and history.
struct Process {
    spec: LocalContainer,
    child: Option<Child>,
    restarts: i32,
    ready: bool,
    state: State,
    last_exit: Option<(i32, String, String)>,
    restart_at: Option<Instant>,
    log: PathBuf,
}

struct Runner {
    kubelet: Arc<Kubelet>,
    pod: Pod,
    stopped: watch::Receiver<Option<Stop>>,
    dir: PathBuf,
    processes: Vec<Process>,
    view: Option<PodView>,
    start_time: String,
}

impl Runner {
    fn new(kubelet: Arc<Kubelet>, pod: Pod, stopped: watch::Receiver<Option<Stop>>) -> Self {
        let dir = kubelet.dir.join(format!(
            "{}_{}_{}",
            pod.namespace().unwrap_or_default(),
            pod.name_any(),
            pod.uid().unwrap_or_default()
        ));
        Runner {
            kubelet,
            pod,
            stopped,
            dir,
            processes: Vec::new(),
            view: None,
            start_time: now(),
        }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(
            self.kubelet.client.clone(),
            &self.pod.namespace().unwrap_or_default(),
        )
    }

    /// Runs the pod until told to stop; returns why it stopped.
    async fn run(&mut self) -> Stop {
        match self.prepare().await {
            Ok(containers) => {
                for spec in containers {
                    let log = self.dir.join(format!("{}.log", spec.name));
                    self.processes.push(Process {
                        state: State::Waiting {
                            reason: "ContainerCreating".into(),
                            message: String::new(),
                        },
                        spec,
                        child: None,
                        restarts: 0,
                        ready: false,
                        last_exit: None,
                        restart_at: Some(Instant::now()),
                        log,
                    });
                }
            }
            Err(why) => {
                eprintln!("test-kubelet: pod {}: {why}", self.pod.name_any());
                self.report_unstartable(&why).await;
            }
        }
        let stop = loop {
            if let Some(stop) = *self.stopped.borrow_and_update() {
                break stop;
            }
            self.supervise().await;
            self.report().await;
            tokio::select! {
                _ = self.stopped.changed() => {}
                _ = tokio::time::sleep(TICK) => {}
            }
        };
        let grace = match stop {
            Stop::Deleted(g) | Stop::Shutdown(g) => g,
        };
        self.terminate(Duration::from_secs(grace.max(0) as u64))
            .await;
        if let Stop::Deleted(_) = stop {
            remove(&self.kubelet.client, &self.pod).await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        stop
    }

    /// The pod's folder and volumes, and its containers mapped onto the host.
    async fn prepare(&mut self) -> Result<Vec<LocalContainer>, String> {
        let spec = self.pod.spec.clone().ok_or("the pod has no spec")?;
        if spec.init_containers.as_ref().is_some_and(|c| !c.is_empty()) {
            return Err("init containers (and native sidecars) are not supported".into());
        }
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        let files = PodFiles {
            kubelet: &self.kubelet,
            pod: &self.pod,
            dir: &self.dir,
            stopped: &self.stopped,
        };
        let lookups = files.lookups().await?;
        let mut ports = PortMap::default();
        for c in &spec.containers {
            for p in c.ports.iter().flatten() {
                let host = free_port().map_err(|e| format!("a free port: {e}"))?;
                ports.ports.push((p.container_port, host, p.name.clone()));
            }
        }
        let token = files.service_account_token().await?;
        let volumes = files.write_volumes(&lookups, &ports, token.as_deref())?;
        let kubeconfig = match &token {
            Some(token) => Some(files.write_kubeconfig(token)?),
            None => None,
        };
        spec.containers
            .iter()
            .map(|c| {
                let mut local = LocalContainer::new(
                    &self.pod,
                    c,
                    &volumes,
                    &ports,
                    &self.kubelet.entrypoints,
                    &lookups,
                )
                .map_err(|e| format!("container {:?}: {e}", c.name))?;
                if let Some(path) = &kubeconfig {
                    local
                        .env
                        .push(("KUBECONFIG".into(), path.display().to_string()));
                }
                Ok(local)
            })
            .collect()
    }

    /// Reaps exited processes, (re)starts the ones due, probes the running ones.
    async fn supervise(&mut self) {
        let policy = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into());
        for p in &mut self.processes {
            if let Some(child) = &mut p.child {
                if let Ok(Some(exit)) = child.try_wait() {
                    let code = exit.code().unwrap_or(128 + signal_of(&exit));
                    let started = match &p.state {
                        State::Running { started_at, .. } => started_at.clone(),
                        _ => now(),
                    };
                    let finished = now();
                    p.child = None;
                    p.ready = false;
                    let restart = policy == "Always" || (policy == "OnFailure" && code != 0);
                    eprintln!(
                        "test-kubelet: {} container {} exited with {code}{}",
                        self.pod.name_any(),
                        p.spec.name,
                        if restart { "; restarting" } else { "" }
                    );
                    if restart {
                        let backoff = Duration::from_secs(1u64 << p.restarts.clamp(0, 4) as u32)
                            .min(MAX_BACKOFF);
                        p.restart_at = Some(Instant::now() + backoff);
                        p.last_exit = Some((code, started, finished));
                        p.state = State::Waiting {
                            reason: "CrashLoopBackOff".into(),
                            message: format!("exited with {code}; restarting in {backoff:?}"),
                        };
                    } else {
                        p.state = State::Terminated {
                            code,
                            started_at: started,
                            finished_at: finished,
                        };
                    }
                }
            }
            if p.child.is_none() && p.restart_at.is_some_and(|at| at <= Instant::now()) {
                p.restart_at = None;
                let first = matches!(&p.state, State::Waiting { reason, .. } if reason == "ContainerCreating");
                match spawn(&p.spec, &self.dir, &p.log) {
                    Ok(child) => {
                        if !first {
                            p.restarts += 1;
                        }
                        p.state = State::Running {
                            pid: child.id().unwrap_or_default(),
                            started_at: now(),
                        };
                        p.child = Some(child);
                    }
                    Err(e) => {
                        p.restart_at = Some(Instant::now() + MAX_BACKOFF);
                        p.state = State::Waiting {
                            reason: "RunContainerError".into(),
                            message: format!("{}: {e}", p.spec.program.display()),
                        };
                    }
                }
            }
            if p.child.is_some() {
                p.ready = match &p.spec.readiness {
                    Some((port, path)) => probe::http_get(*port, path).await,
                    None => true,
                };
            }
        }
    }

    /// Writes the pod's status when it changed since the last write.
    async fn report(&mut self) {
        let ready = !self.processes.is_empty() && self.processes.iter().all(|p| p.ready);
        let ready_since = match &self.view {
            Some(v) if v.ready == ready => v.ready_since.clone(),
            _ => now(),
        };
        let view = PodView {
            start_time: self.start_time.clone(),
            containers: self
                .processes
                .iter()
                .map(|p| ContainerView {
                    name: p.spec.name.clone(),
                    image: p.spec.image.clone(),
                    ready: p.ready,
                    restarts: p.restarts,
                    state: p.state.clone(),
                    last_exit: p.last_exit.clone(),
                })
                .collect(),
            ready,
            ready_since,
        };
        if self.view.as_ref() == Some(&view) {
            return;
        }
        if self.patch_status(&view).await {
            self.view = Some(view);
        }
    }

    /// Writes `view` as the pod's status; false (and said on stderr) when the API refused it.
    async fn patch_status(&self, view: &PodView) -> bool {
        let patch = json!({ "status": view.status() });
        let name = self.pod.name_any();
        let patched = self
            .pods()
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        if let Err(e) = &patched {
            eprintln!("test-kubelet: status of {name}: {e}");
        }
        patched.is_ok()
    }

    /// A pod whose containers cannot be mapped: Pending, each container waiting with why.
    async fn report_unstartable(&mut self, why: &str) {
        let spec = self.pod.spec.clone().unwrap_or_default();
        let view = PodView {
            start_time: self.start_time.clone(),
            containers: spec
                .containers
                .iter()
                .map(|c| ContainerView {
                    name: c.name.clone(),
                    image: c.image.clone().unwrap_or_default(),
                    ready: false,
                    restarts: 0,
                    state: State::Waiting {
                        reason: "CreateContainerConfigError".into(),
                        message: why.to_string(),
                    },
                    last_exit: None,
                })
                .collect(),
            ready: false,
            ready_since: self.start_time.clone(),
        };
        self.patch_status(&view).await;
    }

    /// SIGTERM to every process, SIGKILL to what is left after `grace`.
    async fn terminate(&mut self, grace: Duration) {
        for p in &mut self.processes {
            if let Some(pid) = p.child.as_ref().and_then(Child::id) {
                // SAFETY: kill(2) on a child this runner spawned and has not reaped.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
            }
        }
        let deadline = tokio::time::Instant::now() + grace;
        for p in &mut self.processes {
            if let Some(child) = &mut p.child {
                if tokio::time::timeout_at(deadline, child.wait())
                    .await
                    .is_err()
                {
                    eprintln!(
                        "test-kubelet: {} container {} outlived its grace period; SIGKILL",
                        self.pod.name_any(),
                        p.spec.name
                    );
                    let _ = child.kill().await;
                }
            }
            p.child = None;
        }
    }
}

/// Starts one container's process: its own process group (a Ctrl-C at the terminal reaches the
/// kubelet, which stops it), killed if the kubelet dies, output appended to `log`.
fn spawn(spec: &LocalContainer, dir: &Path, log: &Path) -> std::io::Result<Child> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let mut command = Command::new(&spec.program);
    command
        .args(&spec.args)
        .env_clear()
        .envs(
            ["PATH", "HOME", "LD_LIBRARY_PATH", "TMPDIR"]
                .iter()
                .filter_map(|k| std::env::var(k).ok().map(|v| (*k, v))),
        )
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
    unsafe {
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    command.spawn()
}

#[cfg(unix)]
fn signal_of(exit: &std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    exit.signal().unwrap_or(0)
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
