//! `verify`: check a topic for per-session order, loss and duplicates.
//!
//! Records written by `loadgen` carry a per-session `sessionflow-seq`. Reading the output topic
//! of a pipeline back, partition by partition in offset order, each session's numbers must
//! never go down to a number not seen before (an *order violation*: a later record overtook an
//! earlier one). A number seen again is a *duplicate* (allowed: at-least-once replays). Numbers
//! missing below a session's highest are *gaps*; given the input topic, every input record
//! must be found in the output or the DLQ, else it is *lost*.
//!
//! The checking is pure ([`Checker`]); reading a topic is the only I/O.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{Message, Offset, TopicPartitionList};

use sessionflow_worker::kafka::client_settings::ClientSettings;
use sessionflow_worker::record::header;

/// One record as `verify` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRecord {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub session: Option<String>,
    pub seq: Option<u64>,
    /// All headers, for callers that check more (DLQ reasons, event ids).
    pub headers: Vec<(String, String)>,
    pub value: Vec<u8>,
    /// The record's timestamp (ms since the epoch; create time unless the topic uses
    /// log-append time), when it has one.
    pub timestamp_ms: Option<i64>,
}

impl SeqRecord {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Whether a consumer's error is a connection that librdkafka gets back by itself (a broker
/// restarting or moving its leaderships): the read goes on, within its deadline.
fn is_transient(error: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(
        error.rdkafka_error_code(),
        Some(Code::BrokerTransportFailure | Code::AllBrokersDown)
    )
}

/// Reads every record of `topic` up to the high watermarks seen at the start, in offset order
/// per partition (partitions in ascending order).
pub fn read_topic(
    kafka: impl Into<ClientSettings>,
    topic: &str,
    session_header: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<Vec<SeqRecord>> {
    let consumer: BaseConsumer = kafka
        .into()
        .base()
        .set(
            "group.id",
            format!("sessionflow-verify-{}", std::process::id()),
        )
        .set("enable.auto.commit", "false")
        // Committed records only (an exactly-once stage's aborted writes are not output); the
        // end of a partition is then told by its end-of-partition event, since its last
        // offsets may be transaction markers, never delivered.
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .set("fetch.wait.max.ms", "100")
        .create()?;
    let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let partitions: Vec<i32> = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    anyhow::ensure!(!partitions.is_empty(), "topic {topic} not found");
    let mut tpl = TopicPartitionList::new();
    let mut remaining: HashMap<i32, i64> = HashMap::new(); // partition -> high watermark
    for p in &partitions {
        let (low, high) = consumer.fetch_watermarks(topic, *p, Duration::from_secs(10))?;
        if high > low {
            tpl.add_partition_offset(topic, *p, Offset::Offset(low))?;
            remaining.insert(*p, high);
        }
    }
    let mut by_partition: BTreeMap<i32, Vec<SeqRecord>> = BTreeMap::new();
    if tpl.count() > 0 {
        consumer.assign(&tpl)?;
    }
    let deadline = Instant::now() + timeout;
    while !remaining.is_empty() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out reading {topic}; partitions left: {remaining:?}"
        );
        let Some(polled) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = match polled {
            Err(rdkafka::error::KafkaError::PartitionEOF(p)) => {
                remaining.remove(&p);
                continue;
            }
            // librdkafka reconnects by itself; the deadline bounds how long it may take.
            Err(e) if is_transient(&e) => continue,
            polled => polled?,
        };
        let Some(high) = remaining.get(&m.partition()).copied() else {
            continue;
        };
        if m.offset() < high {
            let headers: Vec<(String, String)> = m
                .headers()
                .map(|hs| {
                    hs.iter()
                        .map(|h| {
                            let v = h.value.map(String::from_utf8_lossy).unwrap_or_default();
                            (h.key.to_string(), v.into_owned())
                        })
                        .collect()
                })
                .unwrap_or_default();
            let session = match session_header {
                None => m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                Some(name) => headers
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone()),
            };
            let seq = headers
                .iter()
                .find(|(k, _)| k == header::SEQ)
                .and_then(|(_, v)| v.parse().ok());
            by_partition
                .entry(m.partition())
                .or_default()
                .push(SeqRecord {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(<[u8]>::to_vec),
                    session,
                    seq,
                    headers,
                    value: m.payload().unwrap_or_default().to_vec(),
                    timestamp_ms: m.timestamp().to_millis(),
                });
        }
        if m.offset() + 1 >= high {
            remaining.remove(&m.partition());
        }
    }
    Ok(by_partition.into_values().flatten().collect())
}

