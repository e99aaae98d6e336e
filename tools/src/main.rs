//! The `sessionflow` command: the tools around a pipeline — the demo, load, verification, lag,
//! dead-letter replay, topic creation. A stage itself is `sessionflow-worker run`; the demo
//! starts that binary once per stage.
//!
//! Exit codes: 0 success; 1 runtime failure (or, for `verify` and `demo`, a failed check); 2 bad
//! usage or bad settings, detected before anything touches Kafka.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use sessionflow_tools::demo::{self, DemoOptions};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};
use sessionflow_tools::replay;
use sessionflow_tools::verify::{self, VerifyOptions};
use sessionflow_worker::commit::lag;
use sessionflow_worker::kafka::client_settings::ClientSettings;
use sessionflow_worker::kafka::topics;
use sessionflow_worker::ops::telemetry::{self, LogFormat};

#[derive(Parser)]
#[command(
    name = "sessionflow",
    version,
    about = "sessionflow's tools: demo, loadgen, verify, lag, dlq-replay, create-topics"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// How the tools reach the cluster: the bootstrap list and librdkafka properties (TLS, SASL),
/// the same settings a stage's `kafka:` map gives its clients.
#[derive(clap::Args, Clone)]
struct KafkaArgs {
    #[arg(long, env = "SESSIONFLOW_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// librdkafka properties, one `key=value` a line (e.g. security.protocol=SASL_SSL,
    /// sasl.mechanism, ssl.ca.location); SESSIONFLOW_SASL_USERNAME/PASSWORD fill in the
    /// credentials it does not name.
    #[arg(long, value_name = "FILE")]
    kafka_config: Option<PathBuf>,
    /// One more librdkafka property, `key=value` (repeatable; after --kafka-config).
    #[arg(short = 'X', value_name = "KEY=VALUE")]
    property: Vec<String>,
}

impl KafkaArgs {
    fn settings(&self) -> anyhow::Result<ClientSettings> {
        ClientSettings::for_tool(
            &self.brokers,
            self.kafka_config.as_deref(),
            &self.property,
            |var| std::env::var(var).ok(),
        )
    }
}

