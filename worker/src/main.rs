//! The `sessionflow-worker` command: run one stage of a pipeline (`run`), what the operator's
//! Deployments and the demo start. The tools around a pipeline (demo, loadgen, verify, lag,
//! dlq-replay, create-topics) are the `sessionflow` command (crate sessionflow-tools).
//!
//! The binary chooses the process's allocator: jemalloc with the feature `jemalloc` (on by
//! default), which the engine's heap statistics and purges then use (`ops::memory`).
//!
//! Exit codes: 0 success; 1 runtime failure; 2 bad usage or bad configuration, detected before
//! anything touches Kafka.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use sessionflow_worker::handler::ConfiguredHandler;
use sessionflow_worker::ops::telemetry::{self, LogFormat};
use sessionflow_worker::StageConfig;

/// jemalloc serves Rust's allocations (and, linked unprefixed, the C libraries' `malloc`):
/// measured against glibc's malloc and mimalloc in BENCHMARKS.md ("The allocator"). The
/// library only reads its statistics and purges its arenas (`ops::memory`); choosing it is
/// this binary's business, not that of every binary linking the engine.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "sessionflow-worker",
    version,
    about = "Session-ordered Kafka stage worker (the tools: `sessionflow`)"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one pipeline stage until SIGTERM/SIGINT.
    Run {
        /// Stage config (YAML).
        #[arg(long)]
        config: PathBuf,
        /// Bootstrap servers; overrides `brokers` in the config.
        #[arg(long, env = "SESSIONFLOW_BROKERS")]
        brokers: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match sessionflow_worker::ops::memory::runtime_builder().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(dispatch(cli.command, cli.log_format))
}

async fn dispatch(command: Command, log_format: LogFormat) -> ExitCode {
    // Telemetry is set up once the config (which may name an OTLP endpoint) is read.
    match command {
        Command::Run { config, brokers } => {
            // The head sampler (OTEL_TRACES_SAMPLER[_ARG]), checked before anything starts.
            let sampling = match telemetry::Sampling::from_env(|n| std::env::var(n).ok()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            let config = match load_config(&config, brokers.as_deref()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            // Inside the runtime: the OTLP batch exporter spawns onto it.
            let endpoint = config.otlp_endpoint.as_deref();
            let _telemetry = telemetry::init_with_otlp(log_format, endpoint, sampling);
            report(run_stage(config).await)
        }
    }
}

fn load_config(path: &std::path::Path, brokers: Option<&str>) -> anyhow::Result<StageConfig> {
    let mut config = StageConfig::parse_file(path)?;
    if let Some(b) = brokers {
        config.brokers = b.to_string();
    }
    config.add_credentials(|name| std::env::var(name).ok());
    config.validate()?;
    sessionflow_worker::commit::exactly_once::check_stage(&config)?;
    Ok(config)
}

async fn run_stage(config: StageConfig) -> anyhow::Result<()> {
    let handler = ConfiguredHandler::from_config(&config.handler)?;
    let stop = CancellationToken::new();
    let signals = stop.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("stop requested; draining");
        signals.cancel();
    });
    tracing::info!(stage = %config.stage, input = %config.input, group = %config.group_id(),
        "starting stage");
    sessionflow_worker::run(config, handler, stop).await
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Exit 2 when the brokers refuse what the config asks (exactlyOnce's transactions), as for a
/// bad config: a restart will not help.
fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.is::<sessionflow_worker::output::transaction_probe::Refused>() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
