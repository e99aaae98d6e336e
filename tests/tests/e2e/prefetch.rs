//! Prefetch bounded per worker: with every partition held (its in-flight cap reached by
//! records held inside the handler), what librdkafka has fetched ahead stops at the worker's
//! totals shared by the partitions — `prefetchKbytes` for large records, `prefetchRecords` for
//! small ones (a queue holds at most what it had when it asked, below its share, and one
//! answer) — not at a per-partition limit times the partitions; and nothing fetched ahead is
//! lost once the handler lets go.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use sessionflow_tests::{brokers, builtin, wait_until, Gate, RecordingHandler, Topics};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};
use sessionflow_worker::config::StageConfig;

const PARTITIONS: i32 = 4;
const RECORDS: u64 = 4_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_worker_prefetches_its_total_not_a_limit_per_partition() {
    const VALUE_BYTES: usize = 4_096;
    const BUDGET_KBYTES: u64 = 512;
    /// The producer's batches (`batch.size`): an answer may overshoot its limit by one.
    const BATCH_BYTES: u64 = 16_384;
    // ~16 MiB of values, 32 times the budget, in small batches: a fetch answer holds at least
    // one whole producer batch whatever `max.partition.fetch.bytes` says.
    let most = prefetched_while_held("prefetch", VALUE_BYTES, BATCH_BYTES, |stage| {
        stage.prefetch_kbytes = BUDGET_KBYTES;
        // nisshi lets the first non-empty partition of a fetch answer take the whole
        // `fetch.max.bytes` (Kafka only lets it exceed `max.partition.fetch.bytes` by its first
        // batch), so this holds only if the engine asks for answers of one share. It may not
        // ask for less than `message.max.bytes` (1 MB unless set), which is set to the share
        // here; `fetch.max.bytes` is the engine's.
        let share_bytes = (BUDGET_KBYTES * 1_024 / PARTITIONS as u64).to_string();
        stage.kafka.insert("message.max.bytes".into(), share_bytes);
    })
    .await;
    // Two shares per queue (what it held when librdkafka asked, and one answer), and the batch
    // an answer may overshoot by.
    let bound =
        ((2 * BUDGET_KBYTES * 1_024 + PARTITIONS as u64 * BATCH_BYTES) / VALUE_BYTES as u64) as i64;
    assert!(
        most <= bound,
        "{most} records of {VALUE_BYTES} bytes prefetched with a budget of {BUDGET_KBYTES} KiB \
         (at most {bound})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_records_are_bounded_by_the_record_total_not_the_bytes() {
    const VALUE_BYTES: usize = 100;
    const BUDGET_RECORDS: u64 = 64;
    /// Small producer batches and small answers, so that one answer is a few records.
    const BATCH_BYTES: u64 = 1_024;
    const ANSWER_BYTES: u64 = 2_048;
    // ~400 KB of records: far below the default `prefetchKbytes`, so only the record total
    // can stop librdkafka before it has fetched them all.
    let most = prefetched_while_held("prefetch-records", VALUE_BYTES, BATCH_BYTES, |stage| {
        stage.prefetch_records = BUDGET_RECORDS;
        for key in [
            "fetch.max.bytes",
            "max.partition.fetch.bytes",
            "message.max.bytes",
        ] {
            stage.kafka.insert(key.into(), ANSWER_BYTES.to_string());
        }
    })
    .await;
    // A queue asks while it holds less than its share, and an answer adds at most its limit
    // and one batch, of records of at least VALUE_BYTES each.
    let share = BUDGET_RECORDS / PARTITIONS as u64;
    let answer = (ANSWER_BYTES + BATCH_BYTES) / VALUE_BYTES as u64;
    let bound = (PARTITIONS as u64 * (share + answer)) as i64;
    assert!(
        most <= bound,
        "{most} records of {VALUE_BYTES} bytes prefetched with a total of {BUDGET_RECORDS} \
         records (at most {bound})"
    );
}

/// Produces `RECORDS` of `value_bytes` over `PARTITIONS`, runs a worker configured by `tune`
/// whose handler holds every record until every partition is held, and returns the most
/// records seen prefetched meanwhile; then lets go and checks that every record is handled
/// once, in order.
async fn prefetched_while_held(
    name: &str,
    value_bytes: usize,
    batch_bytes: u64,
    tune: impl FnOnce(&mut StageConfig),
) -> i64 {
    let topics = Topics::create(name, PARTITIONS).await;
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        value_size: value_bytes,
        kafka: vec![("batch.size".into(), batch_bytes.to_string())],
        ..LoadgenOptions::new(&brokers(), &topics.input, RECORDS, 40)
    };
    loadgen::run(&opts).await.expect("loadgen");

    let gate = Gate::default();
    let handler = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .holding(|_, _| true, gate.clone());
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.max_in_flight_per_partition = 8;
    tune(&mut stage);
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    wait_until(Duration::from_secs(60), || {
        worker.metrics.paused_partitions.get() == i64::from(PARTITIONS)
    })
    .await
    .expect("every partition held behind its in-flight cap");
    // Fetching goes on behind the holds until the queues are full: watch it settle.
    let mut most = 0;
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_secs(3) {
        most = most.max(worker.metrics.prefetched_records.get());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("{name}: prefetched at most {most} records while every partition was held");
    assert!(
        most > 0,
        "nothing was seen prefetched: the gauge reads nothing"
    );

    gate.open();
    topics.wait_fully_committed(Duration::from_secs(120)).await;
    handler.assert_in_order();
    let handled: usize = handler
        .seen
        .lock()
        .unwrap()
        .attempts
        .values()
        .map(|a| a.iter().map(|(seq, _)| seq).collect::<HashSet<_>>().len())
        .sum();
    assert_eq!(
        handled, RECORDS as usize,
        "every record handled once held ones let go"
    );
    worker.shutdown().await.unwrap();
    topics.delete().await;
    most
}
