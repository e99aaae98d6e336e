//! `sessionflow-bench`: the harness behind `make bench`.
//!
//! It runs every scenario ([`scenarios`]) against the four systems ([`systems`]) on one broker,
//! then the growth sweeps ([`sweeps`]), each run in a child process of this same binary
//! ([`run`]), measures them the same way ([`measurement`], [`handler`], [`workload`]), and
//! writes BENCHMARKS.md ([`report`], [`sweep_report`]) with SVG charts ([`charts`]) and the raw
//! results as JSON. It measures and reports; it asserts nothing about time. `--only sweeps`
//! runs the sweeps alone and replaces only their section and their part of results.json.

mod callgrind;
mod charts;
mod handler;
mod measurement;
mod pc_report;
mod report;
mod run;
mod scenarios;
mod simulated_io;
mod sweep_report;
mod sweeps;
mod systems;
mod targets;
mod workload;

use std::path::PathBuf;
use std::process::Command as Process;
use std::time::Instant;

use clap::{ArgAction, Parser, Subcommand};

use crate::scenarios::ScenarioId;

/// jemalloc, as the worker binary has it (worker/src/main.rs): every system measured here runs
/// in this process, so the allocator is part of what is measured, and the numbers stay those of
/// the worker's (BENCHMARKS.md, "The allocator"; `bench/callgrind.sh`). The engine's
/// `malloc_conf` (ops::memory) applies here too.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "sessionflow-bench",
    about = "Benchmarks sessionflow against a ceiling and two baselines"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Bootstrap servers of the broker to run on.
    #[arg(long, env = "SESSIONFLOW_BROKERS")]
    brokers: Option<String>,
    /// The report to write.
    #[arg(long, default_value = "BENCHMARKS.md")]
    out: PathBuf,
    /// Where the charts and results.json go.
    #[arg(long, default_value = "bench/results")]
    results_dir: PathBuf,
    /// Multiplies record counts and durations (development: e.g. 0.05).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Run only these scenarios (comma-separated), e.g. `--only p1,p3`; `sweeps` is the growth
    /// sweeps (`--only sweeps` runs them alone).
    #[arg(long, value_delimiter = ',')]
    only: Vec<ScenarioId>,
    /// Run only these systems, e.g. `--systems sessionflow` or `--systems sessionflow-output`
    /// (sessionflow with an output topic, which no scenario runs by default).
    #[arg(long, value_delimiter = ',')]
    systems: Vec<systems::SystemKind>,
    /// Also run sessionflow as a stage with an output topic ("sessionflow + output"): the
    /// handler returns the input value, the engine writes it to a topic made for the run.
    #[arg(long)]
    sessionflow_output: bool,
    /// Extra librdkafka properties for sessionflow's stage (its `kafka:` map, which its
    /// consumer and producer both get), e.g. `--sessionflow-kafka linger.ms=1`; repeatable.
    /// `queued.max.messages.kbytes=N` sets the engine's prefetch total (`prefetchKbytes`),
    /// `queued.min.messages=N` its total in records (`prefetchRecords`).
    #[arg(long, value_parser = key_value)]
    sessionflow_kafka: Vec<(String, String)>,
    /// The commit interval of `sessionflow-eos` and `sessionflow-alo100` instead of their
    /// 100 ms (their rows' labels still read 100 ms): a growth point of exactlyOnce's cost.
    #[arg(long)]
    variant_commit_interval_ms: Option<u64>,
    /// The input topic's partitions in every scenario run, instead of its own (8): a growth
    /// point, e.g. of exactlyOnce's cost (one transaction per partition per commit interval).
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..=1_000))]
    partitions: Option<i32>,
    /// sessionflow's `maxInFlightPerPartition` instead of its default (10,000), and with it the
    /// Parallel Consumer's `maxConcurrency` (the same budget: sessions, at most this many per
    /// partition); the report's definitions still read 10,000. A growth point.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_in_flight_per_partition: Option<u32>,
    /// At most this many Parallel Consumer worker threads (its `maxConcurrency`), whatever
    /// sessionflow's budget: at the sweeps' 100,000 and 1,000,000 sessions that budget is
    /// 80,000 threads in one JVM. sessionflow is not capped; say so where the numbers go.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pc_max_concurrency: Option<u32>,
    /// Workers of the flat-pool baseline.
    #[arg(long, default_value_t = 64)]
    pool_workers: usize,
    /// Queue capacity of each flat-pool worker.
    #[arg(long, default_value_t = 1_024)]
    pool_queue: usize,
    /// Install the worker binary's telemetry in sessionflow's runs (as a deployed worker has).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    telemetry: bool,
    /// librdkafka's fetch.wait.max.ms for every system's consumer. nisshi's long poll re-checks
    /// after half the remaining wait, so this sets the latency floor (10 ms: ~3–5 ms).
    #[arg(long, default_value_t = 10)]
    fetch_wait_ms: u64,
    /// The broker's pid file (scripts/broker.sh writes one): its CPU time and version are read.
    #[arg(long)]
    broker_pid_file: Option<PathBuf>,
    /// Hand-written notes appended to the report.
    #[arg(long, default_value = "bench/NOTES.md")]
    notes: PathBuf,
    /// Where each run's stderr goes.
    #[arg(long, default_value = "target/bench-logs")]
    log_dir: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// One run in its own process (used by the harness itself).
    #[command(hide = true)]
    Child { spec: String },
    /// A fixed in-process workload (mock cluster) for instructions per record under callgrind
    /// (see bench/callgrind.sh).
    CallgrindWorkload(callgrind::WorkloadArgs),
    /// Redraw every chart from `<results-dir>/results.json` (after a change to the charts),
    /// without running anything.
    Charts,
}

