//! A write purged while on the wire can still reach the broker, and an `exactlyOnce` stage must
//! not let it into a transaction that commits.
//!
//! The membership fence and a leaving partition purge their producers' writes, in flight
//! included (`Transactions::purge`): librdkafka answers them as purged at once, but a request
//! already sent is not called back; the broker stores it whenever it arrives. The partition's
//! transaction is then doomed, and the consumer loop aborts it and replays the partition. If
//! the abort kept the producer (same producer id and epoch — librdkafka bumps the epoch for a
//! timed-out write, not for a purged one), the late write would arrive in the *next*
//! transaction, which has registered the same output partition, and commit with it: the
//! replayed record's output twice, or the stale one in place of the new (its sequence number
//! taken). A new producer with the same transactional id bumps the epoch, and its init's
//! abort writes the markers with it: the late write is refused as of an older epoch.
//!
//! Each test starts its broker with an advertised address where a relay
//! (`sessionflow_tests::relay`) holds the produce requests: a write is sent and on the wire,
//! and reaches the broker only when the test says, after the abort and the next write. The
//! first drives `Transactions` itself (each purge, and a partition that leaves); the others a
//! worker, whose revocation's write fence, or membership fence, purges. With the producer
//! kept by the abort, the first read the stale output committed beside the replay's, and the
//! worker tests 49 and 100 duplicates in the read_committed output.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sessionflow_tests::relay::{broker_behind_relay, Relay, OFFSET_COMMIT, OFFSET_FETCH, PRODUCE};
use sessionflow_tests::{
    unique, verify_on, wait_committed_to_end_on, wait_until, ScriptCluster, Topics, WorkerProcess,
};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};
use sessionflow_tools::verify::read_topic;
use sessionflow_worker::output::producer::transactional_producer_config;
use sessionflow_worker::output::transactions::{AbortReason, Doom, Transactions};

/// Ports of this test's broker: 19530 … 19533, the relay on 19533, the address the broker
/// advertises (the test broker uses 9092 …, chaos 19300 …, the SASL_SSL test 19440 …, the
/// truncation test 19460 …, metrics ports 19480 … 19491, the 3-node exactly-once test
/// 19500 … 19510, the transaction probe test 19520 … 19527, `slow_transaction_calls`
/// 19560 … 19563).
const PORT: u16 = 19530;
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_purged_on_the_wire_that_lands_late_is_never_committed() {
    let (relay, cluster) = broker_behind_relay(PORT).await;

    // The partition stays: the loop aborts and replays it, its producer writes the replay.
    for purge in [Purge::ByTheFence, Purge::ByACommitWaitingForIt] {
        let stage = Stage::create(&cluster, "late-stay").await;
        let transactions = stage.transactions();
        stage
            .write_purged_on_the_wire(&relay, &transactions, purge)
            .await;
        tokio::task::block_in_place(|| transactions.abort(0)).expect("abort");
        stage.replay_and_commit(&relay, &transactions).await;
        assert_eq!(
            stage.committed_output(),
            ["fresh"],
            "record 0's output, once: the write purged {purge:?} must not commit with the \
             replay's transaction"
        );
    }

    // The partition leaves: its transaction is aborted and its producer closed; the next
    // owner's writes the replay.
    let stage = Stage::create(&cluster, "late-leave").await;
    let transactions = stage.transactions();
    stage
        .write_purged_on_the_wire(&relay, &transactions, Purge::ByTheFence)
        .await;
    tokio::task::block_in_place(|| transactions.abort_and_close(0));
    let next_owner = stage.transactions();
    stage.replay_and_commit(&relay, &next_owner).await;
    assert_eq!(
        stage.committed_output(),
        ["fresh"],
        "record 0's output, once: the purged write must not commit with the next owner's \
         transaction"
    );
}

/// What gives a write on the wire up.
#[derive(Debug, Clone, Copy)]
enum Purge {
    /// The membership fence (or a stop, or a lost assignment): `StageProducer::purge`.
    ByTheFence,
    /// A commit waiting for the barrier, while a partition's transaction is doomed.
    ByACommitWaitingForIt,
}

/// One partition of a stage's input and output, on the test's broker.
struct Stage {
    bootstrap: String,
    input: String,
    output: String,
    group: String,
}

