//! The operator end to end on a real Kubernetes control plane (issue 36, step 2):
//! `scripts/cluster.sh` runs kube-apiserver (RBAC, ServiceAccount tokens),
//! kube-controller-manager (garbage collector, Deployment and ReplicaSet controllers),
//! kube-scheduler and kwok (fake nodes whose pods become Running and Ready).
//!
//! Each test works in a namespace of its own: it `helm install`s charts/sessionflow there
//! (release `sf`, `watchNamespace` = that namespace: ServiceAccount, Roles, RoleBindings, the
//! operator's Deployment and Service), makes a token for the release's ServiceAccount
//! (TokenRequest), and runs `sessionflow-operator run` as a process with a kubeconfig holding
//! only that token, so that the chart's RBAC, not the test's admin rights, decides what the
//! operator may do. (kwok makes the chart's own operator pod Running without running anything:
//! there is no image to run here.) The namespace (and the Kafka topics the operator created)
//! are deleted at the end, whether the test passed or not.
//!
//! The cluster: `SESSIONFLOW_CLUSTER_KUBECONFIG` names its admin kubeconfig
//! (`scripts/cluster.sh start` prints it; `scripts/with-cluster.sh` exports it). Unset: the
//! tests print SKIPPED and pass, unless `SESSIONFLOW_REQUIRE_CLUSTER=1` (CI sets it when the
//! cluster could be installed), which makes them fail. helm: `SESSIONFLOW_HELM`, else the one
//! `scripts/chart-check.sh` caches, else `helm` on PATH. Kafka: `SESSIONFLOW_BROKERS`, else
//! 127.0.0.1:9092.
//!
//! Every wait polls against a generous deadline; no test asserts how long anything took.

mod autoscale;
mod crd;
mod gc;
mod helm;
mod kubelet;
mod leader;
mod names;
mod reconcile;

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::FutureExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Event, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::RoleBinding;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config, ResourceExt};
use serde_json::{json, Value};
use sessionflow_operator::crd::{SessionPipeline, CRD_NAME};
use sessionflow_operator::render::PIPELINE_LABEL;
use sessionflow_tests::{unique, workspace_binary};

