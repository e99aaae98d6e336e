//! Writing a stage's results: output records and dead letters, one acknowledged write at a time.
//!
//! The producer only sends and reports the broker's answer; *when* a record counts as done is
//! decided by the caller (see `settle`), which waits for that answer before the session moves
//! on. librdkafka keeps per-partition order and, with the idempotent producer, its own retries
//! cannot reorder or duplicate; one session's outputs share a key, hence a partition.
//!
//! Sends that librdkafka refuses locally because its queue is full wait and try again; any
//! other refusal, local or from the broker after librdkafka's retries, is returned to the
//! caller, which knows what the record needs next (the DLQ, or another try).
//!
//! In `atLeastOnce` every write goes through the producer of a [`ProducerSlot`], which a write
//! the broker refused has replaced: librdkafka may reuse an idempotent producer's sequence
//! numbers after such a refusal, and Kafka then drops new records as retries of old ones
//! (`producer_slot`).
//!
//! The client's fatal errors (an idempotent producer that can no longer guarantee order) are
//! caught by [`ProducerEvents`]: the worker goes not-ready and stops, and a restart replays
//! what was in flight. (In `exactlyOnce` a partition's transactional producer reports its own
//! fatal error, a fence, to the loop instead: `output::fenced`.)

use std::sync::Arc;
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer, PurgeConfig};
use tokio_util::sync::CancellationToken;

use crate::commit::completion::{Completion, CompletionSender};
use crate::commit::offsets::Partition;
use crate::group::membership::WriteGate;
use crate::kafka::client_settings::ClientSettings;
use crate::ops::health::Health;
use crate::ops::metrics::Metrics;
use crate::ops::telemetry;
use crate::output::dlq::dlq_headers;
use crate::output::producer_slot::ProducerSlot;
use crate::output::transactions::{Share, Transactions};
use crate::record::DlqReason;
use crate::record::{header, InputRecord, WritePermit};

/// How long to wait before re-enqueueing when librdkafka's local queue is full.
const QUEUE_FULL_BACKOFF: Duration = Duration::from_millis(5);

/// The producer side of a stage.
#[derive(Clone)]
pub struct StageProducer {
    inner: Arc<Inner>,
}

struct Inner {
    /// Every `atLeastOnce` write's producer, replaced after a refused write (`producer_slot`).
    producers: ProducerSlot<ProducerEvents>,
    output: Option<String>,
    dlq: String,
    stage: String,
    completions: CompletionSender,
    metrics: Metrics,
    events: ProducerEvents,
    /// Closed while the group coordinator may have given up on this worker (`membership`).
    gate: Arc<WriteGate>,
    /// `exactlyOnce`: the per-partition transactional producers every write goes through.
    transactions: Option<Arc<Transactions<ProducerEvents>>>,
}

/// What a fatal producer error sets off: the worker goes not-ready and stops.
#[derive(Clone)]
pub struct ProducerEvents {
    pub health: Arc<Health>,
    pub metrics: Metrics,
    /// Cancelled on a fatal error: the worker stops and exits non-zero.
    pub fatal: CancellationToken,
}

impl ProducerEvents {
    fn raise_fatal(&self, error: &dyn std::fmt::Display) {
        if self.fatal.is_cancelled() {
            return;
        }
        self.metrics.fatal_errors.inc();
        self.health.fail();
        tracing::error!(error = %error,
            "fatal producer error: the worker stops; a restart replays what was in flight");
        self.fatal.cancel();
    }
}

impl ClientContext for ProducerEvents {
    fn error(&self, error: KafkaError, reason: &str) {
        // librdkafka reports a fatal error with its underlying code (e.g. an out-of-order
        // sequence number), so the client's fatal state is also checked after every failed
        // write (see `StageProducer::check_fatal`).
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) {
            self.raise_fatal(&error);
        } else {
            tracing::warn!(error = %error, reason, "kafka producer error");
        }
    }
}

/// Why a write did not land.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// librdkafka refused to send it (too large, unknown topic, a fatal client state…).
    #[error("refused by the producer: {0}")]
    Refused(KafkaError),
    /// The broker did not acknowledge it after the producer's own retries.
    #[error("not acknowledged: {0}")]
    NotAcknowledged(KafkaError),
    #[error("the producer was dropped before acknowledging")]
    Dropped,
}

impl WriteError {
    /// Refused because the `exactlyOnce` partition producer was fenced (`output::fenced`).
    pub fn is_fence(&self) -> bool {
        match self {
            Self::Refused(e) | Self::NotAcknowledged(e) => crate::output::fenced::is_fence(e),
            Self::Dropped => false,
        }
    }