/// What `verify` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub records: u64,
    pub dlq_records: u64,
    pub sessions: u64,
    /// A record seen after a higher sequence number of its session, itself not seen before.
    pub order_violations: u64,
    pub duplicates: u64,
    /// Sequence numbers missing below a session's highest, in neither output nor DLQ.
    pub gaps: u64,
    /// Input records in neither output nor DLQ (only when the input was given).
    pub lost: u64,
    /// Sessions whose output ends on an older record after a newer one (`1,2,1`): a result
    /// written after its partition moved on. A replay that re-emits a whole range (`1,2,1,2`)
    /// ends where it should and is not counted.
    pub stale_ends: u64,
    /// Records without a session or a sequence number (not checked).
    pub unsequenced: u64,
    /// A few examples of violations, for the human reading the report.
    pub examples: Vec<String>,
}

impl VerifyReport {
    /// No violation, no stale end, no gap, nothing lost.
    pub fn is_ok(&self) -> bool {
        self.order_violations == 0 && self.stale_ends == 0 && self.gaps == 0 && self.lost == 0
    }
}

impl std::fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "records           {}", self.records)?;
        writeln!(f, "dlq records       {}", self.dlq_records)?;
        writeln!(f, "sessions          {}", self.sessions)?;
        writeln!(f, "order violations  {}", self.order_violations)?;
        writeln!(f, "stale ends        {}", self.stale_ends)?;
        writeln!(f, "duplicates        {}", self.duplicates)?;
        writeln!(f, "gaps              {}", self.gaps)?;
        writeln!(f, "lost              {}", self.lost)?;
        writeln!(f, "unsequenced       {}", self.unsequenced)?;
        for e in &self.examples {
            writeln!(f, "  e.g. {e}")?;
        }
        write!(
            f,
            "verdict           {}",
            if self.is_ok() { "OK" } else { "FAILED" }
        )
    }
}

/// The pure checking core.
#[derive(Debug, Default)]
pub struct Checker {
    sessions: HashMap<String, SessionSeen>,
    dlq: HashMap<String, HashSet<u64>>,
    report: VerifyReport,
}

#[derive(Debug, Default)]
struct SessionSeen {
    seen: HashSet<u64>,
    max: u64,
    /// The last sequence number written for the session.
    last: u64,
    /// Where the records of `last` and of `max` are, when known: a stale end names both, so
    /// that the worker that wrote the late one can be found from its time.
    last_at: Option<Place>,
    max_at: Option<Place>,
}

/// An output record's place and timestamp.
#[derive(Debug, Clone, Copy)]
struct Place {
    partition: i32,
    offset: i64,
    timestamp_ms: Option<i64>,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "partition {} offset {}", self.partition, self.offset)?;
        if let Some(ms) = self.timestamp_ms {
            let day_ms = ms.rem_euclid(86_400_000);
            write!(
                f,
                ", written {:02}:{:02}:{:02}.{:03} UTC",
                day_ms / 3_600_000,
                day_ms / 60_000 % 60,
                day_ms / 1_000 % 60,
                day_ms % 1_000
            )?;
        }
        Ok(())
    }
}

const MAX_EXAMPLES: usize = 10;

