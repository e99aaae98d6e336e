//! `callgrind-workload`: CPU per record counted in instructions, whatever else the machine does.
//!
//! Wall-clock rates on a shared machine move with the other work on it; the number of
//! instructions a record costs does not. This subcommand runs one fixed, in-process workload —
//! librdkafka's mock cluster in this process, `--records` records of `--sessions` Zipf
//! sessions over `--partitions` partitions produced first, then one system (sessionflow, the
//! raw consumer for the floor that librdkafka and the mock broker set, or the per-partition
//! sequential consumer that P1 compares sessionflow with) draining them with the bench's no-op
//! handler. Under `valgrind --tool=callgrind` it brackets the drain with
//! callgrind's client requests: the counters are zeroed just before the system starts (or,
//! with `--window tail`, once a tenth of the records is done) and dumped when the last record
//! is, so that dump holds the cost of draining them, on every thread (see [`Window`]).
//! `bench/callgrind.sh` runs it and divides. Outside valgrind the requests do nothing, and the
//! run reports its rate only. With `--brokers` the records live on a cluster of their own
//! (Apache Kafka, `scripts/kafka.sh`) instead, in fresh topics deleted afterwards: the broker's
//! work is then outside the count, which holds the clients' instructions only.
//!
//! With `--traceparent-sampled R` every record carries a W3C `traceparent` (its own trace),
//! the sampled flag set on a fraction R of them, spread evenly — what an upstream that samples
//! at R sends — to measure the head sampler (`OTEL_TRACES_SAMPLER`, with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` for export; `bench/callgrind.sh` passes the environment on).

use std::ffi::CStr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clap::Args;
use rdkafka::mocking::MockCluster;
use sessionflow_tools::loadgen::SessionChoice;

use crate::handler::{Core, HandlerSpec, Milestone};
use crate::systems::{self, SystemKind, SystemSettings};
use crate::workload::{Load, Producer};

#[derive(Debug, Args)]
pub struct WorkloadArgs {
    /// The system that drains the records: `sessionflow`, `ceiling` or `sequential`.
    #[arg(long, default_value = "sessionflow")]
    system: SystemKind,
    #[arg(long, default_value_t = 50_000)]
    records: u64,
    #[arg(long, default_value_t = 1_000)]
    sessions: u64,
    #[arg(long, default_value_t = 8)]
    partitions: i32,
    /// Install the worker binary's telemetry (tracing subscriber + OpenTelemetry layer).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    telemetry: bool,
    /// Give every record its spans, as when spans are exported (the exporter's own work, a
    /// batch serialised and sent, is not included).
    #[arg(long)]
    spans: bool,
    /// Every record carries a `traceparent`, with the sampled flag on this fraction of them.
    #[arg(long)]
    traceparent_sampled: Option<f64>,
    /// As the benchmark's `--sessionflow-kafka` (e.g. `queued.min.messages=N` for the
    /// engine's `prefetchRecords`).
    #[arg(long, value_parser = crate::key_value)]
    sessionflow_kafka: Vec<(String, String)>,
    /// A Kafka cluster to run on (`host:port,…`; fresh topics and group, deleted afterwards)
    /// instead of librdkafka's mock cluster in this process. Then only the clients' own
    /// instructions are counted, not the broker's.
    #[arg(long)]
    brokers: Option<String>,
    /// What the count covers: `whole` (from just before the system starts: its start-up, the
    /// group join and every record's fetching) or `tail` (from the tenth of the records done).
    #[arg(long, value_enum, default_value_t = Window::Whole)]
    window: Window,
}

/// The part of the drain the count covers.
///
/// `tail` leaves start-up out, but not evenly: librdkafka fetches and parses records well
/// ahead of the handlers (a fetch brings up to a megabyte a partition, and each system's queues
/// hold thousands of records), so by the time a tenth is done a system has paid for the
/// fetching of a share of the rest that depends on its queue settings and on how its threads
/// were scheduled. Both systems' counts then lack a different, varying part of the fetch
/// cost. `whole` counts every record's fetching, and the start-up with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Window {
    Whole,
    Tail,
}

/// Where the workload's records live: librdkafka's mock cluster in this process (its broker's
/// instructions are counted with the clients'), or a cluster of its own (Apache Kafka).
enum Cluster {
    InProcess(MockCluster<'static, rdkafka::producer::DefaultProducerContext>),
    External(String),
}

impl Cluster {
    /// The cluster, with `topics` of `partitions` partitions.
    async fn with_topics(
        brokers: Option<String>,
        topics: &[&str],
        partitions: i32,
    ) -> anyhow::Result<Self> {
        match brokers {
            Some(brokers) => {
                sessionflow_worker::kafka::topics::create(&brokers, topics, partitions).await?;
                Ok(Self::External(brokers))
            }
            None => {
                let cluster =
                    MockCluster::new(1).map_err(|e| anyhow::anyhow!("mock cluster: {e}"))?;
                for t in topics {
                    cluster
                        .create_topic(t, partitions, 1)
                        .map_err(|e| anyhow::anyhow!("creating topic {t}: {e}"))?;
                }
                Ok(Self::InProcess(cluster))
            }
        }
    }

