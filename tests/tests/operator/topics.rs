//! Topic creation by the operator against the real broker: missing topics are created with
//! the declared partitions, existing ones are left alone, and nothing is ever deleted.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use sessionflow_operator::crd::{TopicSpec, TopicsSpec};
use sessionflow_operator::kafka::Connection;
use sessionflow_tests::{brokers, unique};
use sessionflow_worker::kafka::topics;

fn partitions(topic: &str) -> usize {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    md.topics()[0].partitions().len()
}

fn declared(name: &str, partitions: i32, replication_factor: Option<i32>) -> TopicSpec {
    TopicSpec {
        name: name.into(),
        partitions,
        replication_factor,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_topics_are_created_and_existing_ones_left_alone() {
    let (a, b, existing) = (
        unique("op-topic-a"),
        unique("op-topic-b"),
        unique("op-topic-c"),
    );
    topics::create(&brokers(), &[&existing], 5).await.unwrap();
    let spec = TopicsSpec {
        create: true,
        dlq: b.clone(),
        declared: vec![
            declared(&a, 3, Some(1)),
            declared(&b, 2, None),
            // Declared with fewer partitions than it has: the operator does not touch it.
            declared(&existing, 2, Some(1)),
        ],
    };
    let connection = Connection::plain(&brokers());
    let mut created = connection.ensure_topics(&spec).await.unwrap();
    created.sort();
    let mut want = vec![a.clone(), b.clone()];
    want.sort();
    assert_eq!(created, want);
    assert_eq!(
        connection.ensure_topics(&spec).await.unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        (partitions(&a), partitions(&b), partitions(&existing)),
        (3, 2, 5)
    );
    topics::delete(&brokers(), &[&a, &b, &existing])
        .await
        .unwrap();
}