    /// Given up by this worker ([`StageProducer::purge`]), not refused by the broker.
    pub fn is_purged(&self) -> bool {
        matches!(
            self,
            Self::NotAcknowledged(KafkaError::MessageProduction(
                RDKafkaErrorCode::PurgeQueue | RDKafkaErrorCode::PurgeInflight
            ))
        )
    }

    /// Timed out in librdkafka (`message.timeout.ms`) with its request perhaps already at the
    /// broker: the record may have been stored although it is reported as not delivered.
    pub fn may_have_landed(&self) -> bool {
        matches!(
            self,
            Self::NotAcknowledged(KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageTimedOut
            ))
        )
    }
}

/// The producer settings the guarantees rely on, then the user's extra properties.
pub fn producer_config(brokers: &str, extra: &[(String, String)]) -> ClientConfig {
    let mut c = ClientSettings::new(brokers).base();
    c.set("linger.ms", "5")
        .set("partitioner", "murmur2_random")
        .set("message.timeout.ms", "300000");
    for (k, v) in extra {
        c.set(k, v);
    }
    // Not overridable: ordered, not duplicated by retries.
    c.set("enable.idempotence", "true");
    c
}

/// The settings of an `exactlyOnce` stage's transactional producers (`output::transactions`,
/// which adds each one's transactional id): [`producer_config`], with the bounds of a write
/// and of a transaction that the stage's commit and rebalance deadlines are sized from.
pub fn transactional_producer_config(brokers: &str, extra: &[(String, String)]) -> ClientConfig {
    let mut c = producer_config(brokers, extra);
    c.set(
        "message.timeout.ms",
        crate::config::EXACTLY_ONCE_MESSAGE_TIMEOUT_MS.to_string(),
    )
    .set(
        "transaction.timeout.ms",
        crate::config::EXACTLY_ONCE_TRANSACTION_TIMEOUT_MS.to_string(),
    );
    c
}

