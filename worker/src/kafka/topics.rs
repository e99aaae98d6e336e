//! Creating and deleting topics.
//!
//! Brokers may auto-create a topic on first produce, with whatever partition count they like
//! (nisshi picks 4), so the demo, the tests and users' setup create every topic explicitly with
//! the partition count they mean. Existing topics are left as they are.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;

use crate::kafka::client_settings::ClientSettings;
use rdkafka::types::RDKafkaErrorCode;

fn admin(kafka: impl Into<ClientSettings>) -> anyhow::Result<AdminClient<DefaultClientContext>> {
    Ok(kafka.into().base().create()?)
}

/// A topic to create: name, partitions, replication factor (-1: the broker's default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicRequest {
    pub name: String,
    pub partitions: i32,
    pub replication: i32,
}

/// Creates each topic with `partitions` partitions unless it already exists.
pub async fn create(
    kafka: impl Into<ClientSettings>,
    topics: &[&str],
    partitions: i32,
) -> anyhow::Result<()> {
    let requests: Vec<TopicRequest> = topics
        .iter()
        .map(|t| TopicRequest {
            name: t.to_string(),
            partitions,
            replication: 1,
        })
        .collect();
    create_missing(&admin(kafka)?, &requests).await?;
    Ok(())
}

/// Creates the requested topics that do not exist yet, through `admin` (whose configuration
/// carries any credentials); returns the names of those it created.
pub async fn create_missing(
    admin: &AdminClient<DefaultClientContext>,
    requests: &[TopicRequest],
) -> anyhow::Result<Vec<String>> {
    let new: Vec<NewTopic<'_>> = requests
        .iter()
        .map(|t| {
            NewTopic::new(
                &t.name,
                t.partitions,
                TopicReplication::Fixed(t.replication),
            )
        })
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    let mut created = Vec::new();
    for result in admin.create_topics(&new, &opts).await? {
        match result {
            Ok(topic) => created.push(topic),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => anyhow::bail!("creating topic {topic}: {code}"),
        }
    }
    Ok(created)
}

/// Deletes the topics; missing ones are ignored.
pub async fn delete(kafka: impl Into<ClientSettings>, topics: &[&str]) -> anyhow::Result<()> {
    let admin = admin(kafka)?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    for result in admin.delete_topics(topics, &opts).await? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((topic, code)) => anyhow::bail!("deleting topic {topic}: {code}"),
        }
    }
    Ok(())
}
