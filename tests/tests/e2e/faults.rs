//! Order and no loss under faults (issue 10). Most tests run on Apache Kafka: each on a node of
//! its own behind the tests' relay (`sessionflow_tests::relay`), which refuses the Produce
//! requests to the topic a test names and the OffsetCommit requests with the error it names,
//! and delays every answer; the tests that take a node down or move the group coordinator each
//! run on a three-node cluster of their own (`ClusterPipeline`); the panicking handler needs no
//! fault of the broker's and runs on the shared broker.
//!
//! The other end-to-end tests live in a world where every produce succeeds, every commit lands
//! and the broker never blinks. Real pipelines do not: a broker restarts, the output topic
//! refuses a batch, the DLQ is unavailable for a while, commits fail during a rebalance, the
//! group coordinator moves, acks are slow, a handler panics. Each test here injects one such
//! fault into a running worker and ends as every fault test must: `verify` finds nothing lost,
//! nothing out of order, no session ending on an older record than one it already wrote,
//! duplicates within the in-flight bound, and the group's committed offsets equal the input's
//! end offsets once the input is drained (lag 0 — what the operator's autoscaler sees; a
//! partition whose commits stop would never scale down).
//!
//! What librdkafka 2.12 does with the errors (seen in these tests): a refused Produce request
//! fails every partition's batch in it; librdkafka retries `NOT_ENOUGH_REPLICAS` and
//! `REQUEST_TIMED_OUT` itself (the idempotent producer keeps them unduplicated and in order);
//! `MSG_SIZE_TOO_LARGE` and `TOPIC_AUTHORIZATION_FAILED` fail the messages of the request and
//! bump the idempotent producer's epoch (after which librdkafka may reuse sequence numbers, and
//! Kafka then drop new batches as retries of old ones: the worker gives its writes to a new
//! producer, see [`an_output_refused_as_unauthorized_goes_to_the_dlq_in_order`]); `TOPIC_AUTHORIZATION_FAILED` also puts the topic in
//! an error state until the next metadata refresh, so the outputs queued meanwhile are refused
//! locally too. On OffsetCommit, librdkafka gives up on a manual async commit after
//! `REBALANCE_IN_PROGRESS`, `ILLEGAL_GENERATION` (the assignment is then lost and the member
//! rejoins) and `COORDINATOR_NOT_AVAILABLE` (after looking for the coordinator again) — and,
//! under rdkafka 0.39's `BaseConsumer`, tells the application nothing but a `COMMITFAIL` log
//! line (see [`commits_converge_after_failing_for_a_while`]). The mock cluster, where these
//! tests ran before, takes injected errors from one cluster-wide stack whatever the request's
//! topic, and checks no sequence numbers of an idempotent producer (see [`Pipeline::stage`]).

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::types::RDKafkaRespErr;
use sessionflow_tests::relay::{Relay, RelayedNode, OFFSET_COMMIT, PRODUCE};
use sessionflow_tests::{
    assert_replays_within, builtin, verify_on, wait_committed_to_end_on, wait_until, Gate,
    RecordingHandler, ScriptCluster, Topics,
};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};
use sessionflow_tools::verify::{read_topic, SeqRecord, VerifyReport};
use sessionflow_worker::record::header;
use sessionflow_worker::{HandlerError, RunningWorker, StageConfig};

/// Input (and output) partitions of every test.
const PARTITIONS: i32 = 4;
/// `maxInFlightPerPartition` of every test: the replay a rebalance may cause is at most what
/// was in flight, so this (times the partitions) bounds the duplicates.
const MAX_IN_FLIGHT: usize = 200;
/// The documented bound on duplicates in the output.
const REPLAY_BOUND: u64 = MAX_IN_FLIGHT as u64 * PARTITIONS as u64;
/// How long the committed offsets get to reach the end offsets once a fault is over.
const CONVERGE: Duration = Duration::from_secs(60);

/// Where a fault test runs: the brokers and the topics of one test.
struct Pipeline {
    brokers: String,
    topics: Topics,
}

impl Pipeline {
    /// A stage with Kafka's smallest session timeout (6 s; a join then takes about 3 s), and
    /// one Produce request in flight per connection, as the chaos run's mock workers have: the
    /// mock checks no sequence numbers of an idempotent producer, and a request failed with
    /// `REQUEST_TIMED_OUT` followed by one that succeeds makes librdkafka count the first as
    /// stored ("implicit ack") when the mock never stored it (RELIABILITY.md, *Limits of the
    /// mock cluster*; one output lost that way on 6 Dec, when the produce-error tests ran on
    /// the mock).
    fn stage(&self) -> StageConfig {
        stage_on(&self.brokers, &self.topics)
    }

    /// Produces `per_session` numbered records for each of `sessions` sessions named
    /// `<prefix><n>`, interleaved.
    async fn produce(&self, prefix: &str, sessions: u64, per_session: u64) {
        produce_on(&self.brokers, &self.topics, prefix, sessions, per_session).await;
    }

    fn read(&self, topic: &str) -> Vec<SeqRecord> {
        read_topic(&self.brokers, topic, None, Duration::from_secs(60)).expect("read topic")
    }