const MANAGER: &str = "sessionflow-tests";
/// The helm release of every test (one per namespace).
pub const RELEASE: &str = "sf";
/// The label helm's chart puts on every object of a release, naming it.
pub const INSTANCE_LABEL: &str = "app.kubernetes.io/instance";
/// How long anything the cluster or the operator does may take before a test gives up: far
/// above what it takes (seconds), on a shared 2-core machine. `SESSIONFLOW_CLUSTER_PATIENCE_SECS`
/// overrides it (e.g. shorter, to see a broken operator fail sooner).
fn patience() -> Duration {
    let secs = std::env::var("SESSIONFLOW_CLUSTER_PATIENCE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    Duration::from_secs(secs)
}

fn repo_path(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn yaml(text: &str) -> Value {
    serde_saphyr::from_str(text).expect("valid YAML")
}

fn brokers() -> String {
    std::env::var("SESSIONFLOW_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// The admin kubeconfig of the cluster, or `None` (SKIPPED).
fn admin_kubeconfig() -> Option<String> {
    match std::env::var("SESSIONFLOW_CLUSTER_KUBECONFIG") {
        Ok(path) if !path.is_empty() => Some(path),
        _ => {
            assert!(
                std::env::var("SESSIONFLOW_REQUIRE_CLUSTER").as_deref() != Ok("1"),
                "SESSIONFLOW_REQUIRE_CLUSTER=1 but SESSIONFLOW_CLUSTER_KUBECONFIG is not set"
            );
            eprintln!(
                "\n*** SKIPPED: the cluster tests need a Kubernetes control plane: run \
                 `scripts/cluster.sh install` and export \
                 SESSIONFLOW_CLUSTER_KUBECONFIG=$(scripts/cluster.sh start | tail -n1) ***\n"
            );
            None
        }
    }
}

fn helm() -> PathBuf {
    if let Some(helm) = std::env::var_os("SESSIONFLOW_HELM") {
        return helm.into();
    }
    let cache = std::env::var_os("SESSIONFLOW_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/sessionflow")
        });
    // The helm scripts/chart-check.sh installs (HELM_NPM_VERSION there).
    let cached = cache.join("helm-npm-2.2.2/helm");
    if cached.exists() {
        cached
    } else {
        "helm".into()
    }
}

async fn client_of(path: &str) -> Client {
    let kubeconfig = Kubeconfig::read_from(path).expect("kubeconfig");
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig usable");
    Client::try_from(config).expect("client")
}

async fn install_crd(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let text = std::fs::read_to_string(repo_path("crds/sessionpipeline.yaml")).unwrap();
    let crd: CustomResourceDefinition = serde_json::from_value(yaml(&text)).unwrap();
    // Server-side apply: the tests own the CRD; `crd::a_plain_kubectl_apply_installs_the_crd`
    // checks the client-side apply a user runs.
    crds.patch(
        CRD_NAME,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("the API server accepts the CRD");
    tokio::time::timeout(
        patience(),
        await_condition(crds, CRD_NAME, conditions::is_crd_established()),
    )
    .await
    .expect("CRD established in time")
    .expect("watch");
}

/// One test's namespace on the cluster, with the chart's ServiceAccount and RBAC in it and a
/// token kubeconfig of that ServiceAccount for the operator processes.
pub struct Env {
    /// The admin's client (the test's own calls).
    pub client: Client,
    pub namespace: String,
    /// Kubeconfig of the operator's ServiceAccount (a token, no admin rights).
    operator_kubeconfig: PathBuf,
    /// Topics the test's pipelines name (the operator creates them); deleted at the end.
    topics: std::sync::Mutex<Vec<String>>,
    /// The operator processes' logs.
    logs: std::sync::Mutex<Vec<PathBuf>>,
}

impl Env {
    /// Runs `test` in a fresh namespace; deletes it (and the topics) afterwards, also when the
    /// test panicked, then passes the panic on. Returns without running `test` (SKIPPED)
    /// when there is no cluster.
    pub async fn run<F, Fut>(name: &str, test: F)
    where
        F: FnOnce(&'static Env) -> Fut,
        Fut: Future<Output = ()>,
    {
        let Some(admin) = admin_kubeconfig() else {
            return;
        };
        let client = client_of(&admin).await;
        install_crd(&client).await;
        // Leaked: the test's futures borrow it for their whole life; one per test process.
        let env: &'static Env = Box::leak(Box::new(Env::create(client, name).await));
        let outcome = AssertUnwindSafe(async {
            env.install_chart().await;
            test(env).await
        })
        .catch_unwind()
        .await;
        if outcome.is_err() {
            env.describe().await;
        }
        let logs = std::mem::take(&mut *env.logs.lock().unwrap());
        for log in &logs {
            if outcome.is_err() {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                eprintln!("--- the last lines of {}:", log.display());
                for line in &lines[lines.len().saturating_sub(40)..] {
                    eprintln!("{line}");
                }
            }
            if std::env::var_os("SESSIONFLOW_CLUSTER_KEEP_LOGS").is_none() {
                let _ = std::fs::remove_file(log);
            }
        }
        env.cleanup().await;
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }

    /// What a failed test prints besides the operator's log: the namespace's pods and events,
    /// and what the control plane's controllers logged about it (a pod that never became
    /// ready is a controller's, the scheduler's or kwok's to explain, not the operator's).
    async fn describe(&self) {
        let ns = &self.namespace;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        match pods.list(&ListParams::default()).await {
            Ok(list) => {
                eprintln!("--- the pods of {ns}:");
                for pod in list {
                    let status = pod.status.as_ref();
                    let conditions: Vec<String> = status
                        .and_then(|s| s.conditions.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|c| format!("{}={}", c.type_, c.status))
                        .collect();
                    let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
                    let phase = status.and_then(|s| s.phase.as_deref());
                    eprintln!(
                        "{} node {node:?} phase {phase:?} {}",
                        pod.name_any(),
                        conditions.join(" ")
                    );
                }
            }
            Err(e) => eprintln!("--- listing the pods of {ns}: {e}"),
        }
        let events: Api<Event> = Api::namespaced(self.client.clone(), ns);
        match events.list(&ListParams::default()).await {
            Ok(list) => {
                eprintln!("--- the events of {ns}:");
                for event in list {
                    let object = &event.involved_object;
                    eprintln!(
                        "{:?} {:?} {}/{}: {}",
                        event.type_.unwrap_or_default(),
                        event.reason.unwrap_or_default(),
                        object.kind.as_deref().unwrap_or_default(),
                        object.name.as_deref().unwrap_or_default(),
                        event.message.unwrap_or_default()
                    );
                }
            }
            Err(e) => eprintln!("--- listing the events of {ns}: {e}"),
        }
        // scripts/cluster.sh writes each component's output to its state directory.
        let state = repo_path(".local/cluster");
        for component in ["kube-controller-manager", "kube-scheduler", "kwok"] {
            let log = state.join(format!("{component}.log"));
            let text = match std::fs::read_to_string(&log) {
                Ok(text) => text,
                Err(e) => {
                    eprintln!("--- {}: {e}", log.display());
                    continue;
                }
            };
            let about: Vec<&str> = text.lines().filter(|l| l.contains(ns.as_str())).collect();
            eprintln!("--- the last lines of {} about {ns}:", log.display());
            if about.is_empty() {
                eprintln!("(none)");
            }
            for line in &about[about.len().saturating_sub(20)..] {
                eprintln!("{line}");
            }
        }
    }

    async fn create(client: Client, name: &str) -> Env {
        let namespace = unique(&format!("cl-{name}"));
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": namespace, "labels": { "sessionflow.io/test": "cluster" } }
                }))
                .unwrap(),
            )
            .await
            .expect("namespace created");
        eprintln!("cluster test {name}: namespace {namespace}");
        Env {
            client,
            operator_kubeconfig: std::env::temp_dir().join(format!("{namespace}.kubeconfig")),
            namespace,
            topics: Default::default(),
            logs: Default::default(),
        }
    }

    /// `helm install` of the chart as release [`RELEASE`] in the namespace, watching it only
    /// (`--skip-crds`: [`install_crd`] installed the CRD; helm would skip it anyway once it
    /// exists, and tests run concurrently). kwok fakes the chart's operator pod (Running, no
    /// process); the test runs the operator as a process instead, with a token of the release's
    /// ServiceAccount written into the operator's kubeconfig.
    async fn install_chart(&self) {
        let ns = &self.namespace;
        self.helm(&["install", RELEASE])
            .arg(repo_path("charts/sessionflow"))
            .args(["--skip-crds", "--set"])
            .arg(format!("watchNamespace={ns}"))
            // One fake operator pod is enough; leader election keeps the lease Role.
            .args([
                "--set",
                "leaderElection.enabled=true",
                "--set",
                "replicas=1",
            ])
            .run("helm install");
        let release = ListParams::default().labels(&format!("{INSTANCE_LABEL}={RELEASE}"));
        let accounts = Api::<ServiceAccount>::namespaced(self.client.clone(), ns)
            .list(&release)
            .await
            .expect("list ServiceAccounts")
            .items;
        let [account] = &accounts[..] else {
            panic!("the release has {} ServiceAccounts", accounts.len());
        };
        let account = account.name_any();
        let bindings = Api::<RoleBinding>::namespaced(self.client.clone(), ns)
            .list(&release)
            .await
            .expect("list RoleBindings")
            .items;
        assert_eq!(
            bindings.len(),
            2,
            "operator and leader-election bindings: {:?}",
            bindings.iter().map(|b| b.name_any()).collect::<Vec<_>>()
        );
        let token = Api::<ServiceAccount>::namespaced(self.client.clone(), ns)
            .create_token_request(
                &account,
                &PostParams::default(),
                &TokenRequest {
                    spec: TokenRequestSpec {
                        audiences: vec![],
                        expiration_seconds: Some(3600),
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .await
            .expect("TokenRequest")
            .status
            .expect("token")
            .token;
        let admin = yaml(&std::fs::read_to_string(admin_kubeconfig().unwrap()).unwrap());
        let cluster = &admin["clusters"][0]["cluster"];
        // JSON is YAML: kube (and kubectl) read it.
        let kubeconfig = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{ "name": "cluster", "cluster": {
                "server": cluster["server"],
                "certificate-authority-data": cluster["certificate-authority-data"],
            }}],
            "users": [{ "name": account, "user": { "token": token } }],
            "contexts": [{ "name": "operator", "context": {
                "cluster": "cluster", "user": account, "namespace": ns,
            }}],
            "current-context": "operator",
        });
        std::fs::write(&self.operator_kubeconfig, kubeconfig.to_string()).unwrap();
    }

    /// A helm command on the cluster (admin kubeconfig) in this test's namespace.
    pub fn helm(&self, args: &[&str]) -> Helm {
        let mut command = Command::new(helm());
        command
            .args(args)
            .arg("--kubeconfig")
            .arg(admin_kubeconfig().expect("a cluster"))
            .args(["--namespace", &self.namespace]);
        Helm(command)
    }

    /// The operator's kubeconfig (the ServiceAccount's token).
    pub fn operator_kubeconfig(&self) -> &Path {
        &self.operator_kubeconfig
    }

    async fn cleanup(&self) {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        if let Err(e) = namespaces
            .delete(&self.namespace, &DeleteParams::background())
            .await
        {
            eprintln!("cleanup: deleting namespace {}: {e}", self.namespace);
        }
        let _ = std::fs::remove_file(&self.operator_kubeconfig);
        let topics = std::mem::take(&mut *self.topics.lock().unwrap());
        if !topics.is_empty() {
            let names: Vec<&str> = topics.iter().map(String::as_str).collect();
            let _ = sessionflow_worker::kafka::topics::delete(&brokers(), &names).await;
        }
    }

    /// Starts `sessionflow-operator run` for this namespace as the chart's ServiceAccount (the
    /// binary built next to the tests, or the one `SESSIONFLOW_OPERATOR_BIN` names). With
    /// `identity`, it competes for the Lease (as a replica named so).
    pub fn operator(&self, identity: Option<&str>) -> Operator {
        let binary = std::env::var_os("SESSIONFLOW_OPERATOR_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace_binary("sessionflow-operator"));
        let mut command = Command::new(binary);
        command
            .args(["run", "--namespace", &self.namespace])
            .args([
                "--metrics-addr",
                "127.0.0.1:0",
                "--scale-interval-secs",
                "1",
            ])
            .env("KUBECONFIG", &self.operator_kubeconfig)
            .env("RUST_LOG", "info,kube=warn")
            .env_remove("SESSIONFLOW_NAMESPACE")
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .stderr(Stdio::inherit());
        // Its log (tracing writes to stdout) goes to a file, printed when the test fails.
        let log = std::env::temp_dir().join(format!(
            "{}-{}.log",
            self.namespace,
            identity.unwrap_or("operator")
        ));
        command.stdout(std::fs::File::create(&log).expect("operator log file"));
        self.logs.lock().unwrap().push(log);
        if let Some(identity) = identity {
            command
                .args(["--leader-election", "--lease-namespace", &self.namespace])
                .env("POD_NAME", identity);
        }
        Operator(command.spawn().expect("operator starts"))
    }

    /// A one-stage pipeline `name` (stage `work`, replicas `min`..`max`) on the test broker;
    /// the operator creates its topics.
    pub fn pipeline(&self, name: &str, min: i32, max: i32) -> SessionPipeline {
        let input = unique("cluster-in");
        let output = unique("cluster-out");
        let dlq = unique("cluster-dlq");
        self.topics
            .lock()
            .unwrap()
            .extend([input.clone(), output.clone(), dlq.clone()]);
        serde_json::from_value(json!({
            "apiVersion": "sessionflow.io/v1alpha1",
            "kind": "SessionPipeline",
            "metadata": { "name": name, "namespace": self.namespace },
            "spec": {
                "kafka": { "bootstrapServers": brokers() },
                "topics": {
                    "create": true,
                    "dlq": dlq,
                    "declared": [
                        { "name": input, "partitions": 2 },
                        { "name": output, "partitions": 2 },
                        { "name": dlq, "partitions": 1 },
                    ],
                },
                "stages": [{
                    "name": "work",
                    "input": input,
                    "output": output,
                    "handler": { "builtin": {} },
                    "replicas": { "min": min, "max": max },
                }],
            },
        }))
        .expect("a SessionPipeline")
    }

    pub fn pipelines(&self) -> Api<SessionPipeline> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    pub fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Waits until pipeline `name` says Ready=True (`what` names the wait in its failure).
    pub async fn wait_ready(&self, name: &str, what: &str) {
        eventually(what, || async {
            let sp = self
                .pipelines()
                .get(name)
                .await
                .map_err(|e| e.to_string())?;
            match condition(&sp, "Ready") {
                Some((s, _, _)) if s == "True" => Ok(()),
                other => Err(format!("Ready={other:?}")),
            }
        })
        .await;
    }

    pub async fn create_pipeline(&self, sp: &SessionPipeline) -> SessionPipeline {
        self.pipelines()
            .create(&PostParams::default(), sp)
            .await
            .expect("pipeline created")
    }

    /// The Deployments labelled as `pipeline`'s.
    pub async fn pipeline_deployments(&self, pipeline: &str) -> Vec<Deployment> {
        self.deployments()
            .list(&ListParams::default().labels(&format!("{PIPELINE_LABEL}={pipeline}")))
            .await
            .expect("list deployments")
            .items
    }

    /// Sets `spec.replicas` of a Deployment as `kubectl scale` does (the scale subresource).
    pub async fn hand_scale(&self, name: &str, replicas: i32) {
        self.deployments()
            .patch_scale(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": { "replicas": replicas } })),
            )
            .await
            .expect("scaled by hand");
    }
}

/// A helm command line ([`Env::helm`]).
pub struct Helm(Command);

impl Helm {
    pub fn arg(mut self, arg: impl AsRef<std::ffi::OsStr>) -> Self {
        self.0.arg(arg);
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        self.0.args(args);
        self
    }

    /// Runs it; panics (naming `what` and helm's stderr) unless it succeeds; its stdout.
    pub fn run(mut self, what: &str) -> String {
        let out = self.0.output().unwrap_or_else(|e| {
            panic!(
                "helm ({}) does not run: {e}; scripts/chart-check.sh installs it",
                helm().display()
            )
        });
        assert!(
            out.status.success(),
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// An operator process; killed (SIGKILL) when dropped.
pub struct Operator(Child);

impl Operator {
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Still running (it exits on errors it cannot recover from, e.g. a forbidden call at
    /// start-up).
    pub fn running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `probe` until it returns `Ok`, for at most [`patience`]; panics with `what` and the
/// last thing seen otherwise.
pub async fn eventually<T, D, F, Fut>(what: &str, mut probe: F) -> T
where
    D: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, D>>,
{
    let started = Instant::now();
    loop {
        let last = match probe().await {
            Ok(value) => {
                eprintln!("{what}: after {:.1?}", started.elapsed());
                return value;
            }
            Err(seen) => seen,
        };
        if started.elapsed() > patience() {
            panic!("{what}: not within {:?}; last seen: {last:?}", patience());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The pipeline's condition `type_` as (status, reason, message).
pub fn condition(sp: &SessionPipeline, type_: &str) -> Option<(String, String, String)> {
    let c = sp
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}
