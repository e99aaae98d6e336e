//! The lag the operator measures, and the replicas it derives, against real brokers.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use sessionflow_operator::autoscale::{self, History, Policy, Signal};
use sessionflow_operator::kafka::Connection;
use sessionflow_tests::{brokers, end_offsets, unique};
use sessionflow_tools::loadgen::{self, LoadgenOptions};
use sessionflow_worker::commit::lag::{self, PartitionLag};
use sessionflow_worker::commit::offset_map;
use sessionflow_worker::kafka::topics;

fn member(brokers: &str, group: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .create()
        .unwrap()
}

fn commit(consumer: &BaseConsumer, topic: &str, offsets: &[(i32, i64, &str)]) {
    let mut tpl = TopicPartitionList::new();
    for (p, offset, metadata) in offsets {
        tpl.add_partition_offset(topic, *p, Offset::Offset(*offset))
            .unwrap();
        if let Some(mut e) = tpl.find_partition(topic, *p) {
            e.set_metadata(*metadata);
        }
    }
    consumer.commit(&tpl, CommitMode::Sync).unwrap();
}

fn policy(lag_per_replica: u64) -> Policy {
    Policy {
        min: 1,
        max: 10,
        lag_per_replica,
        scale_down_window: Duration::ZERO,
        scale_up_max_step: None,
    }
}

fn signal(lags: &[PartitionLag]) -> Signal {
    Signal {
        effective_lag: lag::total_effective(lags) as u64,
        partitions: lags.len() as u32,
    }
}

/// A member of the group commits part of what was produced and pauses; the operator, which
/// never joins the group, reads exactly high watermark − committed offset per partition, and
/// the member keeps its assignment (the reads caused no rebalance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_is_exact_while_the_group_is_paused_and_replicas_follow_it() {
    let topic = unique("op-lag");
    let group = unique("op-lag-group");
    topics::create(&brokers(), &[&topic], 4).await.unwrap();
    loadgen::run(&LoadgenOptions::new(&brokers(), &topic, 2_000, 100))
        .await
        .unwrap();
    let end = end_offsets(&topic);
    assert_eq!(end.iter().sum::<i64>(), 2_000);

    let consumer = member(&brokers(), &group);
    consumer.subscribe(&[&topic]).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while consumer.assignment().unwrap().count() < 4 {
        assert!(std::time::Instant::now() < deadline, "never assigned");
        let _ = consumer.poll(Duration::from_millis(100));
    }
    // Commit a different share of each partition, then pause everything.
    let first: Vec<i64> = end
        .iter()
        .enumerate()
        .map(|(p, e)| e * (p as i64 + 1) / 5)
        .collect();
    let offsets: Vec<(i32, i64, &str)> = first
        .iter()
        .enumerate()
        .map(|(p, o)| (p as i32, *o, ""))
        .collect();
    commit(&consumer, &topic, &offsets);
    consumer.pause(&consumer.assignment().unwrap()).unwrap();

    let connection = Connection::plain(&brokers());
    let lags = connection.read_lag(&group, &topic).await.unwrap();
    let mut expected_total = 0;
    for (p, l) in lags.iter().enumerate() {
        assert_eq!(l.partition, p as i32);
        assert_eq!(l.high, end[p], "partition {p} high watermark");
        assert_eq!(l.committed, Some(first[p]), "partition {p} committed");
        assert_eq!(l.lag(), end[p] - first[p], "partition {p} lag");
        // No map was committed (empty metadata): effective lag is plain lag.
        assert_eq!(l.effective_lag(), l.lag());
        expected_total += end[p] - first[p];
    }
    assert_eq!(lag::total(&lags), expected_total);

    // ~1,000 records of lag at 250 per replica: 4 replicas (also the partition count).
    let p = policy(250);
    let mut history = History::default();
    let s = signal(&lags);
    let up = autoscale::decide(&p, Some(&s), 1, &mut history, Duration::ZERO);
    assert_eq!(
        up.desired,
        (expected_total as u64).div_ceil(250).min(4) as u32
    );
    assert!(up.desired > 1);

    // The group catches up to 300 records of lag: the replicas follow it down.
    let second: Vec<(i32, i64, &str)> = end
        .iter()
        .enumerate()
        .map(|(p, e)| (p as i32, e - 75, ""))
        .collect();
    commit(&consumer, &topic, &second);
    let lags = connection.read_lag(&group, &topic).await.unwrap();
    assert_eq!(lag::total(&lags), 300);
    let down = autoscale::decide(
        &p,
        Some(&signal(&lags)),
        up.desired,
        &mut history,
        Duration::from_secs(1),
    );
    assert_eq!(down.desired, 2);

    let _ = consumer.poll(Duration::from_millis(100));
    assert_eq!(
        consumer.assignment().unwrap().count(),
        4,
        "the operator's reads moved no partition"
    );
    drop(consumer);
    topics::delete(&brokers(), &[&topic]).await.unwrap();
}