    /// The end of every fault test ([`settle_on`]).
    async fn settle(&self, worker: RunningWorker) -> VerifyReport {
        settle_on(&self.brokers, &self.topics, worker).await
    }
}

/// A three-node Apache Kafka cluster of the test's own (`scripts/kafka.sh --nodes 3` on `port`
/// … `port + 11`), with topics of three replicas (`min.insync.replicas` 2): a node can go down
/// and the partitions it led move to the others. The tests that use one run one at a time
/// (nextest's `kafka-clusters` group). It must outlive the test's workers.
struct ClusterPipeline {
    cluster: ScriptCluster,
    pipeline: Pipeline,
}

impl std::ops::Deref for ClusterPipeline {
    type Target = Pipeline;
    fn deref(&self) -> &Pipeline {
        &self.pipeline
    }
}

impl ClusterPipeline {
    /// From a multi-thread runtime (the script blocks while the nodes start).
    async fn new(name: &str, port: u16) -> Self {
        let cluster = tokio::task::block_in_place(|| ScriptCluster::start(port, &["--nodes", "3"]));
        let topics = cluster
            .create_replicated_stage_topics(name, PARTITIONS, 3)
            .await;
        Self {
            pipeline: Pipeline {
                brokers: cluster.bootstrap.clone(),
                topics,
            },
            cluster,
        }
    }

    /// The node id of the group's coordinator now.
    fn coordinator(&self) -> i32 {
        tokio::task::block_in_place(|| self.cluster.group_coordinator(&self.topics.group))
    }

    /// The node ids leading each partition of `topic` now.
    fn leaders(&self, topic: &str) -> Vec<i32> {
        tokio::task::block_in_place(|| self.cluster.leaders(topic))
    }

    /// Takes node `id` down (a crash, or a controlled shutdown when `controlled`) and returns
    /// once its process is gone; the in-process worker's runtime threads are not blocked.
    fn take_down(&self, id: i32, controlled: bool) {
        let i = (id - 1) as usize;
        tokio::task::block_in_place(|| {
            if controlled {
                self.cluster.stop_node(i);
            } else {
                self.cluster.kill_node(i);
            }
        });
    }

    /// Shuts the group coordinator's node down (controlled: its leaderships move first) and
    /// returns the nodes the coordinator moved from and to; fails if it did not move.
    fn move_coordinator(&self) -> (i32, i32) {
        let from = self.coordinator();
        self.take_down(from, true);
        let to = self.coordinator();
        assert_ne!(
            from, to,
            "the coordinator did not move off a node that shut down"
        );
        (from, to)
    }

    fn bring_back(&self, id: i32) {
        tokio::task::block_in_place(|| self.cluster.restart_node((id - 1) as usize));
    }

    /// Produces `sessions` × `per_session` records of sessions named `<prefix><n>` (as
    /// [`Pipeline::produce`]) at `rate` a second in the background, so that a fault meets
    /// records still coming.
    fn produce_paced(
        &self,
        prefix: &str,
        sessions: u64,
        per_session: u64,
        rate: f64,
    ) -> tokio::task::JoinHandle<()> {
        let opts = LoadgenOptions {
            rate: Some(rate),
            ..load(&self.brokers, &self.topics, prefix, sessions, per_session)
        };
        tokio::spawn(async move {
            loadgen::run(&opts).await.expect("loadgen");
        })
    }
}

/// An Apache Kafka node of the test's own on `port` behind the tests' relay, which refuses the
/// requests a test names and delays answers (`sessionflow_tests::relay`), with the topics of
/// one test: input and output of [`PARTITIONS`] partitions, a DLQ of one. It must outlive the
/// test's workers. Each test's port is its own (four each from 19600 on; all the relayed
/// nodes' ports are listed at `sessionflow_tests::relay::broker_behind_relay`).
struct RelayedPipeline {
    relay: Relay,
    _node: ScriptCluster,
    pipeline: Pipeline,
}

impl std::ops::Deref for RelayedPipeline {
    type Target = Pipeline;
    fn deref(&self) -> &Pipeline {
        &self.pipeline
    }
}

impl RelayedPipeline {
    async fn new(name: &str, port: u16) -> Self {
        let RelayedNode {
            relay,
            node,
            brokers,
            topics,
        } = RelayedNode::start(port, name, PARTITIONS).await;
        Self {
            relay,
            _node: node,
            pipeline: Pipeline { brokers, topics },
        }
    }
}

/// The first port of each relayed test's node ([`RelayedPipeline`]).
const COMMIT_REBALANCING_PORT: u16 = 19600;
const COMMIT_GENERATION_PORT: u16 = 19604;
const COMMIT_COORDINATOR_PORT: u16 = 19608;
const RETRIABLE_PORT: u16 = 19612;
const TOO_LARGE_PORT: u16 = 19616;
const UNAUTHORIZED_PORT: u16 = 19620;
const DLQ_RETRIABLE_PORT: u16 = 19624;
const DLQ_REFUSED_PORT: u16 = 19628;
const DLQ_BLOCKED_PORT: u16 = 19632;
const SLOW_ACKS_PORT: u16 = 19636;
/// The first port of each three-node cluster ([`ClusterPipeline`], twelve ports each).
const LEADER_DOWN_PORT: u16 = 19660;
const COORDINATOR_DOWN_PORT: u16 = 19672;
const COORDINATOR_MOVED_PORT: u16 = 19684;
const COORDINATOR_MOVED_EOS_PORT: u16 = 19696;

