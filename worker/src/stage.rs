//! Running one stage: wiring the consumer loop, dispatchers, session tasks and producer.
//!
//! The pieces start in dependency order (metrics server, producer, dispatchers, then the
//! consumer loop that feeds them) and stop in reverse: the consumer loop stops fetching, waits
//! for in-flight records up to the shutdown timeout and commits; then session tasks are
//! aborted, the producer's acknowledgements awaited and its queue flushed. Rust users embed the
//! engine through [`start`] / [`run`] with their own [`Handler`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::producer::Producer;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;

use crate::commit::completion;
use crate::commit::lag::{Assigned, LagReporter};
use crate::config::{Delivery, StageConfig, EXACTLY_ONCE_TRANSACTION_TIMEOUT_MS};
use crate::dispatch::dispatcher::Dispatcher;
use crate::handler::Handler;
use crate::intake::prefetch::{self, Prefetch};
use crate::intake::{consumer_config, IntakeLoop, IntakeSettings, IntakeTokens};
use crate::ops::health::{self, Health};
use crate::ops::metrics::Metrics;
use crate::output::producer::{
    producer_config, transactional_producer_config, ProducerEvents, StageProducer,
};
use crate::output::transaction_probe::{probe_id, until_answered};
use crate::output::transactions::Transactions;
use crate::session::task::SessionContext;

/// How long, after the consumer loop ends, session tasks and acknowledgements get to finish.
pub const CLOSE_GRACE: Duration = Duration::from_secs(10);
/// How long the start waits for the input topic's partition count (see `prefetch`).
const PARTITION_COUNT_WAIT: Duration = Duration::from_secs(3);

/// A stage running in the background. Dropping it stops the stage gracefully (as
/// [`stop`](Self::stop) does) without waiting: a handle lost to a panic or an early return
/// must not leave a consumer loop running, which would also keep its runtime from shutting
/// down.
pub struct RunningWorker {
    pub metrics: Metrics,
    pub health: Arc<Health>,
    /// Where `/metrics` is served, when enabled.
    pub metrics_addr: Option<SocketAddr>,
    stop: CancellationToken,
    done: JoinHandle<anyhow::Result<()>>,
    producer: StageProducer,
    _stop_on_drop: DropGuard,
}

impl RunningWorker {
    /// Asks the worker to stop gracefully (as SIGTERM does).
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Waits for the worker to end.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.done.await?
    }

    /// Stops the worker and waits for it.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.stop();
        self.wait().await
    }

    /// The stage's producer client, for fault-injection tests (e.g. librdkafka's
    /// `rd_kafka_test_fatal_error`).
    pub fn producer_client(
        &self,
    ) -> rdkafka::producer::FutureProducer<crate::output::producer::ProducerEvents> {
        self.producer.client()
    }
}

/// Runs a stage until `stop` is cancelled.
pub async fn run<H: Handler>(
    config: StageConfig,
    handler: H,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let worker = start(config, handler).await?;
    let stopper = worker.stop.clone();
    tokio::spawn(async move {
        stop.cancelled().await;
        stopper.cancel();
    });
    worker.wait().await
}