/// The operator reads the completed-offset map the workers commit as the offsets' metadata, and
/// scales on the records really left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effective_lag_counts_out_records_the_commit_metadata_marks_done() {
    let bootstrap = brokers();
    let topic = unique("op-effective");
    let group = unique("op-effective-group");
    topics::create(&bootstrap, &[&topic], 4).await.unwrap();
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    for i in 0..40 {
        producer
            .send(
                BaseRecord::<str, str>::to(&topic)
                    .partition(0)
                    .key("s")
                    .payload(&i.to_string()),
            )
            .unwrap();
    }
    producer.flush(Duration::from_secs(10)).unwrap();

    // Watermark 10 on partition 0; of 10..40 only 10, 11, 12 and 15 are unfinished.
    let map = offset_map::encode(10, 40, 0, [10, 11, 12, 15]).unwrap();
    let committer = member(&bootstrap, &group);
    commit(&committer, &topic, &[(0, 10, map.as_str())]);

    let lags = Connection::plain(&bootstrap)
        .read_lag(&group, &topic)
        .await
        .unwrap();
    let p0 = lags.iter().find(|l| l.partition == 0).unwrap();
    assert_eq!((p0.high, p0.committed), (40, Some(10)));
    assert_eq!(p0.lag(), 30);
    assert_eq!(p0.done_above, 26);
    assert_eq!(p0.effective_lag(), 4);
    assert_eq!(lag::total(&lags), 30, "empty partitions add nothing");

    // On plain lag this stage would take all 4 partitions' worth of replicas; on effective lag, 2.
    let p = policy(2);
    let plain = Signal {
        effective_lag: lag::total(&lags) as u64,
        partitions: 4,
    };
    assert_eq!(autoscale::recommend(&p, &plain), 4);
    assert_eq!(autoscale::recommend(&p, &signal(&lags)), 2);
    drop(committer);
    topics::delete(&bootstrap, &[&topic]).await.unwrap();
}

/// A topic written by a transactional producer: one committed transaction of 10 records (its
/// commit marker at offset 10), then an open one (1 record at 11, not committed). A group
/// consumes everything it can (`read_committed`) and commits its position (11: librdkafka's
/// position skips the marker). The operator's reader reads to the last stable offset (11): lag
/// 0, the open transaction is not lag; a `read_uncommitted` client's high watermark (12)
/// counts the open record. The marker itself is below the LSO: a group that committed 10
/// (its last record + 1) would see it as 1 of lag at either level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_is_read_to_the_last_stable_offset_so_transactions_are_not_lag() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let topic = unique("op-lso");
    let group = unique("op-lso-group");
    topics::create(&brokers(), &[&topic], 1).await.unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", unique("op-lso-txn"))
        .create()
        .unwrap();
    let t = Duration::from_secs(30);
    producer.init_transactions(t).unwrap();
    producer.begin_transaction().unwrap();
    for i in 0..10 {
        let payload = i.to_string();
        producer
            .send(
                FutureRecord::<str, str>::to(&topic)
                    .key("s")
                    .payload(&payload),
                t,
            )
            .await
            .unwrap();
    }
    producer.commit_transaction(t).unwrap();
    // An open transaction after it.
    producer.begin_transaction().unwrap();
    producer
        .send(
            FutureRecord::<str, str>::to(&topic)
                .key("s")
                .payload("open"),
            t,
        )
        .await
        .unwrap();

    // The group takes what read_committed lets it (the 10 records) and commits its position.
    let consumer = member(&brokers(), &group);
    consumer.subscribe(&[&topic]).unwrap();
    let mut taken = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while taken < 10 {
        assert!(std::time::Instant::now() < deadline, "took {taken} of 10");
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            m.unwrap();
            taken += 1;
        }
    }
    for _ in 0..10 {
        let _ = consumer.poll(Duration::from_millis(100));
    }
    let position = consumer.position().unwrap();
    let position = match position.find_partition(&topic, 0).unwrap().offset() {
        Offset::Offset(o) => o,
        other => panic!("position {other:?}"),
    };
    commit(&consumer, &topic, &[(0, position, "")]);

    let lags = Connection::plain(&brokers())
        .read_lag(&group, &topic)
        .await
        .unwrap();
    let uncommitted: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_uncommitted")
        .create()
        .unwrap();
    let raw = lag::read_with(&uncommitted, &topic, t).unwrap();
    eprintln!(
        "position {position}; read_committed: high {} committed {:?} lag {}; \
         read_uncommitted: high {} lag {}",
        lags[0].high,
        lags[0].committed,
        lags[0].lag(),
        raw[0].high,
        raw[0].lag()
    );
    // LSO = the open transaction's first offset (11); the high watermark is past its record.
    assert_eq!(position, 11, "the position skips the commit marker");
    assert_eq!(lags[0].high, 11, "last stable offset");
    assert_eq!(raw[0].high, 12, "high watermark");
    assert_eq!(lags[0].committed, Some(position));
    assert_eq!(lags[0].lag(), 11 - position);
    assert!(raw[0].lag() > lags[0].lag());
    // The commit marker is below the LSO: it is lag at both levels for a group that commits
    // past its last record (10) rather than its position (librdkafka's position skips the
    // marker: 11, as asserted above).
    commit(&consumer, &topic, &[(0, 10, "")]);
    let lags = Connection::plain(&brokers())
        .read_lag(&group, &topic)
        .await
        .unwrap();
    let raw = lag::read_with(&uncommitted, &topic, t).unwrap();
    assert_eq!((lags[0].lag(), raw[0].lag()), (1, 2));
    producer.abort_transaction(t).unwrap();
}
