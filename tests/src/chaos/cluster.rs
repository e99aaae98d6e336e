//! The cluster of a chaos run, whichever it is (`CHAOS_CLUSTER`): Apache Kafka or the mock.
//!
//! The runner plays one schedule against either; this is the one place that knows which
//! fault belongs to which cluster, what the cluster is called in the log, and which settings
//! only one of them needs (the mock's one-request-in-flight producers). A fault of the other
//! cluster never reaches here: schedules are drawn for the run's cluster.

use std::path::Path;

use crate::kafka_cluster::KafkaChaos;
use crate::mock_cluster::{MockChaos, PRODUCER_PROPERTIES};
use crate::schedule::{Action, ClusterKind, BROKERS};

/// The topics of the run.
pub struct RunTopics {
    pub input: String,
    pub output: String,
    pub dlq: String,
    pub group: String,
}

/// The run's cluster.
pub enum ChaosCluster {
    Mock(MockChaos),
    Kafka(Box<KafkaChaos>),
}

impl ChaosCluster {
    /// Starts the cluster of `kind` and creates the run's topics (`partitions` for input and
    /// output, 1 for the DLQ). Kafka's nodes use `kafka_port` … + 12 and log under `dir`.
    pub fn start(
        kind: ClusterKind,
        topics: &RunTopics,
        partitions: i32,
        kafka_port: u16,
        dir: &Path,
    ) -> anyhow::Result<Self> {
        Ok(match kind {
            ClusterKind::Mock => Self::Mock(MockChaos::start(topics, partitions)?),
            ClusterKind::Kafka => Self::Kafka(Box::new(KafkaChaos::start(
                kafka_port, topics, partitions, dir,
            )?)),
        })
    }

    pub fn bootstrap(&self) -> String {
        match self {
            Self::Mock(m) => m.bootstrap(),
            Self::Kafka(k) => k.bootstrap(),
        }
    }

    /// One line for the log: what the cluster is.
    pub fn describe(&self, partitions: i32) -> String {
        match self {
            Self::Mock(m) => format!(
                "librdkafka mock, {BROKERS} brokers at {}, {partitions} input partitions, \
                 replication {}",
                m.bootstrap(),
                m.replication
            ),
            Self::Kafka(k) => format!(
                "Apache Kafka, {BROKERS} KRaft nodes on ports {}…{} behind toxiproxy (API on \
                 {}), clients at {}, {partitions} input partitions, replication {BROKERS}",
                k.port(),
                k.port() + 11,
                k.port() + 12,
                k.bootstrap()
            ),
        }
    }

    /// librdkafka properties every producer of the run needs (the load generator's and the
    /// workers'): the mock's workaround of [`PRODUCER_PROPERTIES`]; none on Kafka.
    pub fn producer_properties(&self) -> Vec<(String, String)> {
        match self {
            Self::Mock(_) => PRODUCER_PROPERTIES
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            Self::Kafka(_) => vec![],
        }
    }

    /// Takes a cluster fault's action; returns what it did, for the log.
    pub fn apply(&mut self, action: &Action, topics: &RunTopics) -> anyhow::Result<Vec<String>> {
        match self {
            Self::Mock(m) => {
                match action {
                    Action::BrokerDown(b) => m.broker_down(*b)?,
                    Action::BrokerUp(b) => m.broker_up(*b)?,
                    Action::ProduceErrors { error, count } => m.produce_errors(*error, *count),
                    Action::CommitErrors(error) => m.commit_errors(*error),
                    Action::EndCommitErrors => m.end_commit_errors(),
                    Action::CoordinatorMove(b) => m.move_coordinator(&topics.group, *b)?,
                    Action::Delay { broker, delay } => m.delay(*broker, *delay)?,
                    Action::EndDelay { broker, delay } => m.end_delay(*broker, *delay)?,
                    other => anyhow::bail!("not a fault of the mock cluster: {other}"),
                }
                Ok(vec![])
            }
            Self::Kafka(k) => Ok(match action {
                Action::KillBroker(b) => k.kill_broker(*b)?,
                Action::RestartBroker(b) => k.restart_broker(*b)?,
                Action::FreezeBroker(b) => k.freeze_broker(*b)?,
                Action::ThawBroker(b) => k.thaw_broker(*b)?,
                Action::StopLeader { token } => k.stop_leader(*token, &topics.input)?,
                Action::RestartLeader { token } => k.restart_leader(*token)?,
                Action::NetDelay {
                    broker,
                    delay,
                    token,
                } => {
                    k.net_delay(*broker, *delay, *token)?;
                    vec![]
                }
                Action::EndNetDelay { broker, token } => {
                    k.end_net_delay(*broker, *token)?;
                    vec![]
                }
                Action::NetCut {
                    broker,
                    blackhole,
                    token,
                } => {
                    k.net_cut(*broker, *blackhole, *token)?;
                    vec![]
                }
                Action::EndNetCut {
                    broker,
                    blackhole,
                    token,
                } => {
                    k.end_net_cut(*broker, *blackhole, *token)?;
                    vec![]
                }
                other => anyhow::bail!("not a fault of the Kafka cluster: {other}"),
            }),
        }
    }

    /// Undoes every fault still in force; returns what it healed, for the log.
    pub fn heal(&mut self) -> anyhow::Result<Vec<String>> {
        match self {
            Self::Mock(m) => m.heal(),
            Self::Kafka(k) => k.heal(),
        }
    }
}
