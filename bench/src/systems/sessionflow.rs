//! System 2: sessionflow, the engine in-process through its library API.
//!
//! Exactly what a Rust user does: a `StageConfig`, a `Handler` of their own (here, the bench
//! handler), `sessionflow_worker::start`. The stage is terminal (no output topic), like the
//! baselines, so every system does the same work per record; the engine still tracks every
//! offset, commits contiguous watermarks and runs its own order watchdog. As *sessionflow +
//! output* (settings with an `output` topic) the handler returns the record's value and the
//! engine writes it to that topic: a record is done when its output is acknowledged, which is
//! what a pipeline stage that is not the last one pays. The `sessionflow-eos` variant sets
//! `delivery: exactlyOnce` and a 100 ms commit interval (`sessionflow-alo100`: the same interval,
//! atLeastOnce); a terminal stage still commits each partition's offsets in a transaction of
//! its partition's transactional producer. With `telemetry` the
//! worker binary's tracing setup is installed first, as in a deployed worker, with logging at
//! `warn`: with no OTLP endpoint and no `traceparent` on the records, no record gets a span.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::FutureExt;
use sessionflow_worker::config::{BuiltinHandlerConfig, HandlerConfig, RetryConfig, StageSettings};
use sessionflow_worker::record::header;
use sessionflow_worker::{Handler, HandlerError, HandlerResult, InputRecord, StageConfig};

use super::{common_kafka, Running, SystemSettings, PREFETCH_KEY, PREFETCH_RECORDS_KEY};
use crate::handler::Core;
use crate::workload::decode;

struct BenchHandler {
    core: Arc<Core>,
    /// Return the input value as the output record (sessionflow + output).
    echo: bool,
}

impl Handler for BenchHandler {
    async fn handle(&self, record: &InputRecord, attempt: u32) -> HandlerResult {
        let seq = record.header(header::SEQ);
        match decode(record.value(), seq) {
            Some(v) => self
                .core
                .call(v, record.partition, attempt)
                .await
                .map(|()| {
                    self.echo
                        .then(|| record.value().unwrap_or_default().to_vec())
                })
                .map_err(HandlerError::Transient),
            None => Ok(None),
        }
    }
}

pub fn stage_config(settings: &SystemSettings) -> StageConfig {
    // The baselines' prefetch is per partition queue; sessionflow bounds it per worker
    // (`prefetchKbytes`, `prefetchRecords`: its defaults unless the run asks otherwise).
    let kafka: BTreeMap<String, String> = common_kafka(settings)
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .chain(settings.sessionflow_kafka.iter().cloned())
        .filter(|(k, _)| k != PREFETCH_KEY && k != PREFETCH_RECORDS_KEY)
        .collect();
    // `--sessionflow-kafka queued.max.messages.kbytes=N` (or `queued.min.messages=N`) sets the
    // engine's total.
    let total = |key: &str| {
        settings
            .sessionflow_kafka
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.parse().ok())
    };
    let prefetch_kbytes =
        total(PREFETCH_KEY).unwrap_or_else(sessionflow_worker::config::defaults::prefetch_kbytes);
    let prefetch_records = total(PREFETCH_RECORDS_KEY)
        .unwrap_or_else(sessionflow_worker::config::defaults::prefetch_records);
    StageConfig {
        brokers: settings.brokers.clone(),
        group: Some(settings.group.clone()),
        stage: "bench".into(),
        input: settings.topic.clone(),
        output: settings.output.clone(),
        dlq: settings.dlq.clone(),
        // Not used: the bench handler is passed to `start` directly.
        handler: HandlerConfig::Builtin(BuiltinHandlerConfig::default()),
        settings: StageSettings {
            session: Some(Default::default()),
            retry: Some(RetryConfig {
                initial_backoff_ms: settings.retry_initial_ms,
                max_backoff_ms: settings.retry_max_ms,
                multiplier: 2.0,
                max_attempts: 0,
            }),
            stuck: Some(Default::default()),
            commit_interval_ms: Some(settings.commit_interval_ms),
            shutdown_timeout_ms: Some(10_000),
            delivery: settings
                .exactly_once
                .then_some(sessionflow_worker::config::Delivery::ExactlyOnce),
        },
        rebalance: Default::default(),
        dispatchers: 8,
        dispatcher_capacity: 1_024,
        session_idle_ms: settings.session_idle_ms,
        max_in_flight_per_partition: settings
            .max_in_flight_per_partition
            .unwrap_or_else(sessionflow_worker::config::defaults::max_in_flight_per_partition),
        prefetch_kbytes,
        prefetch_records,
        lag_interval_ms: 5_000,
        shutdown_drain_queued: false,
        metrics_addr: None,
        otlp_endpoint: None,
        kafka,
    }
}

