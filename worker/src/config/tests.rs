//! The stage configuration's tests: what parses, what is refused and with which key named.

use std::time::Duration;

use super::*;
use crate::session::stuck::{StuckAction, StuckPolicy};

const MINIMAL: &str = "
brokers: 127.0.0.1:9092
stage: nlu
input: in
dlq: dead
handler:
  builtin: {}
";

#[test]
fn minimal_config_gets_defaults() {
    let c = StageConfig::from_yaml(MINIMAL).unwrap();
    assert_eq!(c.group_id(), "sessionflow-nlu");
    assert_eq!(c.settings.session(), SessionSource::Key);
    assert_eq!(c.dispatchers, 8);
    assert_eq!(c.settings.retry().max_attempts, 0);
    assert_eq!(c.settings.commit_interval_ms(), 1_000);
    assert_eq!(c.settings.shutdown_timeout_ms(), 20_000);
    assert_eq!(c.output, None);
}

#[test]
fn credentials_come_from_the_environment() {
    let mut c = StageConfig::from_yaml(MINIMAL).unwrap();
    c.add_credentials(|name| match name {
        SASL_USERNAME_ENV => Some("svc".into()),
        SASL_PASSWORD_ENV => Some("s3cret".into()),
        _ => None,
    });
    assert_eq!(c.kafka["sasl.username"], "svc");
    assert_eq!(c.kafka["sasl.password"], "s3cret");
    let mut none = StageConfig::from_yaml(MINIMAL).unwrap();
    none.add_credentials(|_| None);
    assert!(none.kafka.is_empty());
}

#[test]
fn full_config_parses() {
    let c = StageConfig::from_yaml(
        "
brokers: k:9092
group: g
stage: llm
input: a
output: b
dlq: d
session: {from: header, name: conversation}
handler:
  http: {url: 'http://svc:8080/x', timeoutMs: 500}
retry: {initialBackoffMs: 5, maxBackoffMs: 50, multiplier: 3, maxAttempts: 4}
commitIntervalMs: 200
dispatchers: 4
sessionIdleMs: 1000
maxInFlightPerPartition: 64
metricsAddr: 127.0.0.1:0
kafka: {fetch.wait.max.ms: '100'}
stuck: {timeoutMs: 900, action: dlq}
rebalance: {strategy: eager, drainTimeoutMs: 3000}
",
    )
    .unwrap();
    assert_eq!(
        c.settings.session(),
        SessionSource::Header {
            name: "conversation".into()
        }
    );
    assert_eq!(
        c.handler,
        HandlerConfig::Http(HttpHandlerConfig {
            url: "http://svc:8080/x".into(),
            timeout_ms: 500
        })
    );
    assert_eq!(
        crate::session::retry::RetryPolicy::from(c.settings.retry()).max_attempts,
        4
    );
    assert_eq!(c.kafka["fetch.wait.max.ms"], "100");
    assert_eq!(
        StuckPolicy::from(c.settings.stuck()),
        StuckPolicy {
            timeout: Duration::from_millis(900),
            action: StuckAction::DeadLetter
        }
    );
    assert_eq!(
        c.rebalance.strategy.assignment_strategy(),
        Some("range,roundrobin")
    );
    assert_eq!(c.rebalance.strategy.group_protocol(), "classic");
}

/// The keys the guarantees rest on are refused in the `kafka:` map with the key named; a
/// `rebalance.strategy: consumer` (KIP-848) stage also refuses the classic protocol's
/// session and heartbeat settings, which the broker owns there.
#[test]
fn the_engines_own_kafka_keys_are_refused_by_name() {
    for key in [
        "auto.offset.reset",
        "isolation.level",
        "group.protocol",
        "partition.assignment.strategy",
        "enable.auto.commit",
    ] {
        assert_eq!(
            key_of(&format!("{MINIMAL}kafka: {{{key}: 'x'}}\n")),
            format!("kafka.{key}")
        );
    }
    let consumer = format!("{MINIMAL}rebalance: {{strategy: consumer}}\n");
    let c = StageConfig::from_yaml(&consumer).unwrap();
    assert_eq!(c.rebalance.strategy, RebalanceStrategy::Consumer);
    assert_eq!(c.rebalance.strategy.group_protocol(), "consumer");
    assert_eq!(c.rebalance.strategy.assignment_strategy(), None);
    for key in CLASSIC_ONLY_KAFKA_KEYS {
        let err =
            StageConfig::from_yaml(&format!("{consumer}kafka: {{{key}: '6000'}}\n")).unwrap_err();
        assert_eq!(err.key, format!("kafka.{key}"));
        assert!(err.message.contains("consumer"), "{err}");
        // The classic protocol takes them.
        StageConfig::from_yaml(&format!(
            "{MINIMAL}kafka: {{{key}: '6000', max.poll.interval.ms: '300000'}}\n"
        ))
        .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
}

#[test]
fn a_drain_that_cannot_finish_within_max_poll_interval_is_refused() {
    // The setting: max.poll.interval.ms 10 s with the default 10 s drain.
    let err = StageConfig::from_yaml(&format!(
        "{MINIMAL}kafka: {{max.poll.interval.ms: '10000', session.timeout.ms: '6000'}}\n"
    ))
    .unwrap_err();
    assert_eq!(err.key, "rebalance.drainTimeoutMs");
    assert!(err.message.contains("max.poll.interval.ms"), "{err}");
    assert!(err.message.contains("2500"), "{err}");
    // Just inside: 2 × 2499 + 5000 < 10000.
    StageConfig::from_yaml(&format!(
        "{MINIMAL}rebalance: {{drainTimeoutMs: 2499}}\nkafka: {{max.poll.interval.ms: '10000', session.timeout.ms: '6000'}}\n"
    ))
    .unwrap();
    // Default max.poll.interval.ms (300 s): the default drain fits, 150 s does not.
    StageConfig::from_yaml(MINIMAL).unwrap();
    assert_eq!(
        key_of(&format!("{MINIMAL}rebalance: {{drainTimeoutMs: 150000}}\n")),
        "rebalance.drainTimeoutMs"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}kafka: {{max.poll.interval.ms: soon}}\n")),
        "kafka.max.poll.interval.ms"
    );
    // Below the (default 45 s) session timeout librdkafka would refuse the consumer.
    assert_eq!(
        key_of(&format!(
            "{MINIMAL}kafka: {{max.poll.interval.ms: '30000'}}\n"
        )),
        "kafka.max.poll.interval.ms"
    );
}