fn main() -> anyhow::Result<()> {
    // The worker's runtime: its workers hand their allocator caches back after a trim (P5).
    sessionflow_worker::ops::memory::runtime_builder()
        .build()?
        .block_on(run(Cli::parse()))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Some(Command::Child { spec }) => return run::child(serde_json::from_str(&spec)?).await,
        Some(Command::CallgrindWorkload(args)) => return callgrind::run(args).await,
        Some(Command::Charts) => return redraw_charts(&cli.results_dir),
        None => {}
    }
    let started = Instant::now();
    let brokers = cli.brokers.clone().ok_or_else(|| {
        anyhow::anyhow!("no broker: pass --brokers or set SESSIONFLOW_BROKERS (make bench does)")
    })?;
    std::fs::create_dir_all(&cli.results_dir)?;
    std::fs::create_dir_all(&cli.log_dir)?;
    let broker_pid = cli
        .broker_pid_file
        .as_ref()
        .and_then(|f| std::fs::read_to_string(f).ok())
        .and_then(|s| s.trim().parse::<u32>().ok())
        .filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists());
    let mut env = report::Environment {
        command: command_line(),
        nproc: output_of("nproc", &[])
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0),
        cpu_model: cpu_model(),
        date: output_of("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default(),
        broker: broker_description(broker_pid),
        brokers: brokers.clone(),
        load_before: load_average(),
        pool_workers: cli.pool_workers,
        telemetry: cli.telemetry,
        fetch_wait_ms: cli.fetch_wait_ms,
        scale: cli.scale,
        ..Default::default()
    };
    let opts = scenarios::Options {
        brokers,
        exe: std::env::current_exe()?,
        pool_workers: cli.pool_workers,
        pool_queue: cli.pool_queue,
        telemetry: cli.telemetry,
        fetch_wait_ms: cli.fetch_wait_ms,
        sessionflow_kafka: cli.sessionflow_kafka.clone(),
        variant_commit_interval_ms: cli.variant_commit_interval_ms,
        max_in_flight_per_partition: cli.max_in_flight_per_partition.map(|n| n as usize),
        pc_max_concurrency: cli.pc_max_concurrency.map(|n| n as usize),
        log_dir: cli.log_dir.clone(),
        broker_pid,
    };
    eprintln!(
        "sessionflow-bench: broker {} ({}), load {}, logs in {}",
        opts.brokers,
        env.broker,
        env.load_before,
        cli.log_dir.display()
    );
    let mut outcomes = Vec::new();
    let mut failures = Vec::new();
    for mut sc in scenarios::all(cli.scale) {
        if !cli.only.is_empty() && !cli.only.contains(&sc.id) {
            continue;
        }
        sc.systems = systems::select(&sc.systems, &cli.systems, cli.sessionflow_output);
        if let Some(n) = cli.partitions {
            sc.partitions = n;
            sc.what = format!(
                "{} Run on {n} partitions instead (`--partitions {n}`).",
                sc.what
            );
        }
        if sc.systems.is_empty() {
            continue;
        }
        eprintln!("== {:?}: {}", sc.id, sc.title);
        match scenarios::run(&opts, &sc).await {
            Ok(o) => outcomes.push(o),
            Err(e) => {
                eprintln!("{:?} failed: {e:#}", sc.id);
                failures.push(format!("{:?}: {e:#}", sc.id));
            }
        }
    }
    let sweeps_alone = !cli.only.is_empty() && cli.only.iter().all(|i| *i == ScenarioId::Sweeps);
    let mut growth = None;
    if cli.only.is_empty() || cli.only.contains(&ScenarioId::Sweeps) {
        let mut sweep_env = report::Environment {
            date: output_of("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default(),
            load_before: load_average(),
            ..env.clone()
        };
        let selection = sweeps::Selection {
            only: &cli.systems,
            with_output: cli.sessionflow_output,
        };
        let sweeps = sweeps::run(&opts, cli.scale, &selection).await;
        sweep_env.load_after = load_average();
        failures.extend(sweeps.failures.iter().map(|f| format!("sweeps: {f}")));
        growth = Some((sweep_report::section(&sweep_env, &sweeps), sweeps));
    }
    env.load_after = load_average();
    env.wall_s = started.elapsed().as_secs_f64();

    let results_path = cli.results_dir.join("results.json");
    let mut results = serde_json::json!({ "scenarios": outcomes, "sweeps": null });
    if sweeps_alone {
        // Keep the scenarios of the last full run (an older file is the bare array).
        let old: Option<serde_json::Value> = std::fs::read_to_string(&results_path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        results["scenarios"] = match old {
            Some(serde_json::Value::Array(a)) => serde_json::Value::Array(a),
            Some(mut v) => v["scenarios"].take(),
            None => serde_json::Value::Array(vec![]),
        };
    }
    if let Some((_, sweeps)) = &growth {
        results["sweeps"] = serde_json::to_value(sweeps)?;
    }
    std::fs::write(&results_path, serde_json::to_string_pretty(&results)?)?;
    draw_charts(&outcomes, growth.as_ref().map(|(_, s)| s), &cli.results_dir)?;
    let growth_md = growth.as_ref().map(|(md, _)| md.as_str());
    if sweeps_alone {
        if let (Some(section), Ok(existing)) = (growth_md, std::fs::read_to_string(&cli.out)) {
            let notes = std::fs::read_to_string(&cli.notes).ok();
            let first_line = notes.as_deref().and_then(|n| n.lines().next());
            std::fs::write(
                &cli.out,
                sweep_report::splice(&existing, section, first_line),
            )?;
            eprintln!(
                "sessionflow-bench: replaced the sweeps' section of {} ({:.0} s)",
                cli.out.display(),
                env.wall_s
            );
            anyhow::ensure!(failures.is_empty(), "{} run(s) failed", failures.len());
            return Ok(());
        }
    }
    let mut notes = std::fs::read_to_string(&cli.notes).ok();
    let notes_first_line = notes
        .as_deref()
        .and_then(|n| n.lines().next())
        .map(str::to_string);
    let failed = (!failures.is_empty()).then(|| {
        format!(
            "## Runs that failed\n\n{}\n\n",
            failures
                .iter()
                .map(|f| format!("- {f}"))
                .collect::<Vec<_>>()
                .join("\n")
        )
    });
    if let Some(failed) = &failed {
        notes = Some(format!("{failed}{}", notes.unwrap_or_default()));
    }
    let existing = std::fs::read_to_string(&cli.out).ok();
    if cli.systems.iter().any(|s| s.is_parallel_consumer()) {
        // On request, not the full benchmark: its own section, the rest of the file kept.
        let full = report::markdown(&env, &outcomes, growth_md, failed.as_deref());
        let section = pc_report::section(&full, &cli.results_dir.display().to_string());
        std::fs::write(
            &cli.out,
            pc_report::splice(
                existing.as_deref().unwrap_or_default(),
                &section,
                notes_first_line.as_deref(),
            ),
        )?;
    } else {
        let fresh = report::markdown(&env, &outcomes, growth_md, notes.as_deref());
        std::fs::write(
            &cli.out,
            pc_report::carry(&fresh, existing.as_deref(), notes_first_line.as_deref()),
        )?;
    }
    eprintln!(
        "sessionflow-bench: wrote {} in {:.0} s",
        cli.out.display(),
        env.wall_s
    );
    for v in targets::verdicts(&outcomes) {
        eprintln!(
            "  {:<60} {:<40} {}",
            v.target,
            v.measured,
            match v.met {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "not measured",
            }
        );
    }
    anyhow::ensure!(failures.is_empty(), "{} run(s) failed", failures.len());
    Ok(())
}

/// The charts of what ran (a run of the sweeps alone leaves the scenarios' charts as they are).
fn draw_charts(
    outcomes: &[scenarios::Outcome],
    sweeps: Option<&sweeps::Sweeps>,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    if !outcomes.is_empty() {
        charts::throughput_chart(outcomes, &dir.join("throughput.svg"))?;
    }
    if let Some(p4) = outcomes.iter().find(|o| o.scenario.id == ScenarioId::P4) {
        charts::p4_latency_chart(p4, &dir.join("p4-latency-cdf.svg"))?;
    }
    if let Some(sweeps) = sweeps {
        sweep_report::write_charts(sweeps, dir)?;
    }
    Ok(())
}

/// Every chart, from the results.json in `dir`.
fn redraw_charts(dir: &std::path::Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(dir.join("results.json"))?;
    let mut results: serde_json::Value = serde_json::from_str(&text)?;
    let outcomes: Vec<scenarios::Outcome> = serde_json::from_value(results["scenarios"].take())?;
    let sweeps: Option<sweeps::Sweeps> = serde_json::from_value(results["sweeps"].take())?;
    draw_charts(&outcomes, sweeps.as_ref(), dir)
}

/// `KEY=VALUE`.
fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))
}