impl Checker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds an output record, in its partition's offset order.
    pub fn output(&mut self, session: Option<&str>, seq: Option<u64>) {
        self.output_at(session, seq, None);
    }

    /// [`output`](Self::output) for a record read from the topic: a stale end then says where
    /// its records are and when they were written.
    pub fn output_record(&mut self, r: &SeqRecord) {
        let place = Place {
            partition: r.partition,
            offset: r.offset,
            timestamp_ms: r.timestamp_ms,
        };
        self.output_at(r.session.as_deref(), r.seq, Some(place));
    }

    fn output_at(&mut self, session: Option<&str>, seq: Option<u64>, place: Option<Place>) {
        self.report.records += 1;
        let (Some(session), Some(seq)) = (session, seq) else {
            self.report.unsequenced += 1;
            return;
        };
        let s = self.sessions.entry(session.to_string()).or_default();
        if !s.seen.insert(seq) {
            self.report.duplicates += 1;
        } else if seq < s.max {
            self.report.order_violations += 1;
            if self.report.examples.len() < MAX_EXAMPLES {
                self.report
                    .examples
                    .push(format!("session {session}: seq {seq} after seq {}", s.max));
            }
        }
        if seq >= s.max {
            s.max = seq;
            s.max_at = place;
        }
        s.last = seq;
        s.last_at = place;
    }

    /// Feeds a DLQ record: accounted for, not part of the order check.
    pub fn dead_letter(&mut self, session: Option<&str>, seq: Option<u64>) {
        self.report.dlq_records += 1;
        if let (Some(session), Some(seq)) = (session, seq) {
            self.dlq.entry(session.to_string()).or_default().insert(seq);
        }
    }

    fn accounted(&self, session: &str, seq: u64) -> bool {
        self.sessions
            .get(session)
            .is_some_and(|s| s.seen.contains(&seq))
            || self.dlq.get(session).is_some_and(|d| d.contains(&seq))
    }

    /// Finishes the check; `input` (session, seq) pairs, when given, must all be accounted for.
    pub fn finish<'a>(
        mut self,
        input: Option<impl IntoIterator<Item = (&'a str, u64)>>,
    ) -> VerifyReport {
        let mut gaps = 0;
        for (session, s) in &self.sessions {
            if s.last < s.max {
                self.report.stale_ends += 1;
                if self.report.examples.len() < MAX_EXAMPLES {
                    let mut example = format!(
                        "session {session}: ends on seq {} after seq {}",
                        s.last, s.max
                    );
                    if let (Some(last), Some(max)) = (s.last_at, s.max_at) {
                        example += &format!(" (seq {} at {last}; seq {} at {max})", s.last, s.max);
                    }
                    self.report.examples.push(example);
                }
            }
            for seq in 1..=s.max {
                if !self.accounted(session, seq) {
                    gaps += 1;
                    if self.report.examples.len() < MAX_EXAMPLES {
                        self.report
                            .examples
                            .push(format!("session {session}: seq {seq} missing"));
                    }
                }
            }
        }
        self.report.gaps = gaps;
        if let Some(input) = input {
            let mut lost = 0;
            for (session, seq) in input {
                if !self.accounted(session, seq) {
                    lost += 1;
                    if self.report.examples.len() < MAX_EXAMPLES {
                        self.report
                            .examples
                            .push(format!("session {session}: seq {seq} lost"));
                    }
                }
            }
            self.report.lost = lost;
        }
        let mut sessions: HashSet<&str> = self.sessions.keys().map(String::as_str).collect();
        sessions.extend(self.dlq.keys().map(String::as_str));
        self.report.sessions = sessions.len() as u64;
        self.report
    }
}

/// Options of the `verify` command.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// The cluster (bootstrap list, TLS and SASL settings).
    pub kafka: ClientSettings,
    pub topic: String,
    pub dlq: Option<String>,
    pub input: Option<String>,
    pub session_header: Option<String>,
    pub timeout: Duration,
}