fn key_of(yaml: &str) -> String {
    StageConfig::from_yaml(yaml).unwrap_err().key
}

/// The flattened settings keep their keys' names in errors, though serde's flatten hides
/// their path (they are read again on their own to find it), and unknown keys beside
/// them are still refused.
#[test]
fn errors_in_the_shared_settings_name_the_key() {
    assert_eq!(
        key_of(&format!("{MINIMAL}commitIntervalMs: soon\n")),
        "commitIntervalMs"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}shutdownTimeoutMs: -1\n")),
        "shutdownTimeoutMs"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}stuck: {{timeoutMs: 1, when: later}}\n")),
        "stuck.when"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}shutdownTimeoutMs: 0\n")),
        "shutdownTimeoutMs"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}session: {{from: header}}\n")),
        "session"
    );
    let unknown = StageConfig::from_yaml(&format!("{MINIMAL}retries: {{}}\n")).unwrap_err();
    assert!(unknown.message.contains("retries"), "{unknown}");
}

/// A stage's own settings over its pipeline's over the worker's defaults, field by field.
#[test]
fn settings_are_laid_over_their_defaults_field_by_field() {
    let stage = StageSettings {
        retry: Some(RetryConfig {
            max_attempts: 9,
            ..RetryConfig::default()
        }),
        commit_interval_ms: Some(250),
        delivery: Some(Delivery::AtLeastOnce),
        ..StageSettings::default()
    };
    let pipeline = StageSettings {
        retry: Some(RetryConfig {
            max_attempts: 3,
            ..RetryConfig::default()
        }),
        shutdown_timeout_ms: Some(45_000),
        delivery: Some(Delivery::ExactlyOnce),
        ..StageSettings::default()
    };
    let merged = stage
        .over(&pipeline)
        .over(&StageSettings::worker_defaults());
    assert_eq!(merged.retry.unwrap().max_attempts, 9);
    assert_eq!(merged.commit_interval_ms, Some(250));
    assert_eq!(merged.shutdown_timeout_ms, Some(45_000));
    assert_eq!(merged.session, Some(SessionSource::Key));
    assert_eq!(merged.stuck, Some(StuckConfig::default()));
    assert_eq!(merged.delivery(), Delivery::AtLeastOnce);
    assert_eq!(
        StageSettings::default()
            .over(&pipeline)
            .over(&StageSettings::worker_defaults())
            .delivery(),
        Delivery::ExactlyOnce
    );
    assert_eq!(StageSettings::default().delivery(), Delivery::AtLeastOnce);
    assert_eq!(
        StageSettings::default().over(&StageSettings::worker_defaults()),
        StageSettings::worker_defaults()
    );
}

#[test]
fn errors_name_the_key() {
    assert_eq!(
        key_of(&format!("{MINIMAL}retry: {{multiplier: fast}}\n")),
        "retry.multiplier"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}retry: {{multiplier: 0.5}}\n")),
        "retry.multiplier"
    );
    assert_eq!(key_of(&format!("{MINIMAL}dispatchers: 0\n")), "dispatchers");
    assert_eq!(
        key_of(&format!("{MINIMAL}stuck: {{action: explode}}\n")),
        "stuck.action"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}rebalance: {{strategy: sticky}}\n")),
        "rebalance.strategy"
    );
    assert_eq!(key_of(&format!("{MINIMAL}output: in\n")), "output");
    assert_eq!(
        key_of(&format!("{MINIMAL}kafka: {{enable.auto.commit: 'true'}}\n")),
        "kafka.enable.auto.commit"
    );
    assert_eq!(
        key_of(&format!(
            "{MINIMAL}kafka: {{queued.max.messages.kbytes: '9000'}}\n"
        )),
        "kafka.queued.max.messages.kbytes"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}prefetchKbytes: 0\n")),
        "prefetchKbytes"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}kafka: {{queued.min.messages: '5'}}\n")),
        "kafka.queued.min.messages"
    );
    assert_eq!(
        key_of(&format!("{MINIMAL}prefetchRecords: 0\n")),
        "prefetchRecords"
    );
    assert_eq!(
        key_of(&MINIMAL.replace("builtin: {}", "builtin: {poisonRate: 2}")),
        "handler.builtin.poisonRate"
    );
    assert_eq!(
        key_of(&MINIMAL.replace("builtin: {}", "http: {url: ftp://x}")),
        "handler.http.url"
    );
    let unknown = StageConfig::from_yaml(&format!("{MINIMAL}dispachers: 3\n")).unwrap_err();
    assert!(unknown.message.contains("dispachers"), "{unknown}");
    let missing = StageConfig::from_yaml("stage: x\n").unwrap_err();
    assert!(missing.message.contains("input"), "{missing}");
}
