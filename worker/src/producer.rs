//! Writing a stage's results: output records and dead letters, and completing their offsets.
//!
//! A record counts as done only once the broker has acknowledged what it produced, so the
//! producer is where completions start. Sends are *enqueued* in session order by the session
//! task (librdkafka keeps per-partition order, and with the idempotent producer its retries
//! cannot reorder or duplicate), and a small task awaits each acknowledgement; the session task
//! moves on to its next record without waiting for the round trip. One session's outputs share
//! a key, hence a partition, hence an order.
//!
//! A failed output (after librdkafka's own retries) goes to the DLQ as `produce-failed`. A
//! failed dead letter is retried until it lands: completing it anyway would lose the record.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use tokio_util::task::TaskTracker;

use crate::completion::{Completion, CompletionSender};
use crate::dlq::{dlq_headers, DlqReason};
use crate::metrics::Metrics;
use crate::record::{header, InputRecord};
use crate::telemetry;

/// How long to wait before re-enqueueing when librdkafka's local queue is full.
const QUEUE_FULL_BACKOFF: Duration = Duration::from_millis(5);
/// Backoff between attempts to write a dead letter that the broker refused.
const DLQ_RETRY_BACKOFF: Duration = Duration::from_millis(500);

/// The producer side of a stage.
#[derive(Clone)]
pub struct StageProducer {
    inner: Arc<Inner>,
}

struct Inner {
    producer: FutureProducer,
    output: Option<String>,
    dlq: String,
    stage: String,
    completions: CompletionSender,
    metrics: Metrics,
    /// Acknowledgement waiters, so shutdown can wait for them.
    acks: TaskTracker,
}

/// The producer settings the guarantees rely on, then the user's extra properties.
pub fn producer_config(brokers: &str, extra: &[(String, String)]) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("linger.ms", "5")
        .set("partitioner", "murmur2_random")
        .set("message.timeout.ms", "300000");
    for (k, v) in extra {
        c.set(k, v);
    }
    // Not overridable: ordered, not duplicated by retries.
    c.set("enable.idempotence", "true");
    c
}

impl StageProducer {
    pub fn new(
        config: &ClientConfig,
        output: Option<String>,
        dlq: String,
        stage: String,
        completions: CompletionSender,
        metrics: Metrics,
    ) -> anyhow::Result<Self> {
        let producer: FutureProducer = config.create()?;
        Ok(Self {
            inner: Arc::new(Inner {
                producer,
                output,
                dlq,
                stage,
                completions,
                metrics,
                acks: TaskTracker::new(),
            }),
        })
    }

    /// Writes the output of a processed record (if any) and completes the record once the
    /// broker has acknowledged it.
    pub async fn output(&self, record: &InputRecord, payload: Option<Vec<u8>>) {
        let (Some(topic), Some(payload)) = (self.inner.output.as_deref(), payload) else {
            self.complete(record);
            return;
        };
        let traceparent = telemetry::traceparent(record).unwrap_or_default();
        let mut extra = vec![(header::EVENT_ID, record.event_id.as_bytes())];
        if !traceparent.is_empty() {
            extra.push((header::TRACEPARENT, traceparent.as_bytes()));
        }
        let headers = record.headers_with(&[header::EVENT_ID, header::TRACEPARENT], &extra);
        let key = record.session.as_deref().unwrap_or_default();
        let ack = match self
            .enqueue_keyed(topic, Some(key), Some(&payload), headers)
            .await
        {
            Ok(ack) => ack,
            Err(e) => {
                // Refused locally (e.g. larger than message.max.bytes): it never will be sent.
                self.inner.metrics.produce_errors.inc();
                tracing::warn!(error = %e, partition = record.partition, offset = record.offset,
                    session = %record.session_str(), "output refused by the producer; sending to DLQ");
                return self
                    .dead_letter(record, DlqReason::ProduceFailed, &e.to_string(), 1)
                    .await;
            }
        };
        let this = self.clone();
        let record = record.clone();
        self.inner.acks.spawn(async move {
            match ack.await {
                Ok(Ok(_)) => {
                    this.inner.metrics.records_out.inc();
                    this.complete(&record);
                }
                Ok(Err((e, _))) => {
                    this.inner.metrics.produce_errors.inc();
                    tracing::warn!(error = %e, partition = record.partition, offset = record.offset,
                        session = %record.session_str(), "output not acknowledged; sending to DLQ");
                    this.dead_letter(&record, DlqReason::ProduceFailed, &e.to_string(), 1)
                        .await;
                }
                Err(_) => tracing::error!("producer dropped before acknowledging"),
            }
        });
    }