/// Reads the topics and checks them.
pub fn run(opts: &VerifyOptions) -> anyhow::Result<VerifyReport> {
    let read = |topic: &str| {
        read_topic(
            &opts.kafka,
            topic,
            opts.session_header.as_deref(),
            opts.timeout,
        )
    };
    let mut checker = Checker::new();
    for r in read(&opts.topic)? {
        checker.output_record(&r);
    }
    if let Some(dlq) = &opts.dlq {
        for r in read(dlq)? {
            checker.dead_letter(r.session.as_deref(), r.seq);
        }
    }
    let input = match &opts.input {
        Some(topic) => Some(read(topic)?),
        None => None,
    };
    let pairs = input.as_ref().map(|records| {
        records
            .iter()
            .filter_map(|r| Some((r.session.as_deref()?, r.seq?)))
            .collect::<Vec<_>>()
    });
    Ok(checker.finish(pairs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_goes_on_through_a_broker_restarting_and_stops_on_anything_else() {
        use rdkafka::error::KafkaError;
        use rdkafka::types::RDKafkaErrorCode as Code;
        assert!(is_transient(&KafkaError::MessageConsumption(
            Code::BrokerTransportFailure
        )));
        assert!(is_transient(&KafkaError::MessageConsumption(
            Code::AllBrokersDown
        )));
        assert!(!is_transient(&KafkaError::MessageConsumption(
            Code::TopicAuthorizationFailed
        )));
        assert!(!is_transient(&KafkaError::MessageConsumption(
            Code::UnknownTopicOrPartition
        )));
    }

    fn record(partition: i32, offset: i64, seq: u64, timestamp_ms: i64) -> SeqRecord {
        SeqRecord {
            partition,
            offset,
            key: None,
            session: Some("s".into()),
            seq: Some(seq),
            headers: Vec::new(),
            value: Vec::new(),
            timestamp_ms: Some(timestamp_ms),
        }
    }

    #[test]
    fn a_stale_end_says_where_and_when_its_records_were_written() {
        let mut c = Checker::new();
        c.output_record(&record(3, 10, 1, 0));
        c.output_record(&record(3, 11, 2, 45_296_789)); // 12:34:56.789
        c.output_record(&record(3, 12, 1, 86_400_000 + 3_723_004)); // 01:02:03.004, next day
        let r = c.finish(None::<Vec<(&str, u64)>>);
        assert_eq!(r.stale_ends, 1);
        assert_eq!(
            r.examples,
            [
                "session s: ends on seq 1 after seq 2 (seq 1 at partition 3 offset 12, written \
              01:02:03.004 UTC; seq 2 at partition 3 offset 11, written 12:34:56.789 UTC)"
            ]
        );
    }

    fn check(
        output: &[(&str, u64)],
        dlq: &[(&str, u64)],
        input: Option<&[(&str, u64)]>,
    ) -> VerifyReport {
        let mut c = Checker::new();
        for (s, q) in output {
            c.output(Some(s), Some(*q));
        }
        for (s, q) in dlq {
            c.dead_letter(Some(s), Some(*q));
        }
        c.finish(input.map(|i| i.iter().copied()))
    }

    #[test]
    fn in_order_is_ok() {
        let r = check(&[("a", 1), ("b", 1), ("a", 2), ("b", 2)], &[], None);
        assert!(r.is_ok(), "{r}");
        assert_eq!(r.sessions, 2);
    }

    #[test]
    fn overtaking_is_a_violation() {
        let r = check(&[("a", 2), ("a", 1)], &[], None);
        assert_eq!(r.order_violations, 1);
        assert!(!r.is_ok());
    }

    #[test]
    fn replays_are_duplicates_not_violations() {
        let r = check(
            &[("a", 1), ("a", 2), ("a", 3), ("a", 2), ("a", 3), ("a", 4)],
            &[],
            None,
        );
        assert_eq!((r.order_violations, r.duplicates), (0, 2));
        assert!(r.is_ok());
    }

    #[test]
    fn ending_on_an_older_record_is_a_stale_end() {
        let r = check(&[("a", 1), ("a", 2), ("a", 1)], &[], None);
        assert_eq!((r.order_violations, r.stale_ends), (0, 1));
        assert!(!r.is_ok());
        // A whole range written again ends where it should.
        let r = check(&[("a", 1), ("a", 2), ("a", 1), ("a", 2)], &[], None);
        assert_eq!(r.stale_ends, 0);
        assert!(r.is_ok());
    }

    #[test]
    fn gaps_unless_dead_lettered() {
        let r = check(&[("a", 1), ("a", 3)], &[], None);
        assert_eq!(r.gaps, 1);
        let r = check(&[("a", 1), ("a", 3)], &[("a", 2)], None);
        assert_eq!(r.gaps, 0);
        assert!(r.is_ok());
    }

    #[test]
    fn lost_tail_is_found_against_the_input() {
        let input = [("a", 1), ("a", 2), ("a", 3)];
        let r = check(&[("a", 1), ("a", 2)], &[], Some(&input));
        assert_eq!((r.gaps, r.lost), (0, 1));
        assert!(!r.is_ok());
    }
}
