//! A record taken from the input topic, and the header names sessionflow reads and writes.
//!
//! The consumer copies each Kafka message out of librdkafka's buffer once, into an
//! [`InputRecord`], so the message can outlive the poll call that produced it and travel through
//! the dispatcher and session tiers. The record knows its session and its stable event id from
//! the start; everything downstream only reads them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use rdkafka::message::{Headers, OwnedHeaders};
use rdkafka::Message;

use crate::config::SessionSource;
use crate::offsets::{Offset, Partition};

/// Header names on the wire.
pub mod header {
    /// Stable id of the event a record carries; kept across stages and replays.
    pub const EVENT_ID: &str = "sessionflow-event-id";
    /// Session id, sent to HTTP handlers.
    pub const SESSION: &str = "sessionflow-session";
    /// Attempt number (1-based), sent to HTTP handlers.
    pub const ATTEMPT: &str = "sessionflow-attempt";
    /// Per-session sequence number written by `loadgen`, checked by `verify`.
    pub const SEQ: &str = "sessionflow-seq";
    /// W3C trace context.
    pub const TRACEPARENT: &str = "traceparent";
    pub const DLQ_REASON: &str = "sessionflow-dlq-reason";
    pub const DLQ_ERROR: &str = "sessionflow-dlq-error";
    pub const SOURCE_TOPIC: &str = "sessionflow-source-topic";
    pub const SOURCE_PARTITION: &str = "sessionflow-source-partition";
    pub const SOURCE_OFFSET: &str = "sessionflow-source-offset";
    pub const STAGE: &str = "sessionflow-stage";
    pub const ATTEMPTS: &str = "sessionflow-attempts";
}

/// One assignment of one partition to this worker. Records carry it so that work belonging to
/// a partition this worker no longer owns can be recognised and dropped.
///
/// A revocation goes in two steps. *Draining*: records of the partition not started yet are
/// released (the next owner takes them), retries stop, and the records inside a handler may
/// still finish and write their results. *Revoked* (the drain deadline passed): the lease is
/// the fence between two owners — a result (output or dead letter) is written only under a
/// [`WritePermit`], which cannot be had once the lease is revoked, and the revocation waits
/// for the permits already out. So once it has finished waiting, the old owner writes nothing
/// more for the partition: no result of a handler that outlived the drain lands after the new
/// owner's results.
#[derive(Debug)]
pub struct Lease {
    pub partition: Partition,
    /// Increases with every assignment of any partition in this process.
    pub epoch: u64,
    /// [`REVOKED`] and [`DRAINING`] bits, and below them the number of write permits out.
    state: AtomicU64,
}

const REVOKED: u64 = 1 << 63;
const DRAINING: u64 = 1 << 62;
const PERMITS: u64 = DRAINING - 1;

impl Lease {
    pub fn new(partition: Partition, epoch: u64) -> Self {
        Self {
            partition,
            epoch,
            state: AtomicU64::new(0),
        }
    }

    /// Start no new record of this lease; the ones inside a handler may finish.
    pub fn drain(&self) {
        self.state.fetch_or(DRAINING, Ordering::AcqRel);
    }

    /// No new write permit from now on; the ones out stay valid until dropped.
    pub fn revoke(&self) {
        self.state.fetch_or(REVOKED | DRAINING, Ordering::AcqRel);
    }

    pub fn is_revoked(&self) -> bool {
        self.state.load(Ordering::Acquire) & REVOKED != 0
    }

    /// Draining or revoked: a record of this lease must not be started (or retried).
    pub fn is_draining(&self) -> bool {
        self.state.load(Ordering::Acquire) & DRAINING != 0
    }

    /// Permission to write a result of this lease, or `None` once it is revoked. Checking and
    /// taking are one atomic step, so a revocation either sees this permit or refuses it.
    pub fn begin_write(self: &Arc<Self>) -> Option<WritePermit> {
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            if current & REVOKED != 0 {
                return None;
            }
            match self.state.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(WritePermit(self.clone())),
                Err(seen) => current = seen,
            }
        }
    }

    /// Write permits not yet dropped: results on their way to the broker.
    pub fn writes_in_flight(&self) -> u64 {
        self.state.load(Ordering::Acquire) & PERMITS
    }
}

