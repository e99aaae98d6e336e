//! Replay stays bounded when commits fail (issue 10, item 8), and done means acknowledged
//! (item 2), on Apache Kafka: each test has a node of its own behind the tests' relay
//! (`sessionflow_tests::relay`), whose refused `OffsetCommit` requests and delayed answers are
//! the injected faults. A refused commit never reaches the node, as with a coordinator that
//! answers with an error; the group's other requests (heartbeats, joins) go through.
//!
//! While every commit fails, the watermark the worker computes keeps moving, but what a crash
//! would replay is everything since the last commit the broker *confirmed*. So intake must be
//! held once that span reaches `maxInFlightPerPartition`; otherwise a worker that crashes after
//! a long commit outage replays its whole backlog.

use std::time::Duration;

use rdkafka::types::RDKafkaRespErr;
use sessionflow_tests::relay::{Relay, RelayedNode, OFFSET_COMMIT};
use sessionflow_tests::{
    end_offsets_on, verify_on, wait_committed_to_end_on, wait_until, ScriptCluster, Topics,
    WorkerProcess,
};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};

const PARTITIONS: i32 = 4;
const CAP: u64 = 100;
const RECORDS: u64 = 10_000;

/// The first port of each test's node (four each, the relay on the fourth; all the relayed
/// nodes' ports are listed at `sessionflow_tests::relay::broker_behind_relay`).
const OUTAGE_PORT: u16 = 19580;
const SLOW_ACK_PORT: u16 = 19584;
const FINAL_FAILS_PORT: u16 = 19588;
const FINAL_REBALANCING_PORT: u16 = 19592;
const FINAL_FENCED_PORT: u16 = 19596;

/// Kafka's error code for a librdkafka error that a broker sends.
fn code(error: RDKafkaRespErr) -> i16 {
    error as i16
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_commit_outage_replays_at_most_the_in_flight_cap() {
    let RelayedNode {
        relay,
        node: _node,
        brokers,
        topics,
    } = RelayedNode::start(OUTAGE_PORT, "outage", PARTITIONS).await;
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
    relay.refuse(
        OFFSET_COMMIT,
        code(RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS),
        5_000,
    );
    let outage_from = std::time::Instant::now();
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
    let refused = relay.refused(OFFSET_COMMIT);
    let outage = outage_from.elapsed().as_secs_f64();
    eprintln!(
        "commit outage from {at_outage} outputs: the worker went on to {last}, \
         {refused} commits refused in {outage:.1} s"
    );
    first.kill();
    relay.accept(OFFSET_COMMIT);
    assert!(
        refused > 0,
        "no commit was refused: the test did not test it"
    );
    // Refused commits are not sent again at once (`intake::commit_backoff`): a few a second at
    // most, where an early commit after each refusal sent thousands.
    let bound = 20 + (20.0 * outage) as usize;
    assert!(
        refused <= bound,
        "{refused} commits sent to a coordinator refusing them in {outage:.1} s (bound {bound})"
    );

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

/// Done means acknowledged (issue 10, item 2): with produce acks delayed well past the drain
/// timeout, a partition leaves the worker (a member joins), comes back to it (the member is
/// killed and times out), and then the worker itself is killed. A replay the worker's recent
/// event-id cache skipped while the earlier output was still unacknowledged would be committed
/// without any output: `verify` would find it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_that_comes_back_during_slow_acks_then_a_kill_loses_nothing() {
    let RelayedNode {
        relay,
        node: _node,
        brokers,
        topics,
    } = RelayedNode::start(SLOW_ACK_PORT, "slowack", 2).await;
    let records = 1_200;
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        rate: Some(200.0),
        ..LoadgenOptions::new(&brokers, &topics.input, records, 40)
    };
    let load = tokio::spawn(async move { loadgen::run(&opts).await });
    let outputs = || end_offsets_on(&brokers, &topics.output).iter().sum::<i64>() as u64;
    let yaml = topics.stage_yaml_on(
        &brokers,
        "{latencyMs: 5, seed: 3}",
        "rebalance: {strategy: eager, drainTimeoutMs: 300}\nsessionIdleMs: 60000",
    );
    let a = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(90), || outputs() >= 200)
        .await
        .expect("progress before the slow acks");
    // Every request now takes 1.5 s: produce acks outlast the 300 ms drain.
    relay.delay_answers(Duration::from_millis(1_500));
    let b = WorkerProcess::spawn(&yaml);
    tokio::time::sleep(Duration::from_secs(8)).await;
    // The joiner dies: after its session timeout its partitions come back to `a`.
    b.kill();
    tokio::time::sleep(Duration::from_secs(10)).await;
    relay.delay_answers(Duration::ZERO);
    a.kill();
    load.await.unwrap().expect("loadgen");

    let c = WorkerProcess::spawn(&yaml);
    wait_committed_to_end_on(&brokers, &topics, Duration::from_secs(180))
        .await
        .unwrap_or_else(|(committed, end)| panic!("committed {committed:?} never reached {end:?}"));
    assert!(c.terminate().success());
    let report = verify_on(&brokers, &topics);
    eprintln!("slow acks, partition back to the same worker, kill -9:\n{report}");
    assert_eq!(report.lost, 0, "{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, records, "{report}");
}