impl Stage {
    async fn create(cluster: &ScriptCluster, name: &str) -> Self {
        let stage = Self {
            bootstrap: cluster.bootstrap.clone(),
            input: unique(&format!("{name}-in")),
            output: unique(&format!("{name}-out")),
            group: unique(name),
        };
        cluster
            .create_topics(&[(&stage.input, 1), (&stage.output, 1)])
            .await;
        stage
    }

    /// A worker's transactional producers, configured as the worker configures them, with
    /// partition 0's open.
    fn transactions(&self) -> Arc<Transactions<DefaultClientContext>> {
        let config = transactional_producer_config(&self.bootstrap, &[]);
        let transactions =
            Transactions::new(config, &self.group, &self.input, DefaultClientContext);
        tokio::task::block_in_place(|| transactions.open(0)).expect("open partition 0's producer");
        Arc::new(transactions)
    }

    /// Input record 0's write goes on the wire and is held there, and `purge` gives it up:
    /// its transaction is doomed.
    async fn write_purged_on_the_wire(
        &self,
        relay: &Relay,
        transactions: &Arc<Transactions<DefaultClientContext>>,
        purge: Purge,
    ) {
        relay.hold(&[PRODUCE]);
        let seen = relay.produce_requests_seen();
        // The write's share of the commit barrier, held until it is answered (as `settle` does).
        let share = transactions.share().await;
        let stale = send(
            &transactions.producer(0).expect("open"),
            &self.output,
            "stale",
        );
        let answered = tokio::spawn(async move {
            let answer = stale.await.expect("answered").map(|_| ());
            drop(share);
            answer
        });
        wait_until(WAIT, || relay.produce_requests_seen() == seen + 1)
            .await
            .expect("the write reaches the wire");
        let reason = match purge {
            Purge::ByTheFence => {
                transactions.purge();
                AbortReason::Fence
            }
            Purge::ByACommitWaitingForIt => {
                // Record 1's write of the same transaction was refused; a commit then waits
                // for the barrier, purging the doomed partition's writes as it waits.
                let refused = Doom {
                    reason: AbortReason::Write,
                    record: Some(1),
                    epoch: Some(0),
                };
                transactions.doom(0, refused);
                let barrier = tokio::task::block_in_place(|| transactions.exclusive(WAIT));
                drop(barrier.expect("the barrier, once the purged write has let its share go"));
                AbortReason::Write
            }
        };
        let purged = answered.await.unwrap().unwrap_err().0;
        assert_eq!(
            purged.rdkafka_error_code(),
            Some(RDKafkaErrorCode::PurgeInflight),
            "the write was purged in flight"
        );
        let doom = transactions.doom_of(0).expect("the transaction is doomed");
        assert_eq!(doom.reason, reason);
    }

    /// Record 0 replayed: its new write goes on the wire behind the purged one; then the wire
    /// delivers both, and the replay's transaction commits with record 0's offset.
    async fn replay_and_commit(
        &self,
        relay: &Relay,
        transactions: &Transactions<DefaultClientContext>,
    ) {
        let seen = relay.produce_requests_seen();
        let fresh = send(
            &transactions.producer(0).expect("open"),
            &self.output,
            "fresh",
        );
        wait_until(WAIT, || relay.produce_requests_seen() == seen + 1)
            .await
            .expect("the replay's write reaches the wire");
        relay.release(&[PRODUCE]);
        fresh
            .await
            .expect("answered")
            .expect("the replay's write is stored");
        let member: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .set("group.id", &self.group)
            .create()
            .expect("consumer");
        let metadata = Arc::new(member.group_metadata().expect("group metadata"));
        let mut offsets = TopicPartitionList::new();
        offsets
            .add_partition_offset(&self.input, 0, Offset::Offset(1))
            .unwrap();
        tokio::task::block_in_place(|| transactions.commit(0, &offsets, &metadata))
            .expect("the replay's transaction commits");
        tokio::task::block_in_place(|| transactions.abort_all());
    }

    /// The output's committed records' values.
    fn committed_output(&self) -> Vec<String> {
        let committed = tokio::task::block_in_place(|| {
            read_topic(&self.bootstrap, &self.output, None, Duration::from_secs(30))
        })
        .expect("read the output");
        committed
            .iter()
            .map(|r| String::from_utf8_lossy(&r.value).into_owned())
            .collect()
    }
}

