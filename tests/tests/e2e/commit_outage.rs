//! Replay stays bounded when commits fail (issue 10, item 8), against librdkafka's mock
//! cluster (worker processes connect to it over loopback; its OffsetCommit errors are the
//! injected fault).
//!
//! While every commit fails, the watermark the worker computes keeps moving, but what a crash
//! would replay is everything since the last commit the broker *confirmed*. So intake must be
//! held once that span reaches `maxInFlightPerPartition`; otherwise a worker that crashes after
//! a long commit outage replays its whole backlog.

use std::time::Duration;

use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use sessionflow_tests::{
    end_offsets_on, init_telemetry, unique, verify_on, wait_committed_to_end_on, wait_until,
    Topics, WorkerProcess,
};
use sessionflow_worker::loadgen::{self, LoadgenOptions, SessionChoice};

const PARTITIONS: i32 = 4;
const CAP: u64 = 100;
const RECORDS: u64 = 10_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_commit_outage_replays_at_most_the_in_flight_cap() {
    init_telemetry();
    let cluster = MockCluster::new(1).expect("mock cluster");
    let brokers = cluster.bootstrap_servers();
    let topics = Topics {
        input: unique("outage-in"),
        output: unique("outage-out"),
        dlq: unique("outage-dlq"),
        group: unique("outage-group"),
    };
    for t in [&topics.input, &topics.output] {
        cluster.create_topic(t, PARTITIONS, 1).unwrap();
    }
    cluster.create_topic(&topics.dlq, 1, 1).unwrap();
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        ..LoadgenOptions::new(&brokers, &topics.input, RECORDS, 200)
    };
    loadgen::run(&opts).await.expect("loadgen");
    let outputs = || end_offsets_on(&brokers, &topics.output).iter().sum::<i64>() as u64;

    let yaml = topics.stage_yaml_on(
        &brokers,
        "{latencyMs: 2, seed: 8}",
        &format!("maxInFlightPerPartition: {CAP}"),
    );
    let first = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(90), || outputs() >= 1_000)
        .await
        .expect("progress before the outage");

    // Every commit from now on fails (one error per request, far more than the test sends).
    cluster.request_errors(
        RDKafkaApiKey::OffsetCommit,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS; 5_000],
    );
    let at_outage = outputs();
    // Let the worker go as far as it will: until its output stops growing for 3 s.
    let mut last = at_outage;
    let mut still = 0;
    while still < 30 && last < RECORDS {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = outputs();
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
    eprintln!("commit outage from {at_outage} outputs: the worker went on to {last}");
    first.kill();
    cluster.clear_request_errors(RDKafkaApiKey::OffsetCommit);

    let second = WorkerProcess::spawn(&yaml);
    wait_committed_to_end_on(&brokers, &topics, Duration::from_secs(180))
        .await
        .unwrap_or_else(|(committed, end)| panic!("committed {committed:?} never reached {end:?}"));
    assert!(second.terminate().success());

    let report = verify_on(&brokers, &topics);
    eprintln!("kill -9 after a commit outage, restart:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, RECORDS, "{report}");
    // Held at the cap, counted from the last confirmed commit: at most the cap per partition
    // is replayed (plus the record that crossed it, and one parked).
    let bound = PARTITIONS as u64 * (CAP + 2);
    assert!(
        report.duplicates <= bound,
        "{} replays after the outage (bound {bound})",
        report.duplicates
    );
}
