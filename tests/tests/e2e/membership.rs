//! The membership fence (RELIABILITY.md, footnote 9): a silent coordinator, and a consumer loop
//! blocked on one, each on an Apache Kafka node of its own behind the tests' relay
//! (`sessionflow_tests::relay`).
//!
//! A member whose group coordinator stops answering must stop writing before the coordinator
//! could give its partitions to another member, and go on once it answers again. In the field
//! this is a connection to the coordinator that hangs while the member is in a rejoin, where
//! librdkafka itself never times the session out. That state cannot be reached on purpose in
//! a test, so the test silences exactly what the worker listens to — the coordinator's answers
//! to offset commits and offset fetches (the relay answers each one "request timed out", which
//! librdkafka retries until the silence ends, as it would a request on a hung connection) —
//! and lets librdkafka's heartbeats through: the group keeps the member and librdkafka keeps
//! the partitions assigned all along, and only the fence can stop the writes. (An error that
//! says the coordinator is gone would not do: librdkafka then looks for a new one, stops
//! heartbeating meanwhile, and times the session out itself.) Every answer of the node is also
//! slowed down (2 s) during the silence, so that writes are on their way when the fence closes:
//! it must take them back and write them again once the coordinator answers (a write given up
//! instead would never be committed, and the test would time out).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sessionflow_tests::relay::{broker_behind_relay, OFFSET_COMMIT, OFFSET_FETCH, SYNC_GROUP};
use sessionflow_tests::{
    end_offsets_on, unique, verify_on, wait_committed_to_end_on, wait_until, WorkerProcess,
};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};

const PARTITIONS: i32 = 4;
const RECORDS: u64 = 12_000;
/// How long the coordinator stays silent: twice the workers' 6 s session timeout.
const SILENCE: Duration = Duration::from_secs(12);
/// How late the node's answers come during the silence.
const SLOW: Duration = Duration::from_secs(2);
/// After how much silence no write may start: the fence's 4 s (⅔ of the session timeout),
/// plus a second for the last commit before the silence and the loop's turn.
const FENCED_AFTER: Duration = Duration::from_secs(5);
/// Ports of the tests' nodes, four each, the relay on the fourth (all the relayed nodes' ports
/// are listed at `sessionflow_tests::relay::broker_behind_relay`).
const BLOCKED_PORT: u16 = 19570;
/// How late the node's answers come while the worker joins (see the gate test).
const SLOW_JOIN: Duration = Duration::from_millis(700);
const SILENT_PORT: u16 = 19648;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_the_coordinator_stops_answering_stops_writing_until_it_answers_again() {
    let (relay, node) = broker_behind_relay(SILENT_PORT).await;
    let brokers = node.bootstrap.clone();
    let topics = node.create_stage_topics("fence", PARTITIONS).await;
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        rate: Some(300.0),
        ..LoadgenOptions::new(&brokers, &topics.input, RECORDS, 200)
    };
    let load = tokio::spawn(async move { loadgen::run(&opts).await });
    let worker =
        WorkerProcess::spawn(&topics.stage_yaml_on(&brokers, "{latencyMs: 2, seed: 5}", ""));
    let outputs = || end_offsets_on(&brokers, &topics.output).iter().sum::<i64>();
    wait_until(Duration::from_secs(90), || outputs() >= 500)
        .await
        .expect("progress before the silence");

    let timed_out = RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT as i16;
    let silence_from = now_ms();
    relay.refuse(OFFSET_COMMIT, timed_out, usize::MAX);
    relay.refuse(OFFSET_FETCH, timed_out, usize::MAX);
    relay.delay_answers(SLOW);
    tokio::time::sleep(SILENCE).await;
    let refused = (relay.refused(OFFSET_COMMIT), relay.refused(OFFSET_FETCH));
    relay.accept(OFFSET_COMMIT);
    relay.accept(OFFSET_FETCH);
    relay.delay_answers(Duration::ZERO);
    let healed = now_ms();
    eprintln!("refused during the silence: {refused:?} (OffsetCommit, OffsetFetch)");
    assert!(refused.0 > 0, "no commit was answered \"timed out\"");

    load.await.unwrap().expect("loadgen");
    wait_committed_to_end_on(&brokers, &topics, Duration::from_secs(180))
        .await
        .unwrap_or_else(|(committed, end)| panic!("committed {committed:?} never reached {end:?}"));
    assert!(worker.terminate().success());

    let created = output_create_times(&brokers, &topics.output);
    let fenced_from = silence_from + FENCED_AFTER.as_millis() as i64;
    let before = created.iter().filter(|&&t| t < silence_from).count();
    let fenced = created
        .iter()
        .filter(|&&t| t >= fenced_from && t < healed)
        .count();
    let after = created.iter().filter(|&&t| t >= healed).count();
    eprintln!(
        "outputs created: {before} before the silence, {fenced} from {FENCED_AFTER:?} into it \
         until it ended, {after} after"
    );
    assert!(before > 0 && after > 0, "the worker wrote before and after");
    assert_eq!(
        fenced, 0,
        "outputs written while the coordinator had been silent for most of a session timeout"
    );
    let report = verify_on(&brokers, &topics);
    eprintln!("coordinator silent for {SILENCE:?}:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, RECORDS, "{report}");
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

/// The create time (ms since the epoch) of every record in `topic`.
fn output_create_times(brokers: &str, topic: &str) -> Vec<i64> {
    let ends = end_offsets_on(brokers, topic);
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", sessionflow_tests::unique("fence-reader"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..ends.len() as i32 {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    let wanted: i64 = ends.iter().sum();
    let mut times = Vec::with_capacity(wanted as usize);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while (times.len() as i64) < wanted && std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            if let Some(t) = m.timestamp().to_millis() {
                times.push(t);
            }
        }
    }
    assert_eq!(times.len() as i64, wanted, "every output read back");
    times
}

