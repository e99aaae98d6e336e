//! Exactly-once delivery: the decisions that do not touch Kafka (docs/exactly-once.md).
//!
//! In `exactlyOnce` a partition's outputs, dead letters and offsets are committed in one
//! transaction, by a transactional producer of the partition's own ([`transactional_id`]): the
//! next owner's `init_transactions` with the same id fences the old one, whatever kept it from
//! stopping (frozen, cut off, lost, killed).
//!
//! The outputs of records done *above* the watermark are in the transaction too, so the
//! completed-offset map that says they are done must be committed with them — always. The
//! at-least-once fallback (a map over [`MAX_METADATA`] is not sent, the plain watermark is)
//! would commit outputs the next owner does not know are done, and it would write them again.
//! So here the map is kept small enough by construction: a map describes the offsets from the
//! watermark to the newest begun, and one describing at most [`MAX_MAP_SPAN`] offsets always
//! fits, whatever is done in it (its bitset form does, and the encoder takes the shorter of
//! run lengths and bitset). [`may_begin`] says whether taking a record in keeps the span within
//! that; a record that does not is not begun (the partition waits for its oldest records to
//! finish and fetches it again). With no gaps in the offsets this is the in-flight cap: a cap
//! up to [`MAX_MAP_SPAN`] is allowed ([`check_in_flight_cap`]), and only gaps (transaction
//! markers of an exactly-once upstream stage, compaction) make a record wait.
//!
//! The transaction's timeout must outlast the longest a transaction stays open
//! ([`TransactionTimeouts::check`]).
//!
//! Pure: no Kafka types.

use std::time::Duration;

use crate::commit::offset_map::MAX_METADATA;
use crate::commit::offsets::{Offset, Partition};
use crate::config::{
    ConfigError, Delivery, StageConfig, EXACTLY_ONCE_MESSAGE_TIMEOUT_MS,
    EXACTLY_ONCE_TRANSACTION_TIMEOUT_MS, REVOCATION_COMMIT_ALLOWANCE_MS,
};

/// The transactional id of the producer that writes the results of `partition` of `topic` for
/// the consumer group `group`. One per input partition: its next owner uses the same id, and
/// its `init_transactions` fences every producer of an older owner.
pub fn transactional_id(group: &str, topic: &str, partition: Partition) -> String {
    format!("{group}.{topic}.{partition}")
}

/// Bytes of `v` as the map's varint.
const fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

/// The longest a completed-offset map describing `span` offsets can be, in characters, for any
/// watermark, leader epoch and done offsets: prefix and kind (4), then base64 (no padding) of
/// the header (watermark ≤ `i64::MAX`, epoch + 1 ≤ 2³¹, span) and of the bitset — the encoder
/// writes the bitset unless the run lengths are shorter.
pub const fn longest_map(span: usize) -> usize {
    let header =
        varint_len(i64::MAX as u64) + varint_len(i32::MAX as u64 + 1) + varint_len(span as u64);
    let bytes = header + span.div_ceil(8);
    4 + (bytes * 4).div_ceil(3)
}

/// The most offsets a map may describe and still fit in the commit metadata, whatever is done
/// in it.
pub const MAX_MAP_SPAN: usize = max_map_span();

const fn max_map_span() -> usize {
    let mut span = 0;
    while longest_map(span + 1) <= MAX_METADATA {
        span += 1;
    }
    span
}

/// Whether a partition may begin the record at `offset`: its map, which will run from the
/// partition's oldest unfinished offset (`first_unfinished`; `None` when nothing is
/// unfinished: the record becomes the watermark) to `offset`, still fits the commit metadata.
pub fn may_begin(first_unfinished: Option<Offset>, offset: Offset) -> bool {
    first_unfinished.is_none_or(|w| {
        offset
            .checked_sub(w)
            .and_then(|d| usize::try_from(d).ok())
            .is_some_and(|d| d < MAX_MAP_SPAN)
    })
}