    /// Writes `record` to the DLQ and completes it once the broker has acknowledged it.
    pub async fn dead_letter(
        &self,
        record: &InputRecord,
        reason: DlqReason,
        error: &str,
        attempts: u32,
    ) {
        tracing::warn!(reason = reason.as_str(), error, partition = record.partition,
            offset = record.offset, session = %record.session_str(), event_id = %record.event_id,
            "record to DLQ");
        let this = self.clone();
        let record = record.clone();
        let error = error.to_string();
        let first = self
            .enqueue_dead_letter(&record, reason, &error, attempts)
            .await;
        self.inner.acks.spawn(async move {
            let mut ack = first;
            loop {
                match ack.await {
                    Ok(Ok(_)) => break,
                    Ok(Err((e, _))) => {
                        tracing::error!(error = %e, topic = %this.inner.dlq,
                            "DLQ write failed; retrying (the record stays uncommitted)");
                        tokio::time::sleep(DLQ_RETRY_BACKOFF).await;
                    }
                    Err(_) => return,
                }
                ack = this
                    .enqueue_dead_letter(&record, reason, &error, attempts)
                    .await;
            }
            this.inner
                .metrics
                .dlq
                .with_label_values(&[reason.as_str()])
                .inc();
            this.complete(&record);
        });
    }

    async fn enqueue_dead_letter(
        &self,
        record: &InputRecord,
        reason: DlqReason,
        error: &str,
        attempts: u32,
    ) -> DeliveryFuture {
        loop {
            let headers = dlq_headers(record, &self.inner.stage, reason, error, attempts);
            let queued = self
                .enqueue_keyed(
                    &self.inner.dlq,
                    record.key.as_deref(),
                    record.value.as_deref(),
                    headers,
                )
                .await;
            match queued {
                Ok(ack) => return ack,
                Err(e) => {
                    // The dead letter is the input record itself; if even that is refused, the
                    // only safe thing is to keep it uncommitted and say so loudly.
                    tracing::error!(error = %e, topic = %self.inner.dlq,
                        "DLQ record refused by the producer; retrying");
                    tokio::time::sleep(DLQ_RETRY_BACKOFF).await;
                }
            }
        }
    }

    /// Enqueues one record, waiting while librdkafka's local queue is full. Other local
    /// refusals are returned: they do not go away by waiting.
    async fn enqueue_keyed(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: OwnedHeaders,
    ) -> Result<DeliveryFuture, KafkaError> {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(k) = key {
            record = record.key(k);
        }
        if let Some(p) = payload {
            record = record.payload(p);
        }
        loop {
            match self.inner.producer.send_result(record) {
                Ok(ack) => return Ok(ack),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    tokio::time::sleep(QUEUE_FULL_BACKOFF).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    fn complete(&self, record: &InputRecord) {
        // The consumer loop may be gone during shutdown; the record then stays uncommitted.
        let _ = self.inner.completions.send(Completion::done(record));
    }

    /// Completes a replayed record that was already done, without producing anything.
    pub fn skip_replayed(&self, record: &InputRecord) {
        self.complete(record);
    }

    /// Gives up on a record without completing it: it will be redelivered (to this worker or
    /// the partition's next owner) because its offset is never committed.
    pub fn release(&self, record: &InputRecord) {
        let _ = self.inner.completions.send(Completion::released(record));
    }

    /// Waits for every acknowledgement in flight, then flushes the client.
    pub async fn close(&self, timeout: Duration) {
        self.inner.acks.close();
        let _ = tokio::time::timeout(timeout, self.inner.acks.wait()).await;
        let producer = self.inner.producer.clone();
        let _ = tokio::task::spawn_blocking(move || producer.flush(timeout)).await;
    }
}
