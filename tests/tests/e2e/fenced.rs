//! A fenced partition producer of an exactly-once stage, on the broker under test
//! (docs/exactly-once.md, "Aborts and rewinds"): another process opens a transactional
//! producer with the transactional id of one input partition (`<group>.<topic>.<p>`) while the
//! group still assigns that partition to the worker — a zombie of some other member, say. Its
//! `init_transactions` fences the worker's producer of that partition. The worker gives up
//! only that partition (nothing of its open transaction commits), goes on with the others,
//! and once the grace is over reopens the partition's producer (fencing the zombie in turn)
//! and replays it from its last commit.
//!
//! Needs a broker with transactions (Apache Kafka; a single node needs
//! `transaction.state.log.replication.factor=1`, which `scripts/kafka.sh` sets).

use std::time::Duration;

use rdkafka::producer::{BaseRecord, Producer};
use sessionflow_tests::{
    end_offsets, transactional_producer, verify_pipeline, wait_until, Topics, WorkerProcess,
};
use sessionflow_worker::commit::exactly_once::transactional_id;

const T: Duration = Duration::from_secs(30);
/// The worker's metrics port.
const PORT: u16 = 19492;
/// The input partition whose transactional id the zombie takes.
const FENCED: i32 = 1;

/// The sum of the worker's series `name` (`sessionflow_` left out) with all of `labels`
/// (e.g. `reason="write"`), 0 if none.
async fn metric(name: &str, labels: &[&str]) -> u64 {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], PORT));
    let (status, body) = sessionflow_tests::http_get(addr, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    let full = format!("sessionflow_{name}");
    body.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(full.as_str()))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// One exactly-once worker on 4 partitions, 100 sessions. While records flow, the test fences
/// the worker's producer of partition 1 (a producer of its own with that transactional id,
/// whose transaction it then leaves open with a record in the output). The worker does not
/// stop; it counts the fence; every record is exactly once in the read_committed output, in
/// order per session; the group commits every partition to its end (partition 1 too: it was
/// reopened after the grace), and the zombie's open transaction was fenced by that reopen (its
/// commit is refused, its record never visible).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_partition_producer_gives_up_only_its_partition_and_reopens_it_after_the_grace() {
    let topics = Topics::create("eos-fenced", 4).await;
    let total: u64 = 30_000;
    crate::produce_round_robin(&topics, 100, 300).await;
    let yaml = topics
        .stage_yaml("{latencyMs: 10, seed: 5}", "delivery: exactlyOnce")
        .replace(
            "metricsAddr: null",
            &format!("metricsAddr: 127.0.0.1:{PORT}"),
        );
    let log = std::env::temp_dir().join(sessionflow_tests::unique("eos-fenced") + ".log");
    let mut worker = WorkerProcess::spawn_logging_at(
        &yaml,
        &[],
        std::fs::File::create(&log).expect("log file").into(),
        "sessionflow_worker=warn",
    );
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let started = wait_until(Duration::from_secs(120), || {
        topics.output_count() >= 1_500 || !worker.running()
    })
    .await;
    assert!(
        started.is_ok() && worker.running(),
        "the worker made no progress:\n{}",
        read_log()
    );

    // The zombie: partition 1's transactional id, a transaction left open with a write in it.
    let zombie = transactional_producer(&transactional_id(&topics.group, &topics.input, FENCED));
    zombie.begin_transaction().expect("begin");
    zombie
        .send(
            BaseRecord::to(&topics.output)
                .key("zombie")
                .payload("zombie"),
        )
        .map_err(|(e, _)| e)
        .expect("send");
    zombie.flush(T).expect("flush");
    let at_fence = topics.output_count();

    worker
        .wait_for_log(
            &log,
            "the partition is given up —",
            "fence",
            Duration::from_secs(60),
        )
        .await;
    let input = topics.input.clone();
    let done = wait_until(Duration::from_secs(120), || {
        !worker.running() || topics.committed() == end_offsets(&input)
    })
    .await;
    assert!(worker.running(), "the worker stopped:\n{}", read_log());
    assert!(
        done.is_ok(),
        "committed {:?} never reached the end offsets {:?} (partition {FENCED} stuck?):\n{}",
        topics.committed(),
        end_offsets(&input),
        read_log()
    );
    assert!(
        read_log().contains("its transactional producer is reopened"),
        "the partition was not reopened:\n{}",
        read_log()
    );
    // The reopen's init fenced the zombie: its transaction was aborted, its commit refused.
    let zombie_commit = zombie.commit_transaction(T);
    assert!(
        zombie_commit.is_err(),
        "the zombie's transaction committed after the reopen"
    );
    let fences = metric(
        "transactions_total",
        &["result=\"aborted\"", "reason=\"fenced\""],
    )
    .await;
    assert!(fences >= 1, "fences counted: {fences}");
    // Records per transaction: over the committed ones, every input record exactly once (those
    // of the transaction the fence aborted count in the one that replayed them). The last
    // commit is observed just after the broker confirmed it: waited for.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let (transactions, records) = loop {
        let transactions = metric("transaction_records_count", &[]).await;
        let records = metric("transaction_records_sum", &[]).await;
        if records == total || std::time::Instant::now() >= until {
            break (transactions, records);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        records == total && transactions > 0,
        "transaction_records: {transactions} committed transactions carrying {records} \
         records, not {total}"
    );
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], PORT));
    let (health, _) = sessionflow_tests::http_get(addr, "/healthz").await;
    assert_eq!(health, 200, "the worker is healthy");

    let report = verify_pipeline(&topics);
    eprintln!(
        "exactlyOnce, partition {FENCED}'s producer fenced at {at_fence} output offsets \
         ({fences} fence(s) counted; the zombie's commit: {zombie_commit:?}; {transactions} \
         transactions committed, carrying {records} records):\n{report}"
    );
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.duplicates, 0, "{report}");
    assert_eq!(report.stale_ends, 0, "{report}");
    assert_eq!(report.records + report.dlq_records, total, "{report}");
    let status = worker.terminate();
    assert!(status.success(), "the worker's stop: {status}");
    topics.delete().await;
}