/// Sends `value` to partition 0 of `topic`; the answer comes with the returned future.
fn send<C: ClientContext + 'static>(
    producer: &FutureProducer<C>,
    topic: &str,
    value: &str,
) -> DeliveryFuture {
    let record = FutureRecord::<(), str>::to(topic)
        .partition(0)
        .payload(value);
    producer
        .send_result(record)
        .map_err(|(e, _)| e)
        .expect("the write is queued")
}

/// Ports of the worker tests' brokers: 19540 … 19543 and 19550 … 19553, each relay on the
/// last.
const REVOCATION_PORT: u16 = 19540;
const MEMBERSHIP_PORT: u16 = 19550;
const RECORDS: u64 = 2_000;

/// The same through a worker: an `exactlyOnce` worker whose writes are all on the wire when a
/// second worker joins. Its revocation's write fence runs out and purges every producer with
/// writes out; the partitions it keeps are doomed, aborted and replayed, each by a new
/// producer; the relay then delivers the purged writes. The read_committed output must hold
/// every record once: a late write taken into a kept partition's next transaction would be a
/// duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_worker_whose_revocation_purges_writes_on_the_wire_commits_none_of_them() {
    // Cooperative, so that the first worker keeps partitions through the rebalance; a short
    // rebalance timeout, so that its write fence runs out within the test (8.5 s).
    let mut run = WorkerRun::start(
        REVOCATION_PORT,
        "late-revoke",
        "rebalance: {strategy: cooperative, drainTimeoutMs: 500}",
        (
            "max.poll.interval.ms: '300000'",
            "max.poll.interval.ms: '15000'",
        ),
    )
    .await;
    let second = WorkerProcess::spawn(&run.yaml);
    run.wait_for_log(
        "still unacknowledged at the fence's deadline",
        "the revocation's purge",
    )
    .await;
    run.replays_on_the_wire_then_release().await;
    run.assert_renewed_together();
    run.finish(vec![second]).await;
}

/// The membership fence's purge through a worker: the group coordinator's offset requests are
/// held (the worker hears nothing from it) until the fence closes and purges the writes on the
/// wire; then the coordinator answers again, the worker aborts and replays its partitions,
/// each with a new producer, and the relay delivers the purged writes. The session timeout is
/// 30 s here, so the fence closes (at 20 s of silence) well before the coordinator would drop
/// the member, whose heartbeats wait behind the held requests on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_worker_whose_membership_fence_purges_writes_on_the_wire_commits_none_of_them(
) {
    let mut run = WorkerRun::start(
        MEMBERSHIP_PORT,
        "late-fence",
        "",
        ("session.timeout.ms: '6000'", "session.timeout.ms: '30000'"),
    )
    .await;
    run.relay.hold(&[OFFSET_FETCH, OFFSET_COMMIT]);
    run.wait_for_log(
        "no answer from the group coordinator for two thirds of the session timeout",
        "the membership fence's purge",
    )
    .await;
    run.relay.release(&[OFFSET_FETCH, OFFSET_COMMIT]);
    run.replays_on_the_wire_then_release().await;
    run.assert_renewed_together();
    run.finish(vec![]).await;
}

/// An `exactlyOnce` worker on a broker of its own behind a relay, its input produced, every
/// write it makes held on the wire from its start.
struct WorkerRun {
    relay: Relay,
    cluster: ScriptCluster,
    topics: Topics,
    yaml: String,
    worker: WorkerProcess,
    log: std::path::PathBuf,
}

