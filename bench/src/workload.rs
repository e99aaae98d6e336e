//! The workload: the records every system consumes, and the producer that writes them.
//!
//! A comparison is only fair if every system reads the same records, so a scenario's records
//! are a pure function of its seed: sessions are chosen by the worker's own
//! `loadgen::session_sequence` (the Zipf and uniform choices `loadgen` uses), each record
//! carries its session as the key and its per-session sequence number in loadgen's
//! `sessionflow-seq` header, so the engine's own order watchdog sees the same numbers as the
//! bench's order check. What loadgen does not write, the bench puts in the value: the
//! wall-clock microsecond at which the record was handed to the producer (latency starts
//! there), the session's index (so the checks index arrays instead of hashing strings) and a
//! flag marking warm-up records, which only tell a consumer that it is fetching.

use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use sessionflow_tools::loadgen::{session_sequence, SessionChoice};
use sessionflow_worker::record::header;

use crate::measurement::now_us;

/// Bytes of the value before the padding: timestamp (8), session index (4), flags (4).
const PREFIX: usize = 16;
/// Value size, like loadgen's default record (prefix + padding); the record-size sweep
/// ([`crate::sweeps`]) sets its own.
pub const VALUE_SIZE: usize = 80;
const FLAG_WARMUP: u32 = 1;

/// What the handler needs from a record, whichever system delivered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordView {
    pub sid: u32,
    pub seq: u64,
    pub produced_us: u64,
    pub warmup: bool,
}

/// A record's value of `size` bytes (at least the prefix).
pub fn encode_value(produced_us: u64, sid: u32, warmup: bool, size: usize) -> Vec<u8> {
    let size = size.max(PREFIX);
    let mut v = Vec::with_capacity(size);
    v.extend_from_slice(&produced_us.to_le_bytes());
    v.extend_from_slice(&sid.to_le_bytes());
    let flags = if warmup { FLAG_WARMUP } else { 0 };
    v.extend_from_slice(&flags.to_le_bytes());
    v.resize(size, b'x');
    v
}

/// Reads a record's value and `sessionflow-seq` header; `None` for a record the bench did not
/// write.
pub fn decode(value: Option<&[u8]>, seq: Option<&[u8]>) -> Option<RecordView> {
    let v = value?;
    if v.len() < PREFIX {
        return None;
    }
    let produced_us = u64::from_le_bytes(v[0..8].try_into().ok()?);
    let sid = u32::from_le_bytes(v[8..12].try_into().ok()?);
    let flags = u32::from_le_bytes(v[12..16].try_into().ok()?);
    let warmup = flags & FLAG_WARMUP != 0;
    let seq = match seq {
        Some(s) => std::str::from_utf8(s).ok()?.parse().ok()?,
        None if warmup => 0,
        None => return None,
    };
    Some(RecordView {
        sid,
        seq,
        produced_us,
        warmup,
    })
}

/// The `sessionflow-seq` header of a Kafka message.
pub fn seq_header<H: rdkafka::message::Headers>(headers: Option<&H>) -> Option<&[u8]> {
    headers?
        .iter()
        .find(|h| h.key == header::SEQ)
        .and_then(|h| h.value)
}

/// The key (session id) of session `sid`.
pub fn session_key(sid: u32) -> String {
    format!("session-{sid:07}")
}

/// Records to produce.
#[derive(Debug, Clone)]
pub struct Load {
    pub topic: String,
    pub records: u64,
    pub sessions: u64,
    pub choice: SessionChoice,
    pub seed: u64,
    /// Records per second; `None`: as fast as the broker takes them.
    pub rate: Option<f64>,
    /// Bytes of each record's value.
    pub value_size: usize,
}

/// How producing went.
#[derive(Debug, Clone, Copy)]
pub struct Produced {
    pub elapsed: Duration,
}

/// A producer for one topic's load. Paced loads use the one that wrote the warm-up records,
/// so connection set-up and the idempotent producer's id are not charged to the first records.
pub struct Producer {
    inner: FutureProducer,
}

impl Producer {
    pub fn new(brokers: &str, paced: bool) -> anyhow::Result<Self> {
        Ok(Self {
            inner: ClientConfig::new()
                .set("bootstrap.servers", brokers)
                // Paced: a record's latency starts at its stamp, so do not hold it back long.
                .set("linger.ms", if paced { "1" } else { "10" })
                .set("partitioner", "murmur2_random")
                .set("enable.idempotence", "true")
                .set("queue.buffering.max.messages", "500000")
                .create()?,
        })
    }