/// The fence is judged on a timer of its own, not only by the consumer loop, whose thread
/// blocks for seconds at a time in librdkafka calls: here the committed offsets an assignment
/// reads (OffsetFetch, which the coordinator's silence leaves unanswered until the worker's
/// 10 s read times out), the same way as the synchronous commit of a revocation while other
/// partitions keep writing. The gate must close while the loop is still blocked: the worker
/// says "writes stop" before it says "partition assigned" (which it logs once the read
/// returns). Judged by the loop alone, the gate closed only after the block, when the loop ran
/// again (seen fail that way with the fence's own thread not judging).
///
/// On Apache Kafka, a node of the test's own behind the tests' relay (`relay.rs`), which
/// holds the offset requests from the worker's first SyncGroup on: the coordinator's
/// connection hangs, heartbeats behind them too, so Kafka times the member's session out
/// meanwhile (its partitions are then lost, and it joins again once the relay lets the
/// requests through). Every answer of the node comes 700 ms late until then, so that the
/// worker's join always takes longer than a third of the session timeout, when its commit
/// thread asks the coordinator something: the join of a loaded machine, on which a hold from
/// the worker's start held that question, and the SyncGroup behind it (CI, stop 53).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_closes_while_the_consumer_loop_is_blocked() {
    let (relay, cluster) = broker_behind_relay(BLOCKED_PORT).await;
    let brokers = cluster.bootstrap.clone();
    let topics = cluster
        .create_stage_topics("fence-blocked", PARTITIONS)
        .await;
    const BLOCKED_RECORDS: u64 = 2_000;
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        ..LoadgenOptions::new(&brokers, &topics.input, BLOCKED_RECORDS, 50)
    };
    loadgen::run(&opts).await.expect("loadgen");
    // Silent from the worker's first SyncGroup on: its first assignment reads its committed
    // offsets into the silence, which holds the coordinator's connection (its heartbeats too)
    // until the relay lets the requests through. Not from its start: the worker's commit thread
    // asks the coordinator for an offset once it has heard nothing for a third of the session
    // timeout, and a join slower than that (a loaded machine) would have had that read held,
    // with the SyncGroup behind it on the same connection: no assignment at all (seen in CI).
    relay.hold_from(SYNC_GROUP, &[OFFSET_FETCH, OFFSET_COMMIT]);
    relay.delay_answers(SLOW_JOIN);
    let log = std::env::temp_dir().join(unique("fence-blocked") + ".log");
    let worker = WorkerProcess::spawn_logging_at(
        &topics.stage_yaml_on(&brokers, "{seed: 5}", ""),
        &[],
        std::fs::File::create(&log).expect("log file").into(),
        "sessionflow_worker=info",
    );
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let both = wait_until(Duration::from_secs(60), || {
        let said = read_log();
        said.contains("writes stop") && said.contains("partition assigned")
    })
    .await;
    let fetches_held = relay.requests_seen(OFFSET_FETCH);
    relay.delay_answers(Duration::ZERO);
    relay.release(&[OFFSET_FETCH, OFFSET_COMMIT]);
    let said = read_log();
    let intake: Vec<&str> = said.lines().filter(|l| l.contains("intake")).collect();
    eprintln!(
        "offset fetches held: {fetches_held}; the worker said:\n{}",
        intake.join("\n")
    );
    both.expect("the worker never both closed its gate and finished its assignment");
    // What the worker said before its assignment: its read of the committed offsets held
    // until it timed out, and the gate closed (last, if a slow join had closed and opened it
    // before) while the read was held.
    let before = &said[..said.find("partition assigned").expect("assigned")];
    assert!(
        before.contains("reading committed offsets failed"),
        "the assignment's read of the committed offsets was not held ({fetches_held} seen)"
    );
    let closed = before.rfind("writes stop");
    let reopened = before.rfind("writes resume");
    assert!(
        closed.is_some_and(|c| reopened.is_none_or(|r| c > r)),
        "the gate closed only after the consumer loop's blocking read had returned"
    );

    // And once the coordinator answers: writes resume, nothing lost.
    wait_committed_to_end_on(&brokers, &topics, Duration::from_secs(120))
        .await
        .unwrap_or_else(|(committed, end)| panic!("committed {committed:?} never reached {end:?}"));
    let _ = std::fs::remove_file(&log);
    assert!(worker.terminate().success());
    let report = verify_on(&brokers, &topics);
    eprintln!("{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(
        report.records - report.duplicates,
        BLOCKED_RECORDS,
        "{report}"
    );
}
