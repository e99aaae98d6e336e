//! What a dead-letter record looks like.
//!
//! A DLQ record must let an operator understand and replay it without any other source: it
//! keeps the original key, value and headers, and adds why it failed, where it came from and
//! how often it was tried.

use rdkafka::message::OwnedHeaders;

pub use crate::record::DlqReason;
use crate::record::{header, InputRecord};

/// The headers a dead letter gets on top of the original record's (its `traceparent` is
/// replaced, and an event id is added when the record had none).
pub const ADDED_HEADERS: [&str; 7] = [
    header::DLQ_REASON,
    header::DLQ_ERROR,
    header::SOURCE_TOPIC,
    header::SOURCE_PARTITION,
    header::SOURCE_OFFSET,
    header::STAGE,
    header::ATTEMPTS,
];

/// The headers of the DLQ copy of `record`: the original ones, then sessionflow's.
pub fn dlq_headers(
    record: &InputRecord,
    stage: &str,
    reason: DlqReason,
    error: &str,
    attempts: u32,
) -> OwnedHeaders {
    let partition = record.partition.to_string();
    let offset = record.offset.to_string();
    let attempts = attempts.to_string();
    let traceparent = crate::ops::telemetry::traceparent(record).unwrap_or_default();
    let ours: Vec<&str> = std::iter::once(header::TRACEPARENT)
        .chain(ADDED_HEADERS)
        .collect();
    let has_event_id = record.header(header::EVENT_ID).is_some();
    let event_id = record.event_id();
    let mut extra: Vec<(&str, &[u8])> = vec![
        (header::DLQ_REASON, reason.as_str().as_bytes()),
        (header::DLQ_ERROR, error.as_bytes()),
        (header::SOURCE_TOPIC, record.topic.as_bytes()),
        (header::SOURCE_PARTITION, partition.as_bytes()),
        (header::SOURCE_OFFSET, offset.as_bytes()),
        (header::STAGE, stage.as_bytes()),
        (header::ATTEMPTS, attempts.as_bytes()),
    ];
    if !has_event_id {
        extra.push((header::EVENT_ID, event_id.as_bytes()));
    }
    if !traceparent.is_empty() {
        extra.push((header::TRACEPARENT, traceparent.as_bytes()));
    }
    record.headers_with(&ours, &extra)
}
