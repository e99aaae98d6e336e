//! A fenced transactional producer: how an exactly-once stage learns that one partition's
//! producer can no longer write, without stopping the worker.
//!
//! Partition *p*'s producer (`output::transactions`) fails for good when another producer
//! calls `init_transactions` with its transactional id (`<group>.<topic>.<p>`): the broker
//! bumps the id's epoch, aborts what *p* had open, and refuses every later request of the old
//! epoch (`PRODUCER_FENCED`, `INVALID_PRODUCER_EPOCH`). librdkafka then puts that client in its
//! fatal state and reports it through the client's error callback. Each partition's producer
//! has a [`PartitionEvents`] context of its own, which notes the partition in [`Fenced`]
//! instead of stopping the stage (the shared context's fatal handler would); the consumer loop
//! takes the notes and gives that partition up (`intake::transactional`). Errors that are not
//! fatal go to the stage's context as before.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::commit::offsets::Partition;

/// The partitions whose producer reported a fatal error since the loop last looked.
#[derive(Default)]
pub struct Fenced {
    partitions: Mutex<HashSet<Partition>>,
    /// Whether there is one, without the lock (read every turn of the loop).
    any: AtomicBool,
}

impl Fenced {
    /// `partition`'s producer has failed for good (or a write says so): the loop looks at it.
    pub fn note(&self, partition: Partition) {
        self.partitions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(partition);
        self.any.store(true, Ordering::Release);
    }

    /// Whether a partition was noted (no lock taken).
    pub fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// The partitions noted, taken out of the list (empty at once when there are none).
    pub fn take(&self) -> Vec<Partition> {
        if !self.any.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        partitions.drain().collect()
    }
}

/// Whether an error says the producer was fenced (another producer has its
/// transactional id) or failed fatally in its transactional state: no abort can help, the
/// client is done. Not a call this worker gave up waiting for (`OperationTimedOut` from
/// `Transactions::commit`): that one is aborted by a new producer, and its partition rewound.
pub fn is_fence(error: &KafkaError) -> bool {
    if let KafkaError::Transaction(e) = error {
        if e.is_fatal() {
            return true;
        }
    }
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
                | RDKafkaErrorCode::Fenced
        )
    )
}

/// The client context of one partition's transactional producer: the stage's context `C`,
/// except that a fatal error notes the partition in [`Fenced`] instead of stopping the stage.
#[derive(Clone)]
pub struct PartitionEvents<C> {
    pub inner: C,
    pub partition: Partition,
    pub fenced: Arc<Fenced>,
}

impl<C: ClientContext> ClientContext for PartitionEvents<C> {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.inner.log(level, fac, log_message);
    }

    fn stats_raw(&self, statistics: &[u8]) {
        self.inner.stats_raw(statistics);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        // librdkafka reports the fatal error of a fenced producer with its underlying code
        // (`ERR__FENCED`, "fenced by a newer instance"), others as `ERR__FATAL`.
        let fatal = error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal);
        if !fatal && !is_fence(&error) {
            self.inner.error(error, reason);
            return;
        }
        tracing::warn!(partition = self.partition, error = %error, reason,
            "exactlyOnce: the partition's transactional producer failed for good (fenced: \
             another producer has its transactional id); the consumer loop gives it up");
        self.fenced.note(self.partition);
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::client::DefaultClientContext;

    use super::*;

    #[test]
    fn a_fatal_error_notes_its_partition_once_and_the_rest_go_to_the_stage() {
        let fenced = Arc::new(Fenced::default());
        let events = PartitionEvents {
            inner: DefaultClientContext,
            partition: 3,
            fenced: fenced.clone(),
        };
        assert!(!fenced.any() && fenced.take().is_empty());
        events.error(
            KafkaError::Global(RDKafkaErrorCode::AllBrokersDown),
            "not a fence",
        );
        assert!(!fenced.any());
        events.error(KafkaError::Global(RDKafkaErrorCode::Fenced), "fenced");
        events.error(KafkaError::Global(RDKafkaErrorCode::Fatal), "again");
        assert!(fenced.any());
        assert_eq!(fenced.take(), vec![3]);
        events.error(
            KafkaError::Global(RDKafkaErrorCode::Fatal),
            "another fatal error",
        );
        assert_eq!(fenced.take(), vec![3]);
        assert!(!fenced.any() && fenced.take().is_empty());
    }

    #[test]
    fn a_fence_is_told_from_a_call_given_up() {
        let code = |c| KafkaError::MessageProduction(c);
        assert!(is_fence(&code(RDKafkaErrorCode::ProducerFenced)));
        assert!(is_fence(&code(RDKafkaErrorCode::InvalidProducerEpoch)));
        assert!(is_fence(&code(RDKafkaErrorCode::Fenced)));
        // A commit's answer for an offsets call that did not return: rewound, not given up.
        assert!(!is_fence(&code(RDKafkaErrorCode::OperationTimedOut)));
        assert!(!is_fence(&code(RDKafkaErrorCode::Fatal)));
        assert!(!is_fence(&code(RDKafkaErrorCode::State)));
    }
}
