//! A truncated input log: records rewritten under offsets the worker has already taken in.
//!
//! Apache Kafka, three nodes started for the test (`scripts/kafka.sh`, ports of its own). The
//! input's one partition lives on nodes 1 (leader) and 2, with unclean leader election on:
//! node 2 is killed, records are written that only node 1 has (ISR shrunk to node 1), the worker
//! processes and commits them; then node 1 is killed and node 2 elected without them — the log
//! is truncated back to what node 2 has, and new records are written under the same offsets,
//! at a newer leader epoch. librdkafka moves the worker's fetch position back to the truncation
//! point without a word. The new records must be processed, not skipped as "already taken in"
//! (before leader epochs were read, they were lost: committed past, never handled).

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use sessionflow_tests::{
    committed_offsets_on, end_offsets_on, wait_until, ScriptCluster, Topics, WorkerProcess,
};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};
use sessionflow_tools::verify::{self, VerifyOptions, VerifyReport};

/// Ports of this test's cluster: 19460 … 19471 (the test broker uses 9092 …, the SASL_SSL
/// test 19440 …, chaos 19300 …).
const PORT: u16 = 19460;
/// Records of each batch: before the follower goes, while only the leader has them (these
/// are truncated away), and after the unclean election (under the truncated offsets).
const SHARED: u64 = 100;
const LEADER_ONLY: u64 = 50;
const REWRITTEN: u64 = 80;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_rewritten_under_offsets_already_taken_in_are_processed_not_skipped() {
    let cluster = ScriptCluster::start(PORT, &["--nodes", "3"]);
    let brokers = cluster.bootstrap.clone();
    let topics = Topics::named("truncated");
    // Node ids are 1-based (node 0 of kafka.sh is id 1). The input on ids 1 and 2, unclean
    // election allowed; output and DLQ on id 3 alone, which stays up throughout.
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("admin client");
    let input_replicas: &[&[i32]] = &[&[1, 2]];
    let third: &[&[i32]] = &[&[3]];
    let created = admin
        .create_topics(
            &[
                NewTopic::new(&topics.input, 1, TopicReplication::Variable(input_replicas))
                    .set("unclean.leader.election.enable", "true")
                    .set("min.insync.replicas", "1"),
                NewTopic::new(&topics.output, 1, TopicReplication::Variable(third))
                    .set("min.insync.replicas", "1"),
                NewTopic::new(&topics.dlq, 1, TopicReplication::Variable(third))
                    .set("min.insync.replicas", "1"),
            ],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create topics");
    assert!(created.iter().all(|r| r.is_ok()), "{created:?}");

    let worker = WorkerProcess::spawn(&topics.stage_yaml_on(&brokers, "{seed: 1}", ""));
    let produce = |prefix: &str, records: u64| {
        let opts = LoadgenOptions {
            choice: SessionChoice::RoundRobin,
            session_prefix: prefix.into(),
            ..LoadgenOptions::new(&brokers, &topics.input, records, 5)
        };
        async move { loadgen::run(&opts).await.expect("loadgen") }
    };
    let committed = || committed_offsets_on(&brokers, &topics.group, &topics.input)[0];
    let partition = || partition_state(&brokers, &topics.input);

    produce("shared-", SHARED).await;
    wait_until(Duration::from_secs(120), || committed() == SHARED as i64)
        .await
        .expect("the shared records committed");

    // The follower goes: once the controller has fenced it, only the leader is in sync.
    cluster.kill_node(1);
    wait_until(Duration::from_secs(60), || partition().isr == vec![1])
        .await
        .unwrap_or_else(|()| panic!("ISR never shrank to the leader: {:?}", partition()));
    produce("leader-only-", LEADER_ONLY).await;
    let taken = (SHARED + LEADER_ONLY) as i64;
    wait_until(Duration::from_secs(120), || committed() == taken)
        .await
        .expect("the leader-only records committed");

    // The leader goes and the follower comes back: elected without the last records.
    cluster.kill_node(0);
    cluster.restart_node(1);
    wait_until(Duration::from_secs(120), || partition().leader == 2)
        .await
        .unwrap_or_else(|()| panic!("the follower was never elected: {:?}", partition()));
    assert_eq!(
        end_offsets_on(&brokers, &topics.input),
        vec![SHARED as i64],
        "the log was truncated to what the follower had"
    );
    produce("rewritten-", REWRITTEN).await;
    cluster.restart_node(0);

    let end = (SHARED + REWRITTEN) as i64;
    wait_until(Duration::from_secs(120), || committed() == end)
        .await
        .unwrap_or_else(|()| panic!("committed {} never reached the end {end}", committed()));
    // The commit may move before the last outputs are read back, and the nodes may still be
    // settling (a read that fails is read again): the report decides.
    let mut report = None;
    let _ = wait_until(Duration::from_secs(60), || {
        report = verify(&brokers, &topics).or(report.take());
        report.as_ref().is_some_and(|r| r.lost == 0)
    })
    .await;
    let report = report.expect("verify never read the topics");
    assert!(worker.terminate().success());
    eprintln!("input truncated at {SHARED} and rewritten with {REWRITTEN} records:\n{report}");
    // Lost: an input record (now in the log) in neither output nor DLQ. The leader-only
    // records are no longer input (the truncation took them); their outputs stay.
    assert_eq!(report.lost, 0, "{report}");
    assert!(report.is_ok(), "{report}");
    assert!(
        report.records >= SHARED + LEADER_ONLY + REWRITTEN,
        "{report}"
    );
}

#[derive(Debug, Default)]
struct PartitionState {
    leader: i32,
    isr: Vec<i32>,
}

/// Partition 0 of `topic` as the cluster's metadata shows it now.
fn partition_state(brokers: &str, topic: &str) -> PartitionState {
    let consumer: BaseConsumer = match ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
    {
        Ok(c) => c,
        Err(_) => return PartitionState::default(),
    };
    let Ok(metadata) = consumer.fetch_metadata(Some(topic), Duration::from_secs(5)) else {
        return PartitionState::default();
    };
    metadata
        .topics()
        .first()
        .and_then(|t| t.partitions().first())
        .map(|p| PartitionState {
            leader: p.leader(),
            isr: p.isr().to_vec(),
        })
        .unwrap_or_default()
}

/// `verify` of the test's topics, or `None` when a topic could not be read.
fn verify(brokers: &str, topics: &Topics) -> Option<VerifyReport> {
    verify::run(&VerifyOptions {
        kafka: brokers.into(),
        topic: topics.output.clone(),
        dlq: Some(topics.dlq.clone()),
        input: Some(topics.input.clone()),
        session_header: None,
        timeout: Duration::from_secs(20),
    })
    .map_err(|e| eprintln!("verify: {e:#}"))
    .ok()
}
