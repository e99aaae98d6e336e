//! Prefetch bounded per worker: with every partition held (its in-flight cap reached by
//! records held inside the handler), what librdkafka has fetched ahead stops at the worker's
//! `prefetchKbytes` shared by the partitions (two shares per queue at most: what was there
//! when it asked, and one answer), not at a per-partition limit times the partitions; and
//! nothing fetched ahead is lost once the handler lets go.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use sessionflow_tests::{brokers, builtin, wait_until, Gate, RecordingHandler, Topics};
use sessionflow_worker::loadgen::{self, LoadgenOptions, SessionChoice};

const PARTITIONS: i32 = 4;
const VALUE_BYTES: usize = 4_096;
const RECORDS: u64 = 4_000;
const BUDGET_KBYTES: u64 = 512;
/// The producer's batches (`batch.size`): an answer may overshoot its limit by one.
const BATCH_BYTES: u64 = 16_384;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_worker_prefetches_its_total_not_a_limit_per_partition() {
    let topics = Topics::create("prefetch", PARTITIONS).await;
    // ~16 MiB of values, 32 times the budget, in small batches: a fetch answer holds at least
    // one whole producer batch whatever `max.partition.fetch.bytes` says.
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        value_size: VALUE_BYTES,
        kafka: vec![("batch.size".into(), BATCH_BYTES.to_string())],
        ..LoadgenOptions::new(&brokers(), &topics.input, RECORDS, 40)
    };
    loadgen::run(&opts).await.expect("loadgen");

    let gate = Gate::default();
    let handler = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .holding(|_, _| true, gate.clone());
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.max_in_flight_per_partition = 8;
    stage.prefetch_kbytes = BUDGET_KBYTES;
    // nisshi lets the first non-empty partition of a fetch answer take the whole
    // `fetch.max.bytes` (Kafka only lets it exceed `max.partition.fetch.bytes` by its first
    // batch): on nisshi a queue stays within two shares only with answers of one share.
    let share_bytes = (BUDGET_KBYTES * 1_024 / PARTITIONS as u64).to_string();
    for key in ["fetch.max.bytes", "message.max.bytes"] {
        stage.kafka.insert(key.into(), share_bytes.clone());
    }
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
    eprintln!("prefetched at most {most} records while every partition was held");
    // Two shares per queue (what it held when librdkafka asked, and one answer), and the batch
    // an answer may overshoot by.
    let bound =
        ((2 * BUDGET_KBYTES * 1_024 + PARTITIONS as u64 * BATCH_BYTES) / VALUE_BYTES as u64) as i64;
    assert!(
        most > 0,
        "nothing was seen prefetched: the gauge reads nothing"
    );
    assert!(
        most <= bound,
        "{most} records of {VALUE_BYTES} bytes prefetched with a budget of {BUDGET_KBYTES} KiB \
         (at most {bound})"
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
}
