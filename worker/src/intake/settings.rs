//! What the consumer loop is told, and how its consumer is configured.
//!
//! The loop's settings are read by the loop, the rebalance callbacks and the shutdown alike;
//! they live apart so that each of those can name them without naming the others.

use std::time::Duration;

use rdkafka::config::ClientConfig;

use crate::config::RebalanceStrategy;
use crate::intake::prefetch::Prefetch;
use crate::kafka::client_settings::ClientSettings;
use crate::record::SessionSource;

/// The consumer loop's settings.
#[derive(Debug, Clone)]
pub struct IntakeSettings {
    pub input: String,
    pub session: SessionSource,
    pub commit_interval: Duration,
    pub max_in_flight_per_partition: usize,
    /// Longest wait for a revoked partition's in-flight records.
    pub revoke_drain_timeout: Duration,
    /// After that, longest wait for the results of a revoked partition already on their way
    /// to the broker (the fence): as much of the poll budget as the revocation has left.
    pub write_fence_timeout: Duration,
    /// Longest wait for in-flight records at shutdown.
    pub shutdown_timeout: Duration,
    /// After that, longest wait for the results already on their way to the broker, before
    /// they are given up (purged) and the worker leaves the group.
    pub shutdown_fence_timeout: Duration,
    /// At shutdown, also process the records queued behind each session's current one
    /// (otherwise they are released to the partition's next owner).
    pub shutdown_drain_queued: bool,
    /// What librdkafka may prefetch (the consumer was created with its share per partition).
    pub prefetch: Prefetch,
    /// The group's `session.timeout.ms`: the membership fence's measure.
    pub session_timeout: Duration,
}

/// The consumer settings the guarantees rely on, then the user's extra properties.
pub fn consumer_config(
    brokers: &str,
    group: &str,
    strategy: RebalanceStrategy,
    prefetch: Prefetch,
    extra: &[(String, String)],
) -> ClientConfig {
    let mut c = ClientSettings::new(brokers).base();
    // How much one fetch brings and how soon a full queue is looked at again (the user's
    // `kafka:` may change these).
    for (k, v) in prefetch.fetch_settings(extra) {
        c.set(k, v);
    }
    for (k, v) in extra {
        c.set(k, v);
    }
    // Each partition has its own queue (see `partition_queues`), so these are per partition:
    // shares of the worker's totals.
    for (k, v) in prefetch.queue_settings() {
        c.set(k, v);
    }
    c.set("group.id", group)
        .set("group.protocol", strategy.group_protocol())
        // Starting at the end would skip what was produced before the stage first ran.
        .set("auto.offset.reset", "earliest")
        // An aborted transaction's records (an exactly-once upstream stage's zombie) are never
        // input.
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    if let Some(assignor) = strategy.assignment_strategy() {
        c.set("partition.assignment.strategy", assignor);
    }
    c
}