/// Kafka's error code for a librdkafka error that a broker sends.
fn code(error: RDKafkaRespErr) -> i16 {
    error as i16
}

/// Kafka's error codes for librdkafka errors that a broker sends.
fn codes(errors: &[RDKafkaRespErr]) -> Vec<i16> {
    errors.iter().map(|&e| code(e)).collect()
}

/// The stage of every fault test ([`Pipeline::stage`]), on `brokers`.
fn stage_on(brokers: &str, topics: &Topics) -> StageConfig {
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.brokers = brokers.to_string();
    stage.max_in_flight_per_partition = MAX_IN_FLIGHT;
    stage
        .kafka
        .insert("session.timeout.ms".into(), "6000".into());
    stage
        .kafka
        .insert("heartbeat.interval.ms".into(), "200".into());
    stage
        .kafka
        .insert("max.in.flight.requests.per.connection".into(), "1".into());
    stage
}

/// Produces `per_session` numbered records for each of `sessions` sessions named
/// `<prefix><n>`, interleaved, to the input of `topics` on `brokers`.
async fn produce_on(brokers: &str, topics: &Topics, prefix: &str, sessions: u64, per_session: u64) {
    loadgen::run(&load(brokers, topics, prefix, sessions, per_session))
        .await
        .expect("loadgen");
}

/// What [`produce_on`] produces, as the load generator's options (as fast as the broker takes
/// them; `rate` paces them).
fn load(
    brokers: &str,
    topics: &Topics,
    prefix: &str,
    sessions: u64,
    per_session: u64,
) -> LoadgenOptions {
    LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        session_prefix: prefix.into(),
        ..LoadgenOptions::new(brokers, &topics.input, sessions * per_session, sessions)
    }
}

/// The end of every fault test: the group's committed offsets reach the input's end offsets
/// while the worker still runs (idle partitions included), the worker stops cleanly, and
/// `verify` finds nothing lost, out of order or ending stale, and duplicates within
/// [`REPLAY_BOUND`].
async fn settle_on(brokers: &str, topics: &Topics, worker: RunningWorker) -> VerifyReport {
    let converged = wait_committed_to_end_on(brokers, topics, CONVERGE).await;
    let (commit_errors, produce_errors) = (
        worker.metrics.commit_errors.get(),
        worker.metrics.produce_errors.get(),
    );
    eprintln!(
        "records in {}, out {}, retries {}, produce errors {produce_errors}, \
         commit errors {commit_errors}",
        worker.metrics.records_in.get(),
        worker.metrics.records_out.get(),
        worker.metrics.retries.get(),
    );
    let commit_metrics: Vec<String> = worker
        .metrics
        .render()
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("commit"))
        .map(str::to_string)
        .collect();
    eprintln!("commit metrics: {commit_metrics:?}");
    if let Err((committed, end)) = converged {
        panic!(
            "committed {committed:?} never reached the end offsets {end:?} \
             (commit errors counted: {commit_errors})"
        );
    }
    worker.shutdown().await.expect("clean shutdown");
    let report = verify_on(brokers, topics);
    eprintln!("{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.stale_ends, 0, "{report}");
    assert_replays_within(&report, REPLAY_BOUND);
    report
}

/// A handler that writes `session:seq` and takes `delay` per record, so a run lasts long
/// enough for a fault to land in the middle of it.
fn slow_pass_through(delay: Duration) -> RecordingHandler {
    RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .with_delay(move |_, _| delay)
}

/// Waits until the worker has written `n` outputs: the fault then lands mid-run.
async fn wait_for_outputs(worker: &RunningWorker, n: u64) {
    wait_until(Duration::from_secs(60), || {
        worker.metrics.records_out.get() >= n
    })
    .await
    .unwrap_or_else(|_| panic!("fewer than {n} outputs written"));
}

/// Handler-side order problems. A rebalance replays records legitimately (the handler then
/// sees a session's earlier seq again), so tests with rebalances print these instead of
/// asserting them, and rely on `verify` for the output's order.
fn print_order_problems(handler: &RecordingHandler) {
    let problems = handler.order_problems();
    eprintln!(
        "handler-side order problems (replays after a rebalance show here): {} {:?}",
        problems.len(),
        problems.iter().take(5).collect::<Vec<_>>()
    );
}

// ---- broker down ----------------------------------------------------------------------------