/// Starts a stage in the background.
pub async fn start<H: Handler>(config: StageConfig, handler: H) -> anyhow::Result<RunningWorker> {
    config.validate()?;
    crate::commit::exactly_once::check_stage(&config)?;
    if let crate::record::SessionSource::Header { name } = &config.settings.session() {
        // Order is kept per partition's owner: a session whose records carry the header but
        // whose keys differ lands on several partitions, so on several workers at once.
        tracing::warn!(header = %name,
            "session ids come from a header: a session is ordered only within one partition; \
             if its records are keyed differently (and so spread over partitions), two workers \
             may run it at once. Key the records by session, or make sure one session's \
             records share a partition");
    }
    let metrics = Metrics::new(&config.stage);
    let health = Arc::new(Health::default());
    let tokens = IntakeTokens::default();
    let stop = tokens.stop.clone();
    let abort = tokens.abort.clone();
    let server_stop = CancellationToken::new();

    let metrics_addr = match config.metrics_addr {
        Some(addr) => Some(
            health::serve(addr, metrics.clone(), health.clone(), server_stop.clone())
                .await
                .map_err(|e| anyhow::anyhow!("metricsAddr {addr}: {e}"))?,
        ),
        None => None,
    };

    let extra: Vec<(String, String)> = config
        .kafka
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let (completions_tx, completions_rx) = completion::channel();
    let events = ProducerEvents {
        health: health.clone(),
        metrics: metrics.clone(),
        fatal: tokens.fatal.clone(),
    };
    metrics.eos_enabled.set(i64::from(
        config.settings.delivery() == Delivery::ExactlyOnce,
    ));
    let mut probe = None;
    let transactions = (config.settings.delivery() == Delivery::ExactlyOnce).then(|| {
        let c = transactional_producer_config(&config.brokers, &extra);
        probe = Some((c.clone(), probe_id(&config.group_id(), &config.input)));
        Arc::new(Transactions::new(
            c,
            &config.group_id(),
            &config.input,
            events.clone(),
        ))
    });
    let producer = StageProducer::new(
        &producer_config(&config.brokers, &extra),
        events,
        config.output.clone(),
        config.dlq.clone(),
        config.stage.clone(),
        completions_tx,
        metrics.clone(),
        transactions,
    )?;

    let sessions = TaskTracker::new();
    let session_ctx = Arc::new(SessionContext {
        handler: Arc::new(handler),
        producer: producer.clone(),
        retry: config.settings.retry().into(),
        stuck: config.settings.stuck().into(),
        metrics: metrics.clone(),
        health: health.clone(),
        abort: abort.clone(),
        release_queued: tokens.release_queued.clone(),
    });
    let idle = Duration::from_millis(config.session_idle_ms);
    let senders: Vec<_> = (0..config.dispatchers)
        .map(|_| {
            let (tx, rx) = crate::dispatch::handoff::handoff(config.dispatcher_capacity);
            sessions.spawn(Dispatcher::new(rx, session_ctx.clone(), idle, sessions.clone()).run());
            tx
        })
        .collect();

    // librdkafka takes the prefetch share once, when the consumer is created: count the input
    // topic's partitions now (no broker yet: the assumed count, see `prefetch`).
    let counted = {
        let producer = producer.clone();
        let topic = config.input.clone();
        tokio::task::spawn_blocking(move || {
            prefetch::count_partitions(producer.client().client(), &topic, PARTITION_COUNT_WAIT)
        })
        .await
        .ok()
        .flatten()
    };
    if counted.is_none() {
        tracing::warn!(topic = %config.input, assumed = prefetch::UNCOUNTED_PARTITIONS,
            "could not count the input topic's partitions at start; the prefetch budget is shared by the assumed count");
    }
    let settings = IntakeSettings {
        input: config.input.clone(),
        session: config.settings.session(),
        commit_interval: Duration::from_millis(config.settings.commit_interval_ms()),
        max_in_flight_per_partition: config.max_in_flight_per_partition,
        revoke_drain_timeout: Duration::from_millis(config.rebalance.drain_timeout_ms),
        write_fence_timeout: Duration::from_millis(config.write_fence_ms()),
        shutdown_timeout: Duration::from_millis(config.settings.shutdown_timeout_ms()),
        shutdown_fence_timeout: Duration::from_millis(config.shutdown_fence_ms()),
        shutdown_drain_queued: config.shutdown_drain_queued,
        prefetch: Prefetch::new(config.prefetch_kbytes, config.prefetch_records, counted),
        session_timeout: crate::group::session_timeout::effective(
            &config,
            &crate::kafka::client_settings::ClientSettings::with_properties(
                config.brokers.clone(),
                extra.iter().cloned(),
            )
            .base(),
        )
        .await,
    };
    let assigned = Assigned::default();
    let lag_thread = LagReporter {
        brokers: config.brokers.clone(),
        kafka: extra.clone(),
        group: config.group_id(),
        topic: config.input.clone(),
        interval: Duration::from_millis(config.lag_interval_ms),
        assigned: assigned.clone(),
        metrics: metrics.clone(),
    }
    .spawn(server_stop.clone())?;
    let intake = IntakeLoop::new(
        &consumer_config(
            &config.brokers,
            &config.group_id(),
            config.rebalance.strategy,
            settings.prefetch,
            &extra,
        ),
        settings,
        completions_rx,
        assigned,
        senders,
        producer.clone(),
        metrics.clone(),
        health.clone(),
        tokio::runtime::Handle::current(),
        tokens,
    )?;
    tokio::spawn(crate::ops::memory::trim_after_reaps(
        metrics.sessions.clone(),
        server_stop.clone(),
    ));
    // In exactlyOnce, the brokers are asked first whether they take the stage's transactions
    // (`transaction_probe`): the worker joins its group only once they do.
    let (probe_health, probe_stop) = (health.clone(), stop.clone());
    let thread = std::thread::Builder::new()
        .name(format!("intake-{}", config.stage))
        .spawn(move || -> anyhow::Result<()> {
            if let Some((config, id)) = probe {
                let timeout_ms = EXACTLY_ONCE_TRANSACTION_TIMEOUT_MS;
                let stopped = || probe_stop.is_cancelled();
                until_answered(&config, &id, timeout_ms, &probe_health, stopped)?;
                if stopped() {
                    return Ok(());
                }
            }
            Ok(intake.run()?)
        })?;

    let summary = metrics.clone();
    let closing = producer.clone();
    let done = tokio::spawn(async move {
        let joined = tokio::task::spawn_blocking(move || thread.join()).await?;
        let producer = closing;
        // The loop has drained and committed (or given up at its deadline).
        abort.cancel();
        sessions.close();
        let _ = tokio::time::timeout(CLOSE_GRACE, sessions.wait()).await;
        producer.close(CLOSE_GRACE).await;
        server_stop.cancel();
        let _ = tokio::task::spawn_blocking(move || lag_thread.join()).await;
        summary.log();
        match joined {
            Ok(result) => result,
            Err(_) => Err(anyhow::anyhow!("the consumer loop panicked")),
        }
    });
    Ok(RunningWorker {
        metrics,
        health,
        metrics_addr,
        _stop_on_drop: stop.clone().drop_guard(),
        stop,
        done,
        producer,
    })
}
