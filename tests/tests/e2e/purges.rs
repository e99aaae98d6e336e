//! Results still on their way when a partition leaves: taken back from the producer, and
//! nothing lost by taking them back.
//!
//! On Apache Kafka, a node of the test's own behind the tests' relay (`sessionflow_tests::relay`),
//! which answers every Produce request to the output with a retriable error
//! (`NOT_ENOUGH_REPLICAS`) for as long as the test wants: the worker's results sit in its
//! producer, retried, while its partitions change hands. Whatever the producer still holds of a
//! partition that has left must never be sent (it could land after the next owner's results),
//! so it is purged; the purge takes back the writes of the partitions still owned too, which
//! are written again, and the records whose writes were taken back are replayed by whoever owns
//! their partition next — verify finds nothing lost.
//!
//! - a revocation whose write fence ran out (the group's rebalance timeout bounds it:
//!   `max.poll.interval.ms` 15 s here, so the fence waits 8.5 s). Kafka's coordinator waits
//!   for the revoking member and keeps answering it meanwhile, so the membership fence stays
//!   open and the purge is the revocation's own (on librdkafka's mock cluster, where this test
//!   ran before, the rebalance went on without the member and the membership fence purged
//!   first);
//! - a lost assignment (the relay answers a heartbeat with `UNKNOWN_MEMBER_ID`, as a
//!   coordinator that forgot the member: librdkafka drops the partitions as lost, and the member
//!   joins again).

use std::time::Duration;

use rdkafka::types::RDKafkaRespErr;
use sessionflow_tests::relay::{RelayedNode, HEARTBEAT, PRODUCE};
use sessionflow_tests::{http_get, verify_on, wait_committed_to_end_on, wait_until, WorkerProcess};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};

const PARTITIONS: i32 = 4;
const RECORDS: u64 = 6_000;
/// The metrics endpoints of the workers that must purge (ports of these tests' own).
const REVOKE_METRICS: u16 = 19480;
const LOST_METRICS: u16 = 19481;
/// The first port of each test's node (four each, the relay on the fourth; all the relayed
/// nodes' ports are listed at `sessionflow_tests::relay::broker_behind_relay`).
const REVOKE_PORT: u16 = 19640;
const LOST_PORT: u16 = 19644;

/// The tests' node behind the relay ([`RelayedNode`]), and what the tests do with it.
struct Node(RelayedNode);

impl std::ops::Deref for Node {
    type Target = RelayedNode;
    fn deref(&self) -> &RelayedNode {
        &self.0
    }
}

impl Node {
    async fn start(name: &str, port: u16) -> Self {
        Self(RelayedNode::start(port, name, PARTITIONS).await)
    }

    fn load(&self) -> tokio::task::JoinHandle<anyhow::Result<loadgen::LoadgenReport>> {
        let opts = LoadgenOptions {
            choice: SessionChoice::RoundRobin,
            rate: Some(300.0),
            ..LoadgenOptions::new(&self.brokers, &self.topics.input, RECORDS, 200)
        };
        tokio::spawn(async move { loadgen::run(&opts).await })
    }

    /// A worker config: cooperative rebalancing, a half-second drain, a rebalance timeout
    /// short enough for the write fence to run out within the test, and metrics on
    /// `metrics_port` if given.
    fn stage(&self, metrics_port: Option<u16>) -> String {
        let yaml = self.topics.stage_yaml_on(
            &self.brokers,
            "{latencyMs: 2, seed: 5}",
            "rebalance: {strategy: cooperative, drainTimeoutMs: 500}",
        );
        let yaml = match metrics_port {
            Some(port) => yaml.replace(
                "metricsAddr: null",
                &format!("metricsAddr: 127.0.0.1:{port}"),
            ),
            None => yaml,
        };
        // The `kafka:` map is the config's last section.
        format!("{yaml}  max.poll.interval.ms: '15000'\n")
    }

    /// Records in the output topic.
    fn output_count(&self) -> u64 {
        sessionflow_tests::end_offsets_on(&self.brokers, &self.topics.output)
            .iter()
            .sum::<i64>() as u64
    }

    /// Starts refusing every Produce request to the output (retriably): results stay in the
    /// producers.
    fn refuse_produces(&self) {
        let code = RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS as i16;
        self.relay
            .refuse_produce(&self.topics.output, &[code; 100_000]);
    }

    fn accept_produces(&self) {
        self.relay.accept(PRODUCE);
    }
}

/// Once the worker logging to `log` (metrics on `port`) has said `event` (within 90 s), what
/// it has taken back from its producer; produces are accepted again either way.
async fn taken_back_once(node: &Node, log: &std::path::Path, port: u16, event: &str) -> u64 {
    let happened = wait_until(Duration::from_secs(90), || read(log).contains(event)).await;
    let taken = taken_back_soon(port).await;
    node.accept_produces();
    happened.unwrap_or_else(|()| panic!("the worker never said \"{event}\":\n{}", read(log)));
    taken
}