/// A result of a [`Lease`] may be written while this lives (see [`Lease::begin_write`]).
#[derive(Debug)]
pub struct WritePermit(Arc<Lease>);

impl Drop for WritePermit {
    fn drop(&mut self) {
        self.0.state.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A record of the input topic, owned.
#[derive(Debug, Clone)]
pub struct InputRecord {
    pub topic: Arc<str>,
    pub partition: Partition,
    pub offset: Offset,
    pub key: Option<Bytes>,
    pub value: Option<Bytes>,
    /// Headers in their original order; duplicates kept.
    pub headers: Vec<(String, Option<Bytes>)>,
    /// Session id; `None` when the record has none (it goes to the DLQ).
    pub session: Option<Bytes>,
    /// `sessionflow-event-id` of the input, or `topic-partition-offset`.
    pub event_id: String,
    pub lease: Arc<Lease>,
}

impl InputRecord {
    /// Copies a Kafka message into an owned record.
    pub fn from_message<M: Message>(
        message: &M,
        topic: Arc<str>,
        source: &SessionSource,
        lease: Arc<Lease>,
    ) -> Self {
        let headers: Vec<(String, Option<Bytes>)> = message
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_string(), h.value.map(Bytes::copy_from_slice)))
                    .collect()
            })
            .unwrap_or_default();
        let key = message.key().map(Bytes::copy_from_slice);
        let session = match source {
            SessionSource::Key => key.clone(),
            SessionSource::Header { name } => find(&headers, name).cloned(),
        }
        .filter(|s| !s.is_empty());
        let event_id = find(&headers, header::EVENT_ID)
            .and_then(|v| std::str::from_utf8(v).ok())
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
            .unwrap_or_else(|| generated_event_id(&topic, message.partition(), message.offset()));
        Self {
            partition: message.partition(),
            offset: message.offset(),
            value: message.payload().map(Bytes::copy_from_slice),
            topic,
            key,
            headers,
            session,
            event_id,
            lease,
        }
    }

    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&Bytes> {
        find(&self.headers, name)
    }

    /// The `sessionflow-seq` header, when present and numeric.
    pub fn seq(&self) -> Option<u64> {
        std::str::from_utf8(self.header(header::SEQ)?)
            .ok()?
            .parse()
            .ok()
    }

    /// The session id as text, for logs and HTTP headers (lossy for non-UTF-8 ids).
    pub fn session_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(self.session.as_deref().unwrap_or_default())
    }

    /// The input headers, without the ones in `replace`, followed by `extra`.
    pub fn headers_with(&self, replace: &[&str], extra: &[(&str, &[u8])]) -> OwnedHeaders {
        let mut out = OwnedHeaders::new_with_capacity(self.headers.len() + extra.len());
        for (k, v) in &self.headers {
            if replace.contains(&k.as_str()) {
                continue;
            }
            out = out.insert(rdkafka::message::Header {
                key: k,
                value: v.as_deref(),
            });
        }
        for (k, v) in extra {
            out = out.insert(rdkafka::message::Header {
                key: k,
                value: Some(*v),
            });
        }
        out
    }
}

/// `topic-partition-offset`, the event id of a record that carries none. Built without the
/// formatting machinery: it is made for every such record.
fn generated_event_id(topic: &str, partition: Partition, offset: Offset) -> String {
    let mut number = itoa::Buffer::new();
    let mut id = String::with_capacity(topic.len() + 32);
    id.push_str(topic);
    id.push('-');
    id.push_str(number.format(partition));
    id.push('-');
    id.push_str(number.format(offset));
    id
}

