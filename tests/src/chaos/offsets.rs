//! What the operator's autoscaler sees: the group's committed offsets against the input's end
//! offsets. A run is only judged once they are equal (lag 0), so a partition whose commits
//! stopped is a failure even when every record made it to the output.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::TopicPartitionList;

const ANSWER: Duration = Duration::from_secs(10);

/// Reads one group's committed offsets and one topic's end offsets.
pub struct GroupLag {
    consumer: BaseConsumer,
    topic: String,
    partitions: i32,
}

/// Per partition: committed offset (-1 where none) and end offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lag {
    pub committed: Vec<i64>,
    pub end: Vec<i64>,
}

impl Lag {
    pub fn is_zero(&self) -> bool {
        self.committed == self.end
    }

    pub fn total(&self) -> i64 {
        self.committed
            .iter()
            .zip(&self.end)
            .map(|(c, e)| e - (*c).max(0))
            .sum()
    }
}

impl std::fmt::Display for Lag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "lag {} (committed {:?}, end {:?})",
            self.total(),
            self.committed,
            self.end
        )
    }
}

impl GroupLag {
    pub fn new(brokers: &str, group: &str, topic: &str, partitions: i32) -> anyhow::Result<Self> {
        let consumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()?;
        Ok(Self {
            consumer,
            topic: topic.into(),
            partitions,
        })
    }

    pub fn read(&self) -> anyhow::Result<Lag> {
        let mut tpl = TopicPartitionList::new();
        let mut end = Vec::new();
        for p in 0..self.partitions {
            tpl.add_partition(&self.topic, p);
            end.push(self.consumer.fetch_watermarks(&self.topic, p, ANSWER)?.1);
        }
        let committed = self.consumer.committed_offsets(tpl, ANSWER)?;
        Ok(Lag {
            committed: sessionflow_tests::offsets_or_unset(&committed),
            end,
        })
    }
}