/// A node that leads input and output partitions crashes (`kill -9`) mid-run while records
/// are still coming, and is started again a few seconds later: the partitions it led move to
/// the other two nodes (once the controller fences it), fetches and produces to it stall
/// meanwhile, the producer keeps the outputs queued, nothing is skipped. With `coordinator_too`
/// the node is the group's coordinator and stays down longer than the session timeout:
/// heartbeats and commits stall as well, the coordinator moves, and the member may be evicted
/// and rejoin (a rebalance, and the replays it may cause).
async fn broker_down_for_a_few_seconds(name: &str, port: u16, coordinator_too: bool) {
    let p = ClusterPipeline::new(name, port).await;
    let load = p.produce_paced("session-", 40, 50, 250.0);
    let handler = slow_pass_through(Duration::from_millis(30));
    let worker = sessionflow_worker::start(p.stage(), handler.clone())
        .await
        .unwrap();
    wait_for_outputs(&worker, 300).await;
    let coordinator = p.coordinator();
    let (inputs, outputs) = (p.leaders(&p.topics.input), p.leaders(&p.topics.output));
    // Otherwise the node leading the most input and output partitions, of the other two.
    let down = if coordinator_too {
        coordinator
    } else {
        (1..=3)
            .filter(|&n| n != coordinator)
            .max_by_key(|n| inputs.iter().chain(&outputs).filter(|l| *l == n).count())
            .unwrap()
    };
    eprintln!(
        "leaders: input {inputs:?}, output {outputs:?}; coordinator {coordinator}; node {down} \
         goes down"
    );
    let out_at_down = worker.metrics.records_out.get();
    p.take_down(down, false);
    let outage = if coordinator_too { 8 } else { 4 };
    tokio::time::sleep(Duration::from_secs(outage)).await;
    eprintln!(
        "node {down} (coordinator: {coordinator_too}) down for {outage} s: outputs {out_at_down} \
         → {} meanwhile; leaders now: input {:?}, output {:?}",
        worker.metrics.records_out.get(),
        p.leaders(&p.topics.input),
        p.leaders(&p.topics.output),
    );
    p.bring_back(down);
    load.await.unwrap();
    let report = p.settle(worker).await;
    assert_eq!(report.records, 2_000 + report.duplicates, "{report}");
    assert_eq!(report.dlq_records, 0, "{report}");
    print_order_problems(&handler);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_leader_down_for_a_few_seconds_loses_nothing() {
    broker_down_for_a_few_seconds("leader-down", LEADER_DOWN_PORT, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_broker_down_for_a_few_seconds_loses_nothing() {
    broker_down_for_a_few_seconds("coordinator-down", COORDINATOR_DOWN_PORT, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retriable_produce_errors_on_the_output_are_retried_in_order() {
    use RDKafkaRespErr::*;
    let p = RelayedPipeline::new("produce-retriable", RETRIABLE_PORT).await;
    p.produce("session-", 40, 25).await;
    let handler = slow_pass_through(Duration::from_millis(20));
    let worker = sessionflow_worker::start(p.stage(), handler.clone())
        .await
        .unwrap();
    wait_for_outputs(&worker, 100).await;
    let errors = [
        RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
    ];
    // Only the output's requests are refused (the input is written, the DLQ idle).
    p.relay.refuse_produce(&p.topics.output, &codes(&errors));
    let metrics = worker.metrics.clone();
    let report = p.settle(worker).await;
    assert_eq!(
        p.relay.refused(PRODUCE),
        errors.len(),
        "every error was sent"
    );
    assert_eq!(
        metrics.produce_errors.get(),
        0,
        "librdkafka retried them all"
    );
    assert_eq!(report.dlq_records, 0, "{report}");
    assert_eq!(
        (report.records, report.duplicates),
        (1_000, 0),
        "idempotent retries neither lose nor duplicate: {report}"
    );
    handler.assert_in_order();
}

/// Records of sessions that have a later record in the output written before their dead
/// letter was: output n+1 visible downstream before n's fate was settled (issue 10, item 3).
/// Compares the records' create times (set when each was handed to the producer).
fn outputs_ahead_of_their_dead_letter(output: &[SeqRecord], dlq: &[SeqRecord]) -> Vec<String> {
    let mut ahead = Vec::new();
    for d in dlq {
        let (Some(session), Some(seq), Some(dead_at)) = (&d.session, d.seq, d.timestamp_ms) else {
            continue;
        };
        for o in output {
            if o.session.as_ref() == Some(session)
                && o.seq.is_some_and(|q| q > seq)
                && o.timestamp_ms.is_some_and(|t| t < dead_at)
            {
                ahead.push(format!(
                    "{session}: output of seq {} written {} ms before the dead letter of seq {seq}",
                    o.seq.unwrap_or_default(),
                    dead_at - o.timestamp_ms.unwrap_or_default()
                ));
            }
        }
    }
    ahead
}

/// A permanent Produce `error`, once, mid-run: the records of the refused request go to the
/// DLQ as `produce-failed` (nothing else does), every other output lands, and no later output
/// of their sessions was written before their dead letter (issue 10, item 3).
///
/// Which request receives the error: the next Produce request to the output after the
/// injection, carrying the batch the producer had lingered for one output partition:
/// typically a few records of as many sessions.
async fn refused_outputs_go_to_the_dlq_in_order(p: &RelayedPipeline, error: RDKafkaRespErr) {
    p.produce("session-", 40, 25).await;
    let handler = slow_pass_through(Duration::from_millis(20));
    let worker = sessionflow_worker::start(p.stage(), handler.clone())
        .await
        .unwrap();
    wait_for_outputs(&worker, 100).await;
    // Slow answers, so that the refusal comes back after the sessions' next records were
    // handled: whether their outputs may go out before it is what this test is about.
    p.relay.delay_answers(Duration::from_millis(300));
    p.relay.refuse_produce(&p.topics.output, &[code(error)]);
    wait_until(Duration::from_secs(60), || {
        worker.metrics.produce_errors.get() > 0
    })
    .await
    .expect("the refused request's records are reported");
    tokio::time::sleep(Duration::from_secs(1)).await;
    p.relay.delay_answers(Duration::ZERO);
    let metrics = worker.metrics.clone();
    let report = p.settle(worker).await;
    let produce_errors = metrics.produce_errors.get();
    let dlq = p.read(&p.topics.dlq);
    let output = p.read(&p.topics.output);
    eprintln!(
        "refused outputs: {} (produce errors {produce_errors}, producers replaced {}, writes \
         taken back {}): {:?}",
        dlq.len(),
        metrics.producers_replaced.get(),
        metrics.writes_taken_back.get(),
        dlq.iter()
            .map(|d| format!(
                "{}:{}",
                d.session.as_deref().unwrap_or("?"),
                d.seq.unwrap_or(0)
            ))
            .collect::<Vec<_>>()
    );
    assert!(
        !dlq.is_empty(),
        "the refused request's records are in the DLQ"
    );
    for d in &dlq {
        assert_eq!(
            d.header(header::DLQ_REASON),
            Some("produce-failed"),
            "{d:?}"
        );
    }
    assert_eq!(dlq.len() as u64, produce_errors);
    assert!(
        metrics.producers_replaced.get() >= 1,
        "the producer that had a write refused took the later writes too"
    );
    assert_eq!(report.records + report.dlq_records, 1_000, "{report}");
    let ahead = outputs_ahead_of_their_dead_letter(&output, &dlq);
    assert!(
        ahead.is_empty(),
        "{} later outputs were written before their session's dead letter: {:?}",
        ahead.len(),
        &ahead[..ahead.len().min(10)]
    );
    handler.assert_in_order();
}

/// Kafka refuses a batch as too large for it (a broker whose `message.max.bytes` is below the
/// producer's): the batch's records go to the DLQ, nothing else is lost. (After the refusal
/// the worker writes through a new producer: see the next test. With the old one kept, this
/// test lost a batch of outputs once in 13 runs beside other fault tests, on 7 Dec; its path
/// was not found, the unauthorized one's was.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_refused_as_too_large_goes_to_the_dlq_in_order() {
    let p = RelayedPipeline::new("produce-too-large", TOO_LARGE_PORT).await;
    refused_outputs_go_to_the_dlq_in_order(
        &p,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE,
    )
    .await;
}

/// librdkafka also puts the topic in an error state on this one until its next metadata
/// refresh (about a second here), so outputs queued meanwhile are refused too: more records
/// than the one request's go to the DLQ, each accounted for as `produce-failed`.
///
/// Where the worker's producer replacement (`output::producer_slot`) comes from: with one
/// producer for the whole run, this test lost a batch of outputs librdkafka had reported
/// delivered (10 or 11 records of as many sessions) in 6 of 8 runs beside five other fault
/// tests on 7 Dec (the command in RELIABILITY.md, *What failed, and how*): librdkafka 2.12.1,
/// after its epoch bump, restored the topic's pre-bump producer state when the topic came
/// back, bumped it again and sent a new batch with sequence numbers it had already used, which
/// Kafka answered as a retry of the batch it had stored. With a new producer after the
/// refusal: 0 in 8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_refused_as_unauthorized_goes_to_the_dlq_in_order() {
    let p = RelayedPipeline::new("produce-unauthorized", UNAUTHORIZED_PORT).await;
    refused_outputs_go_to_the_dlq_in_order(
        &p,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
    )
    .await;
}

// ---- produce errors on the DLQ --------------------------------------------------------------

/// Poison sessions (every record poison, prefix `bad-`) write only dead letters. Their first
/// records are held until the ordinary sessions are done, and then the DLQ's requests get
/// `errors`, one each. Every poison record must land in the DLQ exactly once, every ordinary
/// record in the output.
async fn dead_letters_survive(name: &str, port: u16, errors: &[RDKafkaRespErr]) {
    let p = RelayedPipeline::new(name, port).await;
    p.produce("ok-", 20, 10).await;
    p.produce("bad-", 8, 10).await;
    let gate = Gate::default();
    let handler = RecordingHandler::new(|s, q, _| {
        if s.starts_with("bad-") {
            Err(HandlerError::Poison(format!("cannot parse {s}:{q}")))
        } else {
            Ok(Some(format!("{s}:{q}").into_bytes()))
        }
    })
    .holding(|s, q| s.starts_with("bad-") && q == 1, gate.clone());
    let worker = sessionflow_worker::start(p.stage(), handler.clone())
        .await
        .unwrap();
    // Every output acknowledged (counted on its ack): from now on only the DLQ is written.
    wait_for_outputs(&worker, 200).await;
    p.relay.refuse_produce(&p.topics.dlq, &codes(errors));
    gate.open();
    let metrics = worker.metrics.clone();
    let report = p.settle(worker).await;
    eprintln!(
        "dead letters counted: {}",
        metrics.dlq.with_label_values(&["poison"]).get()
    );
    assert_eq!(
        p.relay.refused(PRODUCE),
        errors.len(),
        "every error was sent"
    );

    let dlq = p.read(&p.topics.dlq);
    let mut landed: HashMap<(String, u64), usize> = HashMap::new();
    for d in &dlq {
        assert_eq!(d.header(header::DLQ_REASON), Some("poison"), "{d:?}");
        *landed
            .entry((d.session.clone().unwrap(), d.seq.unwrap()))
            .or_default() += 1;
    }
    let mut expected = Vec::new();
    for s in 0..8 {
        for q in 1..=10 {
            expected.push((format!("bad-{s:06}"), q));
        }
    }
    let missing: Vec<_> = expected
        .iter()
        .filter(|k| !landed.contains_key(k))
        .collect();
    let twice: Vec<_> = landed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        missing.is_empty(),
        "poison records not in the DLQ: {missing:?}"
    );
    assert!(
        twice.is_empty(),
        "poison records in the DLQ twice: {twice:?}"
    );
    assert_eq!(dlq.len(), 80);
    // A session's next record is handled only once the previous one has gone to the DLQ,
    // acknowledged (guarantee 1, "done means acknowledged"): its dead letters are in order.
    let mut last: HashMap<&str, u64> = HashMap::new();
    let mut inversions = 0;
    for d in &dlq {
        let (s, q) = (d.session.as_deref().unwrap(), d.seq.unwrap());
        if last.get(s).is_some_and(|&prev| prev > q) {
            inversions += 1;
        }
        last.insert(s, q);
    }
    assert_eq!(
        inversions, 0,
        "dead letters out of session order in the DLQ"
    );
    assert_eq!(report.records, 200, "{report}");
    handler.assert_in_order();
}

/// A burst of retriable Produce errors while poison records are dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retriable_dlq_produce_errors_lose_no_dead_letter() {
    use RDKafkaRespErr::*;
    dead_letters_survive(
        "dlq-retriable",
        DLQ_RETRIABLE_PORT,
        &[
            RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
            RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
            RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
            RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
            RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
            RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        ],
    )
    .await;
}

/// A DLQ write the broker refuses (permanently, as far as librdkafka knows) once: the worker
/// writes the dead letter again until it lands (issue 10, item 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_dlq_write_is_written_again() {
    use RDKafkaRespErr::*;
    dead_letters_survive(
        "dlq-refused",
        DLQ_REFUSED_PORT,
        &[
            RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
            RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE,
        ],
    )
    .await;
}

