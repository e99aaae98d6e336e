//! The report: BENCHMARKS.md from the outcomes, with the ratios and the targets.
//!
//! A benchmark is only worth as much as its conditions are known, so the report starts with
//! the exact command, the machine, the date, the broker and the load on the machine, then
//! defines every number before giving it. The ratios are computed here, the verdicts against
//! the targets in [`crate::targets`] (pure functions, unit-tested), from the same outcomes the
//! tables show; nothing is rounded in sessionflow's favour, and a target missed is printed as
//! missed. Notes written
//! by hand after profiling live in `bench/NOTES.md` and are included as they are.

use std::fmt::Write as _;

use crate::scenarios::{Measured, Outcome};
use crate::systems::SystemKind;

/// Where and how the benchmark ran.
#[derive(Debug, Clone, Default)]
pub struct Environment {
    pub command: String,
    pub nproc: usize,
    pub cpu_model: String,
    pub date: String,
    pub broker: String,
    pub brokers: String,
    pub load_before: String,
    pub load_after: String,
    pub wall_s: f64,
    pub pool_workers: usize,
    pub telemetry: bool,
    pub fetch_wait_ms: u64,
    pub scale: f64,
}

/// `a / b` when both are known and `b` is not zero.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// P2's ideal throughput: every session busy all the time, `sessions / io`, but never more
/// than the raw consumer manages.
pub fn ideal_rate(sessions: u64, io_ms: u64, ceiling: Option<f64>) -> Option<f64> {
    if io_ms == 0 {
        return ceiling;
    }
    let ideal = sessions as f64 / (io_ms as f64 / 1e3);
    Some(ceiling.map_or(ideal, |c| ideal.min(c)))
}

pub fn throughput(o: &Outcome, kind: SystemKind) -> Option<f64> {
    let s = o.system(kind)?;
    s.backlog
        .as_ref()
        .or(s.paced.as_ref())
        .and_then(|m| m.result.throughput())
}

pub fn healthy_quantile(m: Option<&Measured>, q: f64) -> Option<f64> {
    let m = m?;
    m.result.healthy.quantile(q, m.censored_healthy())
}

/// Two decimals; three significant digits below 0.1 (a ratio of 0.0027 is not "0.00").
pub fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        None => "—".into(),
        Some(r) if r > 0.0 && r < 0.1 => {
            let decimals = (2.0 - r.log10().floor()).clamp(3.0, 9.0) as usize;
            format!("{r:.decimals$}×")
        }
        Some(r) => format!("{r:.2}×"),
    }
}

