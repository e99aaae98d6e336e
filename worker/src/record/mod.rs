//! A record taken from the input topic, and the header names sessionflow reads and writes.
//!
//! The consumer copies each Kafka message out of librdkafka's buffer once, into an
//! [`InputRecord`], so the message can outlive the poll call that produced it and travel through
//! the dispatcher and session tiers. The record knows its session (and its `sessionflow-seq`)
//! from the start; its stable event id is made when something asks for it, since a stage that
//! writes no result never does. Everything downstream only reads them.

pub mod session_id;
pub mod topic_name;

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rdkafka::message::{Headers, OwnedHeaders};
use rdkafka::Message;
use smallvec::SmallVec;

use serde::{Deserialize, Serialize};

use crate::record::topic_name::TopicName;

/// Kafka partition number.
pub type Partition = i32;

/// Kafka offset.
pub type Offset = i64;

/// Why a record went to the DLQ (`sessionflow-dlq-reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DlqReason {
    /// The handler said the record can never succeed.
    Poison,
    /// Transient failures until `retry.maxAttempts`.
    RetriesExhausted,
    /// No session id in the key / session header.
    MissingSession,
    /// The output record was not acknowledged after the producer's own retries.
    ProduceFailed,
    /// The handler did not finish within the stuck-offset timeout.
    Stuck,
    /// `exactlyOnce`: its output made every transaction of its partition abort (e.g. too
    /// large for the output topic), `POISON_ABORTS` times in a row.
    TransactionAbort,
}

impl DlqReason {
    pub const ALL: [DlqReason; 6] = [
        Self::Poison,
        Self::RetriesExhausted,
        Self::MissingSession,
        Self::ProduceFailed,
        Self::Stuck,
        Self::TransactionAbort,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Poison => "poison",
            Self::RetriesExhausted => "retries-exhausted",
            Self::MissingSession => "missing-session",
            Self::ProduceFailed => "produce-failed",
            Self::Stuck => "stuck",
            Self::TransactionAbort => "transaction-abort",
        }
    }
}

/// Where a record's session id is read from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "from", rename_all = "camelCase", deny_unknown_fields)]
pub enum SessionSource {
    /// The record key.
    #[default]
    Key,
    /// A record header.
    Header { name: String },
}

/// Written by hand: a derived schema of an internally tagged enum repeats the tag in every
/// variant, which a Kubernetes structural schema cannot express.
#[cfg(feature = "schema")]
impl schemars::JsonSchema for SessionSource {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "SessionSource".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Where a record's session id is read from: the record key (`from: key`) or a header (`from: header`, `name: <header>`).",
            "type": "object",
            "properties": {
                "from": { "type": "string", "enum": ["key", "header"] },
                "name": { "type": "string", "minLength": 1 }
            },
            "required": ["from"],
            "x-kubernetes-validations": [{
                "rule": "self.from == 'header' ? has(self.name) : !has(self.name)",
                "message": "session.name is required with from: header, and only then"
            }]
        })
    }
}

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

    /// Every name above.
    const KNOWN: [&str; 12] = [
        EVENT_ID,
        SESSION,
        ATTEMPT,
        SEQ,
        TRACEPARENT,
        DLQ_REASON,
        DLQ_ERROR,
        SOURCE_TOPIC,
        SOURCE_PARTITION,
        SOURCE_OFFSET,
        STAGE,
        ATTEMPTS,
    ];

    /// `key` as a header name of a record: shared when it is one of sessionflow's, so the
    /// headers every record carries cost no allocation each.
    pub(crate) fn name(key: &str) -> super::HeaderName {
        match KNOWN.iter().find(|known| **known == key) {
            Some(known) => super::HeaderName::Borrowed(known),
            None => super::HeaderName::Owned(key.to_owned()),
        }
    }
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
///
/// Every record holds the lease (an `Arc`), so its reference count changes twice per record,
/// on the consumer's thread and on a runtime worker. The lease is aligned to two cache lines so
/// that what the session tasks read per record (`epoch`, `state`) is not on the line those
/// counts are on.
#[derive(Debug)]
#[repr(align(128))]
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

/// A header name: the names sessionflow knows are shared, any other is the record's own copy.
pub type HeaderName = Cow<'static, str>;

/// Where one piece of a record (key, value, a header's value) lies in its buffer. A record's
/// pieces together are one Kafka record, which is under 2 GiB, so 32 bits hold any place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    start: u32,
    len: u32,
}

