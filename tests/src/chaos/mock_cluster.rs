//! The mock cluster of a chaos run (`CHAOS_CLUSTER=mock`): librdkafka's, hosted in this
//! process.
//!
//! Three brokers on real 127.0.0.1 ports, so the worker processes reach it like any cluster,
//! and every fault of the schedule is one call of the mock's API. The cluster remembers what
//! it has broken, so overlapping faults heal when the last of them ends and
//! [`MockChaos::heal`] can undo all of it before the run is judged.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::mocking::{MockCluster, MockCoordinator};
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

use crate::cluster::RunTopics;
use crate::schedule::{KafkaErr, BROKERS};

/// OffsetCommit errors queued for a "commits fail for a while" fault: more than the workers
/// send in its longest span (a commit every 200 ms per worker); the heal clears the rest.
const COMMIT_ERRORS_QUEUED: usize = 100_000;

/// librdkafka properties every producer of a run needs on the mock cluster (and only there): one request in
/// flight per connection. The mock does not check an idempotent producer's sequence numbers
/// (it only does for transactional ones), so with several requests in flight a failed Produce
/// R1 followed by a successful R2 appends R2 first; librdkafka, seeing R2 acknowledged, then
/// counts R1 as persisted (its "implicit ack": Kafka would only have taken R2 after R1) and
/// reports R1's records delivered although the mock never stored them. One request in flight
/// makes the mock behave as Kafka does here.
pub const PRODUCER_PROPERTIES: [(&str, &str); 1] = [("max.in.flight.requests.per.connection", "1")];

/// The mock cluster and the faults currently injected into it.
pub struct MockChaos {
    mock: MockCluster<'static, DefaultProducerContext>,
    /// Per broker: how many "down" faults are under way.
    down: BTreeMap<i32, u32>,
    /// Per broker: the round-trip delays under way (the longest applies).
    delays: BTreeMap<i32, Vec<Duration>>,
    /// "Commits fail" faults under way.
    commit_faults: u32,
    /// The replication factor the topics got (3, or 1 when the mock refused 3).
    pub replication: i32,
}

impl MockChaos {
    /// Starts the cluster and creates the run's topics.
    pub fn start(topics: &RunTopics, input_partitions: i32) -> anyhow::Result<Self> {
        let mock = MockCluster::new(BROKERS)
            .map_err(|e| anyhow::anyhow!("starting the mock cluster: {e}"))?;
        let create = |topic: &str, partitions: i32, replication: i32| {
            mock.create_topic(topic, partitions, replication)
                .map_err(|e| anyhow::anyhow!("creating topic {topic}: {e}"))
        };
        // Replication 3 where the mock takes it, so a broker down leaves followers behind.
        let replication = match create(&topics.input, input_partitions, BROKERS) {
            Ok(()) => BROKERS,
            Err(_) => {
                create(&topics.input, input_partitions, 1)?;
                1
            }
        };
        create(&topics.output, input_partitions, replication)?;
        create(&topics.dlq, 1, replication)?;
        let cluster = Self {
            mock,
            down: BTreeMap::new(),
            delays: BTreeMap::new(),
            commit_faults: 0,
            replication,
        };
        Ok(cluster)
    }

    pub fn bootstrap(&self) -> String {
        self.mock.bootstrap_servers()
    }

    pub fn broker_down(&mut self, broker: i32) -> anyhow::Result<()> {
        self.mock.broker_down(broker)?;
        *self.down.entry(broker).or_default() += 1;
        Ok(())
    }

    /// Ends one "down" fault of `broker`; it comes back up when none is left.
    pub fn broker_up(&mut self, broker: i32) -> anyhow::Result<()> {
        let faults = self.down.entry(broker).or_default();
        *faults = faults.saturating_sub(1);
        if *faults == 0 {
            self.down.remove(&broker);
            self.mock.broker_up(broker)?;
        }
        Ok(())
    }

    pub fn produce_errors(&self, error: KafkaErr, count: usize) {
        self.mock
            .request_errors(RDKafkaApiKey::Produce, &vec![resp_err(error); count]);
    }

    pub fn commit_errors(&mut self, error: KafkaErr) {
        self.mock.request_errors(
            RDKafkaApiKey::OffsetCommit,
            &vec![resp_err(error); COMMIT_ERRORS_QUEUED],
        );
        self.commit_faults += 1;
    }

    /// Ends one "commits fail" fault; the queued errors go when none is left.
    pub fn end_commit_errors(&mut self) {
        self.commit_faults = self.commit_faults.saturating_sub(1);
        if self.commit_faults == 0 {
            self.mock.clear_request_errors(RDKafkaApiKey::OffsetCommit);
        }
    }

    pub fn move_coordinator(&self, group: &str, broker: i32) -> anyhow::Result<()> {
        self.mock
            .coordinator(MockCoordinator::Group(group.to_string()), broker)?;
        Ok(())
    }

    pub fn delay(&mut self, broker: i32, delay: Duration) -> anyhow::Result<()> {
        self.delays.entry(broker).or_default().push(delay);
        self.apply_delay(broker)
    }

    /// Ends one delay of `broker`; the longest one left (or none) applies.
    pub fn end_delay(&mut self, broker: i32, delay: Duration) -> anyhow::Result<()> {
        let delays = self.delays.entry(broker).or_default();
        if let Some(i) = delays.iter().position(|d| *d == delay) {
            delays.remove(i);
        }
        self.apply_delay(broker)
    }

    fn apply_delay(&mut self, broker: i32) -> anyhow::Result<()> {
        let longest = self
            .delays
            .get(&broker)
            .and_then(|d| d.iter().max().copied())
            .unwrap_or_default();
        if longest.is_zero() {
            self.delays.remove(&broker);
        }
        self.mock.broker_round_trip_time(broker, longest)?;
        Ok(())
    }

    /// Undoes every fault: brokers up, no delay, no queued request error. Returns what it
    /// healed, for the log.
    pub fn heal(&mut self) -> anyhow::Result<Vec<String>> {
        let mut healed = Vec::new();
        for b in std::mem::take(&mut self.down).into_keys() {
            self.mock.broker_up(b)?;
            healed.push(format!("broker {b} up"));
        }
        for b in std::mem::take(&mut self.delays).into_keys() {
            self.mock.broker_round_trip_time(b, Duration::ZERO)?;
            healed.push(format!("broker {b} without delay"));
        }
        self.commit_faults = 0;
        self.mock.clear_request_errors(RDKafkaApiKey::Produce);
        self.mock.clear_request_errors(RDKafkaApiKey::OffsetCommit);
        healed.push("no Produce or OffsetCommit errors queued".into());
        Ok(healed)
    }
}

fn resp_err(e: KafkaErr) -> RDKafkaRespErr {
    use RDKafkaRespErr::*;
    match e {
        KafkaErr::NotLeaderForPartition => RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
        KafkaErr::LeaderNotAvailable => RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE,
        KafkaErr::RequestTimedOut => RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        KafkaErr::NotEnoughReplicas => RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        KafkaErr::CoordinatorNotAvailable => RD_KAFKA_RESP_ERR_COORDINATOR_NOT_AVAILABLE,
        KafkaErr::NotCoordinator => RD_KAFKA_RESP_ERR_NOT_COORDINATOR,
        KafkaErr::CoordinatorLoadInProgress => RD_KAFKA_RESP_ERR_COORDINATOR_LOAD_IN_PROGRESS,
    }
}