/// A final commit that fails for good is a failure of the run (issue 10, item 10): the
/// coordinator refuses every OffsetCommit when the worker is told to stop, so its last
/// progress cannot be committed; it must say so — exit non-zero, not "final watermarks
/// committed" and 0 — and lose nothing: the next worker replays from the last confirmed commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_commit_that_fails_for_good_exits_non_zero_and_loses_nothing() {
    let (relay, _node, brokers, topics, yaml) = stop_test(FINAL_FAILS_PORT, "final-fails", 6).await;
    let first = WorkerProcess::spawn(&yaml);
    wait_for_progress(&brokers, &topics).await;
    relay.refuse(
        OFFSET_COMMIT,
        code(RDKafkaRespErr::RD_KAFKA_RESP_ERR_COORDINATOR_NOT_AVAILABLE),
        100_000,
    );
    let status = first.terminate();
    assert!(
        !status.success(),
        "a stop whose final commit failed must not exit 0, got {status}"
    );
    assert!(relay.refused(OFFSET_COMMIT) > 0, "no commit was refused");
    relay.accept(OFFSET_COMMIT);

    restart_and_verify(&brokers, &topics, &yaml, "final commit refused").await;
}

/// A stop during a rebalance (issue 33): the broker refuses the final commit as
/// `RebalanceInProgress` for longer than the five seconds the final commit used to retry (2 of
/// ~19 SIGTERMs exited 1 this way). The worker keeps trying until its stop's own deadline, does
/// not send partitions already confirmed, and commits in the close's revocation: exit 0, and
/// the restart replays nothing the stop had finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_commit_refused_during_a_rebalance_is_retried_until_the_stops_deadline() {
    let (relay, _node, brokers, topics, yaml) =
        stop_test(FINAL_REBALANCING_PORT, "final-rebalancing", 8).await;
    let log = std::env::temp_dir().join(sessionflow_tests::unique("rebalancing-worker") + ".log");
    let first = WorkerProcess::spawn_logging_at(
        &yaml,
        &[],
        std::fs::File::create(&log).expect("log file").into(),
        "info",
    );
    wait_for_progress(&brokers, &topics).await;
    // About 25 tries fit in five seconds (a try every ~200 ms); these last three times as long.
    relay.refuse(
        OFFSET_COMMIT,
        code(RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS),
        80,
    );
    let status = first.terminate();
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    relay.accept(OFFSET_COMMIT);
    assert!(
        status.success(),
        "a stop whose final commit was refused for a while exits 0 once it lands, got {status}:\n{}",
        said.lines().filter(|l| l.contains("commit")).collect::<Vec<_>>().join("\n")
    );
    assert!(
        said.contains("final commit refused; serving the group and trying again"),
        "the final commit was never refused: the test did not test it"
    );
    // The stop committed everything it finished: the restart redoes nothing.
    let second = WorkerProcess::spawn(&yaml);
    wait_committed_to_end_on(&brokers, &topics, Duration::from_secs(180))
        .await
        .unwrap_or_else(|(committed, end)| panic!("committed {committed:?} never reached {end:?}"));
    assert!(second.terminate().success());
    let report = verify_on(&brokers, &topics);
    eprintln!("final commit refused during a rebalance, restart:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, STOP_RECORDS, "{report}");
    assert_eq!(
        report.duplicates, 0,
        "the restart redid what the stop had committed: {report}"
    );
}

