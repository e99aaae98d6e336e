//! Whether the brokers take this stage's transactions, asked before the worker joins its group.
//!
//! `exactlyOnce` needs a transaction coordinator that accepts the worker's
//! `transaction.timeout.ms` and lets it use its transactional ids. Asked only at the first
//! assignment (each partition's `init_transactions`), a broker that cannot is found out by a
//! worker already in its group, which stops — and a Deployment restarts it, again and again. So
//! the worker asks first, with a producer of its own id (`<group>.<topic>.probe`, see
//! [`probe_id`]), and sorts the answer ([`Answer`]):
//! - a **refusal** (transactions unsupported, a `transaction.max.timeout.ms` below the worker's
//!   timeout, an ACL) will not change by waiting: the worker stops with exit code 2 and the
//!   cause named ([`Refused`]);
//! - **no answer** (no broker, no coordinator yet — a transaction log that cannot be created,
//!   say) may change: the worker stays not ready and asks again, as it does for a missing
//!   broker.
//!
//! The probe's producer begins no transaction; its id only bumps its own epoch on each call.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer};

use crate::ops::health::Health;

/// How long one ask waits for the coordinator.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);
/// The pause between two asks that found no coordinator.
const ASK_AGAIN: Duration = Duration::from_secs(2);

/// The probe's transactional id: of the stage (its group and input topic), never one of a
/// partition's (`commit::exactly_once::transactional_id` ends in the partition's number).
pub fn probe_id(group: &str, topic: &str) -> String {
    format!("{group}.{topic}.probe")
}

/// The brokers will not take this stage's transactions; waiting will not change that.
#[derive(Debug, thiserror::Error)]
#[error("exactlyOnce cannot run on these brokers: {0}")]
pub struct Refused(pub String);

/// What one ask found.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// The coordinator inited the probe's producer: transactions work here.
    Ready,
    /// A refusal, with its cause in words.
    Refused(String),
    /// No answer yet (no broker, no coordinator); worth asking again.
    NoAnswer(String),
}

/// Sorts the error of the probe's `init_transactions`. `timeout_ms`: the worker's
/// `transaction.timeout.ms`, named in the refusal it causes.
pub fn sort(
    code: Option<RDKafkaErrorCode>,
    retriable: bool,
    said: &str,
    timeout_ms: u64,
) -> Answer {
    match code {
        Some(RDKafkaErrorCode::InvalidTransactionTimeout) => Answer::Refused(format!(
            "the broker refuses transaction.timeout.ms={timeout_ms}: its \
             transaction.max.timeout.ms is lower; raise it to at least {timeout_ms} ({said})"
        )),
        Some(RDKafkaErrorCode::TransactionalIdAuthorizationFailed) => Answer::Refused(format!(
            "the broker does not let this principal use the stage's transactional ids: allow \
             WRITE and DESCRIBE on TransactionalId, pattern type PREFIXED, for \
             `<group>.<topic>.` ({said})"
        )),
        Some(RDKafkaErrorCode::ClusterAuthorizationFailed) => Answer::Refused(format!(
            "the broker does not let this principal write idempotently: allow IDEMPOTENT_WRITE \
             on the cluster ({said})"
        )),
        Some(RDKafkaErrorCode::UnsupportedVersion | RDKafkaErrorCode::UnsupportedFeature) => {
            Answer::Refused(format!(
                "the broker does not support transactions (Apache Kafka 2.5 or newer is \
                 needed) ({said})"
            ))
        }
        _ if retriable => Answer::NoAnswer(format!(
            "{said}; if this lasts, check that the brokers can host the transaction log \
             (transaction.state.log.replication.factor ≤ the number of brokers)"
        )),
        _ => Answer::Refused(said.to_string()),
    }
}