    fn bootstrap(&self) -> String {
        match self {
            Self::InProcess(cluster) => cluster.bootstrap_servers(),
            Self::External(brokers) => brokers.clone(),
        }
    }

    /// Deletes `topics` from a cluster of its own (the mock cluster goes with the process).
    async fn clean_up(&self, topics: &[&str]) {
        if let Self::External(brokers) = self {
            if let Err(e) = sessionflow_worker::kafka::topics::delete(brokers, topics).await {
                eprintln!("could not delete the workload's topics {topics:?}: {e}");
            }
        }
    }
}

/// Callgrind's client requests (valgrind/callgrind.h): the tool base `('C','T')`, then in order
/// DUMP_STATS, ZERO_STATS, TOGGLE_COLLECT, DUMP_STATS_AT.
const CALLGRIND_BASE: usize = ((b'C' as usize) << 24) | ((b'T' as usize) << 16);
const ZERO_STATS: usize = CALLGRIND_BASE + 1;
const DUMP_STATS_AT: usize = CALLGRIND_BASE + 3;

/// Valgrind's client request on x86-64 (valgrind.h's `VALGRIND_DO_CLIENT_REQUEST_EXPR`): a
/// sequence of rotations that leaves `rdi` as it was, then `xchg rbx, rbx`. Natively it does
/// nothing and returns `default`; under valgrind, the tool reads the request from `rax`.
#[cfg(target_arch = "x86_64")]
fn client_request(request: usize, arg: usize, default: usize) -> usize {
    let args: [usize; 6] = [request, arg, 0, 0, 0, 0];
    let mut result = default;
    // SAFETY: the instructions change no register but rdx (declared) and the flags; valgrind
    // reads `args` through rax while it is alive.
    unsafe {
        std::arch::asm!(
            "rol rdi, 3",
            "rol rdi, 13",
            "rol rdi, 61",
            "rol rdi, 51",
            "xchg rbx, rbx",
            inout("rdx") result,
            in("rax") args.as_ptr(),
            options(nostack),
        );
    }
    result
}

#[cfg(not(target_arch = "x86_64"))]
fn client_request(_request: usize, _arg: usize, default: usize) -> usize {
    default
}

/// Runs the workload; prints what `bench/callgrind.sh` reads.
pub async fn run(args: WorkloadArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        matches!(
            args.system,
            SystemKind::Sessionflow | SystemKind::Ceiling | SystemKind::Sequential
        ),
        "--system: sessionflow, ceiling or sequential"
    );
    // Names of their own: a cluster of its own outlives the run.
    let tag = format!("{}-{:x}", std::process::id(), crate::measurement::now_us());
    let (topic, dlq, group) = (
        format!("callgrind-in-{tag}"),
        format!("callgrind-dlq-{tag}"),
        format!("callgrind-{tag}"),
    );
    let cluster =
        Cluster::with_topics(args.brokers.clone(), &[&topic, &dlq], args.partitions).await?;
    let result = drain(&args, &cluster.bootstrap(), &topic, &dlq, &group).await;
    cluster.clean_up(&[&topic, &dlq]).await;
    result
}

