//! The transactional producers of an exactly-once stage: one per input partition it owns.
//!
//! Partition *p*'s producer has the transactional id `<group>.<topic>.<p>`
//! (`commit::exactly_once`); it writes every output and dead letter of *p*'s records, and
//! commits *p*'s input offsets (watermark + completed-offset map) with them. It is opened when
//! *p* is assigned — its `init_transactions` fences every producer of an older owner of *p* and
//! aborts what that one left open — and closed when *p* leaves.
//!
//! The commit barrier: a write holds a [`Share`] from before it is sent until its record's
//! completion has gone to the consumer loop (see `settle`); a commit takes the barrier
//! exclusively ([`Transactions::exclusive`]), so that every write in the transaction it commits
//! is acknowledged and counted in the offsets it commits, and writes that come meanwhile wait
//! for the next transaction.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::TopicPartitionList;
use tokio::sync::{OwnedRwLockReadGuard, RwLock, RwLockWriteGuard};

use crate::commit::exactly_once::transactional_id;
use crate::commit::offsets::Partition;

/// How long a transaction call (init, offsets, commit, abort) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A write's share of the commit barrier.
pub type Share = OwnedRwLockReadGuard<()>;
/// A commit's hold of the barrier: no write is on its way while it lives.
pub type Exclusive<'a> = RwLockWriteGuard<'a, ()>;

/// The transactional producers of one stage, with client context `C` (the stage's
/// `ProducerEvents`: a fatal error stops the worker).
pub struct Transactions<C: ClientContext + Clone + 'static> {
    config: ClientConfig,
    group: String,
    topic: String,
    events: C,
    producers: Mutex<HashMap<Partition, FutureProducer<C>>>,
    barrier: Arc<RwLock<()>>,
}

impl<C: ClientContext + Clone + 'static> Transactions<C> {
    /// `config` is the producer configuration without a transactional id.
    pub fn new(config: ClientConfig, group: &str, topic: &str, events: C) -> Self {
        Self {
            config,
            group: group.into(),
            topic: topic.into(),
            events,
            producers: Mutex::default(),
            barrier: Arc::default(),
        }
    }

    fn producers(&self) -> std::sync::MutexGuard<'_, HashMap<Partition, FutureProducer<C>>> {
        self.producers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens `partition`'s producer: init (fencing any older owner's) and begin. Blocking.
    pub fn open(&self, partition: Partition) -> anyhow::Result<()> {
        let id = transactional_id(&self.group, &self.topic, partition);
        let mut config = self.config.clone();
        config.set("transactional.id", &id);
        let producer: FutureProducer<C> = config.create_with_context(self.events.clone())?;
        producer.init_transactions(CALL_TIMEOUT).map_err(|e| {
            anyhow::anyhow!(
                "init_transactions of {id} failed ({e}): exactlyOnce needs a broker with \
                 transactions (Apache Kafka ≥ 2.5)"
            )
        })?;
        producer.begin_transaction()?;
        tracing::info!(partition, transactional_id = %id, "transactional producer opened");
        self.producers().insert(partition, producer);
        Ok(())
    }

    /// The producer of `partition`, if it is open.
    pub fn producer(&self, partition: Partition) -> Option<FutureProducer<C>> {
        self.producers().get(&partition).cloned()
    }

    /// A write's share of the barrier (waits while a commit holds it).
    pub async fn share(&self) -> Share {
        self.barrier.clone().read_owned().await
    }

    /// The barrier, exclusively: waits for every write's share. Blocking; not on the runtime.
    pub fn exclusive(&self) -> Exclusive<'_> {
        self.barrier.blocking_write()
    }

    /// Commits `partition`'s transaction with `offsets` (its watermark and map) and begins the
    /// next. Call under [`Transactions::exclusive`]. Blocking.
    pub fn commit(
        &self,
        partition: Partition,
        offsets: &TopicPartitionList,
        group: &ConsumerGroupMetadata,
    ) -> KafkaResult<()> {
        let Some(producer) = self.producer(partition) else {
            return Err(KafkaError::MessageProduction(RDKafkaErrorCode::State));
        };
        producer.send_offsets_to_transaction(offsets, group, CALL_TIMEOUT)?;
        producer.commit_transaction(CALL_TIMEOUT)?;
        producer.begin_transaction()
    }

    /// Aborts `partition`'s open transaction (what it wrote since its last commit is never
    /// visible to read_committed readers) and closes its producer.
    pub fn abort_and_close(&self, partition: Partition) {
        if let Some(producer) = self.producers().remove(&partition) {
            if let Err(e) = producer.abort_transaction(CALL_TIMEOUT) {
                tracing::warn!(partition, error = %e, "abort of the open transaction failed \
                    (a fenced producer's transaction is aborted by the broker)");
            }
        }
    }

    /// Gives up every write not yet acknowledged, in every producer. Their transactions can
    /// then no longer commit: the caller stops the worker if anything was given up (see
    /// `StageProducer::purge`).
    /// Returns whether anything was given up.
    pub fn purge(&self) -> bool {
        let mut gave_up = false;
        for producer in self.producers().values() {
            if producer.in_flight_count() > 0 {
                gave_up = true;
                producer.purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
            }
        }
        gave_up
    }

    /// Closes every producer, aborting what each has open.
    pub fn abort_all(&self) {
        let partitions: Vec<Partition> = self.producers().keys().copied().collect();
        for p in partitions {
            self.abort_and_close(p);
        }
    }
}