#[derive(Subcommand)]
enum Command {
    /// Produce N records over S sessions, numbered per session (`sessionflow-seq`).
    Loadgen {
        #[command(flatten)]
        kafka: KafkaArgs,
        #[arg(long)]
        topic: String,
        #[arg(long, default_value_t = 100_000)]
        records: u64,
        #[arg(long, default_value_t = 1_000)]
        sessions: u64,
        /// Pick sessions with a Zipf law of this exponent instead of uniformly.
        #[arg(long)]
        zipf: Option<f64>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Padding bytes per value.
        #[arg(long, default_value_t = 64)]
        value_size: usize,
        #[arg(long, default_value = "session-")]
        session_prefix: String,
    },
    /// Read a topic back and check per-session order, gaps, loss and duplicates.
    Verify {
        #[command(flatten)]
        kafka: KafkaArgs,
        /// The topic to check (a stage's output).
        #[arg(long)]
        topic: String,
        /// The DLQ: its records count as accounted for.
        #[arg(long)]
        dlq: Option<String>,
        /// The pipeline's input: every record in it must be in the output or the DLQ.
        #[arg(long)]
        input: Option<String>,
        /// Read the session id from this header instead of the key.
        #[arg(long)]
        session_header: Option<String>,
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
    },
    /// Show a consumer group's lag on a topic, read from the broker.
    Lag {
        #[command(flatten)]
        kafka: KafkaArgs,
        #[arg(long)]
        group: String,
        #[arg(long)]
        topic: String,
        /// Wait until the total lag is 0 (exit 1 if it is not within --timeout-secs).
        #[arg(long)]
        wait_zero: bool,
        #[arg(long, default_value_t = 600)]
        timeout_secs: u64,
    },
    /// Run the demo pipeline (ingest → nlu → llm → delivery), one worker process per stage,
    /// on an embedded broker unless --brokers is given; verified at the end (exit 1 if not OK).
    Demo {
        /// A real broker instead of the embedded one (librdkafka's mock cluster).
        #[arg(long)]
        brokers: Option<String>,
        /// The stage configs (one YAML per stage; chained by their topics).
        #[arg(long, default_value = "examples/demo")]
        config_dir: PathBuf,
        #[arg(long, default_value_t = 120_000)]
        records: u64,
        #[arg(long, default_value_t = 1_000)]
        sessions: u64,
        /// Records per second produced; 0 produces as fast as the broker takes them.
        #[arg(long, default_value_t = 2_000.0)]
        rate: f64,
        /// Partitions of every topic.
        #[arg(long, default_value_t = 8)]
        partitions: i32,
        /// Where generated stage configs and stage logs go (a directory per run).
        #[arg(long, default_value = ".local/demo")]
        state_dir: PathBuf,
        /// Longest wait for the pipeline to finish once the load has started.
        #[arg(long, default_value_t = 600)]
        timeout_secs: u64,
        /// The worker binary each stage runs (`sessionflow-worker run`); default: the
        /// `sessionflow-worker` next to this binary, else the one on the PATH.
        #[arg(long, env = "SESSIONFLOW_WORKER_BIN")]
        worker_bin: Option<PathBuf>,
    },
    /// Produce selected dead letters back to the topic they came from (new event ids; see the
    /// README, "Dead letters", before replaying: replayed records come after their session's
    /// newer records).
    DlqReplay {
        #[command(flatten)]
        kafka: KafkaArgs,
        /// The DLQ topic.
        #[arg(long)]
        dlq: String,
        /// Only dead letters of this stage.
        #[arg(long)]
        stage: Option<String>,
        /// Only this reason (poison, retries-exhausted, missing-session, produce-failed, stuck).
        #[arg(long)]
        reason: Option<String>,
        /// Only this session (record key).
        #[arg(long)]
        session: Option<String>,
        /// Produce to this topic instead of each record's source topic.
        #[arg(long)]
        to: Option<String>,
        /// Count what would be replayed; produce nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Create topics (existing ones are left alone).
    CreateTopics {
        #[command(flatten)]
        kafka: KafkaArgs,
        #[arg(long, default_value_t = 8)]
        partitions: i32,
        #[arg(required = true)]
        topics: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(dispatch(cli.command, cli.log_format))
}

async fn dispatch(command: Command, log_format: LogFormat) -> ExitCode {
    let _telemetry = telemetry::init(log_format);
    match command {
        Command::Loadgen {
            kafka,
            topic,
            records,
            sessions,
            zipf,
            seed,
            value_size,
            session_prefix,
        } => {
            let settings = match kafka.settings() {
                Ok(s) => s,
                Err(e) => return usage_error(e),
            };
            let properties = settings
                .properties()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let opts = LoadgenOptions {
                choice: zipf.map_or(SessionChoice::Uniform, SessionChoice::Zipf),
                kafka: properties,
                seed,
                value_size,
                session_prefix,
                progress: true,
                ..LoadgenOptions::new(settings.brokers(), &topic, records, sessions)
            };
            report(loadgen::run(&opts).await.map(|r| {
                println!(
                    "produced {} records over {} sessions to {topic} in {:.2}s ({:.0} records/s)",
                    r.records,
                    r.sessions_used,
                    r.elapsed.as_secs_f64(),
                    r.rate()
                );
            }))
        }
        Command::Verify {
            kafka,
            topic,
            dlq,
            input,
            session_header,
            timeout_secs,
        } => {
            let kafka = match kafka.settings() {
                Ok(s) => s,
                Err(e) => return usage_error(e),
            };
            let opts = VerifyOptions {
                kafka,
                topic,
                dlq,
                input,
                session_header,
                timeout: Duration::from_secs(timeout_secs),
            };
            match tokio::task::spawn_blocking(move || verify::run(&opts)).await {
                Ok(Ok(r)) => {
                    println!("{r}");
                    if r.is_ok() {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    }
                }
                Ok(Err(e)) => report(Err(e)),
                Err(e) => report(Err(e.into())),
            }
        }
        Command::Lag {
            kafka,
            group,
            topic,
            wait_zero,
            timeout_secs,
        } => {
            let kafka = match kafka.settings() {
                Ok(s) => s,
                Err(e) => return usage_error(e),
            };
            let task = move || show_lag(&kafka, &group, &topic, wait_zero, timeout_secs);
            match tokio::task::spawn_blocking(task).await {
                Ok(r) => report(r),
                Err(e) => report(Err(e.into())),
            }
        }
        Command::Demo {
            brokers,
            config_dir,
            records,
            sessions,
            rate,
            partitions,
            state_dir,
            timeout_secs,
            worker_bin,
        } => {
            let worker_bin = match worker_bin.map_or_else(worker_binary, Ok) {
                Ok(bin) => bin,
                Err(e) => return usage_error(e),
            };
            let opts = DemoOptions {
                brokers,
                config_dir,
                records,
                sessions,
                rate,
                partitions,
                state_dir,
                timeout: Duration::from_secs(timeout_secs),
                worker_bin,
            };
            match demo::run(&opts).await {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => report(Err(e)),
            }
        }
        Command::DlqReplay {
            kafka,
            dlq,
            stage,
            reason,
            session,
            to,
            dry_run,
        } => {
            let selection = replay::Selection {
                stage,
                reason,
                session,
            };
            let kafka = match kafka.settings() {
                Ok(s) => s,
                Err(e) => return usage_error(e),
            };
            match replay::run(&kafka, &dlq, &selection, to.as_deref(), dry_run).await {
                Ok(r) => {
                    let verb = if dry_run { "would replay" } else { "replayed" };
                    for (topic, n) in &r.replayed {
                        println!("{verb} {n} record(s) to {topic}");
                    }
                    println!(
                        "not selected: {}; selected without a source topic: {}",
                        r.skipped, r.no_target
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => report(Err(e)),
            }
        }
        Command::CreateTopics {
            kafka,
            partitions,
            topics: names,
        } => {
            let kafka = match kafka.settings() {
                Ok(s) => s,
                Err(e) => return usage_error(e),
            };
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            report(topics::create(&kafka, &names, partitions).await)
        }
    }
}

fn show_lag(
    kafka: &ClientSettings,
    group: &str,
    topic: &str,
    wait_zero: bool,
    timeout_secs: u64,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(timeout_secs);
    let mut last_print = std::time::Instant::now() - Duration::from_secs(10);
    // One client for every read of a --wait-zero.
    let reader = lag::LagReader::new(kafka, group)?;
    loop {
        let lags = reader.read_blocking(topic)?;
        let total = lag::total(&lags);
        if !wait_zero {
            println!("partition  low  high  committed  lag");
            for l in &lags {
                let committed = l.committed.map_or("-".to_string(), |c| c.to_string());
                println!(
                    "{}  {}  {}  {committed}  {}",
                    l.partition,
                    l.low,
                    l.high,
                    l.lag()
                );
            }
            println!("total lag {total}");
            return Ok(());
        }
        if total == 0 {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "lag of {group} on {topic} still {total} after {timeout_secs}s"
        );
        if last_print.elapsed() >= Duration::from_secs(2) {
            let high: i64 = lags.iter().map(|l| l.high).sum();
            eprintln!(
                "  {group}: {} of {high} committed, lag {total}",
                high - total
            );
            last_print = std::time::Instant::now();
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The `sessionflow-worker` built beside this binary (cargo puts both in one directory; the
/// image installs both in /usr/local/bin), else the one on the PATH.
fn worker_binary() -> anyhow::Result<PathBuf> {
    const NAME: &str = "sessionflow-worker";
    let beside = std::env::current_exe()?.with_file_name(NAME);
    if beside.is_file() {
        return Ok(beside);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(NAME))
        .find(|bin| bin.is_file())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{NAME} is neither beside {} nor on the PATH: build it (cargo build -p \
                 sessionflow-worker) or name it with --worker-bin",
                beside.display()
            )
        })
}

/// Bad tool settings (an unreadable --kafka-config, a malformed -X): exit 2, nothing touched.
fn usage_error(e: anyhow::Error) -> ExitCode {
    eprintln!("error: {e:#}");
    ExitCode::from(2)
}

fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