/// A record of the input topic, owned.
///
/// Key, value and header values are copied out of librdkafka's buffer into one buffer of the
/// record's own, sized for all of them, and the record keeps where each piece lies. One
/// allocation holds every byte, and dropping the record frees it with no reference count to
/// touch: the record is made on the consumer's thread and dropped on a runtime worker, so
/// each shared count would be a cache line moved between cores, twice per piece. What
/// outlives the record (a session's id in the dispatcher's map) is copied out of it.
#[derive(Debug, Clone)]
pub struct InputRecord {
    pub topic: TopicName,
    pub partition: Partition,
    pub offset: Offset,
    /// The `sessionflow-seq` header, when present and numeric (read once, at intake: the
    /// order watchdog looks at it twice per record).
    pub seq: Option<u64>,
    pub lease: Arc<Lease>,
    bytes: Box<[u8]>,
    key: Option<Piece>,
    value: Option<Piece>,
    /// The session id: the key's piece or a header's; `None` when the record has none (it goes
    /// to the DLQ).
    session: Option<Piece>,
    /// The session id's [`session_id::session_hash`], taken once here (0 without an id).
    session_hash: u64,
    /// Headers in their original order; duplicates kept. Two fit in the record itself.
    headers: SmallVec<[(HeaderName, Option<Piece>); 2]>,
}

/// The pieces of a record, to build one without a Kafka message (tests, tools).
#[derive(Debug, Clone, Copy, Default)]
pub struct Parts<'a> {
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    pub headers: &'a [(&'a str, Option<&'a [u8]>)],
}

impl InputRecord {
    /// Copies a Kafka message into an owned record.
    pub fn from_message<M: Message>(
        message: &M,
        topic: TopicName,
        source: &SessionSource,
        lease: Arc<Lease>,
    ) -> Self {
        // The headers are read once (each read converts a name from a C string), the first
        // few into an array, so the buffer is sized exactly before anything is copied.
        let raw = message.headers();
        let mut first = [("", None::<&[u8]>); HEADERS_AT_ONCE];
        let (mut count, mut header_bytes) = (0, 0);
        for h in raw.iter().flat_map(|hs| hs.iter()) {
            header_bytes += h.value.map_or(0, <[u8]>::len);
            if let Some(slot) = first.get_mut(count) {
                *slot = (h.key, h.value);
            }
            count += 1;
        }
        let (key, value) = (message.key(), message.payload());
        let mut buffer =
            Buffer::sized(key.map_or(0, <[u8]>::len) + value.map_or(0, <[u8]>::len) + header_bytes);
        let key = key.map(|k| buffer.copy(k));
        let value = value.map(|v| buffer.copy(v));
        let mut headers = SmallVec::with_capacity(count);
        for (name, value) in &first[..count.min(HEADERS_AT_ONCE)] {
            headers.push((header::name(name), value.map(|v| buffer.copy(v))));
        }
        // Past the first few, by index: `skip` would read (and convert) the first few again.
        if let Some(hs) = raw.filter(|_| count > HEADERS_AT_ONCE) {
            for h in (HEADERS_AT_ONCE..count).filter_map(|i| hs.try_get(i)) {
                headers.push((header::name(h.key), h.value.map(|v| buffer.copy(v))));
            }
        }
        let place = Place {
            topic,
            partition: message.partition(),
            offset: message.offset(),
            lease,
        };
        Self::assemble(place, buffer, key, value, headers, source)
    }

    /// A record of `parts`, its session read as `source` says: what [`Self::from_message`]
    /// makes of a Kafka message with those pieces.
    pub fn new(
        topic: TopicName,
        partition: Partition,
        offset: Offset,
        parts: Parts<'_>,
        source: &SessionSource,
        lease: Arc<Lease>,
    ) -> Self {
        let size = |p: Option<&[u8]>| p.map_or(0, <[u8]>::len);
        let header_bytes: usize = parts.headers.iter().map(|(_, v)| size(*v)).sum();
        let mut buffer = Buffer::sized(size(parts.key) + size(parts.value) + header_bytes);
        let key = parts.key.map(|k| buffer.copy(k));
        let value = parts.value.map(|v| buffer.copy(v));
        let headers = parts
            .headers
            .iter()
            .map(|(name, v)| (header::name(name), v.map(|v| buffer.copy(v))))
            .collect();
        let place = Place {
            topic,
            partition,
            offset,
            lease,
        };
        Self::assemble(place, buffer, key, value, headers, source)
    }

