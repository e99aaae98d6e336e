//! The group protocols against Apache Kafka: the membership fence of a KIP-848 stage
//! (`rebalance.strategy: consumer`) measures with the session timeout the broker applies, not
//! a client setting that protocol ignores. (The protocols' rebalance and handover tests are
//! in `rebalance` and `handover`, one per protocol.)

use std::time::Duration;

use sessionflow_tests::{brokers, builtin, Topics};
use sessionflow_worker::config::RebalanceStrategy;
use sessionflow_worker::group::session_timeout;
use sessionflow_worker::kafka::client_settings::ClientSettings;

/// scripts/kafka.sh sets the broker's `group.consumer.session.timeout.ms` to 6 s, far from
/// Kafka's default of 45 s: a fence that assumed the default would let a dropped member write
/// for half a minute after its partitions moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kip848_stage_measures_its_fence_with_the_brokers_session_timeout() {
    let topics = Topics::create("kip848-timeout", 1).await;
    let admin = ClientSettings::new(brokers()).base();
    let mut config = topics.stage(builtin(0.0, 0.0));
    config.kafka.remove("session.timeout.ms");
    config.kafka.remove("heartbeat.interval.ms");
    config.rebalance.strategy = RebalanceStrategy::Consumer;
    config.validate().expect("a KIP-848 stage config");
    assert_eq!(
        session_timeout::effective(&config, &admin).await,
        Duration::from_secs(6)
    );
    // The classic protocol keeps its own setting (the broker cannot know it before the join).
    let mut classic = topics.stage(builtin(0.0, 0.0));
    classic
        .kafka
        .insert("session.timeout.ms".into(), "7000".into());
    assert_eq!(
        session_timeout::effective(&classic, &admin).await,
        Duration::from_secs(7)
    );
    topics.delete().await;
}