/// [`taken_back`], read until it is not 0 or for two seconds: the purge answers every queued
/// delivery at once, and each is counted when its session sees the answer.
async fn taken_back_soon(port: u16) -> u64 {
    for _ in 0..20 {
        let taken = taken_back(port).await;
        if taken > 0 {
            return taken;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    0
}

/// What the worker with metrics on `port` has taken back from its producer.
async fn taken_back(port: u16) -> u64 {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|l| l.strip_prefix("sessionflow_writes_taken_back_total{stage=\"test\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// A worker logging at info to a file of its own, and a reader of that file.
fn logged_worker(yaml: &str, name: &str) -> (WorkerProcess, std::path::PathBuf) {
    let log = std::env::temp_dir().join(sessionflow_tests::unique(name) + ".log");
    let worker = WorkerProcess::spawn_logging_at(
        yaml,
        &[],
        std::fs::File::create(&log).expect("log file").into(),
        "sessionflow_worker=info",
    );
    (worker, log)
}

fn read(log: &std::path::Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// After the faults: everything committed, nothing lost, in order.
async fn settle_and_verify(node: &Node, what: &str) {
    wait_committed_to_end_on(&node.brokers, &node.topics, Duration::from_secs(180))
        .await
        .unwrap_or_else(|(committed, end)| panic!("committed {committed:?} never reached {end:?}"));
    let report = verify_on(&node.brokers, &node.topics);
    eprintln!("{what}:\n{report}");
    assert_eq!(report.lost, 0, "{report}");
    assert_eq!(report.order_violations, 0, "{report}");
    assert_eq!(report.gaps, 0, "{report}");
    assert_eq!(
        report.records - report.duplicates + report.dlq_records,
        RECORDS,
        "{report}"
    );
}

/// One worker (metrics on `port`, logging to a file) on a relayed node of its own, loaded, past
/// its first 500 outputs, with every Produce to the output refused from then on: its results
/// stay in its producer.
struct Refused {
    node: Node,
    load: tokio::task::JoinHandle<anyhow::Result<loadgen::LoadgenReport>>,
    worker: WorkerProcess,
    log: std::path::PathBuf,
    port: u16,
}

impl Refused {
    async fn start(name: &str, node_port: u16, port: u16) -> Self {
        let node = Node::start(name, node_port).await;
        let load = node.load();
        let (worker, log) = logged_worker(&node.stage(Some(port)), name);
        wait_until(Duration::from_secs(90), || node.output_count() >= 500)
            .await
            .expect("progress before the refusals");
        node.refuse_produces();
        Self {
            node,
            load,
            worker,
            log,
            port,
        }
    }

    /// Once the worker has said `event`, asserts it took writes back (`what` names the case)
    /// and accepts produces again.
    async fn assert_taken_back_at(&self, event: &str, what: &str) {
        let taken = taken_back_once(&self.node, &self.log, self.port, event).await;
        assert!(
            taken > 0,
            "{what}, and nothing was taken back:\n{}",
            read(&self.log)
        );
    }

    /// After the load: everything committed, nothing lost, in order; the workers stopped.
    async fn finish(self, what: &str, others: Vec<WorkerProcess>) {
        self.load.await.unwrap().expect("loadgen");
        settle_and_verify(&self.node, what).await;
        let _ = std::fs::remove_file(&self.log);
        for w in others {
            let _ = w.terminate();
        }
        let _ = self.worker.terminate();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_whose_write_fence_runs_out_purges_the_producer_and_loses_nothing() {
    let run = Refused::start("purge-revoke", REVOKE_PORT, REVOKE_METRICS).await;
    // A second member joins: the first revokes two partitions whose results cannot land.
    let second = WorkerProcess::spawn(&run.node.stage(None));
    run.assert_taken_back_at("still unacknowledged", "the fence ran out")
        .await;
    run.finish(
        "a revocation's fence ran out under refused produces",
        vec![second],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_assignment_with_results_on_their_way_purges_the_producer_and_loses_nothing() {
    let run = Refused::start("purge-lost", LOST_PORT, LOST_METRICS).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The coordinator forgets the member: its partitions are lost, with results on their way.
    run.node.relay.refuse(
        HEARTBEAT,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_MEMBER_ID as i16,
        1,
    );
    run.assert_taken_back_at(
        "partitions lost",
        "partitions lost with results on their way",
    )
    .await;
    run.finish("an assignment lost under refused produces", vec![])
        .await;
}