    fn assemble(
        place: Place,
        buffer: Buffer,
        key: Option<Piece>,
        value: Option<Piece>,
        headers: SmallVec<[(HeaderName, Option<Piece>); 2]>,
        source: &SessionSource,
    ) -> Self {
        let bytes = buffer.0.into_boxed_slice();
        let find_piece = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| *v)
        };
        let session = match source {
            SessionSource::Key => key,
            SessionSource::Header { name } => find_piece(name),
        }
        .filter(|s| s.len > 0);
        let seq = find_piece(header::SEQ).and_then(|p| parse_seq(slice(&bytes, p)));
        let session_hash = session.map_or(0, |p| session_id::session_hash(slice(&bytes, p)));
        Self {
            topic: place.topic,
            partition: place.partition,
            offset: place.offset,
            seq,
            lease: place.lease,
            bytes,
            key,
            value,
            session,
            session_hash,
            headers,
        }
    }

    pub fn key(&self) -> Option<&[u8]> {
        self.key.map(|p| self.piece(p))
    }

    pub fn value(&self) -> Option<&[u8]> {
        self.value.map(|p| self.piece(p))
    }

    /// The session id; `None` when the record has none (or an empty one).
    pub fn session(&self) -> Option<&[u8]> {
        self.session.map(|p| self.piece(p))
    }

    /// The session id's hash in this process ([`session_id::session_hash`]); 0 without one.
    pub fn session_hash(&self) -> u64 {
        self.session_hash
    }

    /// The headers in their original order, duplicates kept.
    pub fn headers(&self) -> impl ExactSizeIterator<Item = (&str, Option<&[u8]>)> + '_ {
        self.headers
            .iter()
            .map(|(k, v)| (k.as_ref(), v.map(|p| self.piece(p))))
    }

    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers()
            .find(|(k, _)| *k == name)
            .and_then(|(_, v)| v)
    }

    fn piece(&self, piece: Piece) -> &[u8] {
        slice(&self.bytes, piece)
    }

    /// The `sessionflow-seq` header, when present and numeric.
    pub fn seq(&self) -> Option<u64> {
        self.seq
    }

    /// The `sessionflow-event-id` the record carries (non-empty UTF-8), if any.
    pub fn carried_event_id(&self) -> Option<&str> {
        self.header(header::EVENT_ID)
            .and_then(|v| std::str::from_utf8(v).ok())
            .filter(|v| !v.is_empty())
    }

    /// The stable id of the record's event: the one it carries, or `topic-partition-offset`.
    /// Made when asked, not at intake: a stage that writes no output never needs it.
    pub fn event_id(&self) -> Cow<'_, str> {
        match self.carried_event_id() {
            Some(id) => Cow::Borrowed(id),
            None => Cow::Owned(generated_event_id(&self.topic, self.partition, self.offset)),
        }
    }

    /// The session id as text, for logs and HTTP headers (lossy for non-UTF-8 ids).
    pub fn session_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(self.session().unwrap_or_default())
    }

    /// The input headers, without the ones in `replace`, followed by `extra`.
    pub fn headers_with(&self, replace: &[&str], extra: &[(&str, &[u8])]) -> OwnedHeaders {
        let mut out = OwnedHeaders::new_with_capacity(self.headers.len() + extra.len());
        for (key, value) in self.headers().filter(|(k, _)| !replace.contains(k)) {
            out = out.insert(rdkafka::message::Header { key, value });
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

/// Where a record came from, and under which lease it is held.
struct Place {
    topic: TopicName,
    partition: Partition,
    offset: Offset,
    lease: Arc<Lease>,
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

/// Headers of a record read in one pass; any after them are read a second time.
const HEADERS_AT_ONCE: usize = 8;

/// A record's buffer while its pieces are copied in, sized for all of them.
struct Buffer(Vec<u8>);

impl Buffer {
    fn sized(len: usize) -> Self {
        Self(Vec::with_capacity(len))
    }

    fn copy(&mut self, bytes: &[u8]) -> Piece {
        let place = |n: usize| u32::try_from(n).expect("a Kafka record is under 2 GiB");
        let start = place(self.0.len());
        self.0.extend_from_slice(bytes);
        Piece {
            start,
            len: place(bytes.len()),
        }
    }
}

fn slice(bytes: &[u8], piece: Piece) -> &[u8] {
    let start = piece.start as usize;
    &bytes[start..start + piece.len as usize]
}

fn parse_seq(value: &[u8]) -> Option<u64> {
    std::str::from_utf8(value).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_not_on_the_line_of_its_reference_counts() {
        let lease = Arc::new(Lease::new(0, 1));
        // `Arc` keeps its two counts in the 16 bytes before the value.
        let at = Arc::as_ptr(&lease) as usize;
        assert_eq!(at % 128, 0, "the lease starts a line pair of its own");
        assert!(std::mem::size_of::<Lease>() <= 128);
    }
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
        assert_eq!(r.session(), Some(&b"s1"[..]));
        assert_eq!(r.carried_event_id(), None);
        assert_eq!(r.event_id(), "in-3-42");
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
        assert_eq!(r.session(), Some(&b"c9"[..]));
        assert_eq!(r.event_id(), "e-1");
    }

    #[test]
    fn every_header_is_carried_whole_and_named_beyond_the_ones_read_at_once() {
        let long = "x".repeat(1_000);
        let filler: Vec<String> = (0..HEADERS_AT_ONCE).map(|i| format!("h{i}")).collect();
        let mut headers: Vec<(&str, &str)> = vec![(header::SEQ, "17"), ("custom", &long)];
        headers.extend(filler.iter().map(|name| (name.as_str(), "f")));
        headers.push((header::EVENT_ID, "e-9"));
        let m = message(Some(b"s1"), &headers);
        let r = record(&m, &SessionSource::Key);
        assert_eq!(r.key(), Some(&b"s1"[..]));
        assert_eq!(r.value(), Some(&b"v"[..]));
        assert_eq!(r.header("custom").map(|v| v.len()), Some(long.len()));
        assert_eq!(r.carried_event_id(), Some("e-9"));
        assert_eq!(r.seq(), Some(17));
        assert_eq!(r.headers().len(), headers.len());
        for ((name, value), (got_name, got_value)) in headers.iter().zip(r.headers()) {
            assert_eq!(*name, got_name);
            assert_eq!(Some(value.as_bytes()), got_value);
        }
        let shared: Vec<&str> = r
            .headers
            .iter()
            .filter(|(k, _)| matches!(k, Cow::Borrowed(_)))
            .map(|(k, _)| k.as_ref())
            .collect();
        assert_eq!(
            shared,
            [header::SEQ, header::EVENT_ID],
            "sessionflow's names are shared, others are the record's own"
        );
    }

    #[test]
    fn a_sequence_number_counts_only_when_numeric_and_an_empty_event_id_is_none() {
        let m = message(Some(b"s1"), &[(header::SEQ, "7a"), (header::EVENT_ID, "")]);
        let r = record(&m, &SessionSource::Key);
        assert_eq!(r.seq(), None);
        assert_eq!(r.carried_event_id(), None);
        assert_eq!(r.event_id(), "in-3-42");
    }

    #[test]
    fn empty_or_missing_session_is_none() {
        assert!(record(&message(None, &[]), &SessionSource::Key)
            .session()
            .is_none());
        assert!(record(&message(Some(b""), &[]), &SessionSource::Key)
            .session()
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

    type NamedValue = (String, Option<Vec<u8>>);

    fn any_header() -> impl proptest::strategy::Strategy<Value = NamedValue> {
        use proptest::prelude::*;
        let name = prop_oneof![
            Just(header::SEQ.to_string()),
            Just(header::EVENT_ID.to_string()),
            Just("conv".to_string()),
            "[a-z]{1,6}",
        ];
        let value = prop_oneof![
            Just(None),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(Some),
            (0u64..1_000).prop_map(|n| Some(n.to_string().into_bytes())),
        ];
        (name, value)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Every piece reads back as it was given, whichever pieces are missing or empty and
        /// however many headers come (past the ones read at once, too), from a Kafka message
        /// and from `Parts` alike; the session and the sequence number are the right pieces.
        #[test]
        fn every_piece_reads_back_as_given(
            key in proptest::option::of(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..30)),
            value in proptest::option::of(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)),
            headers in proptest::collection::vec(any_header(), 0..12),
            by_header in proptest::prelude::any::<bool>(),
        ) {
            let source = if by_header {
                SessionSource::Header { name: "conv".into() }
            } else {
                SessionSource::Key
            };
            let mut owned = OwnedHeaders::new();
            for (k, v) in &headers {
                owned = owned.insert(Header { key: k, value: v.as_deref() });
            }
            let m = OwnedMessage::new(
                value.clone(), key.clone(), "in".into(), Timestamp::NotAvailable, 3, 42, Some(owned),
            );
            let borrowed: Vec<(&str, Option<&[u8]>)> =
                headers.iter().map(|(k, v)| (k.as_str(), v.as_deref())).collect();
            let parts = Parts { key: key.as_deref(), value: value.as_deref(), headers: &borrowed };
            let lease = Arc::new(Lease::new(3, 1));
            for r in [
                record(&m, &source),
                InputRecord::new("in".into(), 3, 42, parts, &source, lease),
            ] {
                proptest::prop_assert_eq!(r.key(), key.as_deref());
                proptest::prop_assert_eq!(r.value(), value.as_deref());
                let got: Vec<(&str, Option<&[u8]>)> = r.headers().collect();
                proptest::prop_assert_eq!(&got, &borrowed);
                let first = |name: &str| {
                    borrowed.iter().find(|(k, _)| *k == name).and_then(|(_, v)| *v)
                };
                let session = if by_header { first("conv") } else { key.as_deref() };
                proptest::prop_assert_eq!(r.session(), session.filter(|s| !s.is_empty()));
                let seq = first(header::SEQ)
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|v| v.parse::<u64>().ok());
                proptest::prop_assert_eq!(r.seq(), seq);
            }
        }
    }
}