/// A DLQ the broker refuses for a while (issue 10, item 4): while a dead letter cannot be
/// written the worker says so — not ready, `sessionflow_blocked_writes` up, the refusals
/// counted, and the record reported by the stuck timer — keeps trying, and once the broker
/// takes writes again the dead letters land (each once), readiness comes back and the group
/// commits to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dlq_refused_for_a_while_makes_the_worker_unready_and_reports_the_stuck_record() {
    let p = RelayedPipeline::new("dlq-blocked", DLQ_BLOCKED_PORT).await;
    // 20 sessions: every partition gets some (an empty one would never be committed).
    p.produce("bad-", 20, 1).await;
    let mut stage = p.stage();
    stage.settings.stuck.get_or_insert_default().timeout_ms = 1_000;
    let handler =
        RecordingHandler::new(|s, q, _| Err(HandlerError::Poison(format!("cannot parse {s}:{q}"))));
    // Every write to the DLQ is refused as too large (only dead letters are written here).
    p.relay.refuse_produce(
        &p.topics.dlq,
        &[code(RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE); 10_000],
    );
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    let m = worker.metrics.clone();
    wait_until(Duration::from_secs(60), || {
        m.blocked_writes.get() > 0 && m.dlq_write_errors.get() >= 20 && m.stuck_records.get() > 0
    })
    .await
    .unwrap_or_else(|()| {
        panic!(
            "blocked {}, dlq write errors {}, stuck {}",
            m.blocked_writes.get(),
            m.dlq_write_errors.get(),
            m.stuck_records.get()
        )
    });
    assert!(
        !worker.health.is_ready(),
        "not ready while a dead letter is refused"
    );
    assert_eq!(m.dlq.with_label_values(&["poison"]).get(), 0);
    p.relay.accept(PRODUCE);
    wait_until(Duration::from_secs(60), || {
        m.blocked_writes.get() == 0 && worker.health.is_ready()
    })
    .await
    .expect("ready again once the dead letters land");
    let report = p.settle(worker).await;
    assert_eq!(report.dlq_records, 20, "{report}");
    let dlq = p.read(&p.topics.dlq);
    let mut seen: HashMap<(String, u64), usize> = HashMap::new();
    for d in &dlq {
        *seen
            .entry((d.session.clone().unwrap(), d.seq.unwrap()))
            .or_default() += 1;
    }
    assert_eq!(seen.len(), 20, "every poison record dead-lettered");
    assert!(
        seen.values().all(|&n| n == 1),
        "each exactly once: {seen:?}"
    );
    handler.assert_in_order();
}

