//! `sessionflow-operator`: `crd` prints the CustomResourceDefinition; `reference` its field
//! reference; `render` the objects a SessionPipeline becomes; `run` runs the operator.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{watcher, Controller};
use kube::{Api, Client};
use sessionflow_operator::crd::{self, SessionPipeline};
use sessionflow_operator::leader::{self, Leadership};
use sessionflow_operator::liveness::PassClock;
use sessionflow_operator::metrics::Metrics;
use sessionflow_operator::reconciler::{self, Context};
use sessionflow_operator::render::{self, Defaults, MANAGER};
use sessionflow_operator::scaler::{self, Scaler};
use sessionflow_operator::server;

#[derive(Parser)]
#[command(name = "sessionflow-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the SessionPipeline CustomResourceDefinition (YAML).
    Crd,
    /// Print the SessionPipeline field reference (Markdown), generated from the CRD schema.
    Reference {
        /// The worker's stage config file instead.
        #[arg(long)]
        worker: bool,
    },
    /// Run the operator against the cluster of the current kubeconfig or service account.
    Run(RunArgs),
    /// Print, as YAML, every object the operator would apply for a SessionPipeline (no cluster
    /// needed). Exits 2, naming the field, for a spec the operator would mark InvalidSpec.
    Render(RenderArgs),
}

#[derive(clap::Args)]
struct RenderArgs {
    /// The SessionPipeline manifest (`-` for standard input).
    #[arg(short = 'f', long = "file")]
    file: String,
    /// Namespace of the objects (default: the manifest's, else `default`).
    #[arg(long)]
    namespace: Option<String>,
    /// Worker image for stages that name none.
    #[arg(long, env = "SESSIONFLOW_WORKER_IMAGE", default_value = DEFAULT_WORKER_IMAGE)]
    worker_image: String,
    /// The workers' log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Json)]
    worker_log_format: LogFormat,
    /// As `run --allowed-images`.
    #[arg(long, env = "SESSIONFLOW_ALLOWED_IMAGES", value_delimiter = ',')]
    allowed_images: Vec<String>,
}

const DEFAULT_WORKER_IMAGE: &str = concat!(
    "ghcr.io/sessionflow/sessionflow-worker:",
    env!("CARGO_PKG_VERSION")
);

#[derive(clap::Args)]
struct RunArgs {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "SESSIONFLOW_NAMESPACE")]
    namespace: Option<String>,
    /// Worker image for pipelines that name none.
    #[arg(long, env = "SESSIONFLOW_WORKER_IMAGE", default_value = DEFAULT_WORKER_IMAGE)]
    worker_image: String,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "SESSIONFLOW_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Seconds between two autoscaling passes.
    #[arg(long, env = "SESSIONFLOW_SCALE_INTERVAL_SECS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    scale_interval_secs: u64,
    /// The operator's log format.
    #[arg(long, env = "SESSIONFLOW_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// The workers' log format.
    #[arg(long, env = "SESSIONFLOW_WORKER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
    worker_log_format: LogFormat,
    /// Image prefixes worker pods may run (stage images, the pipeline's workerImage,
    /// sidecars), comma-separated, e.g. `registry.example.com/sessionflow/,registry.example.com/handlers/`.
    /// A pipeline naming another image is InvalidSpec. Empty: any image.
    #[arg(long, env = "SESSIONFLOW_ALLOWED_IMAGES", value_delimiter = ',')]
    allowed_images: Vec<String>,
    /// Compete for a Lease so that, of several replicas, only the holder reconciles and scales.
    #[arg(long, env = "SESSIONFLOW_LEADER_ELECTION")]
    leader_election: bool,
    /// Namespace of the Lease (the operator's own; required with --leader-election).
    #[arg(long, env = "POD_NAMESPACE")]
    lease_namespace: Option<String>,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