impl WorkerRun {
    /// `extra` goes into the stage config, and `setting`'s first text is replaced by its second
    /// (a Kafka property). Commits are far apart (60 s), so that no commit waits for the
    /// barrier while writes are held.
    async fn start(port: u16, name: &str, extra: &str, setting: (&str, &str)) -> Self {
        let (relay, cluster) = broker_behind_relay(port).await;
        let topics = cluster.create_stage_topics(name, 4).await;
        let load = LoadgenOptions {
            choice: SessionChoice::RoundRobin,
            ..LoadgenOptions::new(&cluster.bootstrap, &topics.input, RECORDS, 100)
        };
        loadgen::run(&load).await.expect("loadgen");

        let stage = topics
            .stage_yaml_on(
                &cluster.bootstrap,
                "{seed: 5}",
                &format!("delivery: exactlyOnce\n{extra}"),
            )
            .replace("commitIntervalMs: 200", "commitIntervalMs: 60000");
        // The `kafka:` map is the config's last section.
        let yaml =
            format!("{stage}  max.poll.interval.ms: '300000'\n").replace(setting.0, setting.1);
        assert!(yaml.contains(setting.1), "{yaml}");
        relay.hold(&[PRODUCE]);
        let log = std::env::temp_dir().join(unique(name) + ".log");
        let worker = WorkerProcess::spawn_logging_at(
            &yaml,
            &[],
            std::fs::File::create(&log).expect("log file").into(),
            "sessionflow_worker=info",
        );
        let mut run = Self {
            relay,
            cluster,
            topics,
            yaml,
            worker,
            log,
        };
        run.wait_for_log("partition assigned", "the first assignment")
            .await;
        wait_until(WAIT, || run.relay.produce_requests_seen() > 0)
            .await
            .expect("the worker's writes reach the wire");
        // The four partitions' producers, opened at the same time in the assignment's
        // callback (`Transactions::open_each`): one after another, a takeover waited ~0.6 s a
        // partition for the broker to end what the older owner left open.
        run.assert_together(
            "opening the transactional producer",
            "transactional producer opened",
            "the assignment's opens",
        );
        run
    }

    async fn wait_for_log(&mut self, line: &str, what: &str) {
        self.worker
            .wait_for_log(&self.log, line, what, Duration::from_secs(120))
            .await;
    }

    /// Once a kept partition was aborted with a new producer, and the replays' writes are on
    /// the wire behind the purged ones, lets every write through.
    async fn replays_on_the_wire_then_release(&mut self) {
        self.wait_for_log(
            "the new producer took over",
            "a kept partition's abort with a new producer",
        )
        .await;
        let seen = self.relay.produce_requests_seen();
        wait_until(WAIT, || self.relay.produce_requests_seen() > seen)
            .await
            .expect("a replay's write reaches the wire");
        self.relay.release(&[PRODUCE]);
    }

    /// The new producers of the partitions rewound together were opened at the same time
    /// (`Transactions::abort_each`): more than one renewal began before the first ended. Each
    /// takes ~0.6 s (librdkafka asks the broker again every 500 ms while it ends the old
    /// transaction); one after another they held the barrier, and every write of the stage,
    /// for the sum. Call after [`WorkerRun::replays_on_the_wire_then_release`].
    fn assert_renewed_together(&self) {
        self.assert_together(
            "new epoch takes over",
            "the new producer took over",
            "the renewals",
        );
    }

    /// More than one call (its log lines `began` … `ended`) began before the first ended.
    fn assert_together(&self, began: &str, ended: &str, what: &str) {
        let log = std::fs::read_to_string(&self.log).expect("the worker's log");
        let first_ended = log
            .find(ended)
            .unwrap_or_else(|| panic!("none of {what} ended"));
        let begun = log[..first_ended].matches(began).count();
        assert!(
            begun >= 2,
            "{what} ran one after another ({begun} begun before the first ended):\n{log}"
        );
    }

    /// Everything committed; the read_committed output holds every record once, in order.
    async fn finish(self, others: Vec<WorkerProcess>) {
        let bootstrap = &self.cluster.bootstrap;
        wait_committed_to_end_on(bootstrap, &self.topics, Duration::from_secs(180))
            .await
            .unwrap_or_else(|(committed, end)| {
                panic!("committed {committed:?} never reached {end:?}")
            });
        let report = tokio::task::block_in_place(|| verify_on(bootstrap, &self.topics));
        let _ = self.worker.terminate();
        for other in others {
            let _ = other.terminate();
        }
        let _ = std::fs::remove_file(&self.log);
        eprintln!("{report}");
        assert_eq!(report.lost, 0, "{report}");
        assert_eq!(
            report.duplicates, 0,
            "a purged write committed late:\n{report}"
        );
        assert_eq!(report.order_violations, 0, "{report}");
        assert_eq!(report.records + report.dlq_records, RECORDS, "{report}");
    }
}
