//! What librdkafka may fetch ahead, bounded as a total per worker.
//!
//! librdkafka fetches records before they are asked for and keeps them in the queue they will
//! be read from, up to `queued.max.messages.kbytes`. For a consumer read through its one queue
//! that is a total; once every partition has its own queue (see `partition_queues`) it applies
//! to each of them, so a worker's prefetch grew with the partitions it was given (4 MiB × 64
//! partitions is a quarter of a gigabyte before one record is handled). The stage's
//! `prefetchKbytes` is the total instead: each partition's queue gets an equal share of it by
//! the input topic's partition count at start, since one worker may be assigned all of them,
//! and at least [`MIN_SHARE_KBYTES`], so that a partition still takes a fetch's worth of
//! records at a time.
//!
//! librdkafka reads the setting once, when the consumer is created. Partitions added to the
//! topic later, or a count that could not be made at start (no broker yet: then
//! [`UNCOUNTED_PARTITIONS`] is assumed), raise the bound by one share per extra partition
//! until the worker restarts; the consumer loop logs it when an assignment goes beyond the
//! count.
//!
//! librdkafka asks for a partition while its queue holds less than its share, and one answer
//! adds to it. How much is the broker's call. Kafka lets a partition pass
//! `max.partition.fetch.bytes` by its first batch only, and the engine lowers that to the
//! share (when it is below librdkafka's 1 MiB default). nisshi 0.8.1, the broker of the tests
//! and the bench, gives the first non-empty partition of an answer the request's whole
//! `fetch.max.bytes`. So the engine bounds the answer too: `fetch.max.bytes` is one share
//! (librdkafka's own choice, were it left alone), within what librdkafka accepts (at least
//! `message.max.bytes`, 1 MB unless set). Then a queue holds at most two shares (what it held
//! when it asked, and one answer) on either broker, and the worker's queues at most twice the
//! budget. With answers of the whole budget, as the engine asked for before, one queue took up
//! to 32 MiB and its records' bookkeeping with it: P1's peak heap was ~90 MB, 97 % of it
//! librdkafka's (BENCHMARKS.md, *librdkafka's answers, one share each, and fewer commits*).
//!
//! Bytes alone do not bound the memory of small records: librdkafka keeps a few hundred bytes
//! of its own per queued record, and asks for more while a queue holds fewer than
//! `queued.min.messages` (100,000 by default, per queue). With 100-byte records a worker's
//! queues held ~290,000 records, and its peak RSS was 288 MiB where it is 150 MiB with 2,000
//! per queue (P1 in BENCHMARKS.md). So `prefetchRecords` is a total too, shared the same way:
//! librdkafka stops asking for a partition at its share of records, and a queue holds at most
//! its share plus one answer (a share's bytes of records: with 130-byte records, ~16,000 of
//! them for the default budget's share on 8 partitions).

use std::time::Duration;

use rdkafka::client::{Client, ClientContext};

/// The smallest share of one partition's queue, KiB.
pub const MIN_SHARE_KBYTES: u64 = 64;
/// librdkafka's `fetch.queue.backoff.ms` unless the user sets it: a queue at its share makes
/// librdkafka put off fetching that partition, by default for a second, so a share that drains
/// in milliseconds idled its partition for the rest of it (10 KB records drained at 5k msg/s
/// instead of 51k).
pub const FETCH_QUEUE_BACKOFF_MS: u64 = 10;
/// Partitions assumed when the input topic could not be counted at start.
pub const UNCOUNTED_PARTITIONS: usize = 8;

/// The worker's prefetch budget and the partition count it is shared by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    pub total_kbytes: u64,
    pub total_records: u64,
    /// Partitions of the input topic when the consumer was created.
    pub partitions: usize,
}

impl Prefetch {
    /// The budget shared by `partitions` (the count, or [`UNCOUNTED_PARTITIONS`] if none).
    pub fn new(total_kbytes: u64, total_records: u64, partitions: Option<usize>) -> Self {
        Self {
            total_kbytes,
            total_records,
            partitions: partitions.unwrap_or(UNCOUNTED_PARTITIONS).max(1),
        }
    }