impl LogFormat {
    fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => {
            print!("{}", crd::crd_yaml());
            ExitCode::SUCCESS
        }
        Command::Reference { worker } => {
            let text = if worker {
                sessionflow_operator::reference::worker_markdown()
            } else {
                sessionflow_operator::reference::markdown()
            };
            print!("{text}");
            ExitCode::SUCCESS
        }
        Command::Render(args) => render(args),
        Command::Run(args) => {
            init_logging(args.log_format);
            let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
            match runtime.block_on(run(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    tracing::error!(error = format!("{error:#}"), "operator stopped");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// `render`: 0 with the objects on stdout; 2 when the manifest cannot be read or the operator
/// would refuse it.
fn render(args: RenderArgs) -> ExitCode {
    let text = if args.file == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(&args.file)
    };
    let text = match text {
        Ok(text) => text,
        Err(error) => {
            eprintln!("{}: {error}", args.file);
            return ExitCode::from(2);
        }
    };
    let mut sp: SessionPipeline = match serde_saphyr::from_str(&text) {
        Ok(sp) => sp,
        Err(error) => {
            eprintln!("{}: not a SessionPipeline: {error}", args.file);
            return ExitCode::from(2);
        }
    };
    if let Some(ns) = args.namespace {
        sp.metadata.namespace = Some(ns);
    } else if sp.metadata.namespace.is_none() {
        sp.metadata.namespace = Some("default".into());
    }
    let defaults = Defaults {
        worker_image: args.worker_image,
        log_format: args.worker_log_format.as_str().into(),
        allowed_images: args.allowed_images,
    };
    match render::manifests(&sp, &defaults) {
        Ok(yaml) => {
            print!("{yaml}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("{}: invalid spec: {error}", args.file);
            ExitCode::from(2)
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,kube=warn".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Watches what the reconciler creates (only objects labelled as the operator's), so an
/// edited or deleted child triggers a reconcile that repairs it.
fn owns_children(
    controller: Controller<SessionPipeline>,
    client: &Client,
    namespace: Option<&str>,
) -> Controller<SessionPipeline> {
    fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let ours =
        || watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGER}"));
    controller
        .owns(api::<Deployment>(client, namespace), ours())
        .owns(api::<ConfigMap>(client, namespace), ours())
        .owns(api::<Service>(client, namespace), ours())
        .owns(api::<PodDisruptionBudget>(client, namespace), ours())
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let metrics = Metrics::new();
    let ready = Arc::new(AtomicBool::new(false));
    let interval = Duration::from_secs(args.scale_interval_secs);
    let passes = Arc::new(PassClock::new(
        interval,
        scaler::lag_deadline(interval),
        std::time::Instant::now(),
    ));
    let (addr, _server) = server::serve(
        args.metrics_addr,
        metrics.clone(),
        ready.clone(),
        passes.clone(),
    )
    .await?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    let (leadership, election) = if args.leader_election {
        let namespace = args.lease_namespace.as_deref().ok_or_else(|| {
            anyhow::anyhow!("--leader-election needs --lease-namespace (or POD_NAMESPACE)")
        })?;
        let identity = std::env::var("POD_NAME").map_err(|_| {
            anyhow::anyhow!("--leader-election needs POD_NAME (the replica's identity)")
        })?;
        let (leadership, election) = leader::elect(
            client.clone(),
            namespace,
            leader::LEASE_NAME,
            &identity,
            leader::LEASE_SECONDS,
            leader::RENEW_BEFORE_SECONDS,
        )
        .await?;
        tracing::info!(%namespace, lease = leader::LEASE_NAME, %identity, "competing for the operator lease");
        (leadership, Some(election))
    } else {
        (Leadership::always(), None)
    };

    let pipelines = match &args.namespace {
        Some(ns) => Api::<SessionPipeline>::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let reporter = Reporter {
        controller: MANAGER.into(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let defaults = Defaults {
        worker_image: args.worker_image,
        log_format: args.worker_log_format.as_str().into(),
        allowed_images: args.allowed_images,
    };
    let ctx = Arc::new(
        Context::new(client.clone(), defaults, metrics.clone(), reporter.clone())
            .with_leadership(leadership.clone()),
    );
    // A standby's reconciles do nothing; the new leader catches up on every pipeline.
    let controller = owns_children(
        Controller::new(pipelines, watcher::Config::default()),
        &client,
        args.namespace.as_deref(),
    )
    .reconcile_all_on(leadership.gained());
    let store = controller.store();
    let scaler = Scaler::new(
        client.clone(),
        store.clone(),
        metrics,
        Recorder::new(client, reporter),
        interval,
        ctx.scaler_wake.clone(),
    )
    .with_leadership(leadership.clone())
    .with_pass_clock(passes);
    tokio::spawn(async move {
        // kube's store readiness wakes only its most recent waiter (the controller's own), so
        // poll again on a timer rather than waiting once.
        let synced = loop {
            if let Ok(result) =
                tokio::time::timeout(Duration::from_millis(250), store.wait_until_ready()).await
            {
                break result;
            }
        };
        match synced {
            Ok(()) => {
                ready.store(true, Ordering::Relaxed);
                tracing::info!("SessionPipeline cache synced; autoscaler starting");
                scaler.run().await;
            }
            Err(error) => tracing::error!(%error, "SessionPipeline cache never synced"),
        }
    });
    let controller = controller
        .shutdown_on_signal()
        .run(reconciler::reconcile, reconciler::error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "reconcile result");
            }
        });
    tokio::select! {
        _ = controller => {
            if let Some(election) = election {
                election.release().await;
            }
            tracing::info!("stopped");
            Ok(())
        }
        _ = leadership.lost() => {
            // Work in flight ends with the process; the restarted one waits as a standby.
            anyhow::bail!("lost the operator lease")
        }
    }
}