impl StageProducer {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: &ClientConfig,
        events: ProducerEvents,
        output: Option<String>,
        dlq: String,
        stage: String,
        completions: CompletionSender,
        metrics: Metrics,
        transactions: Option<Arc<Transactions<ProducerEvents>>>,
    ) -> anyhow::Result<Self> {
        let producers = ProducerSlot::new(config, events.clone())?;
        Ok(Self {
            inner: Arc::new(Inner {
                producers,
                output,
                dlq,
                stage,
                completions,
                metrics,
                events,
                gate: Arc::default(),
                transactions,
            }),
        })
    }

    /// After a failed write: if the client is in a fatal state (an idempotent producer that
    /// can no longer keep order), stop the worker.
    fn check_fatal<T>(&self, result: Result<T, WriteError>) -> Result<T, WriteError> {
        if result.is_err() {
            let fatal = self.inner.producers.with(|p, _| p.client().fatal_error());
            if let Some((code, reason)) = fatal {
                self.inner
                    .events
                    .raise_fatal(&format!("{code:?}: {reason}"));
            }
        }
        result
    }

    /// Whether the client has failed for good (a fatal error): it purges what it holds, and
    /// nothing written now can land.
    pub fn has_failed(&self) -> bool {
        self.inner.events.fatal.is_cancelled()
            || self
                .inner
                .producers
                .with(|p, _| p.client().fatal_error().is_some())
    }

    /// Whether writes of input `partition` can no longer land: the client has failed, or (in
    /// `exactlyOnce`) the partition's transactional producer was fenced.
    pub fn has_failed_for(&self, partition: Partition) -> bool {
        self.has_failed()
            || self
                .inner
                .transactions
                .as_ref()
                .is_some_and(|t| t.is_fenced(partition))
    }

    /// The gate every write passes first (see `membership`).
    pub fn gate(&self) -> &Arc<WriteGate> {
        &self.inner.gate
    }

    /// `exactlyOnce`: the transactional producers.
    pub fn transactions(&self) -> Option<&Arc<Transactions<ProducerEvents>>> {
        self.inner.transactions.as_ref()
    }

    /// `exactlyOnce`: a write's share of the commit barrier, held from before the write until
    /// its record's completion is sent (see `transactions`). `None` in `atLeastOnce`.
    pub async fn share(&self) -> Option<Share> {
        match &self.inner.transactions {
            Some(t) => Some(t.share().await),
            None => None,
        }
    }

    /// Whether this stage writes outputs at all (a terminal stage does not).
    pub fn has_output(&self) -> bool {
        self.inner.output.is_some()
    }

    /// Writes the output of a processed record and waits for the broker's acknowledgement.
    /// The permit proves the record's partition is still this worker's.
    pub async fn write_output(
        &self,
        record: &InputRecord,
        payload: &[u8],
        _permit: &WritePermit,
    ) -> Result<(), WriteError> {
        let Some(topic) = self.inner.output.as_deref() else {
            return Ok(());
        };
        let traceparent = telemetry::traceparent(record).unwrap_or_default();
        let event_id = record.event_id();
        let mut extra = vec![(header::EVENT_ID, event_id.as_bytes())];
        if !traceparent.is_empty() {
            extra.push((header::TRACEPARENT, traceparent.as_bytes()));
        }
        let headers = record.headers_with(&[header::EVENT_ID, header::TRACEPARENT], &extra);
        let key = record.session().unwrap_or_default();
        let sent = self
            .enqueue(record.partition, topic, Some(key), Some(payload), headers)
            .await
            .map_err(WriteError::Refused);
        let (ack, generation) = self.check_fatal(sent)?;
        self.check_fatal(self.answered(ack, generation).await)?;
        self.inner.metrics.records_out.inc();
        Ok(())
    }

    /// Writes `record` to the DLQ (one try) and waits for the broker's acknowledgement.
    pub async fn write_dead_letter(
        &self,
        record: &InputRecord,
        reason: DlqReason,
        error: &str,
        attempts: u32,
        _permit: &WritePermit,
    ) -> Result<(), WriteError> {
        let headers = dlq_headers(record, &self.inner.stage, reason, error, attempts);
        let sent = self
            .enqueue(
                record.partition,
                &self.inner.dlq,
                record.key(),
                record.value(),
                headers,
            )
            .await
            .map_err(WriteError::Refused);
        let (ack, generation) = self.check_fatal(sent)?;
        self.check_fatal(self.answered(ack, generation).await)?;
        self.inner
            .metrics
            .dlq
            .with_label_values(&[reason.as_str()])
            .inc();
        Ok(())
    }

    /// The broker's answer to a write; a refusal from the broker (not a purge) has the
    /// producer that sent it replaced, `generation` being the one [`ProducerSlot::with`] gave
    /// (`None` in `exactlyOnce`, whose refused writes abort their transaction instead).
    async fn answered(
        &self,
        ack: DeliveryFuture,
        generation: Option<u64>,
    ) -> Result<(), WriteError> {
        let answer = acknowledged(ack).await;
        if let (Err(e @ WriteError::NotAcknowledged(_)), Some(g)) = (&answer, generation) {
            if !e.is_purged() && self.inner.producers.replace(g) {
                self.inner.metrics.producers_replaced.inc();
                tracing::warn!(error = %e,
                    "a write was refused: its producer takes no more writes (a new one does), \
                     since librdkafka may reuse its sequence numbers");
            }
        }
        answer
    }

    /// Enqueues one record, waiting while librdkafka's local queue is full. Other local
    /// refusals are returned: they do not go away by waiting. With the record's delivery, the
    /// generation of the `atLeastOnce` producer it went to.
    /// In `exactlyOnce`, through the transactional producer of the record's input `partition`
    /// (none open: the partition has left, the write is taken back).
    async fn enqueue(
        &self,
        partition: Partition,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: OwnedHeaders,
    ) -> Result<(DeliveryFuture, Option<u64>), KafkaError> {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(k) = key {
            record = record.key(k);
        }
        if let Some(p) = payload {
            record = record.payload(p);
        }
        let sent = match &self.inner.transactions {
            Some(t) => match t.producer(partition) {
                Some(p) => send(record, |r| (p.send_result(r), None)).await?,
                None => {
                    return Err(KafkaError::MessageProduction(RDKafkaErrorCode::PurgeQueue));
                }
            },
            None => {
                let producers = &self.inner.producers;
                send(record, |r| {
                    producers.with(|p, g| (p.send_result(r), Some(g)))
                })
                .await?
            }
        };
        // A write that passed the membership fence as it closed may have been queued after
        // the fence's purge: take it back too (nothing else may be queued while the gate is
        // closed, so this purges only such writes).
        if !self.inner.gate.is_open() {
            self.purge();
        }
        Ok(sent)
    }

    /// The record is done: its result is acknowledged (or it needed none).
    pub fn complete(&self, record: &InputRecord) {
        // The consumer loop may be gone during shutdown; the record then stays uncommitted.
        let _ = self.inner.completions.send(Completion::done(record));
    }

    /// Gives up on a record without completing it: it will be redelivered (to this worker or
    /// the partition's next owner) because its offset is never committed.
    pub fn release(&self, record: &InputRecord) {
        let _ = self.inner.completions.send(Completion::released(record));
    }

    /// Gives up every write not yet acknowledged: librdkafka drops what it has queued or is
    /// retrying (it never sends it) and answers each delivery as purged at once. A request
    /// already on the wire may still be stored by the broker. For a stop, when nothing of
    /// this worker may land once it has left the group, and when the membership fence
    /// closes.
    ///
    /// In `exactlyOnce` a purged write leaves its transaction unable to commit: each partition
    /// that had writes out is doomed (`Transactions::purge`), and the consumer loop aborts its
    /// transaction and rewinds it (or, for a partition leaving, aborts instead of committing).
    pub fn purge(&self) {
        self.inner
            .producers
            .purge_all(PurgeConfig::default().queue().inflight());
        if let Some(t) = &self.inner.transactions {
            t.purge();
        }
    }

    /// Flushes what is still queued in the client.
    pub async fn close(&self, timeout: Duration) {
        let inner = self.inner.clone();
        let _ = tokio::task::spawn_blocking(move || inner.producers.flush(timeout)).await;
    }

    /// The `atLeastOnce` librdkafka client writes go through now (the partition count's
    /// metadata; fault-injection tests).
    pub fn client(&self) -> FutureProducer<ProducerEvents> {
        self.inner.producers.producer()
    }
}

