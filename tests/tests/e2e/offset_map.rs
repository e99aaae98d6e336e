//! Bounded replay through commit metadata, against librdkafka's mock cluster.
//!
//! nisshi drops commit metadata (see shared/TESTING.md), so this test runs against the other
//! real Kafka-protocol implementation available here: librdkafka's in-process mock cluster,
//! which keeps it. A first worker finishes every record but one session's (its first record
//! hangs); its commit stays at that record's offset and carries the map of everything done
//! above it. A second worker in the same group then processes only the unfinished records.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::{Offset, TopicPartitionList};
use sessionflow_tests::{builtin, unique, wait_until, RecordingHandler, Topics};
use sessionflow_worker::loadgen::{self, LoadgenOptions, SessionChoice};
use sessionflow_worker::offset_map;

fn committed(brokers: &str, group: &str, topic: &str) -> (i64, String) {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, 0);
    let got = c.committed_offsets(tpl, Duration::from_secs(5)).unwrap();
    let e = got.find_partition(topic, 0).unwrap();
    match e.offset() {
        Offset::Offset(o) => (o, e.metadata().to_string()),
        _ => (-1, String::new()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_skips_what_the_commit_metadata_says_is_done() {
    sessionflow_tests::init_telemetry();
    let cluster = MockCluster::new(1).unwrap();
    let brokers = cluster.bootstrap_servers();
    let topics = Topics {
        input: unique("map-in"),
        output: unique("map-out"),
        dlq: unique("map-dlq"),
        group: unique("map-group"),
    };
    for t in [&topics.input, &topics.output, &topics.dlq] {
        cluster.create_topic(t, 1, 1).unwrap();
    }
    // 10 sessions × 5 records on one partition; session-000000's first record is offset 0.
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        ..LoadgenOptions::new(&brokers, &topics.input, 50, 10)
    };
    loadgen::run(&opts).await.unwrap();

    let stage = |handler_name: &str| {
        let mut s = topics.stage(builtin(0.0, 0.0));
        s.brokers = brokers.clone();
        s.stage = handler_name.into();
        s.shutdown_timeout_ms = 500;
        // Kafka-legal (≥ 6 s: the mock rejects less, like a real broker); its classic
        // rebalance then waits a few seconds for members.
        s.kafka.insert("session.timeout.ms".into(), "6000".into());
        s.kafka.insert("heartbeat.interval.ms".into(), "200".into());
        s
    };

    // First worker: session-000000 hangs on its first record; everything else finishes.
    let hanging = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .with_delay(|s, q| {
            if s == "session-000000" && q == 1 {
                Duration::from_secs(3_600)
            } else {
                Duration::ZERO
            }
        });
    let first = sessionflow_worker::start(stage("first"), hanging.clone())
        .await
        .unwrap();
    wait_until(Duration::from_secs(60), || {
        let (offset, metadata) = committed(&brokers, &topics.group, &topics.input);
        offset == 0 && offset_map::decode(0, &metadata).is_ok_and(|m| m.count() == 45)
    })
    .await
    .expect("the commit carries the map of the 45 finished records above offset 0");
    first.shutdown().await.unwrap();
    let (offset, metadata) = committed(&brokers, &topics.group, &topics.input);
    let map = offset_map::decode(offset, &metadata).unwrap();
    assert_eq!(offset, 0);
    for o in 0..50 {
        // session-000000 owns offsets 0, 10, 20, 30, 40 (round robin over 10 sessions).
        assert_eq!(map.is_done(o), o % 10 != 0, "offset {o}");
    }

    // Second worker, same group: only session-000000's five records are processed again.
    let fresh = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())));
    let second = sessionflow_worker::start(stage("second"), fresh.clone())
        .await
        .unwrap();
    wait_until(Duration::from_secs(60), || {
        committed(&brokers, &topics.group, &topics.input).0 == 50
    })
    .await
    .expect("the second worker finishes the partition");
    let skipped = second.metrics.replay_skipped.get();
    second.shutdown().await.unwrap();
    let seen = fresh.seen.lock().unwrap();
    let sessions: Vec<&String> = seen.attempts.keys().collect();
    assert_eq!(
        sessions,
        vec!["session-000000"],
        "only the unfinished session was replayed"
    );
    assert_eq!(seen.attempts["session-000000"].len(), 5);
    assert_eq!(skipped, 45);
}