/// Refused settings of an exactly-once stage.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EosConfigError {
    #[error(
        "maxInFlightPerPartition {cap} is above {MAX_MAP_SPAN}, the most offsets whose \
         completed-offset map always fits the commit metadata (exactlyOnce commits the map with \
         the outputs, it cannot fall back to the plain watermark)"
    )]
    InFlightCap { cap: usize },
    #[error(
        "transaction.timeout.ms {transaction:?} does not outlast the longest a transaction \
         stays open ({needed:?}: commit interval + the longer of message.timeout.ms and the \
         revocation's drain + the commit allowance)"
    )]
    TransactionTimeout {
        transaction: Duration,
        needed: Duration,
    },
    #[error(
        "transaction.timeout.ms {transaction:?} is above the broker's \
         transaction.max.timeout.ms {broker:?}: the broker would refuse the producer"
    )]
    AboveBrokerMax {
        transaction: Duration,
        broker: Duration,
    },
}

/// The in-flight cap of an exactly-once stage: at most [`MAX_MAP_SPAN`].
pub fn check_in_flight_cap(cap: usize) -> Result<(), EosConfigError> {
    if cap > MAX_MAP_SPAN {
        return Err(EosConfigError::InFlightCap { cap });
    }
    Ok(())
}

/// What an exactly-once stage needs of its configuration: an in-flight cap whose
/// completed-offset map always fits the commit metadata, and a transaction timeout that
/// outlasts the longest a transaction stays open. Nothing for an at-least-once stage.
pub fn check_stage(config: &StageConfig) -> Result<(), ConfigError> {
    if config.settings.delivery() != Delivery::ExactlyOnce {
        return Ok(());
    }
    // The consumer group protocol (KIP-848) is allowed: a transactional offset commit refused
    // while the broker changes an assignment (ILLEGAL_GENERATION) aborts and rewinds the
    // partition, and the next commit sends the group metadata of then (`intake::transactional`).
    check_in_flight_cap(config.max_in_flight_per_partition)
        .map_err(|e| ConfigError::new("maxInFlightPerPartition", e.to_string()))?;
    let ms = Duration::from_millis;
    TransactionTimeouts {
        commit_interval: ms(config.settings.commit_interval_ms()),
        message_timeout: ms(EXACTLY_ONCE_MESSAGE_TIMEOUT_MS),
        revocation_drain: ms(config.rebalance.drain_timeout_ms.saturating_mul(2)),
        commit_allowance: ms(REVOCATION_COMMIT_ALLOWANCE_MS),
        transaction: ms(EXACTLY_ONCE_TRANSACTION_TIMEOUT_MS),
        broker_max: None,
    }
    .check()
    .map_err(|e| ConfigError::new("delivery", e.to_string()))
}

/// What bounds how long a partition's transaction stays open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransactionTimeouts {
    /// Between two commits of a partition.
    pub commit_interval: Duration,
    /// The producer's `message.timeout.ms`: the longest the write barrier waits for a write.
    pub message_timeout: Duration,
    /// A revocation's drain (both its deadlines).
    pub revocation_drain: Duration,
    /// What a commit (offsets + `EndTxn`) is allowed, after the barrier or the drain.
    pub commit_allowance: Duration,
    /// The producer's `transaction.timeout.ms`: the broker aborts a transaction open longer.
    pub transaction: Duration,
    /// The broker's `transaction.max.timeout.ms`, when known.
    pub broker_max: Option<Duration>,
}

impl TransactionTimeouts {
    /// The longest a transaction stays open: opened right after a commit, it waits a commit
    /// interval, then the barrier (or a revocation's drain, whichever is longer), then its
    /// commit.
    pub fn longest_open(&self) -> Duration {
        self.commit_interval
            .saturating_add(self.message_timeout.max(self.revocation_drain))
            .saturating_add(self.commit_allowance)
    }