    /// `queued.min.messages` for each partition's queue: its share of the records, at least one.
    pub fn share_records(&self) -> u64 {
        (self.total_records / self.partitions as u64).max(1)
    }

    /// `queued.max.messages.kbytes` for each partition's queue.
    pub fn share_kbytes(&self) -> u64 {
        (self.total_kbytes / self.partitions as u64).max(MIN_SHARE_KBYTES)
    }

    /// What `assigned` partitions may hold prefetched at most, KiB.
    pub fn bound_kbytes(&self, assigned: usize) -> u64 {
        assigned as u64 * self.share_kbytes()
    }

    /// The consumer's fetch settings that follow from the budget, given the user's `kafka:`
    /// properties `extra` (whose own values for these keys are applied after them). The shares
    /// of each queue (`queued.max.messages.kbytes`, `queued.min.messages`) are not among them:
    /// they are the engine's own ([`Prefetch::queue_settings`]).
    pub fn fetch_settings(&self, extra: &[(String, String)]) -> [(&'static str, String); 3] {
        let set = |key: &str| {
            extra
                .iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| v.parse().ok())
        };
        let fetch_max =
            self.fetch_max_bytes(set("message.max.bytes"), set("receive.message.max.bytes"));
        [
            ("fetch.max.bytes", fetch_max.to_string()),
            (
                "max.partition.fetch.bytes",
                self.partition_fetch_bytes(set("max.partition.fetch.bytes"))
                    .to_string(),
            ),
            ("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS.to_string()),
        ]
    }

    /// Each partition queue's share, which no `kafka:` property may override.
    pub fn queue_settings(&self) -> [(&'static str, String); 2] {
        [
            (
                "queued.max.messages.kbytes",
                self.share_kbytes().to_string(),
            ),
            ("queued.min.messages", self.share_records().to_string()),
        ]
    }

    /// `fetch.max.bytes`: one share per fetch answer, but at least `message.max.bytes` and at
    /// most `receive.message.max.bytes` − 512, as librdkafka requires (the defaults, 1,000,000
    /// and 100,000,000, unless the user set them).
    pub fn fetch_max_bytes(&self, message_max: Option<u64>, receive_max: Option<u64>) -> u64 {
        let message_max = message_max.unwrap_or(1_000_000);
        let receive_max = receive_max.unwrap_or(100_000_000);
        (self.share_kbytes() * 1_024)
            .max(message_max)
            .min(receive_max.saturating_sub(512))
    }

    /// `max.partition.fetch.bytes`: one share, or `set` (librdkafka's 1 MiB default unless
    /// the user set it) when that is smaller.
    pub fn partition_fetch_bytes(&self, set: Option<u64>) -> u64 {
        (self.share_kbytes() * 1_024).min(set.unwrap_or(1_048_576))
    }

    /// Whether `assigned` partitions stay within the budget (or within the floor's, when the
    /// budget is smaller than a floor share per partition).
    pub fn holds(&self, assigned: usize) -> bool {
        self.bound_kbytes(assigned) <= self.total_kbytes.max(self.bound_kbytes(self.partitions))
    }
}

/// The partition count of `topic`, or `None` when the broker does not tell within `timeout`
/// (blocking: call it off the async workers).
pub fn count_partitions<C: ClientContext>(
    client: &Client<C>,
    topic: &str,
    timeout: Duration,
) -> Option<usize> {
    let metadata = client.fetch_metadata(Some(topic), timeout).ok()?;
    metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().len())
        .filter(|&n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const RECORDS: u64 = 16_384;

    #[test]
    fn the_total_is_shared_by_the_partitions_counted() {
        let p = Prefetch::new(32 * 1_024, RECORDS, Some(8));
        assert_eq!(p.share_kbytes(), 4 * 1_024);
        assert_eq!(p.bound_kbytes(8), 32 * 1_024);
        assert!(p.holds(8));
        assert!(
            !p.holds(9),
            "a partition beyond the count exceeds the total"
        );
    }

    #[test]
    fn a_share_never_falls_below_the_floor() {
        let p = Prefetch::new(1_024, RECORDS, Some(64));
        assert_eq!(p.share_kbytes(), MIN_SHARE_KBYTES);
        assert!(p.holds(64), "the floor's own bound holds");
    }

    #[test]
    fn an_uncounted_topic_is_shared_by_the_assumed_count() {
        let p = Prefetch::new(32 * 1_024, RECORDS, None);
        assert_eq!(p.partitions, UNCOUNTED_PARTITIONS);
        assert_eq!(Prefetch::new(100, RECORDS, Some(0)).partitions, 1);
    }

    #[test]
    fn a_fetch_answer_is_one_share_within_librdkafkas_limits() {
        let p = Prefetch::new(16 * 1_024, RECORDS, Some(8));
        assert_eq!(p.fetch_max_bytes(None, None), 2 << 20);
        assert_eq!(
            Prefetch::new(100, RECORDS, Some(1)).fetch_max_bytes(None, None),
            1_000_000,
            "at least message.max.bytes"
        );
        assert_eq!(
            Prefetch::new(512, RECORDS, Some(4)).fetch_max_bytes(Some(65_536), None),
            128 * 1_024,
            "one share when message.max.bytes allows it"
        );
        assert_eq!(p.fetch_max_bytes(Some(32 << 20), None), 32 << 20);
        assert_eq!(
            Prefetch::new(1 << 20, RECORDS, Some(1)).fetch_max_bytes(None, None),
            100_000_000 - 512,
            "below receive.message.max.bytes"
        );
    }

    #[test]
    fn one_answer_adds_at_most_a_share_to_a_queue() {
        assert_eq!(
            Prefetch::new(512, RECORDS, Some(4)).partition_fetch_bytes(None),
            128 * 1_024
        );
        assert_eq!(
            Prefetch::new(32 * 1_024, RECORDS, Some(8)).partition_fetch_bytes(None),
            1_048_576,
            "never above librdkafka's default"
        );
        assert_eq!(
            Prefetch::new(32 * 1_024, RECORDS, Some(8)).partition_fetch_bytes(Some(65_536)),
            65_536
        );
    }

    #[test]
    fn the_fetch_settings_follow_the_budget_and_the_users_limits() {
        let p = Prefetch::new(16 * 1_024, RECORDS, Some(8));
        let extra = [("message.max.bytes".to_string(), "33554432".to_string())];
        assert_eq!(
            p.fetch_settings(&extra),
            [
                ("fetch.max.bytes", (32 << 20).to_string()),
                ("max.partition.fetch.bytes", 1_048_576.to_string()),
                ("fetch.queue.backoff.ms", "10".to_string()),
            ]
        );
    }

    #[test]
    fn the_records_are_shared_by_the_partitions_counted_too() {
        let p = Prefetch::new(32 * 1_024, 16_384, Some(8));
        assert_eq!(p.share_records(), 2_048);
        assert_eq!(
            p.queue_settings(),
            [
                ("queued.max.messages.kbytes", (4 * 1_024).to_string()),
                ("queued.min.messages", "2048".to_string()),
            ]
        );
        assert_eq!(
            Prefetch::new(1, 10, Some(64)).share_records(),
            1,
            "at least one"
        );
        assert_eq!(Prefetch::new(1, 16_384, None).share_records(), 2_048);
    }

    proptest! {
        /// Every counted partition gets the same share; together they hold no more than the
        /// total (or the floor's bound) and waste less than a KiB per partition to rounding.
        #[test]
        fn shares_add_up_to_the_total(total in 1u64..100_000_000, partitions in 1usize..10_000) {
            let p = Prefetch::new(total, RECORDS, Some(partitions));
            let share = p.share_kbytes();
            prop_assert!(share >= MIN_SHARE_KBYTES);
            let all = p.bound_kbytes(partitions);
            prop_assert!(all <= total.max(MIN_SHARE_KBYTES * partitions as u64));
            if share > MIN_SHARE_KBYTES {
                prop_assert!(total - all < partitions as u64);
            }
            prop_assert!(p.holds(partitions) && p.holds(partitions / 2 + 1));
        }
    }
}
