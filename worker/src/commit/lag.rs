//! Consumer lag as the broker sees it: high watermark minus committed offset, per partition.
//!
//! The "high watermark" is the **last stable offset**: every reader's client sets
//! `isolation.level=read_committed`, and librdkafka's `ListOffsets` (what `fetch_watermarks`
//! sends) carries the client's isolation level, so the broker answers with the LSO: an open
//! transaction's records (which a `read_committed` group cannot take yet) never count as lag.
//! (The default of librdkafka is `read_committed` too; set here so that no passed-through
//! property turns it off.)
//!
//! Read from the broker, not from the worker's fetch position, so it stays true while a
//! partition is held for backpressure (a held partition takes nothing in, yet its lag grows).
//! A partition without a committed offset counts from its low watermark: with
//! `auto.offset.reset=earliest` that is where the group will start.
//!
//! Lag counts every record above the committed watermark, but a worker finishes records out of
//! order across sessions, and the completed-offset map in its commit metadata says which ones
//! above the watermark are already done. *Effective lag* subtracts those: it is the work that
//! is really left, and what the operator scales on. Brokers that drop commit metadata (nisshi)
//! make the two equal.
//!
//! Who reads it: the stage's own reporter ([`LagReporter`], the `sessionflow_partition_lag`
//! gauge), and from outside the group the operator's autoscaler and the tools (`sessionflow
//! lag`, the demo's progress) through [`LagReader`]s kept in a [`LagReaders`]: one client per
//! connection and group, made once and read again, since a librdkafka client costs threads and
//! broker connections, too much to make for every read.

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaResult;
use rdkafka::{Offset, TopicPartitionList};

use crate::commit::offset_map;
use crate::kafka::client_settings::ClientSettings;

/// Lag of one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionLag {
    pub partition: i32,
    pub low: i64,
    pub high: i64,
    /// `None` when the group has committed nothing for the partition.
    pub committed: Option<i64>,
    /// Records above the committed watermark (and below `high`) that the commit metadata's
    /// completed-offset map says are done; 0 without a map.
    pub done_above: i64,
}

impl PartitionLag {
    /// Records not yet committed by the group.
    pub fn lag(&self) -> i64 {
        let from = self.committed.unwrap_or(self.low).max(self.low);
        (self.high - from).max(0)
    }

    /// Records not yet done: [`lag`](Self::lag) minus those the completed-offset map marks done.
    pub fn effective_lag(&self) -> i64 {
        (self.lag() - self.done_above).max(0)
    }
}

/// Total lag over partitions.
pub fn total(lags: &[PartitionLag]) -> i64 {
    lags.iter().map(PartitionLag::lag).sum()
}

/// Total effective lag over partitions.
pub fn total_effective(lags: &[PartitionLag]) -> i64 {
    lags.iter().map(PartitionLag::effective_lag).sum()
}

/// Done offsets in `[committed, high)` per a commit's metadata; 0 for empty or foreign metadata.
fn done_above(committed: i64, high: i64, metadata: &str) -> i64 {
    match offset_map::decode(committed, metadata) {
        Ok(map) => map.count_below(high) as i64,
        Err(_) => 0,
    }
}

/// Reads the lag of `group` on every partition of `topic`, without joining the group.
pub fn read(
    kafka: impl Into<ClientSettings>,
    group: &str,
    topic: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<PartitionLag>> {
    read_with(&lag_client(kafka.into(), group)?, topic, timeout)
}

/// A client that reads `group`'s committed offsets and the partitions' last stable offsets
/// (`read_committed`: transaction markers and open transactions are not lag). Made without
/// reaching a broker.
fn lag_client(kafka: ClientSettings, group: &str) -> KafkaResult<BaseConsumer> {
    kafka
        .base()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()
}

/// Like [`read`], with an existing client whose `group.id` is the group to inspect.
pub fn read_with(
    consumer: &BaseConsumer<impl rdkafka::consumer::ConsumerContext>,
    topic: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<PartitionLag>> {
    let md = consumer.fetch_metadata(Some(topic), timeout)?;
    let partitions: Vec<i32> = md
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    anyhow::ensure!(!partitions.is_empty(), "topic {topic} not found");
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition(topic, *p);
    }
    let committed = consumer.committed_offsets(tpl, timeout)?;
    partitions
        .iter()
        .map(|p| {
            let (low, high) = consumer.fetch_watermarks(topic, *p, timeout)?;
            let entry = committed.find_partition(topic, *p);
            let committed = entry.as_ref().and_then(|e| match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            });
            let done_above = match (committed, &entry) {
                (Some(c), Some(e)) => done_above(c, high, e.metadata()),
                _ => 0,
            };
            Ok(PartitionLag {
                partition: *p,
                low,
                high,
                committed,
                done_above,
            })
        })
        .collect()
}

