//! The demo's broker: embedded, or a real one given by address.
//!
//! Embedded is librdkafka's mock cluster, running inside the demo process: a Kafka-protocol
//! broker on a 127.0.0.1 port that the stage processes reach like any other, with nothing to
//! install or build. It does not implement the admin API's CreateTopics, so topics are made
//! through the mock's own call there and through the admin API on a real broker.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

use sessionflow_worker::kafka::client_settings::ClientSettings;
use sessionflow_worker::kafka::topics;

/// How long a real broker gets to answer a metadata request before the demo gives up.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Fails fast, with a hint, when nothing answers at `brokers`.
fn answers(brokers: &str) -> anyhow::Result<()> {
    let client: BaseConsumer = ClientSettings::new(brokers).base().create()?;
    client.fetch_metadata(None, ANSWER_TIMEOUT).map_err(|e| {
        anyhow::anyhow!(
            "no broker answers at {brokers} ({e}); start one (scripts/broker.sh start) or leave \
             --brokers out to use the embedded one"
        )
    })?;
    Ok(())
}

pub(super) enum Broker {
    Embedded(MockCluster<'static, DefaultProducerContext>),
    External(String),
}

impl Broker {
    pub(super) fn start(brokers: Option<&str>) -> anyhow::Result<Self> {
        Ok(match brokers {
            Some(b) => Self::External(b.to_string()),
            None => Self::Embedded(
                MockCluster::new(1)
                    .map_err(|e| anyhow::anyhow!("starting the embedded broker: {e}"))?,
            ),
        })
    }

    pub(super) fn bootstrap(&self) -> String {
        match self {
            Self::Embedded(cluster) => cluster.bootstrap_servers(),
            Self::External(b) => b.clone(),
        }
    }

    pub(super) fn describe(&self) -> &'static str {
        match self {
            Self::Embedded(_) => "embedded (librdkafka's mock cluster, in this process)",
            Self::External(_) => "external",
        }
    }

    pub(super) async fn create_topics(
        &self,
        names: &[&str],
        partitions: i32,
    ) -> anyhow::Result<()> {
        match self {
            // The mock cluster does not implement the admin API's CreateTopics.
            Self::Embedded(cluster) => {
                for t in names {
                    cluster
                        .create_topic(t, partitions, 1)
                        .map_err(|e| anyhow::anyhow!("creating topic {t}: {e}"))?;
                }
                Ok(())
            }
            Self::External(b) => {
                let brokers = b.clone();
                tokio::task::spawn_blocking(move || answers(&brokers)).await??;
                topics::create(b, names, partitions).await
            }
        }
    }
}