/// A stop while the group has gone on without this member (issue 10, item 9): every commit
/// is refused as `IllegalGeneration` — the member's generation is gone, librdkafka reports
/// its assignment lost, and the worker drops it without a drain or a commit bound to fail.
/// That is no failure of the stop (exit 0; the lost partitions are logged), and nothing is
/// lost: their next owner replays from the last confirmed commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_after_the_group_went_on_without_the_member_exits_0_and_loses_nothing() {
    let (relay, _node, brokers, topics, yaml) =
        stop_test(FINAL_FENCED_PORT, "final-fenced", 7).await;
    let log = std::env::temp_dir().join(sessionflow_tests::unique("fenced-worker") + ".log");
    let first = WorkerProcess::spawn_logging(
        &yaml,
        &[],
        std::fs::File::create(&log).expect("log file").into(),
    );
    wait_for_progress(&brokers, &topics).await;
    relay.refuse(
        OFFSET_COMMIT,
        code(RDKafkaRespErr::RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION),
        100_000,
    );
    let status = first.terminate();
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert!(
        status.success(),
        "a fenced member's stop exits 0, got {status}:\n{said}"
    );
    assert!(
        said.contains("partitions lost"),
        "the lost partitions are logged:\n{said}"
    );
    relay.accept(OFFSET_COMMIT);

    restart_and_verify(
        &brokers,
        &topics,
        &yaml,
        "final commit refused as IllegalGeneration",
    )
    .await;
}

/// Records of each stop test.
const STOP_RECORDS: u64 = 2_000;

/// The start of a stop test: a two-partition node of its own on `port` behind a relay, with
/// [`STOP_RECORDS`] records of 50 sessions, and a worker config for it.
async fn stop_test(
    port: u16,
    name: &str,
    seed: u64,
) -> (Relay, ScriptCluster, String, Topics, String) {
    let RelayedNode {
        relay,
        node,
        brokers,
        topics,
    } = RelayedNode::start(port, name, 2).await;
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        ..LoadgenOptions::new(&brokers, &topics.input, STOP_RECORDS, 50)
    };
    loadgen::run(&opts).await.expect("loadgen");
    let yaml = topics.stage_yaml_on(&brokers, &format!("{{latencyMs: 5, seed: {seed}}}"), "");
    (relay, node, brokers, topics, yaml)
}

/// Waits until the first worker of a stop test has written a quarter of the outputs.
async fn wait_for_progress(brokers: &str, topics: &Topics) {
    let outputs = || end_offsets_on(brokers, &topics.output).iter().sum::<i64>() as u64;
    wait_until(Duration::from_secs(90), || outputs() >= STOP_RECORDS / 4)
        .await
        .expect("progress");
}

/// The end of a stop test: a second worker drains the input (committed = end), stops cleanly,
/// and `verify` finds nothing lost or out of order over the [`STOP_RECORDS`] produced.
async fn restart_and_verify(brokers: &str, topics: &Topics, yaml: &str, what: &str) {
    let second = WorkerProcess::spawn(yaml);
    wait_committed_to_end_on(brokers, topics, Duration::from_secs(180))
        .await
        .unwrap_or_else(|(committed, end)| panic!("committed {committed:?} never reached {end:?}"));
    assert!(second.terminate().success());
    let report = verify_on(brokers, topics);
    eprintln!("{what}, restart:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, STOP_RECORDS, "{report}");
}
