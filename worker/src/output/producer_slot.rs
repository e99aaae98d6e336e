//! The stage's idempotent producer, replaced by a new one after a write the broker refused.
//!
//! librdkafka's idempotent producer answers a batch the broker refuses for good (too large
//! for it, a topic the client may not write) by draining its partitions and bumping its
//! producer epoch itself, and librdkafka 2.12.1 can afterwards send a new batch with sequence
//! numbers it has already used under the bumped epoch: a topic refused as not authorized is
//! set aside, and when it comes back, its partitions' state from before the bump is restored,
//! bumped again, and their sequences start from 0 once more. Kafka takes such a batch for a
//! retry of the one it stored with those numbers and answers with that batch's offset:
//! librdkafka reports the new records delivered, and they were never stored (RELIABILITY.md,
//! *What failed, and how*: acknowledged outputs lost, seen on Apache Kafka).
//!
//! So a producer that has had a write refused gets no new writes: a new one, with a producer
//! id of its own, takes them. The old one's queue (writes not yet sent) is purged at once, so
//! it sends nothing more — those writes are taken back and written again through the new one
//! (`settle`: a purged write whose partition is still this worker's goes again) —, while what
//! it has on the wire is let finish: a session has one write out at a time, so nothing of that
//! session can overtake it. An old producer is kept until the next replacement finds nothing
//! of it in flight, or the close has flushed it.
//!
//! A refusal is known only when its answer comes, so the writes that answer covers all carry
//! the same generation: the first to report it replaces the producer, the rest find it
//! replaced already.

use std::sync::{Mutex, PoisonError, RwLock};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::{FutureProducer, Producer, PurgeConfig};

/// The producer writes go through now, and the ones replaced that still have writes out.
pub struct ProducerSlot<C: ClientContext + 'static> {
    current: RwLock<Current<C>>,
    retired: Mutex<Vec<FutureProducer<C>>>,
    config: ClientConfig,
    context: C,
}

struct Current<C: ClientContext + 'static> {
    producer: FutureProducer<C>,
    /// How many producers came before this one.
    generation: u64,
}

impl<C: ClientContext + Clone + 'static> ProducerSlot<C> {
    /// The first producer, made from `config` with `context` (as every later one is).
    pub fn new(config: &ClientConfig, context: C) -> KafkaResult<Self> {
        let producer = config.create_with_context(context.clone())?;
        Ok(Self {
            current: RwLock::new(Current {
                producer,
                generation: 0,
            }),
            retired: Mutex::default(),
            config: config.clone(),
            context,
        })
    }

    /// Runs `send` with the current producer and its generation, which the caller gives to
    /// [`ProducerSlot::replace`] if the write is refused. The producer is not replaced while
    /// `send` runs: a write enqueued through it is in the queue a replacement purges.
    pub fn with<T>(&self, send: impl FnOnce(&FutureProducer<C>, u64) -> T) -> T {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        send(&current.producer, current.generation)
    }

    /// The current producer.
    pub fn producer(&self) -> FutureProducer<C> {
        self.with(|p, _| p.clone())
    }

    /// Replaces the producer of `generation` by a new one, unless it was replaced already:
    /// what the old one has queued is purged (never sent), what it has in flight finishes.
    /// True when this call replaced it. A new producer that cannot be made (librdkafka refuses
    /// the configuration it accepted before: not expected) leaves the old one in place.
    pub fn replace(&self, generation: u64) -> bool {
        if self.with(|_, g| g) != generation {
            return false;
        }
        // Made before the slot is locked, since making a client starts its threads: writes
        // wait on the lock meanwhile.
        let producer = match self.config.create_with_context(self.context.clone()) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "a new producer could not be made; the old one stays");
                return false;
            }
        };
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if current.generation != generation {
            return false; // replaced meanwhile: the new client is let go unused
        }
        let old = std::mem::replace(&mut current.producer, producer);
        current.generation += 1;
        // Retired before the slot is let go: a `purge_all` meanwhile reaches it too.
        let mut retired = self.retired.lock().unwrap_or_else(PoisonError::into_inner);
        let (busy, idle): (Vec<_>, Vec<_>) =
            retired.drain(..).partition(|p| p.in_flight_count() > 0);
        *retired = busy;
        retired.push(old.clone());
        drop(retired);
        drop(current);
        old.purge(PurgeConfig::default().queue());
        // Let go outside the locks: a client's end joins its threads.
        drop(idle);
        true
    }

    /// Purges what every producer holds, queued or in flight (see `StageProducer::purge`).
    pub fn purge_all(&self, purge: PurgeConfig) {
        self.with(|p, _| p.purge(purge));
        for p in self
            .retired
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            p.purge(purge);
        }
    }

    /// Waits up to `timeout` for what every producer holds to be answered.
    pub fn flush(&self, timeout: Duration) -> KafkaResult<()> {
        let retired: Vec<_> = self
            .retired
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .collect();
        let deadline = std::time::Instant::now() + timeout;
        let mut result = Ok(());
        for p in retired.iter().chain(std::iter::once(&self.producer())) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if let Err(e) = p.flush(left) {
                result = Err::<(), KafkaError>(e);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::client::DefaultClientContext;
    use rdkafka::error::RDKafkaErrorCode;
    use rdkafka::producer::FutureRecord;

    use super::*;

    /// A slot whose producers reach no broker: what they are given stays queued.
    fn slot() -> ProducerSlot<DefaultClientContext> {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("enable.idempotence", "true");
        ProducerSlot::new(&config, DefaultClientContext).expect("producer")
    }

    #[test]
    fn only_the_current_generation_is_replaced_and_only_once() {
        let slot = slot();
        assert_eq!(slot.with(|_, g| g), 0);
        assert!(slot.replace(0));
        assert!(!slot.replace(0), "the same refusal reported again");
        assert_eq!(slot.with(|_, g| g), 1);
        assert!(slot.replace(1));
        assert_eq!(slot.with(|_, g| g), 2);
    }

    #[tokio::test]
    async fn what_the_old_producer_has_queued_is_taken_back_and_the_new_one_takes_writes() {
        let slot = slot();
        let queued = slot.with(|p, _| {
            p.send_result(FutureRecord::<[u8], [u8]>::to("t").payload(b"x"))
                .map_err(|(e, _)| e)
                .expect("queued")
        });
        assert!(slot.replace(0));
        assert!(
            purged(queued).await,
            "a write queued in the replaced producer is purged, never sent"
        );
        let fresh = slot.with(|p, _| {
            p.send_result(FutureRecord::<[u8], [u8]>::to("t").payload(b"y"))
                .map_err(|(e, _)| e)
                .expect("queued")
        });
        // Only the new producer is purged: the write is answered "purged" only if it was there.
        // (Not `in_flight_count`, which also counts the client's events not yet served: a
        // connection error to the unreachable broker made it read 2 in a CI rehearsal.)
        slot.producer().purge(PurgeConfig::default().queue());
        assert!(
            purged(fresh).await,
            "the new producer holds the write made after the replacement"
        );
    }

    /// Whether a queued write's answer is "purged from the queue", within a bound against a
    /// hang (unpurged, it would wait for `message.timeout.ms`).
    async fn purged(write: rdkafka::producer::DeliveryFuture) -> bool {
        let answer = tokio::time::timeout(Duration::from_secs(30), write)
            .await
            .expect("the write is answered")
            .expect("answered");
        answer.map_err(|(e, _)| e.rdkafka_error_code()).err()
            == Some(Some(RDKafkaErrorCode::PurgeQueue))
    }
}