/// Timeout of each broker request of a [`LagReader`]'s read.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A client of one group's committed offsets (and the topic's watermarks), kept to read again;
/// it never subscribes, joins or commits. Clones share the client.
///
/// librdkafka calls block: [`read`](Self::read) runs them on the blocking pool. A read its caller
/// stopped waiting for (a deadline passed) still holds the reader until librdkafka gives up, and
/// the reader refuses to start a second read meanwhile, so an unreachable cluster costs one
/// blocking thread per reader, not one more per attempt.
#[derive(Clone)]
pub struct LagReader {
    consumer: Arc<BaseConsumer>,
    /// A read is running (perhaps one nobody waits for any more).
    busy: Arc<AtomicBool>,
}

/// Clears a reader's `busy` flag when its read ends, however it ends.
struct Busy(Arc<AtomicBool>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl LagReader {
    /// A reader of `group`'s lag over `kafka`'s connection (made without reaching a broker).
    pub fn new(kafka: impl Into<ClientSettings>, group: &str) -> anyhow::Result<Self> {
        let consumer = lag_client(kafka.into(), group)?;
        Ok(Self {
            consumer: Arc::new(consumer),
            busy: Arc::default(),
        })
    }

    /// Lag of the group on every partition of `topic`, on the blocking pool. Fails at once
    /// while an earlier read of this reader has not returned.
    pub async fn read(&self, topic: &str) -> anyhow::Result<Vec<PartitionLag>> {
        let busy = self.claim()?;
        let reader = self.clone();
        let topic = topic.to_string();
        tokio::task::spawn_blocking(move || reader.read_claimed(&topic, busy)).await?
    }

    /// Like [`read`](Self::read), on this thread (it blocks).
    pub fn read_blocking(&self, topic: &str) -> anyhow::Result<Vec<PartitionLag>> {
        let busy = self.claim()?;
        self.read_claimed(topic, busy)
    }

    fn claim(&self) -> anyhow::Result<Busy> {
        anyhow::ensure!(
            !self.busy.swap(true, Ordering::AcqRel),
            "the previous lag read has not returned yet (the cluster does not answer)"
        );
        Ok(Busy(self.busy.clone()))
    }

    fn read_claimed(&self, topic: &str, _busy: Busy) -> anyhow::Result<Vec<PartitionLag>> {
        // Serve what queued up since the last read (client errors and logs), so a reader kept
        // for days does not accumulate them.
        while self.consumer.poll(Duration::ZERO).is_some() {}
        read_with(&self.consumer, topic, READ_TIMEOUT)
    }
}

/// Which reader: the connection's fingerprint (its settings, secrets among them, are not kept
/// twice) and the group.
type ReaderKey = (u64, String);

/// Lag readers kept from one round of reads to the next (the operator's autoscaling passes,
/// the demo's ticks), one per connection and group. A reader not asked for during a whole round
/// (its stage or pipeline is gone, or its credentials changed, which changes the connection) is
/// dropped by [`forget_unused`](Self::forget_unused).
#[derive(Default)]
pub struct LagReaders {
    readers: HashMap<ReaderKey, LagReader>,
    used: HashSet<ReaderKey>,
    created: usize,
}

impl LagReaders {
    /// The reader of `group` on `connection`, made on first use.
    pub fn get(
        &mut self,
        connection: &(impl AsRef<ClientSettings> + ?Sized),
        group: &str,
    ) -> anyhow::Result<LagReader> {
        let settings = connection.as_ref();
        let mut hasher = DefaultHasher::new();
        settings.hash(&mut hasher);
        let key = (hasher.finish(), group.to_string());
        self.used.insert(key.clone());
        if let Some(reader) = self.readers.get(&key) {
            return Ok(reader.clone());
        }
        let reader = LagReader::new(settings, group)?;
        self.created += 1;
        self.readers.insert(key, reader.clone());
        Ok(reader)
    }

    /// Drops the readers not asked for since the last call.
    pub fn forget_unused(&mut self) {
        let used = std::mem::take(&mut self.used);
        self.readers.retain(|key, _| used.contains(key));
    }

    /// Readers kept now.
    pub fn kept(&self) -> usize {
        self.readers.len()
    }

    /// Clients made so far.
    pub fn created(&self) -> usize {
        self.created
    }
}

/// The partitions this worker holds, shared between the consumer loop (writer) and the lag
/// reporter (reader).
pub type Assigned = std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<i32>>>;

/// Reports `sessionflow_partition_lag` for the assigned partitions on a timer of its own,
/// through a client of its own: it keeps reporting while partitions are paused or the consumer
/// loop is busy draining.
pub struct LagReporter {
    pub brokers: String,
    /// The stage's extra librdkafka properties (the consumer's): security protocol, SASL
    /// and TLS settings among them, so the reporter reaches the brokers the consumer reaches.
    pub kafka: Vec<(String, String)>,
    pub group: String,
    pub topic: String,
    pub interval: Duration,
    pub assigned: Assigned,
    pub metrics: crate::ops::metrics::Metrics,
}

impl LagReporter {
    /// Runs on its own thread until `stop` is cancelled.
    pub fn spawn(
        self,
        stop: tokio_util::sync::CancellationToken,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name("lag-reporter".into())
            .spawn(move || self.run(stop))
    }

    /// The reporter's client: the consumer's properties, then what makes it a reader that
    /// never joins or commits.
    fn client_config(&self) -> ClientConfig {
        let mut config =
            ClientSettings::with_properties(self.brokers.clone(), self.kafka.clone()).base();
        config
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed");
        config
    }

    fn run(self, stop: tokio_util::sync::CancellationToken) {
        let consumer: BaseConsumer = match self.client_config().create() {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "lag reporter could not create its client");
                return;
            }
        };
        let mut reported: std::collections::BTreeSet<i32> = Default::default();
        while !stop.is_cancelled() {
            let assigned = self.assigned.lock().map(|a| a.clone()).unwrap_or_default();
            match read_with(&consumer, &self.topic, Duration::from_secs(5)) {
                Ok(lags) => {
                    for l in lags.iter().filter(|l| assigned.contains(&l.partition)) {
                        self.metrics
                            .partition_lag
                            .with_label_values(&[&self.topic, &l.partition.to_string()])
                            .set(l.lag());
                    }
                    for gone in reported.difference(&assigned) {
                        let _ = self
                            .metrics
                            .partition_lag
                            .remove_label_values(&[&self.topic, &gone.to_string()]);
                    }
                    reported = assigned;
                }
                Err(e) => tracing::debug!(error = %e, "lag read failed; retrying"),
            }
            let until = std::time::Instant::now() + self.interval;
            while std::time::Instant::now() < until && !stop.is_cancelled() {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reporter_connects_with_the_consumers_security_settings() {
        let reporter = LagReporter {
            brokers: "kafka:9093".into(),
            kafka: vec![
                ("security.protocol".into(), "SASL_SSL".into()),
                ("sasl.mechanisms".into(), "SCRAM-SHA-512".into()),
                ("sasl.username".into(), "svc".into()),
                (
                    "ssl.ca.location".into(),
                    "/etc/sessionflow/kafka-tls/ca.crt".into(),
                ),
                ("enable.auto.commit".into(), "true".into()),
            ],
            group: "g".into(),
            topic: "t".into(),
            interval: Duration::from_secs(1),
            assigned: Assigned::default(),
            metrics: crate::ops::metrics::Metrics::new("t"),
        };
        let config = reporter.client_config();
        assert_eq!(config.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(config.get("sasl.mechanisms"), Some("SCRAM-SHA-512"));
        assert_eq!(config.get("sasl.username"), Some("svc"));
        assert_eq!(
            config.get("ssl.ca.location"),
            Some("/etc/sessionflow/kafka-tls/ca.crt")
        );
        assert_eq!(config.get("bootstrap.servers"), Some("kafka:9093"));
        assert_eq!(
            config.get("enable.auto.commit"),
            Some("false"),
            "never commits"
        );
    }

    #[test]
    fn readers_are_kept_per_connection_and_group_and_dropped_when_unused() {
        // Nothing listens there: making a client does not need a broker.
        let a = ClientSettings::new("127.0.0.1:1");
        let b = ClientSettings::with_properties("127.0.0.1:1", [("client.id", "b")]);
        let mut readers = LagReaders::default();
        readers.get(&a, "g1").unwrap();
        readers.get(&a, "g1").unwrap();
        readers.get(&a, "g2").unwrap();
        readers.get(&b, "g1").unwrap();
        assert_eq!((readers.kept(), readers.created()), (3, 3));
        readers.forget_unused();
        assert_eq!(readers.kept(), 3, "all three were used in that round");
        readers.get(&a, "g1").unwrap();
        readers.forget_unused();
        assert_eq!(readers.kept(), 1, "only a/g1 was used in the last round");
        readers.get(&a, "g1").unwrap();
        assert_eq!(readers.created(), 3, "a kept reader is not made again");
    }

    #[test]
    fn a_reader_refuses_a_second_read_while_one_runs() {
        let reader = LagReader::new("127.0.0.1:1", "g").unwrap();
        let running = reader.claim().unwrap();
        let refused = reader.clone().read_blocking("t").unwrap_err();
        assert!(
            refused.to_string().contains("has not returned"),
            "{refused}"
        );
        drop(running);
        assert!(reader.claim().is_ok(), "free again once the read ends");
    }

    fn lag(low: i64, high: i64, committed: Option<i64>) -> i64 {
        PartitionLag {
            partition: 0,
            low,
            high,
            committed,
            done_above: 0,
        }
        .lag()
    }

    #[test]
    fn effective_lag_subtracts_what_the_map_marks_done() {
        // Watermark 10, offsets 10..20 taken in; 11, 12 and 15 unfinished, so 13, 14 and
        // 16..19 are done above the watermark (10 itself is unfinished too).
        let metadata = offset_map::encode(10, 20, 0, [10, 11, 12, 15]).unwrap();
        assert_eq!(done_above(10, 20, &metadata), 6);
        // Only what lies below the high watermark counts.
        assert_eq!(done_above(10, 17, &metadata), 3);
        let p = PartitionLag {
            partition: 0,
            low: 0,
            high: 20,
            committed: Some(10),
            done_above: done_above(10, 20, &metadata),
        };
        assert_eq!((p.lag(), p.effective_lag()), (10, 4));
        // No map, someone else's metadata, or a corrupt one: effective lag is plain lag.
        assert_eq!(done_above(10, 20, ""), 0);
        assert_eq!(done_above(10, 20, "checkpoint-7"), 0);
        assert_eq!(done_above(10, 20, "sf1b!!"), 0);
    }

    #[test]
    fn lag_from_committed_or_low_watermark() {
        assert_eq!(lag(0, 100, Some(40)), 60);
        assert_eq!(lag(0, 100, None), 100);
        assert_eq!(lag(30, 100, None), 70);
        // A commit below the low watermark (retention deleted it) counts from the low mark.
        assert_eq!(lag(30, 100, Some(10)), 70);
        assert_eq!(lag(0, 100, Some(100)), 0);
        assert_eq!(lag(0, 0, None), 0);
    }
}