/// One try to enqueue a record: librdkafka's answer (the record back if refused), and what
/// the caller keeps beside the delivery.
type Attempt<'a, T> = (
    Result<DeliveryFuture, (KafkaError, FutureRecord<'a, [u8], [u8]>)>,
    T,
);

/// Enqueues `record` with `attempt` (a producer's `send_result`), waiting while librdkafka's
/// local queue is full.
async fn send<'a, T>(
    mut record: FutureRecord<'a, [u8], [u8]>,
    attempt: impl Fn(FutureRecord<'a, [u8], [u8]>) -> Attempt<'a, T>,
) -> Result<(DeliveryFuture, T), KafkaError> {
    loop {
        match attempt(record) {
            (Ok(ack), kept) => return Ok((ack, kept)),
            (Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)), _) => {
                record = r;
                tokio::time::sleep(QUEUE_FULL_BACKOFF).await;
            }
            (Err((e, _)), _) => return Err(e),
        }
    }
}

async fn acknowledged(ack: DeliveryFuture) -> Result<(), WriteError> {
    match ack.await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((e, _))) => Err(WriteError::NotAcknowledged(e)),
        Err(_) => Err(WriteError::Dropped),
    }
}

/// A producer for unit tests: a terminal stage (no output topic) whose broker never answers,
/// so nothing is written unless a test dead-letters a record.
#[cfg(test)]
pub(crate) fn terminal_stage(
    metrics: &Metrics,
    health: &Arc<Health>,
) -> (StageProducer, crate::commit::completion::CompletionReceiver) {
    let (completions, done) = crate::commit::completion::channel();
    let events = ProducerEvents {
        health: health.clone(),
        metrics: metrics.clone(),
        fatal: Default::default(),
    };
    let producer = StageProducer::new(
        &producer_config("127.0.0.1:1", &[]),
        events,
        None,
        "dlq".into(),
        "test".into(),
        completions,
        metrics.clone(),
        None,
    )
    .expect("a producer needs no broker to be made");
    (producer, done)
}

#[cfg(test)]
mod write_error_tests {
    use super::*;

    #[test]
    fn only_a_timed_out_write_may_have_landed() {
        let failed = |code| WriteError::NotAcknowledged(KafkaError::MessageProduction(code));
        assert!(failed(RDKafkaErrorCode::MessageTimedOut).may_have_landed());
        assert!(!failed(RDKafkaErrorCode::MessageSizeTooLarge).may_have_landed());
        assert!(!failed(RDKafkaErrorCode::PurgeQueue).may_have_landed());
        assert!(failed(RDKafkaErrorCode::PurgeQueue).is_purged());
        let refused = WriteError::Refused(KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageTimedOut,
        ));
        assert!(
            !refused.may_have_landed(),
            "refused before sending: never stored"
        );
    }
}