/// How this benchmark was started (`make bench` sets MAKELEVEL for its recipes, and the bench
/// targets name themselves in SESSIONFLOW_BENCH_GOAL).
fn command_line() -> String {
    let args: Vec<String> = std::env::args().collect();
    let argv = args.join(" ");
    if std::env::var_os("MAKELEVEL").is_some() {
        let port = std::env::var("BROKER_PORT").unwrap_or_default();
        let goal = std::env::var("SESSIONFLOW_BENCH_GOAL").unwrap_or_else(|_| "bench".into());
        format!("make {goal} BROKER_PORT={port}` → `{argv}")
    } else {
        argv
    }
}

fn output_of(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Process::new(cmd).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// The broker's name and version, from its executable when it runs here.
fn broker_description(pid: Option<u32>) -> String {
    let Some(pid) = pid else {
        return "external broker (version not known to the harness)".into();
    };
    // Apache Kafka (scripts/kafka.sh): a JVM running kafka.Kafka from a `kafka-<version>/libs`
    // class path.
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .unwrap_or_default();
    if cmdline.contains("kafka.Kafka") {
        let version = cmdline
            .split("kafka-")
            .skip(1)
            .find_map(|rest| rest.split('/').next().filter(|v| v.contains('.')))
            .unwrap_or("(version unknown)");
        return format!("Apache Kafka {version} (pid {pid}, KRaft, one node, scripts/kafka.sh)");
    }
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    let version = exe
        .as_ref()
        .and_then(|e| output_of(&e.to_string_lossy(), &["--version"]));
    match version {
        Some(v) => format!("{v} (pid {pid}, memory storage)"),
        None => format!("broker pid {pid} (version unknown)"),
    }
}