/// Produces the workload's records to `topic`, then has the system drain them.
async fn drain(
    args: &WorkloadArgs,
    brokers: &str,
    topic: &str,
    dlq: &str,
    group: &str,
) -> anyhow::Result<()> {
    let brokers = brokers.to_string();
    let load = Load {
        topic: topic.into(),
        records: args.records,
        sessions: args.sessions,
        choice: SessionChoice::Zipf(1.0),
        seed: 7,
        rate: None,
        value_size: crate::workload::VALUE_SIZE,
    };
    match args.traceparent_sampled {
        Some(ratio) => produce_traced(&brokers, &load, ratio).await?,
        None => {
            Producer::new(&brokers, false)?.produce(&load).await?;
        }
    }
    let settings = SystemSettings {
        brokers,
        topic: topic.into(),
        dlq: dlq.into(),
        output: None,
        group: group.into(),
        partitions: args.partitions,
        retry_initial_ms: 1,
        retry_max_ms: 100,
        pool_workers: 1,
        pool_queue: 1,
        session_idle_ms: 60_000,
        telemetry: args.telemetry,
        fetch_wait_ms: 10,
        sessionflow_kafka: args.sessionflow_kafka.clone(),
        commit_interval_ms: args.system.commit().map_or(1_000, |(ms, _)| ms),
        exactly_once: args.system.commit().is_some_and(|(_, eos)| eos),
        max_in_flight_per_partition: None,
        pc_max_concurrency: None,
    };
    let core = Arc::new(Core::new(
        HandlerSpec::default(),
        args.sessions as usize,
        args.partitions as usize,
    ));
    let handled = || core.counts().handled;
    let started = Instant::now();
    // The window is bracketed by the calls that finish its first and last records, on their
    // own threads (`Core::on_handled`): exactly the records between them are in the dump.
    let from = match args.window {
        Window::Tail => (args.records / 10).max(1),
        Window::Whole => 0,
    };
    let zeroed = Arc::new(OnceLock::new());
    let dumped = Arc::new(OnceLock::new());
    let reason: &'static CStr = c"drained";
    let at = |count: u64, request: usize, arg: usize, when: &Arc<OnceLock<Instant>>| {
        let when = when.clone();
        Milestone {
            at: count,
            action: Box::new(move || {
                client_request(request, arg, 0);
                let _ = when.set(Instant::now());
            }),
        }
    };
    let dump = at(
        args.records,
        DUMP_STATS_AT,
        reason.as_ptr() as usize,
        &dumped,
    );
    if from == 0 {
        client_request(ZERO_STATS, 0, 0);
        let _ = zeroed.set(Instant::now());
        core.on_handled(vec![dump]);
    } else {
        core.on_handled(vec![at(from, ZERO_STATS, 0, &zeroed), dump]);
    }
    let running = systems::start(args.system, &settings, core.clone()).await?;
    if args.spans {
        sessionflow_worker::ops::telemetry::set_every_record_span(true);
    }
    wait_for(|| handled() >= args.records).await;
    running.stop().await;
    let counts = core.counts();
    let measured = args.records - from;
    let elapsed = match (zeroed.get(), dumped.get()) {
        (Some(z), Some(d)) => d.duration_since(*z),
        _ => anyhow::bail!("the measured window was not bracketed"),
    };
    println!("system: {}", args.system.label());
    println!("records measured: {measured}");
    println!(
        "drain rate msg/s: {:.0}",
        measured as f64 / elapsed.as_secs_f64()
    );
    println!("order violations: {}", counts.order_violations);
    println!("wall s: {:.1}", started.elapsed().as_secs_f64());
    anyhow::ensure!(counts.order_violations == 0, "order violations");
    Ok(())
}

/// `load`'s records as [`Producer::produce`] writes them (key, value, sequence header), each
/// with a `traceparent` of its own trace, sampled on a fraction `ratio` of them.
async fn produce_traced(brokers: &str, load: &Load, ratio: f64) -> anyhow::Result<()> {
    use futures::stream::{FuturesUnordered, StreamExt};
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use sessionflow_worker::record::header;

    anyhow::ensure!(
        (0.0..=1.0).contains(&ratio),
        "--traceparent-sampled: a ratio in [0, 1]"
    );
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "10")
        .set("partitioner", "murmur2_random")
        .set("enable.idempotence", "true")
        .set("queue.buffering.max.messages", "1000000")
        .create()?;
    let order = sessionflow_tools::loadgen::session_sequence(
        load.records,
        load.sessions,
        load.choice,
        load.seed,
    );
    let mut seqs = vec![0u64; load.sessions.max(1) as usize];
    let acks = FuturesUnordered::new();
    for (i, sid) in order.iter().enumerate() {
        let sid = *sid as u32;
        seqs[sid as usize] += 1;
        let seq = seqs[sid as usize].to_string();
        let key = crate::workload::session_key(sid);
        let value = crate::workload::encode_value(
            crate::measurement::now_us(),
            sid,
            false,
            load.value_size,
        );
        let i = i as u64;
        let sampled = ((i + 1) as f64 * ratio).floor() > (i as f64 * ratio).floor();
        let traceparent = format!(
            "00-{:016x}{:016x}-{:016x}-{}",
            0x5e55_10f1_0000_0000u64 | i,
            i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            i + 1,
            if sampled { "01" } else { "00" }
        );
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: header::SEQ,
                value: Some(seq.as_bytes()),
            })
            .insert(Header {
                key: header::TRACEPARENT,
                value: Some(traceparent.as_bytes()),
            });
        let record = FutureRecord::to(&load.topic)
            .key(key.as_bytes())
            .payload(&value)
            .headers(headers);
        acks.push(
            producer
                .send_result(record)
                .map_err(|(e, _)| anyhow::anyhow!("producing: {e}"))?,
        );
    }
    let failed = acks
        .filter(|a| std::future::ready(!matches!(a, Ok(Ok(_)))))
        .count()
        .await;
    anyhow::ensure!(failed == 0, "{failed} records were not acknowledged");
    Ok(())
}

async fn wait_for(mut done: impl FnMut() -> bool) {
    while !done() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