fn find<'a>(headers: &'a [(String, Option<Bytes>)], name: &str) -> Option<&'a Bytes> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedMessage, Timestamp};

    fn message(key: Option<&[u8]>, headers: &[(&str, &str)]) -> OwnedMessage {
        let mut hs = OwnedHeaders::new();
        for (k, v) in headers {
            hs = hs.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        OwnedMessage::new(
            Some(b"v".to_vec()),
            key.map(<[u8]>::to_vec),
            "in".into(),
            Timestamp::NotAvailable,
            3,
            42,
            Some(hs),
        )
    }

    fn record(m: &OwnedMessage, source: &SessionSource) -> InputRecord {
        InputRecord::from_message(m, "in".into(), source, Arc::new(Lease::new(3, 1)))
    }

    #[test]
    fn session_from_key_and_generated_event_id() {
        let r = record(&message(Some(b"s1"), &[]), &SessionSource::Key);
        assert_eq!(r.session.as_deref(), Some(&b"s1"[..]));
        assert_eq!(r.event_id, "in-3-42");
    }

    #[test]
    fn generated_event_ids_name_topic_partition_and_offset() {
        assert_eq!(generated_event_id("in", 3, 42), "in-3-42");
        assert_eq!(
            generated_event_id("a-b", i32::MAX, i64::MAX),
            format!("a-b-{}-{}", i32::MAX, i64::MAX)
        );
        assert_eq!(generated_event_id("t", 0, -1), "t-0--1");
    }

    #[test]
    fn session_from_header_and_kept_event_id() {
        let m = message(Some(b"k"), &[("conv", "c9"), (header::EVENT_ID, "e-1")]);
        let r = record(
            &m,
            &SessionSource::Header {
                name: "conv".into(),
            },
        );
        assert_eq!(r.session.as_deref(), Some(&b"c9"[..]));
        assert_eq!(r.event_id, "e-1");
    }

    #[test]
    fn empty_or_missing_session_is_none() {
        assert!(record(&message(None, &[]), &SessionSource::Key)
            .session
            .is_none());
        assert!(record(&message(Some(b""), &[]), &SessionSource::Key)
            .session
            .is_none());
    }

    #[test]
    fn a_revoked_lease_gives_no_write_permit_and_counts_the_ones_out() {
        let lease = Arc::new(Lease::new(0, 1));
        let first = lease.begin_write().expect("active lease");
        lease.drain();
        assert!(lease.is_draining() && !lease.is_revoked());
        let second = lease.begin_write().expect("a draining lease still writes");
        assert_eq!(lease.writes_in_flight(), 2);
        lease.revoke();
        assert!(lease.is_revoked());
        assert!(lease.begin_write().is_none());
        drop(first);
        assert_eq!(lease.writes_in_flight(), 1);
        drop(second);
        assert_eq!(lease.writes_in_flight(), 0);
        assert!(lease.is_revoked());
    }

    #[test]
    fn permits_race_revocation_without_losing_count() {
        let lease = Arc::new(Lease::new(0, 1));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lease = lease.clone();
                std::thread::spawn(move || {
                    let mut taken = 0;
                    for _ in 0..10_000 {
                        if let Some(p) = lease.begin_write() {
                            taken += 1;
                            drop(p);
                        }
                    }
                    taken
                })
            })
            .collect();
        lease.revoke();
        let refused_after = lease.begin_write().is_none();
        let _: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(refused_after);
        assert_eq!(lease.writes_in_flight(), 0);
    }

    #[test]
    fn headers_are_carried_over_in_order_with_replacements() {
        let m = message(
            Some(b"k"),
            &[("a", "1"), (header::EVENT_ID, "old"), ("a", "2")],
        );
        let r = record(&m, &SessionSource::Key);
        let hs = r.headers_with(&[header::EVENT_ID], &[(header::EVENT_ID, b"new")]);
        let got: Vec<(String, Vec<u8>)> = hs
            .iter()
            .map(|h| (h.key.to_string(), h.value.unwrap().to_vec()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a".into(), b"1".to_vec()),
                ("a".into(), b"2".to_vec()),
                (header::EVENT_ID.into(), b"new".to_vec()),
            ]
        );
    }
}
