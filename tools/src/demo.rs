//! `demo`: the conversational pipeline (ingest → nlu → llm → delivery) on one machine.
//!
//! A newcomer's first question is "does it keep each conversation in order when things fail?",
//! and the answer has to come from a fresh clone within minutes, with nothing installed. So by
//! default the demo brings its own broker ([`broker`]), creates the topics, starts one worker
//! process per stage ([`stages`]) — `sessionflow-worker run --config …`, the command a
//! deployment runs — with the stage configs of `examples/demo/` ([`pipeline`]), produces
//! numbered records over many sessions at a steady rate, shows each stage's progress until the
//! whole pipeline has committed everything ([`progress`], from the stages' `/metrics`:
//! [`scrape`]), stops the stages with SIGTERM, and reports ([`summary`]): one row per stage,
//! then `verify` of the last topic against the first. The verdict is the exit code.

mod broker;
pub mod pipeline;
mod progress;
pub mod scrape;
mod stages;
pub mod summary;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio_util::task::AbortOnDropHandle;

use crate::loadgen::{self, LoadgenOptions};
use sessionflow_worker::config::{HandlerConfig, StageConfig};
use sessionflow_worker::kafka::client_settings::ClientSettings;

use broker::Broker;
use pipeline::Pipeline;
use progress::StageLags;
use scrape::Scraper;
use stages::StageProcesses;

/// How often the demo polls the stages and the broker.
const TICK: Duration = Duration::from_millis(500);

/// What `sessionflow demo` was asked to do.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// A real broker; `None` runs the embedded one.
    pub brokers: Option<String>,
    /// Where the stage configs (`*.yaml`, one per stage) are.
    pub config_dir: PathBuf,
    pub records: u64,
    pub sessions: u64,
    /// Records per second produced; 0 produces as fast as the broker takes them.
    pub rate: f64,
    pub partitions: i32,
    /// Where the generated stage configs and the stage logs go (a directory per run).
    pub state_dir: PathBuf,
    /// Longest wait for the pipeline to finish after the load starts.
    pub timeout: Duration,
    /// The `sessionflow-worker` binary the stages run.
    pub worker_bin: PathBuf,
}

/// Runs the demo; `Ok(false)` when the verification failed. On SIGINT or SIGTERM the stage
/// processes are killed and the embedded broker goes with this process.
pub async fn run(opts: &DemoOptions) -> anyhow::Result<bool> {
    tokio::select! {
        verdict = run_to_end(opts) => verdict,
        signal = interrupted() => anyhow::bail!("interrupted ({signal})"),
    }
}

#[cfg(unix)]
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

#[cfg(not(unix))]
async fn interrupted() -> &'static str {
    let _ = tokio::signal::ctrl_c().await;
    "Ctrl-C"
}

async fn run_to_end(opts: &DemoOptions) -> anyhow::Result<bool> {
    let run_id = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
        .to_string();
    let mut pipeline = Pipeline::load(&opts.config_dir)?;
    let broker = Broker::start(opts.brokers.as_deref())?;
    if matches!(broker, Broker::External(_)) {
        // A real broker keeps earlier runs' topics and groups: make this run's its own.
        pipeline = pipeline.suffixed(&run_id);
    }
    let brokers = broker.bootstrap();
    println!("== broker: {} at {brokers}", broker.describe());
    println!(
        "== pipeline: {} → {} (dead letters: {})",
        pipeline.input(),
        pipeline
            .stages
            .iter()
            .map(|s| format!("[{}] → {}", s.stage, s.output.as_deref().unwrap_or("-")))
            .collect::<Vec<_>>()
            .join(" → "),
        pipeline.dlqs().join(", ")
    );
    for s in &pipeline.stages {
        println!("   {:<9} {}", s.stage, describe_handler(s));
    }
    broker
        .create_topics(&pipeline.topics(), opts.partitions)
        .await?;

    let dir = opts.state_dir.join(format!("run-{run_id}"));
    std::fs::create_dir_all(&dir)?;
    let mut stages = StageProcesses::start(&opts.worker_bin, &pipeline, &brokers, &dir)?;
    println!(
        "== stages: {} worker processes started; configs and logs in {}",
        stages.procs.len(),
        dir.display()
    );
    let scraper = Scraper::new()?;
    stages
        .wait_assigned(&scraper, opts.partitions as usize)
        .await?;

    let rate = (opts.rate > 0.0).then_some(opts.rate);
    println!(
        "== loadgen: {} records over {} sessions, {}",
        opts.records,
        opts.sessions,
        rate.map_or("as fast as possible".to_string(), |r| format!(
            "{r:.0} records/s (~{:.0}s)",
            opts.records as f64 / r
        ))
    );
    let load = LoadgenOptions {
        rate,
        ..LoadgenOptions::new(&brokers, pipeline.input(), opts.records, opts.sessions)
    };
    // Aborted if the demo ends early (its producer must not outlive the embedded broker).
    let load = AbortOnDropHandle::new(tokio::spawn(async move { loadgen::run(&load).await }));
    let lags = StageLags::new(ClientSettings::new(brokers.as_str()), &pipeline)?;
    let started = Instant::now();
    let finals = progress::watch(
        &mut stages,
        &scraper,
        lags,
        &load,
        opts.records,
        started + opts.timeout,
    )
    .await?;
    let produced = load.await??;
    println!(
        "== done: {} records through {} stages in {:.1}s (loadgen {:.1}s)",
        produced.records,
        pipeline.stages.len(),
        started.elapsed().as_secs_f64(),
        produced.elapsed.as_secs_f64()
    );
    stages.stop().await;

    let reading = Instant::now();
    print!(
        "== reading the {} topics back to measure and verify … ",
        pipeline.topics().len()
    );
    let _ = std::io::Write::flush(&mut std::io::stdout());
    let read = summary::read_topics(&brokers, &pipeline).await?;
    println!("{:.1}s", reading.elapsed().as_secs_f64());
    let rows = summary::summarize(&pipeline, &finals, &read);
    println!("\n{}", summary::render_table(&rows));
    println!(
        "   handler: one attempt, estimated from the stage's histogram (buckets √2 apart: ±20%);"
    );
    println!("   end-to-end: loadgen record timestamp → the stage's output record timestamp;");
    println!("   throughput: finished records ÷ (first input record → last output record).");

    let report = summary::check(&read);
    let watchdog: u64 = finals.iter().map(|s| s.order_violations).sum();
    println!(
        "\n== verify: {} against {} (dead letters in {} accounted for)",
        pipeline.output(),
        pipeline.input(),
        pipeline.dlqs().join(", ")
    );
    println!("{report}");
    println!("watchdog (stages' sessionflow_order_violations_total): {watchdog}");
    if watchdog > 0 {
        println!("FAILED: the stages' ordering watchdog saw a session's records out of order");
    }
    if let Some(b) = &opts.brokers {
        println!(
            "   again: sessionflow verify --brokers {b} --topic {} --dlq {} --input {}",
            pipeline.output(),
            pipeline.dlqs()[0],
            pipeline.input()
        );
    }
    Ok(report.is_ok() && watchdog == 0)
}

fn describe_handler(s: &StageConfig) -> String {
    match &s.handler {
        HandlerConfig::Builtin(b) => format!(
            "builtin: {} ms per attempt, {:.0}% transient faults, {:.1}% poison",
            b.latency_ms,
            b.transient_rate * 100.0,
            b.poison_rate * 100.0
        ),
        HandlerConfig::Http(h) => format!("http: {}", h.url),
    }
}