    /// One warm-up record on every partition: a consumer that has seen them all is fetching.
    pub async fn warmups(&self, topic: &str, partitions: i32) -> anyhow::Result<()> {
        for p in 0..partitions {
            let key = format!("warmup-{p}");
            let value = encode_value(now_us(), u32::MAX, true, VALUE_SIZE);
            let record = FutureRecord::to(topic)
                .partition(p)
                .key(key.as_bytes())
                .payload(&value);
            self.inner
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| anyhow::anyhow!("warm-up record to {topic}/{p}: {e}"))?;
        }
        Ok(())
    }

    /// Produces `load` and waits for every acknowledgement.
    pub async fn produce(&self, load: &Load) -> anyhow::Result<Produced> {
        let producer = &self.inner;
        let order = session_sequence(load.records, load.sessions, load.choice, load.seed);
        let mut seqs = vec![0u64; load.sessions.max(1) as usize];
        let mut acks = FuturesUnordered::new();
        let mut failed = 0u64;
        let started = Instant::now();
        let pace = load.rate.filter(|r| *r > 0.0 && r.is_finite());
        let mut i = 0usize;
        while i < order.len() {
            // Paced: send what is due by now, then wait a millisecond.
            let due = match pace {
                Some(rate) => {
                    ((started.elapsed().as_secs_f64() * rate) as usize + 1).min(order.len())
                }
                None => order.len(),
            };
            while i < due {
                let sid = order[i] as u32;
                seqs[sid as usize] += 1;
                let seq = seqs[sid as usize].to_string();
                let key = session_key(sid);
                let value = encode_value(now_us(), sid, false, load.value_size);
                let headers = OwnedHeaders::new().insert(Header {
                    key: header::SEQ,
                    value: Some(seq.as_bytes()),
                });
                let record = FutureRecord::to(&load.topic)
                    .key(key.as_bytes())
                    .payload(&value)
                    .headers(headers);
                let ack = send(producer, record, &mut acks, &mut failed).await?;
                acks.push(ack);
                i += 1;
                while acks.len() > 100_000 {
                    if !matches!(acks.next().await, Some(Ok(Ok(_)))) {
                        failed += 1;
                    }
                }
            }
            while let Some(Some(ack)) = acks.next().now_or_never() {
                if !matches!(ack, Ok(Ok(_))) {
                    failed += 1;
                }
            }
            if pace.is_some() && i < order.len() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        while let Some(ack) = acks.next().await {
            if !matches!(ack, Ok(Ok(_))) {
                failed += 1;
            }
        }
        anyhow::ensure!(
            failed == 0,
            "{failed} records to {} were not acknowledged",
            load.topic
        );
        Ok(Produced {
            elapsed: started.elapsed(),
        })
    }
}

/// Hands one record to librdkafka, waiting for acknowledgements while its queue is full.
async fn send<'a>(
    producer: &FutureProducer,
    mut record: FutureRecord<'a, [u8], Vec<u8>>,
    acks: &mut FuturesUnordered<DeliveryFuture>,
    failed: &mut u64,
) -> anyhow::Result<DeliveryFuture> {
    loop {
        match producer.send_result(record) {
            Ok(ack) => return Ok(ack),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                record = r;
                match acks.next().await {
                    Some(Ok(Ok(_))) => {}
                    Some(_) => *failed += 1,
                    None => tokio::time::sleep(Duration::from_millis(2)).await,
                }
            }
            Err((e, _)) => anyhow::bail!("producing: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip() {
        let v = encode_value(1_234_567, 42, false, VALUE_SIZE);
        assert_eq!(v.len(), VALUE_SIZE);
        assert_eq!(encode_value(1, 1, false, 10_000).len(), 10_000);
        assert_eq!(encode_value(1, 1, false, 3).len(), PREFIX);
        assert_eq!(
            decode(Some(&v), Some(b"17")),
            Some(RecordView {
                sid: 42,
                seq: 17,
                produced_us: 1_234_567,
                warmup: false
            })
        );
        let w = encode_value(5, u32::MAX, true, VALUE_SIZE);
        assert!(decode(Some(&w), None).unwrap().warmup);
    }

    #[test]
    fn foreign_records_are_not_read() {
        assert_eq!(decode(None, Some(b"1")), None);
        assert_eq!(decode(Some(b"short"), Some(b"1")), None);
        let v = encode_value(1, 1, false, VALUE_SIZE);
        assert_eq!(decode(Some(&v), None), None);
        assert_eq!(decode(Some(&v), Some(b"x")), None);
    }
}