pub async fn start(settings: &SystemSettings, core: Arc<Core>) -> anyhow::Result<Running> {
    let telemetry = settings.telemetry.then(|| {
        if std::env::var_os("RUST_LOG").is_none() {
            std::env::set_var("RUST_LOG", "warn");
        }
        sessionflow_worker::ops::telemetry::init(
            sessionflow_worker::ops::telemetry::LogFormat::Text,
        )
    });
    let handler = BenchHandler {
        core,
        echo: settings.output.is_some(),
    };
    let worker = sessionflow_worker::start(stage_config(settings), handler).await?;
    let metrics = worker.metrics.clone();
    Ok(Running {
        stop: Box::new(move || {
            async move {
                if let Err(e) = worker.shutdown().await {
                    eprintln!("sessionflow: shutdown: {e}");
                }
                drop(telemetry);
            }
            .boxed()
        }),
        sessions: Some(Box::new(move || metrics.sessions.get())),
        pid: None,
        go: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sessionflow_worker::config::Delivery;

    fn settings(commit_interval_ms: u64, exactly_once: bool) -> SystemSettings {
        SystemSettings {
            brokers: "127.0.0.1:9092".into(),
            topic: "in".into(),
            dlq: "dlq".into(),
            output: None,
            group: "g".into(),
            partitions: 8,
            retry_initial_ms: 1,
            retry_max_ms: 100,
            pool_workers: 1,
            pool_queue: 1,
            session_idle_ms: 30_000,
            telemetry: false,
            fetch_wait_ms: 10,
            sessionflow_kafka: vec![],
            commit_interval_ms,
            exactly_once,
            max_in_flight_per_partition: None,
            pc_max_concurrency: None,
        }
    }

    #[test]
    fn the_in_flight_budget_is_the_workers_default_unless_the_run_sets_it() {
        let default = stage_config(&settings(1_000, false));
        assert_eq!(
            default.max_in_flight_per_partition,
            sessionflow_worker::config::defaults::max_in_flight_per_partition()
        );
        let set = SystemSettings {
            max_in_flight_per_partition: Some(125),
            ..settings(1_000, false)
        };
        assert_eq!(stage_config(&set).max_in_flight_per_partition, 125);
    }

    #[test]
    fn the_stage_takes_the_variants_delivery_and_commit_interval() {
        let eos = stage_config(&settings(100, true)).settings;
        assert_eq!(eos.delivery(), Delivery::ExactlyOnce);
        assert_eq!(eos.commit_interval_ms, Some(100));
        let alo = stage_config(&settings(1_000, false)).settings;
        assert_eq!(alo.delivery(), Delivery::AtLeastOnce);
        assert_eq!(alo.commit_interval_ms, Some(1_000));
        // What a child reads when the parent sent no such fields: the 1 s atLeastOnce stage.
        let old: SystemSettings = serde_json::from_value({
            let mut v = serde_json::to_value(settings(100, true)).unwrap();
            v.as_object_mut().unwrap().remove("commit_interval_ms");
            v.as_object_mut().unwrap().remove("exactly_once");
            v
        })
        .unwrap();
        assert_eq!((old.commit_interval_ms, old.exactly_once), (1_000, false));
    }
}
