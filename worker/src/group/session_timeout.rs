//! The session timeout the group coordinator really applies to this member.
//!
//! The membership fence ([`crate::group::membership`]) closes the write gate when the coordinator
//! has been silent for two thirds of the session timeout, so it must measure with the timeout
//! the coordinator uses. Under the classic protocol that is the member's own
//! `session.timeout.ms`. Under KIP-848 (`rebalance.strategy: consumer`) the broker decides it:
//! the group's `consumer.session.timeout.ms` if the group has one, else the broker's
//! `group.consumer.session.timeout.ms` (45 s by default). A fence measuring 45 s against a
//! broker that drops members after 6 s would let a dropped member write for 24 s after its
//! partitions moved; so the worker asks the broker at start, and says which value it took.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;

use crate::config::{RebalanceStrategy, StageConfig, DEFAULT_CONSUMER_SESSION_TIMEOUT_MS};

/// How long the start waits for the broker's answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);

/// The session timeout of `config`'s group: its own setting under the classic protocol, the
/// broker's under KIP-848 (read through `admin_config`, the stage's client settings).
pub async fn effective(config: &StageConfig, admin_config: &ClientConfig) -> Duration {
    if config.rebalance.strategy != RebalanceStrategy::Consumer {
        return Duration::from_millis(config.session_timeout_ms());
    }
    match broker_decides(admin_config, &config.group_id()).await {
        Ok((ms, source)) => {
            tracing::info!(
                session_timeout_ms = ms,
                source,
                "KIP-848 session timeout, from the broker"
            );
            Duration::from_millis(ms)
        }
        Err(e) => {
            tracing::warn!(error = %e, assumed_ms = DEFAULT_CONSUMER_SESSION_TIMEOUT_MS,
                "could not read the broker's KIP-848 session timeout; the membership fence assumes Kafka's default");
            Duration::from_millis(DEFAULT_CONSUMER_SESSION_TIMEOUT_MS)
        }
    }
}

/// The group's `consumer.session.timeout.ms`, else the controller-elected broker's
/// `group.consumer.session.timeout.ms`; with where it came from.
async fn broker_decides(
    admin_config: &ClientConfig,
    group: &str,
) -> anyhow::Result<(u64, &'static str)> {
    let admin: AdminClient<DefaultClientContext> = admin_config.create()?;
    let opts = AdminOptions::new().request_timeout(Some(ASK_TIMEOUT));
    if let Ok(results) = admin
        .describe_configs([&ResourceSpecifier::Group(group)], &opts)
        .await
    {
        for resource in results.into_iter().flatten() {
            if let Some(ms) = resource
                .get("consumer.session.timeout.ms")
                .and_then(|e| e.value.as_deref()?.parse().ok())
            {
                return Ok((ms, "group config consumer.session.timeout.ms"));
            }
        }
    }
    let metadata = admin
        .inner()
        .fetch_metadata(None, ASK_TIMEOUT)
        .map_err(|e| anyhow::anyhow!("metadata: {e}"))?;
    let broker = metadata
        .brokers()
        .first()
        .map(|b| b.id())
        .ok_or_else(|| anyhow::anyhow!("no broker in the metadata"))?;
    let results = admin
        .describe_configs([&ResourceSpecifier::Broker(broker)], &opts)
        .await?;
    for resource in results {
        let resource = resource.map_err(|e| anyhow::anyhow!("broker {broker}'s config: {e}"))?;
        if let Some(ms) = resource
            .get("group.consumer.session.timeout.ms")
            .and_then(|e| e.value.as_deref()?.parse().ok())
        {
            return Ok((ms, "broker config group.consumer.session.timeout.ms"));
        }
    }
    anyhow::bail!("broker {broker} does not report group.consumer.session.timeout.ms")
}