    /// Refuses a transaction timeout the broker would refuse, or that a transaction could
    /// outlast (the broker would abort it behind the worker's back).
    pub fn check(&self) -> Result<(), EosConfigError> {
        if let Some(broker) = self.broker_max {
            if self.transaction > broker {
                return Err(EosConfigError::AboveBrokerMax {
                    transaction: self.transaction,
                    broker,
                });
            }
        }
        let needed = self.longest_open();
        if self.transaction <= needed {
            return Err(EosConfigError::TransactionTimeout {
                transaction: self.transaction,
                needed,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::offset_map::{encode, MapError};
    use proptest::prelude::*;

    #[test]
    fn one_transactional_id_per_input_partition() {
        assert_eq!(transactional_id("g", "in", 3), "g.in.3");
        assert_ne!(
            transactional_id("g", "in", 3),
            transactional_id("g", "in", 4)
        );
        assert_ne!(
            transactional_id("g", "in", 3),
            transactional_id("h", "in", 3)
        );
    }

    #[test]
    fn the_bound_is_the_default_cap_and_more() {
        assert!(MAX_MAP_SPAN >= crate::config::defaults::max_in_flight_per_partition());
        assert!(longest_map(MAX_MAP_SPAN) <= MAX_METADATA);
        assert!(longest_map(MAX_MAP_SPAN + 1) > MAX_METADATA);
        assert_eq!(check_in_flight_cap(MAX_MAP_SPAN), Ok(()));
        assert!(check_in_flight_cap(MAX_MAP_SPAN + 1).is_err());
    }

    /// The worst map at the bound (the largest watermark and epoch, every other offset done:
    /// the bitset form) fits.
    #[test]
    fn the_worst_map_at_the_bound_fits() {
        let span = MAX_MAP_SPAN;
        let watermark = i64::MAX - span as i64 - 1;
        let incomplete = (0..span as i64).step_by(2).map(|i| watermark + i);
        let map = encode(watermark, watermark + span as i64, i32::MAX, incomplete);
        assert!(map.is_ok(), "{map:?}");
    }

    /// The bound is tight: one offset more, with every other offset done (the bitset form) and
    /// the largest watermark and epoch, no longer fits.
    #[test]
    fn past_the_bound_a_map_may_not_fit() {
        let span = MAX_MAP_SPAN + 8;
        let watermark = i64::MAX - span as i64 - 1;
        let incomplete = (0..span as i64).step_by(2).map(|i| watermark + i);
        let map = encode(watermark, watermark + span as i64, i32::MAX, incomplete);
        assert!(matches!(map, Err(MapError::TooLarge(_))), "{map:?}");
    }

    #[test]
    fn a_record_is_begun_only_while_the_map_fits() {
        assert!(
            may_begin(None, 1_000_000),
            "nothing unfinished: it is the watermark"
        );
        assert!(may_begin(Some(100), 100));
        assert!(may_begin(Some(100), 100 + MAX_MAP_SPAN as i64 - 1));
        assert!(!may_begin(Some(100), 100 + MAX_MAP_SPAN as i64));
        assert!(!may_begin(Some(100), i64::MAX), "a gap past the span waits");
        assert!(
            !may_begin(Some(100), 99),
            "below the watermark: never ours to begin"
        );
    }

    fn timeouts() -> TransactionTimeouts {
        TransactionTimeouts {
            commit_interval: Duration::from_secs(1),
            message_timeout: Duration::from_secs(30),
            revocation_drain: Duration::from_secs(20),
            commit_allowance: Duration::from_secs(5),
            transaction: Duration::from_secs(60),
            broker_max: Some(Duration::from_secs(900)),
        }
    }

    #[test]
    fn the_transaction_outlasts_its_longest_open() {
        assert_eq!(timeouts().longest_open(), Duration::from_secs(36));
        assert_eq!(timeouts().check(), Ok(()));
        let slow_writes = TransactionTimeouts {
            message_timeout: Duration::from_secs(300),
            ..timeouts()
        };
        assert!(matches!(
            slow_writes.check(),
            Err(EosConfigError::TransactionTimeout { .. })
        ));
        let long_drain = TransactionTimeouts {
            revocation_drain: Duration::from_secs(55),
            ..timeouts()
        };
        assert!(long_drain.check().is_err());
        let exact = TransactionTimeouts {
            transaction: Duration::from_secs(36),
            ..timeouts()
        };
        assert!(exact.check().is_err(), "no margin at all is refused");
    }

    #[test]
    fn a_timeout_the_broker_refuses_is_refused_first() {
        let too_long = TransactionTimeouts {
            transaction: Duration::from_secs(1_000),
            ..timeouts()
        };
        assert!(matches!(
            too_long.check(),
            Err(EosConfigError::AboveBrokerMax { .. })
        ));
        let unknown = TransactionTimeouts {
            broker_max: None,
            ..too_long
        };
        assert_eq!(unknown.check(), Ok(()));
    }

    #[test]
    fn a_stage_is_exactly_once_only_when_asked_and_when_it_fits() {
        const MINIMAL: &str =
            "brokers: b:9092\nstage: s\ninput: in\ndlq: dead\nhandler:\n  builtin: {}\n";
        let stage = |extra: &str| StageConfig::from_yaml(&format!("{MINIMAL}{extra}")).unwrap();
        assert_eq!(stage("").settings.delivery(), Delivery::AtLeastOnce);
        assert_eq!(check_stage(&stage("delivery: exactlyOnce\n")), Ok(()));
        assert_eq!(
            StageConfig::from_yaml(&format!("{MINIMAL}delivery: exactly\n"))
                .unwrap_err()
                .key,
            "delivery"
        );
        let wide = MAX_MAP_SPAN + 1;
        let too_wide = stage(&format!(
            "delivery: exactlyOnce\nmaxInFlightPerPartition: {wide}\n"
        ));
        assert_eq!(
            check_stage(&too_wide).unwrap_err().key,
            "maxInFlightPerPartition"
        );
        // Allowed in atLeastOnce: its map falls back to the plain watermark.
        let at_least_once = stage(&format!("maxInFlightPerPartition: {wide}\n"));
        assert_eq!(check_stage(&at_least_once), Ok(()));
        let kip_848 = stage("delivery: exactlyOnce\nrebalance: {strategy: consumer}\n");
        assert_eq!(check_stage(&kip_848), Ok(()));
        let kip_848 = stage("rebalance: {strategy: consumer}\n");
        assert_eq!(check_stage(&kip_848), Ok(()));
        let long_drain = stage("delivery: exactlyOnce\nrebalance: {drainTimeoutMs: 60000}\n");
        assert_eq!(check_stage(&long_drain).unwrap_err().key, "delivery");
    }

    proptest! {
        /// Every map of at most `MAX_MAP_SPAN` offsets fits, whatever is done in it, at any
        /// watermark and epoch: the exactly-once commit never needs the plain-watermark
        /// fallback.
        #[test]
        fn every_map_within_the_bound_fits(
            span in prop_oneof![1usize..=MAX_MAP_SPAN, MAX_MAP_SPAN - 64..=MAX_MAP_SPAN],
            done_ratio in 0u32..=100,
            seed in any::<u64>(),
            high in any::<bool>(),
            epoch in -1i32..=i32::MAX,
        ) {
            let watermark = if high { i64::MAX - span as i64 - 1 } else { 0 };
            // The watermark itself is unfinished; the rest done with the given ratio.
            let mut state = seed | 1;
            let incomplete: Vec<i64> = (0..span as i64)
                .filter(|i| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    *i == 0 || (state % 100) as u32 >= done_ratio
                })
                .map(|i| watermark + i)
                .collect();
            let map = encode(watermark, watermark + span as i64, epoch, incomplete);
            prop_assert!(map.is_ok(), "{:?}", map);
        }

        /// Beginning only what `may_begin` allows keeps every map within the bound, whatever
        /// the gaps between offsets and whichever records finish.
        #[test]
        fn begun_records_keep_the_map_within_the_bound(
            steps in proptest::collection::vec((1i64..5_000, any::<bool>()), 1..400),
        ) {
            let mut unfinished = std::collections::VecDeque::new();
            let mut next = 0i64;
            for (gap, finish_oldest) in steps {
                let offset = next + gap;
                if may_begin(unfinished.front().copied(), offset) {
                    unfinished.push_back(offset);
                    next = offset + 1;
                }
                if finish_oldest {
                    unfinished.pop_front();
                }
                if let Some(w) = unfinished.front() {
                    prop_assert!((next - w) as usize <= MAX_MAP_SPAN);
                }
            }
        }
    }
}