/// Thousands separators, no decimals.
pub fn fmt_int(v: f64) -> String {
    let n = v.round() as i64;
    let digits = n.abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Milliseconds from µs, 3 significant digits.
pub fn fmt_ms(us: Option<f64>, cap_s: f64) -> String {
    match us {
        None => format!("> {cap_s:.0} s"),
        Some(us) => {
            let ms = us / 1e3;
            if ms >= 100.0 {
                format!("{ms:.0}")
            } else if ms >= 10.0 {
                format!("{ms:.1}")
            } else {
                format!("{ms:.2}")
            }
        }
    }
}

pub fn mib(bytes: u64) -> String {
    format!("{:.0}", bytes as f64 / 1048576.0)
}

/// `bytes` in MiB to a tenth, with the unit (the small diagnostics of P5's table).
fn mib_tenths(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

/// A diagnostic read at rest and again after the reap: `12.3 → 13.5 MiB`, the after figure alone
/// when the rest one was not taken (runs before it was), `—` when neither was.
fn rest_to_after(rest: Option<u64>, after: Option<u64>) -> String {
    match (rest, after) {
        (Some(rest), Some(after)) => {
            format!("{:.1} → {}", rest as f64 / 1048576.0, mib_tenths(after))
        }
        (None, Some(after)) => mib_tenths(after),
        _ => "—".to_string(),
    }
}

fn latency_cells(m: Option<&Measured>) -> [String; 3] {
    let Some(m) = m else {
        return ["—".into(), "—".into(), "—".into()];
    };
    let cap = m.cap_secs;
    [0.5, 0.99, 0.999].map(|q| fmt_ms(healthy_quantile(Some(m), q), cap))
}

/// A run's throughput, with how far it got when its time cap ended it.
pub fn rate_cell(m: Option<&Measured>) -> String {
    match m.and_then(|m| m.result.throughput().map(|t| (t, m))) {
        None => "—".into(),
        Some((t, m)) if m.result.capped => format!(
            "{} (capped: {} of {} in {:.0} s)",
            fmt_int(t),
            fmt_int(m.result.handled as f64),
            fmt_int(m.expected as f64),
            m.wall_s
        ),
        Some((t, _)) => fmt_int(t),
    }
}

/// Every round of a backlog drained in rounds, under the table whose rows are the medians.
fn rounds_line(o: &Outcome, md: &mut String) {
    let per_system: Vec<String> = o
        .systems
        .iter()
        .filter_map(|s| {
            let rounds = &s.backlog.as_ref()?.rounds;
            (!rounds.is_empty()).then(|| {
                let each: Vec<String> = rounds
                    .iter()
                    .map(|r| {
                        let rate = r.rate.map_or("—".into(), fmt_int);
                        format!("{rate} ({:.1} s CPU, {} MiB)", r.cpu_s, mib(r.peak_rss))
                    })
                    .collect();
                format!("{}: {}", s.system.label(), each.join(", "))
            })
        })
        .collect();
    if !per_system.is_empty() {
        let _ = writeln!(
            md,
            "The backlog was drained in {} rounds, the systems in turn, each round by a new \
             group; each row above is the system's median round by rate. Every round, in \
             order: {}.\n",
            o.systems
                .iter()
                .find_map(|s| Some(s.backlog.as_ref()?.rounds.len()))
                .unwrap_or(0),
            per_system.join("; ")
        );
    }
}

fn scenario_table(o: &Outcome, md: &mut String) {
    let sc = &o.scenario;
    let paced_rate = sc
        .paced
        .as_ref()
        .and_then(|p| p.rate)
        .map_or("unpaced".into(), |r| format!("{} msg/s", fmt_int(r)));
    let _ = writeln!(md, "### {:?}: {}\n\n{}\n", sc.id, sc.title, sc.what);
    let backlog = sc
        .backlog
        .as_ref()
        .map(|b| format!("backlog of {} records", fmt_int(b.records as f64)));
    let paced = sc.paced.as_ref().map(|p| {
        format!(
            "paced run: {} records at {paced_rate}",
            fmt_int(p.records as f64)
        )
    });
    let _ = writeln!(
        md,
        "Sessions: {} ({}), partitions: {}. Runs: {}.\n",
        fmt_int(sc.sessions as f64),
        sc.choice.describe(),
        sc.partitions,
        [backlog, paced]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join("; ")
    );
    let throughput_from = if sc.backlog.is_some() {
        "backlog"
    } else {
        "paced"
    };
    let _ = writeln!(
        md,
        "| system | throughput, msg/s ({throughput_from}) | p50 ms | p99 ms | p99.9 ms | \
         achieved rate, paced | order violations | CPU s | broker CPU s | peak RSS MiB |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for s in &o.systems {
        let main = s.backlog.as_ref().or(s.paced.as_ref());
        let [p50, p99, p999] = latency_cells(s.paced.as_ref());
        let violations: u64 = [&s.backlog, &s.paced, &s.fault_free]
            .into_iter()
            .flatten()
            .map(|m| m.result.order_violations)
            .sum();
        let _ = writeln!(
            md,
            "| {} | {} | {p50} | {p99} | {p999} | {} | {} | {} | {} | {} |",
            s.system.label(),
            rate_cell(main),
            rate_cell(s.paced.as_ref()),
            violations,
            main.map_or("—".into(), |m| format!("{:.1}", m.result.cpu_s)),
            main.and_then(|m| m.broker_cpu_s)
                .map_or("—".into(), |c| format!("{c:.1}")),
            main.map_or("—".into(), |m| mib(m.result.peak_rss)),
        );
    }
    md.push('\n');
    rounds_line(o, md);
    if sc.fault_free.is_some() {
        let _ = writeln!(
            md,
            "Healthy sessions (all but session 0), with and without session 0's fault:\n\n\
             | system | p50 fault-free | p50 with fault | p99 fault-free | p99 with fault | \
             p99 ratio | p99.9 with fault | session 0 records done |"
        );
        let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for s in &o.systems {
            let (f, c) = (s.paced.as_ref(), s.fault_free.as_ref());
            let q = |m: Option<&Measured>, q| {
                fmt_ms(healthy_quantile(m, q), m.map_or(0.0, |m| m.cap_secs))
            };
            let r = ratio(healthy_quantile(f, 0.99), healthy_quantile(c, 0.99));
            let failing_done = f.map_or("—".into(), |m| {
                format!(
                    "{} of {}",
                    m.result.handled - m.result.healthy_handled,
                    m.expected - m.expected_healthy
                )
            });
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {failing_done} |",
                s.system.label(),
                q(c, 0.5),
                q(f, 0.5),
                q(c, 0.99),
                q(f, 0.99),
                fmt_ratio(r),
                q(f, 0.999),
            );
        }
        md.push('\n');
    }
    if sc.memory {
        // Every system that probed its memory (sessionflow, and its exactlyOnce variant when run).
        let probed: Vec<_> = o
            .systems
            .iter()
            .filter_map(|s| Some((s.system, s.paced.as_ref()?.result.memory.as_ref()?)))
            .collect();
        if !probed.is_empty() {
            md.push_str(
                "| system | RSS at rest before | peak RSS | RSS after idle reap | after reap ÷ before \
                 | peak live sessions | reap took | diagnostic: heap allocated, at rest → after \
                 the reap | diagnostic: allocator metadata, at rest → after the reap | the \
                 harness's order check, in every RSS (left out of the ratio) |\n\
                 |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            );
            for (system, mem) in &probed {
                let _ = writeln!(
                    md,
                    "| {} | {} MiB | {} MiB | {} MiB | {} | {} | {:.1} s | {} | {} | {} MiB |",
                    system.label(),
                    mib(mem.baseline_rss),
                    mib(mem.peak_rss),
                    mib(mem.after_reap_rss),
                    fmt_ratio(mem.growth()),
                    fmt_int(mem.peak_sessions as f64),
                    mem.reap_secs,
                    rest_to_after(mem.baseline_heap, mem.live_heap),
                    rest_to_after(mem.baseline_metadata, mem.after_reap_metadata),
                    mib(mem.harness_bytes),
                );
            }
            md.push('\n');
        }
    }
    if let Some(rate) = o.io_ceiling {
        let io = o.scenario.handler.io_ms;
        let _ = writeln!(
            md,
            "The simulated I/O's ceiling: {} tasks doing nothing but the handler's {io} ms wait \
             in a loop reach {} msg/s on this machine (one wait lasts {:.2} ms with the clock's \
             own cost); sessionflow's backlog rate is {} of it.\n",
            fmt_int(o.scenario.sessions as f64),
            fmt_int(rate),
            o.scenario.sessions as f64 / rate * 1e3,
            fmt_ratio(ratio(throughput(o, SystemKind::Sessionflow), Some(rate))),
        );
    }
    let _ = writeln!(
        md,
        "Scenario wall time: {:.0} s{}.\n",
        o.wall_s,
        o.backlog_produce_rate.map_or(String::new(), |r| format!(
            "; the backlog was produced at {} msg/s",
            fmt_int(r)
        ))
    );
}

fn ratios_table(outcomes: &[Outcome], md: &mut String) {
    // Every system that ran beside sessionflow somewhere, in the report's order.
    let others: Vec<SystemKind> = SystemKind::EVERY
        .into_iter()
        .filter(|k| !matches!(k, SystemKind::Sessionflow | SystemKind::SessionflowOutput))
        .filter(|k| {
            outcomes
                .iter()
                .any(|o| o.system(*k).is_some() && o.system(SystemKind::Sessionflow).is_some())
        })
        .collect();
    if !others.is_empty() {
        ratio_rows(outcomes, &others, md);
    }
    crate::pc_report::table(
        outcomes,
        md,
        SystemKind::Sessionflow,
        SystemKind::ParallelConsumer,
    );
    crate::pc_report::table(
        outcomes,
        md,
        SystemKind::SessionflowEos,
        SystemKind::ParallelConsumerTx,
    );
}

/// sessionflow's throughput ÷ each of `others`', per scenario.
fn ratio_rows(outcomes: &[Outcome], others: &[SystemKind], md: &mut String) {
    let _ = writeln!(
        md,
        "## Ratios (throughput)\n\n| scenario |{}\n|---|{}",
        others
            .iter()
            .map(|k| format!(" sessionflow ÷ {} |", short_label(*k)))
            .collect::<String>(),
        "---:|".repeat(others.len())
    );
    for o in outcomes {
        let sf = throughput(o, SystemKind::Sessionflow);
        if sf.is_none() || !others.iter().any(|k| o.system(*k).is_some()) {
            continue;
        }
        let cells: String = others
            .iter()
            .map(|k| format!(" {} |", fmt_ratio(ratio(sf, throughput(o, *k)))))
            .collect();
        let _ = writeln!(md, "| {:?} |{cells}", o.scenario.id);
    }
    md.push('\n');
}

/// A system's name in a ratio's column head.
fn short_label(kind: SystemKind) -> &'static str {
    match kind {
        SystemKind::Ceiling => "ceiling",
        SystemKind::Sequential => "per-partition sequential",
        SystemKind::Pool => "flat pool",
        SystemKind::ParallelConsumer => "Parallel Consumer",
        other => other.label(),
    }
}

/// The whole of BENCHMARKS.md; `growth` is the "How cost grows" section
/// ([`crate::sweep_report`]), placed before the hand-written notes.
pub fn markdown(
    env: &Environment,
    outcomes: &[Outcome],
    growth: Option<&str>,
    notes: Option<&str>,
) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# sessionflow benchmarks\n\n\
         Generated by `make bench` (the `sessionflow-bench` crate in `bench/`). It measures and \
         reports; it asserts nothing. Every scenario runs, in one invocation and on one broker, \
         against four systems fed the same records and the same handler: the raw librdkafka \
         consumer (the ceiling), sessionflow (the engine in-process through its library API), a \
         per-partition sequential consumer, and a flat worker pool of {} workers (the seed \
         article's first design). Each run is a separate process.\n",
        env.pool_workers
    );
    let _ = writeln!(
        md,
        "## Conditions\n\n\
         - command: `{}`\n\
         - machine: {} CPUs (`nproc`), {}\n\
         - date: {}\n\
         - broker: {} at {}\n\
         - 1-minute load average: {} before, {} after (other work on this shared machine \
         competes for the same 2 cores)\n\
         - wall time of the whole benchmark: {:.0} s ({:.1} min)\n\
         - sessionflow telemetry: {}\n\
         - every system's consumer: `fetch.wait.max.ms` {} (how long the broker may hold an \
         empty fetch; on nisshi, the broker of earlier runs, whose long poll did not wake when \
         records arrived, it put a floor under every system's latency); prefetch: the baselines `queued.max.messages.kbytes` {} per \
         partition queue, sessionflow its default `prefetchKbytes` {} in total (shared by the \
         partitions; see *The allocator and the prefetch* in the notes); every system's queues: \
         `queued.min.messages` sessionflow's default `prefetchRecords` {} shared by the \
         partitions, `fetch.queue.backoff.ms` {}\n{}",
        env.command,
        env.nproc,
        env.cpu_model,
        env.date,
        env.broker,
        env.brokers,
        env.load_before,
        env.load_after,
        env.wall_s,
        env.wall_s / 60.0,
        if env.telemetry {
            "the worker binary's (tracing subscriber with the OpenTelemetry layer; no OTLP \
             endpoint and the records carry no `traceparent`, so records get no spans; logs at \
             `warn`)"
        } else {
            "none installed (spans are no-ops)"
        },
        env.fetch_wait_ms,
        crate::systems::PREFETCH_KBYTES,
        sessionflow_worker::config::defaults::prefetch_kbytes(),
        sessionflow_worker::config::defaults::prefetch_records(),
        sessionflow_worker::intake::prefetch::FETCH_QUEUE_BACKOFF_MS,
        if (env.scale - 1.0).abs() > f64::EPSILON {
            format!(
                "- **scaled run** (`--scale {}`): not the full-size benchmark\n",
                env.scale
            )
        } else {
            String::new()
        }
    );
    md.push_str(&format!(
        "## Definitions\n\n\
         - **throughput**: records ÷ (last handler completion − first handler call) of the \
         *backlog* run (the records are produced first, then the system drains them; start-up \
         and group join are excluded). P1's backlog is drained in {p1_rounds} rounds, the systems in \
         turn, each round by a new group, and a system's row is its median round (every round is \
         listed under the table). P4 has no backlog run: its throughput is the paced run's. \
         A run that hit its time cap is marked *capped* and its rate is what it handled in that \
         time.\n\
         - **latency**: from the moment the producer stamped the record (wall clock, just before \
         handing it to librdkafka) to the end of the handler call that succeeded (after any \
         retries), measured in the *paced* run, where the system is running and fetching before \
         the records are produced at the offered rate. So it includes producer batching \
         (`linger.ms` 1), the broker, fetching (`fetch.wait.max.ms` as below, the same for \
         every system), \
         queueing inside the system, retries and the handler's own work. Percentiles are \
         nearest-rank over every record of the run (≤ 1/64 bucket error); a record not done \
         within the run's cap counts as slower than all others, so a percentile that lands \
         among those reads \"> cap\". In P4 the percentiles are of the healthy sessions only.\n\
         - **order violations**: checked per record at the handler: each session's `sessionflow-seq` \
         (1, 2, 3… as loadgen numbers them) must enter the handler only after the previous \
         number finished, and a retry must repeat the record inside; anything else counts. \
         Summed over all runs of the scenario.\n\
         - **CPU s**: user + system CPU seconds of the system's process (getrusage) from just \
         before it started to its last record, in the backlog run (P4: the paced run with the \
         fault). **broker CPU s**: the broker process's CPU over the same run (/proc/PID/stat), \
         when the broker runs on this machine. **peak RSS**: the process's VmHWM.\n\
         - Every system uses the same retry policy (the engine's `RetryPolicy`: in place, \
         exponential, full jitter) and the same consumer settings; sessionflow uses its defaults \
         (8 dispatchers × 1,024, 10,000 in flight per partition, commit every 1 s) with no \
         output topic, like the baselines.\n",
        p1_rounds = crate::scenarios::P1_ROUNDS
    ));

    if outcomes.iter().any(|o| {
        o.system(SystemKind::ParallelConsumer).is_some()
            || o.system(SystemKind::ParallelConsumerTx).is_some()
    }) {
        md.push_str(&format!(
            "- **Parallel Consumer (KEY)** (on request: `--systems …,parallel-consumer`): the \
             Confluent Parallel Consumer {PC_VERSION} with kafka-clients {PC_KAFKA_CLIENTS} (the \
             version it is built with), KEY ordering, its default commit mode (periodic \
             asynchronous consumer commits, the offset map in the commit metadata) every 1 s, \
             `fetch.max.wait.ms` as above; run by `java {heap}` (OpenJDK 17) from \
             `bench/parallel-consumer/`. `maxConcurrency` (its worker threads) is the in-flight \
             budget sessionflow gets in the same scenario: one record in the handler per session, \
             at most 10,000 per partition, i.e. the scenario's sessions (1,000 in P1, P2, P4; \
             10 in P3). The bench handler runs as its Java twin on PC's worker thread (the same \
             order check, fault draws and histogram); P2's 5 ms of I/O is a blocking 5 ms park of \
             that thread (`LockSupport.parkNanos`, PC's model: a blocking call in the poll \
             function); a failed attempt throws `PCRetriableException` and PC retries it after \
             the engine's retry delay. Its CPU s and peak RSS are the JVM's, from its start \
             (JVM start-up and JIT compilation included; the harness's child that relays its \
             measurements is not counted).\n",
            heap = crate::systems::parallel_consumer::JAVA_HEAP,
            PC_VERSION = crate::systems::parallel_consumer::PC_VERSION,
            PC_KAFKA_CLIENTS = crate::systems::parallel_consumer::PC_KAFKA_CLIENTS,
        ));
    }
    if outcomes
        .iter()
        .any(|o| o.system(SystemKind::ParallelConsumerTx).is_some())
    {
        md.push_str(
            "- **Parallel Consumer (KEY, transactional, 100 ms)** (on request: \
             `parallel-consumer-tx`): the same JVM, settings and handler, in its transactional commit mode \
             (`PERIODIC_TRANSACTIONAL_PRODUCER`: one producer of transactional id \
             `<group>.pc-tx`, the offsets sent with a transaction every 100 ms, the consumer \
             reading `read_committed`), next to *sessionflow (exactlyOnce, 100 ms)*.\n",
        );
    }
    if outcomes
        .iter()
        .any(|o| o.system(SystemKind::SessionflowOutput).is_some())
    {
        md.push_str(
            "- **sessionflow + output** (on request: `--sessionflow-output`): the same engine \
             as a stage with an output topic of its own per run; the handler returns the \
             record's value (80 bytes) and the engine writes it there (the engine's producer: \
             `linger.ms` 5, idempotent). Its throughput, latency and CPU end at the last \
             handler completion, like every system's.\n",
        );
    }
    if outcomes.iter().any(|o| {
        o.system(SystemKind::SessionflowEos).is_some()
            || o.system(SystemKind::SessionflowAlo100).is_some()
    }) {
        md.push_str(
            "- **sessionflow (exactlyOnce, 100 ms)** and **sessionflow (atLeastOnce, 100 ms)** \
             (on request: `--systems …,sessionflow-eos,sessionflow-alo100`): the same terminal \
             stage with `delivery: exactlyOnce` (a transactional producer per input partition, \
             its offsets committed in a transaction) or atLeastOnce, both committing every \
             100 ms (unless `--variant-commit-interval-ms` says otherwise). Latency ends at the \
             handler, as for every system: a stage with outputs under exactlyOnce makes them \
             visible to `read_committed` readers only at the commit, up to one interval later.\n",
        );
    }
    md.push('\n');
    for o in outcomes {
        scenario_table(o, &mut md);
    }
    ratios_table(outcomes, &mut md);
    let _ = writeln!(
        md,
        "## Targets\n\n| target | measured | met |\n|---|---|---|"
    );
    for v in crate::targets::verdicts(outcomes) {
        let met = match v.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "not measured",
        };
        let _ = writeln!(md, "| {} | {} | {met} |", v.target, v.measured);
    }
    md.push('\n');
    md.push_str(
        "## Charts\n\n\
         ![throughput by scenario and system](bench/results/throughput.svg)\n\n\
         ![P4 latency distribution of the healthy sessions](bench/results/p4-latency-cdf.svg)\n\n\
         The raw results (every histogram) are in `bench/results/results.json`.\n\n",
    );
    if let Some(growth) = growth {
        md.push_str(growth);
        md.push('\n');
    }
    if let Some(notes) = notes {
        md.push_str(notes.trim_end());
        md.push('\n');
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_need_both_sides() {
        assert_eq!(ratio(Some(8.0), Some(10.0)), Some(0.8));
        assert_eq!(ratio(None, Some(10.0)), None);
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
    }

    #[test]
    fn ideal_rate_is_sessions_over_io_capped_by_the_ceiling() {
        assert_eq!(ideal_rate(1_000, 5, Some(500_000.0)), Some(200_000.0));
        assert_eq!(ideal_rate(1_000, 5, Some(150_000.0)), Some(150_000.0));
        assert_eq!(ideal_rate(1_000, 5, None), Some(200_000.0));
        assert_eq!(ideal_rate(1_000, 0, Some(9.0)), Some(9.0));
    }

    #[test]
    fn numbers_are_formatted_for_reading() {
        assert_eq!(fmt_int(1_234_567.4), "1,234,567");
        assert_eq!(fmt_int(999.0), "999");
        assert_eq!(fmt_int(-1_000.0), "-1,000");
        assert_eq!(fmt_ms(Some(1_234.0), 1.0), "1.23");
        assert_eq!(fmt_ms(Some(12_345.0), 1.0), "12.3");
        assert_eq!(fmt_ms(Some(123_456.0), 1.0), "123");
        assert_eq!(fmt_ms(None, 18.0), "> 18 s");
        assert_eq!(fmt_ratio(Some(0.8)), "0.80×");
        assert_eq!(fmt_ratio(Some(0.0027)), "0.00270×");
        assert_eq!(fmt_ratio(Some(0.013)), "0.0130×");
        assert_eq!(fmt_ratio(None), "—");
    }

    /// P5's memory table has a row for every system that probed its memory: a run of the
    /// exactlyOnce variant alone (testdata: stop 44's `--only p3,p4,p5 --systems
    /// sessionflow-eos,parallel-consumer-tx`) printed none while it was kept for `sessionflow`.
    #[test]
    fn the_memory_table_has_a_row_for_every_system_that_probed_it() {
        let outcome: Outcome =
            serde_json::from_str(include_str!("testdata/p5-eos-outcome.json")).unwrap();
        let mut md = String::new();
        scenario_table(&outcome, &mut md);
        assert!(
            md.contains(
                "| sessionflow (exactlyOnce, 100 ms) | 31 MiB | 358 MiB | 37 MiB | 1.19× |"
            ),
            "{md}"
        );
    }

    /// A run of exactlyOnce and PC's transactional mode alone (no plain sessionflow, so no
    /// ratios to the other systems) still gets their side-by-side table.
    #[test]
    fn exactly_once_meets_the_transactional_parallel_consumer_without_plain_sessionflow() {
        let mut p1: serde_json::Value =
            serde_json::from_str(include_str!("testdata/p1-outcome.json")).unwrap();
        let systems = p1["systems"].as_array_mut().unwrap();
        systems.retain(|s| s["system"] == "Sessionflow" || s["system"] == "Sequential");
        for s in systems.iter_mut() {
            s["system"] = if s["system"] == "Sessionflow" {
                "SessionflowEos"
            } else {
                "ParallelConsumerTx"
            }
            .into();
        }
        let outcome: Outcome = serde_json::from_value(p1).unwrap();
        let mut md = String::new();
        ratios_table(&[outcome], &mut md);
        assert!(!md.contains("## Ratios (throughput)"), "{md}");
        assert!(
            md.contains(
                "## sessionflow (exactlyOnce, 100 ms) against the Parallel Consumer (KEY, \
                 transactional, 100 ms)"
            ),
            "{md}"
        );
        assert!(md.contains("| P1 | 0.78"), "{md}");
    }
}