// ---- commit errors --------------------------------------------------------------------------

/// OffsetCommit fails with `error` from the start until every record has been processed, and
/// for two seconds more; then the errors are cleared. With no new record arriving (every
/// partition idle), the committed offsets must still reach the end offsets: a watermark counts
/// as committed only once the broker confirmed it (issue 10, item 7). And the failures are
/// counted: with rdkafka 0.39's `BaseConsumer` the outcome of an *async* manual commit never
/// reaches `ConsumerContext::commit_callback` (the client runs on librdkafka's event API
/// without an `offset_commit_cb`, and `rd_kafka_commit(.., async)` passes no reply queue), so
/// librdkafka only logs `COMMITFAIL` — the log line of the issue — and a worker that waits for
/// that callback waits forever.
///
/// `ILLEGAL_GENERATION` is different: librdkafka takes it as "this member was fenced" and
/// rejoins, reporting the assignment *lost*, which the worker must drop without a drain
/// (issue 10, item 9). Injected on every commit, it would fence the member forever and no
/// record could ever finish; so it is injected as a burst of `count` errors, and the records
/// are finished by the member once it is back.
///
/// On Apache Kafka ([`RelayedPipeline`]): the relay answers the worker's `OffsetCommit`
/// requests with `error` itself (the node never sees them) while the group's other requests go
/// through.
async fn commits_converge_after_failing_for_a_while(
    name: &str,
    port: u16,
    error: RDKafkaRespErr,
    count: usize,
) {
    let p = RelayedPipeline::new(name, port).await;
    p.produce("session-", 20, 25).await;
    p.relay.refuse(OFFSET_COMMIT, code(error), count);
    let handler = slow_pass_through(Duration::from_millis(10));
    let worker = sessionflow_worker::start(p.stage(), handler.clone())
        .await
        .unwrap();
    wait_until(Duration::from_secs(120), || {
        worker.metrics.records_out.get() >= 500 && worker.metrics.in_flight.get() == 0
    })
    .await
    .expect("every record processed while commits fail");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let committed_while_failing =
        sessionflow_tests::committed_offsets_on(&p.brokers, &p.topics.group, &p.topics.input);
    let commit_errors = worker.metrics.commit_errors.get();
    let refused = p.relay.refused(OFFSET_COMMIT);
    eprintln!(
        "while commits failed ({error:?}): committed {committed_while_failing:?}, \
         commit errors counted {commit_errors}, commits refused {refused}"
    );
    p.relay.accept(OFFSET_COMMIT);
    p.settle(worker).await;
    print_order_problems(&handler);
    assert!(
        refused > 0,
        "no commit was refused: the test did not test it"
    );
    // librdkafka gave up on those commits (it logs COMMITFAIL for each): failures the worker
    // must count, however librdkafka reports them.
    assert!(
        commit_errors > 0,
        "commits failed for seconds ({error:?}) and sessionflow_commit_errors_total stayed 0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_converge_after_rebalance_in_progress_errors() {
    commits_converge_after_failing_for_a_while(
        "commit-rebalancing",
        COMMIT_REBALANCING_PORT,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS,
        10_000,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_converge_after_illegal_generation_errors() {
    commits_converge_after_failing_for_a_while(
        "commit-generation",
        COMMIT_GENERATION_PORT,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION,
        3,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_converge_after_the_coordinator_was_unavailable() {
    commits_converge_after_failing_for_a_while(
        "commit-coordinator",
        COMMIT_COORDINATOR_PORT,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_COORDINATOR_NOT_AVAILABLE,
        10_000,
    )
    .await;
}

// ---- coordinator moved ----------------------------------------------------------------------

/// The group coordinator moves to another node mid-run, twice, as in a rolling restart: its
/// node shuts down in a controlled way (the controller moves its leaderships, the group's
/// `__consumer_offsets` partition among them, before it exits), the old coordinator answers
/// `NOT_COORDINATOR` meanwhile, the client finds the new one, and heartbeats and commits carry
/// on there; the node is then started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_moving_mid_run_loses_nothing() {
    let p = ClusterPipeline::new("coordinator-moved", COORDINATOR_MOVED_PORT).await;
    // 40 s of records: a move (a controlled shutdown, then the node's start) took ~4 s here,
    // and each must begin while records still come (until 8 Dec the second came after them).
    let load = p.produce_paced("session-", 40, 100, 100.0);
    let handler = slow_pass_through(Duration::from_millis(30));
    let worker = sessionflow_worker::start(p.stage(), handler.clone())
        .await
        .unwrap();
    for outputs in [300, 2_000] {
        wait_for_outputs(&worker, outputs).await;
        let at = worker.metrics.records_out.get();
        assert!(
            !load.is_finished(),
            "the records were all in before the move at {at} outputs"
        );
        let (from, to) = p.move_coordinator();
        p.bring_back(from);
        eprintln!(
            "the coordinator moved from node {from} to node {to} at {at} outputs (node back at {})",
            worker.metrics.records_out.get()
        );
    }
    load.await.unwrap();
    let report = p.settle(worker).await;
    assert_eq!(report.records, 4_000 + report.duplicates, "{report}");
    print_order_problems(&handler);
}

/// The coordinator's node shut down under an `exactlyOnce` stage. The group coordinator is also
/// where each transaction's offsets go (`TxnOffsetCommit`), and librdkafka 2.12 waits for ever
/// in `send_offsets_to_transaction` when the coordinator it has cached has left the cluster's
/// metadata (issues #5456 and #5511: its coordinator request has no timeout, and nothing makes
/// it look again); the chaos suite met it after a controlled shutdown of the coordinator's
/// node. Here: records, until every partition has committed (each producer has the
/// coordinator cached); the coordinator's node shut down while the producers idle; 12 s later
/// (the node long gone from the metadata) more records, the node started again 4 s into them.
/// Every partition's offsets call then hangs (4 of 4 in each run so far) until its 35 s
/// deadline; the producer must be replaced (the next one with its transactional id fences it
/// and aborts what it held) and the partition rewound, with the worker running on: no fatal
/// error, every record once in the read_committed output, the group committed to the end.
/// Until 8 Dec the worker stopped there (and does with the replacement left out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_moving_under_an_exactly_once_stage_stops_nothing() {
    // The worker's log on stderr with `SESSIONFLOW_TEST_LOG=1` (the hang shows there).
    sessionflow_tests::init_telemetry();
    let p = ClusterPipeline::new("coordinator-moved-eos", COORDINATOR_MOVED_EOS_PORT).await;
    let mut stage = p.stage();
    stage.settings.delivery = Some(sessionflow_worker::config::Delivery::ExactlyOnce);
    let handler = slow_pass_through(Duration::from_millis(5));
    let worker = sessionflow_worker::start(stage, handler).await.unwrap();
    // Every partition's producer commits once, and finds the coordinator.
    p.produce_paced("before-", 40, 25, 500.0).await.unwrap();
    wait_committed_to_end_on(&p.brokers, &p.topics, CONVERGE)
        .await
        .expect("the first records committed");
    // The coordinator's node leaves while the producers idle: each still has it cached when
    // the next records come.
    let (from, to) = p.move_coordinator();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let load = p.produce_paced("after-", 40, 25, 150.0);
    tokio::time::sleep(Duration::from_secs(4)).await;
    p.bring_back(from);
    eprintln!(
        "the coordinator moved from node {from} to node {to}; {} outputs",
        worker.metrics.records_out.get()
    );
    load.await.unwrap();
    let fatal = worker.metrics.fatal_errors.clone();
    let commit_aborts = worker
        .metrics
        .transactions
        .with_label_values(&["aborted", "commit"]);
    let report = p.settle(worker).await;
    assert_eq!(fatal.get(), 0, "the worker stopped on a fatal error");
    // The path under test was taken: a commit failed (the offsets call given up) and aborted.
    assert!(
        commit_aborts.get() > 0,
        "no commit failed: the coordinator's move did not hang the offsets call"
    );
    assert_eq!(report.duplicates, 0, "{report}");
    assert_eq!(report.records, 2_000, "{report}");
}

// ---- slow acks ------------------------------------------------------------------------------

/// The node answers every request 300 ms late (produce acks included) from mid-run on: many
/// outputs of a session are in flight at once; order and completeness hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_produce_acks_keep_order_and_lose_nothing() {
    let p = RelayedPipeline::new("slow-acks", SLOW_ACKS_PORT).await;
    p.produce("session-", 40, 25).await;
    let handler = slow_pass_through(Duration::from_millis(5));
    let worker = sessionflow_worker::start(p.stage(), handler.clone())
        .await
        .unwrap();
    wait_for_outputs(&worker, 50).await;
    p.relay.delay_answers(Duration::from_millis(300));
    wait_for_outputs(&worker, 1_000).await;
    p.relay.delay_answers(Duration::ZERO);
    let report = p.settle(worker).await;
    assert_eq!((report.records, report.dlq_records), (1_000, 0), "{report}");
    handler.assert_in_order();
}

// ---- a panicking handler --------------------------------------------------------------------

/// A handler that panics on the first attempt of every seventh record: each panic is a failed
/// attempt (retried in place), not a lost session (issue 10, item 5). Every record is handled
/// in session order, the session's queued records are kept, nothing is dead-lettered. No
/// fault of the broker's: on Apache Kafka.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_a_failed_attempt_not_a_lost_session() {
    let topics = Topics::create("panic", PARTITIONS).await;
    let brokers = sessionflow_tests::brokers();
    produce_on(&brokers, &topics, "session-", 20, 20).await;
    let handler = RecordingHandler::new(|s, q, attempt| {
        if q % 7 == 3 && attempt == 1 {
            panic!("handler bug on {s}:{q}");
        }
        Ok(Some(format!("{s}:{q}").into_bytes()))
    });
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.max_in_flight_per_partition = MAX_IN_FLIGHT;
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    let metrics = worker.metrics.clone();
    let report = settle_on(&brokers, &topics, worker).await;
    assert_eq!((report.records, report.dlq_records), (400, 0), "{report}");
    // Seq 3 and 10 and 17 of each of the 20 sessions panicked once.
    assert_eq!(metrics.handler_panics.get(), 60);
    handler.assert_in_order();
    for (session, calls) in &handler.seen.lock().unwrap().attempts {
        assert_eq!(calls.len(), 23, "{session}: {calls:?}");
    }
    topics.delete().await;
}