/// Asks once: a producer with the probe's id and `config` (the stage's transactional
/// producers' settings), `init_transactions`, closed. Blocking, up to [`ASK_TIMEOUT`].
pub fn ask(config: &ClientConfig, id: &str, timeout_ms: u64) -> Answer {
    let mut config = config.clone();
    config.set("transactional.id", id);
    let producer: BaseProducer = match config.create() {
        Ok(p) => p,
        Err(e) => return Answer::Refused(format!("the probe's producer: {e}")),
    };
    match producer.init_transactions(ASK_TIMEOUT) {
        Ok(()) => Answer::Ready,
        Err(e) => {
            let retriable = match &e {
                KafkaError::Transaction(t) => t.is_retriable() && !t.is_fatal(),
                _ => true,
            };
            sort(
                e.rdkafka_error_code(),
                retriable,
                &e.to_string(),
                timeout_ms,
            )
        }
    }
}

/// Asks until the brokers answer (see the module doc): `Ok` when transactions work, or when
/// `stopped()` turns true first (the worker is stopping: nothing to probe for); `Err` on a
/// refusal. Keeps `health` alive (and not ready) while it waits. Blocking.
pub fn until_answered(
    config: &ClientConfig,
    id: &str,
    timeout_ms: u64,
    health: &Health,
    stopped: impl Fn() -> bool,
) -> Result<(), Refused> {
    let mut asked = 0u32;
    while !stopped() {
        health.beat();
        match ask(config, id, timeout_ms) {
            Answer::Ready => {
                tracing::info!(probe = %id, "the brokers take this stage's transactions");
                return Ok(());
            }
            Answer::Refused(why) => return Err(Refused(why)),
            Answer::NoAnswer(why) => {
                asked += 1;
                // The first time, then every tenth: a missing broker is not news each time.
                if asked % 10 == 1 {
                    tracing::warn!(
                        probe = %id,
                        asked,
                        "exactlyOnce: no transaction coordinator answered ({why}); not ready, \
                         asking again"
                    );
                }
            }
        }
        for _ in 0..(ASK_AGAIN.as_millis() / 100) {
            if stopped() {
                break;
            }
            health.beat();
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_id_is_no_partitions_id() {
        let id = probe_id("g", "in");
        assert_eq!(id, "g.in.probe");
        for p in 0..64 {
            assert_ne!(
                id,
                crate::commit::exactly_once::transactional_id("g", "in", p)
            );
        }
    }

    #[test]
    fn what_waiting_cannot_change_is_a_refusal_naming_the_setting() {
        let refusal = |code| match sort(Some(code), false, "said", 120_000) {
            Answer::Refused(why) => why,
            other => panic!("{code:?}: {other:?}"),
        };
        assert!(refusal(RDKafkaErrorCode::InvalidTransactionTimeout)
            .contains("transaction.max.timeout.ms is lower; raise it to at least 120000"));
        assert!(
            refusal(RDKafkaErrorCode::TransactionalIdAuthorizationFailed)
                .contains("TransactionalId")
        );
        assert!(refusal(RDKafkaErrorCode::ClusterAuthorizationFailed).contains("IDEMPOTENT_WRITE"));
        assert!(refusal(RDKafkaErrorCode::UnsupportedVersion).contains("2.5 or newer"));
        assert!(refusal(RDKafkaErrorCode::UnsupportedFeature).contains("2.5 or newer"));
        // A refusal stays one even when librdkafka calls it retriable.
        assert!(matches!(
            sort(
                Some(RDKafkaErrorCode::InvalidTransactionTimeout),
                true,
                "",
                1
            ),
            Answer::Refused(_)
        ));
    }

    #[test]
    fn no_coordinator_yet_is_asked_again() {
        for code in [
            Some(RDKafkaErrorCode::CoordinatorNotAvailable),
            Some(RDKafkaErrorCode::OperationTimedOut),
            Some(RDKafkaErrorCode::AllBrokersDown),
            None,
        ] {
            assert!(
                matches!(sort(code, true, "x", 1), Answer::NoAnswer(_)),
                "{code:?}"
            );
        }
        assert!(matches!(
            sort(Some(RDKafkaErrorCode::Fatal), false, "x", 1),
            Answer::Refused(_)
        ));
    }
}
