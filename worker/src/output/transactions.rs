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
//!
//! A transaction that can no longer commit (a write of it refused, or purged) is *doomed*: the
//! write's settler says so ([`Transactions::doom`], naming its record), and the consumer loop
//! aborts it and rewinds the partition (`intake::transactional`). The record an abort names is
//! struck; one struck [`POISON_ABORTS`] times in a row is poison: its next write is a dead
//! letter ([`Transactions::is_poisoned`]), so that one record cannot make the partition abort
//! for ever.
//!
//! A write purged while on the wire may still reach the broker, at any later time. So the abort
//! of a transaction whose writes were purged in flight does not keep the producer: it opens a
//! new one with the same transactional id ([`Transactions::abort`]). Its init bumps the
//! producer epoch and aborts the old transaction with markers of the new epoch, so a late write
//! is refused as of an older epoch. The kept producer would write the next transaction with the
//! same epoch, which registers the same output partitions: a late write would be taken into it,
//! and commit with it (librdkafka bumps the epoch for a write that timed out, not for one
//! purged; `tests/tests/e2e/late_writes.rs` shows the stale output committed).
//!
//! A producer fenced by another one with its transactional id is done for good: its fatal error
//! is noted per partition (`output::fenced`), and the loop gives that partition up
//! ([`Transactions::give_up`]) instead of aborting, until it reopens it.
//!
//! A producer whose `send_offsets_to_transaction` did not return in time is not used again
//! either (librdkafka can wait there for ever when the group coordinator it has cached leaves
//! the cluster: [`send_offsets`]); its partition's transaction fails like one refused, and its
//! abort opens a new producer as above, whose init fences the stuck one.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::TopicPartitionList;
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

use crate::commit::exactly_once::transactional_id;
use crate::commit::offsets::{Offset, Partition};
use crate::output::fenced::{Fenced, PartitionEvents};

/// How long a transaction call (init, offsets, commit, abort) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a commit waiting for the barrier purges the writes of newly doomed partitions.
const PURGE_DOOMED_EVERY: Duration = Duration::from_millis(5);

/// Consecutive aborts of a partition naming the same record after which that record is poison:
/// its next write is a dead letter (reason `transaction-abort`) instead of its output.
pub const POISON_ABORTS: u32 = 3;

/// Why a partition's transaction was aborted (the `reason` of
/// `sessionflow_transactions_total{result="aborted"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortReason {
    /// A write of the transaction was refused by the broker (after the client's retries).
    Write,
    /// The offsets or the end of the transaction were refused (`send_offsets`, `EndTxn`).
    Commit,
    /// Writes of the transaction were given up (purged): the membership fence, or a purge for
    /// partitions leaving this worker.
    Fence,
    /// The partition's producer was fenced (another producer has its transactional id): the
    /// broker aborted the transaction; the partition is given up, and reopened after a grace.
    Fenced,
}

impl AbortReason {
    pub const ALL: [AbortReason; 4] = [Self::Write, Self::Commit, Self::Fence, Self::Fenced];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Write => "write",
            Self::Commit => "commit",
            Self::Fence => "fence",
            Self::Fenced => "fenced",
        }
    }
}

/// A doomed transaction: why, and the record whose write doomed it, if one did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Doom {
    pub reason: AbortReason,
    pub record: Option<Offset>,
    /// The lease epoch of the record whose write doomed it: a doom from an older lease than
    /// the partition's is stale (the transaction it doomed was aborted already, and the
    /// partition rewound under a new lease). `None` (a purge): the partition's transaction now.
    pub epoch: Option<u64>,
}

impl Doom {
    /// Whether this doom replaces `other`, both of the same partition: a purge's always does
    /// (it dooms whatever is open now), a record's does when its lease is newer, or as new
    /// when `other` names no record (a write refused because the transaction was doomed
    /// already names none: the write that doomed it is the one to name).
    fn replaces(&self, other: &Doom) -> bool {
        match (self.epoch, other.epoch) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(new), Some(old)) => {
                new > old || (new == old && other.record.is_none() && self.record.is_some())
            }
        }
    }
}

/// What an abort naming a record makes of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strike {
    /// Struck fewer than [`POISON_ABORTS`] times in a row (or no record named).
    Counted(u32),
    /// Now poison: its next write is a dead letter.
    Poisoned,
    /// Already poison, and its dead letter's transaction aborted too.
    DeadLetterAborted,
}

/// A write's share of the commit barrier.
pub type Share = OwnedRwLockReadGuard<()>;
/// A commit's hold of the barrier: no write is on its way while it lives.
pub type Exclusive = OwnedRwLockWriteGuard<()>;

/// The barrier was not released in time: a write kept its share past every bound a write has
/// (`message.timeout.ms`), so the worker stops rather than wait for ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the write barrier was not released within {0:?}")]
pub struct BarrierStuck(pub Duration);

/// The transactional producers of one stage, with client context `C` (the stage's
/// `ProducerEvents`: a fatal error stops the worker).
pub struct Transactions<C: ClientContext + Clone + 'static> {
    config: ClientConfig,
    group: String,
    topic: String,
    events: C,
    producers: Mutex<HashMap<Partition, FutureProducer<PartitionEvents<C>>>>,
    /// Partitions whose producer reported a fatal error (see `output::fenced`).
    fenced: Arc<Fenced>,
    barrier: Arc<RwLock<()>>,
    /// Partitions whose open transaction can no longer commit; `any_doomed` says whether there
    /// is one without taking the lock (read every turn of the loop).
    doomed: Mutex<HashMap<Partition, Doom>>,
    any_doomed: AtomicBool,
    /// Per partition, the lease epoch of its open transaction's records: a doom from an older
    /// lease is of a transaction aborted already, and is dropped (see [`Transactions::since`]).
    epochs: Mutex<HashMap<Partition, u64>>,
    /// Per partition, the record the last aborts named and how many in a row named it.
    strikes: Mutex<HashMap<Partition, (Offset, u32)>>,
    /// Records whose next write is a dead letter.
    poisoned: Mutex<HashSet<(Partition, Offset)>>,
    /// Partitions whose producer must not take the next transaction: it had writes purged in
    /// flight since its transaction began, or a call of it did not return in time (a thread
    /// still waits in it). Their abort opens a new producer (see the module's documentation).
    replace_on_abort: Mutex<HashSet<Partition>>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
            fenced: Arc::default(),
            barrier: Arc::default(),
            doomed: Mutex::default(),
            any_doomed: AtomicBool::new(false),
            epochs: Mutex::default(),
            strikes: Mutex::default(),
            poisoned: Mutex::default(),
            replace_on_abort: Mutex::default(),
        }
    }

    fn producers(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<Partition, FutureProducer<PartitionEvents<C>>>> {
        locked(&self.producers)
    }

    /// `partition`'s open transaction can no longer commit (a record's write was refused, or
    /// writes were purged): the loop aborts it and rewinds the partition. The first doom of a
    /// transaction is the one kept (see [`Doom::replaces`]).
    pub fn doom(&self, partition: Partition, doom: Doom) {
        let since = locked(&self.epochs).get(&partition).copied();
        if doom.epoch.zip(since).is_some_and(|(e, since)| e < since) {
            return; // of a transaction aborted already
        }
        let mut doomed = locked(&self.doomed);
        match doomed.get_mut(&partition) {
            Some(old) if !doom.replaces(old) => {}
            Some(old) => *old = doom,
            None => {
                doomed.insert(partition, doom);
            }
        }
        self.any_doomed.store(true, Ordering::Release);
    }

    /// `partition`'s open transaction holds the writes of records of lease `epoch` on (set when
    /// it is assigned and when it is rewound): dooms from older leases are dropped, as are
    /// those already noted.
    pub fn since(&self, partition: Partition, epoch: u64) {
        locked(&self.epochs).insert(partition, epoch);
        let mut doomed = locked(&self.doomed);
        if doomed
            .get(&partition)
            .is_some_and(|d| d.epoch.is_some_and(|e| e < epoch))
        {
            doomed.remove(&partition);
        }
    }

    /// Whether a partition's open transaction is doomed (no lock taken).
    pub fn any_doomed(&self) -> bool {
        self.any_doomed.load(Ordering::Acquire)
    }

    /// The doomed partitions, taken out of the list (empty at once when there are none).
    pub fn take_doomed(&self) -> Vec<(Partition, Doom)> {
        if !self.any_doomed.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        locked(&self.doomed).drain().collect()
    }

    /// `partition`'s doom, left in the list.
    pub fn doom_of(&self, partition: Partition) -> Option<Doom> {
        locked(&self.doomed).get(&partition).copied()
    }

    /// `partition`'s doom, taken out of the list.
    pub fn take_doom(&self, partition: Partition) -> Option<Doom> {
        locked(&self.doomed).remove(&partition)
    }

    /// An abort of `partition` named `record`: counts it (see [`Strike`]).
    pub fn strike(&self, partition: Partition, record: Option<Offset>) -> Strike {
        let Some(record) = record else {
            return Strike::Counted(0);
        };
        if locked(&self.poisoned).contains(&(partition, record)) {
            return Strike::DeadLetterAborted;
        }
        let mut strikes = locked(&self.strikes);
        let entry = strikes.entry(partition).or_insert((record, 0));
        if entry.0 != record {
            *entry = (record, 0);
        }
        entry.1 += 1;
        if entry.1 < POISON_ABORTS {
            return Strike::Counted(entry.1);
        }
        strikes.remove(&partition);
        locked(&self.poisoned).insert((partition, record));
        Strike::Poisoned
    }

    /// Whether `record` of `partition` is poison: its write is a dead letter.
    pub fn is_poisoned(&self, partition: Partition, record: Offset) -> bool {
        let poisoned = locked(&self.poisoned);
        !poisoned.is_empty() && poisoned.contains(&(partition, record))
    }

    /// `partition`'s transaction committed with its offsets up to `watermark`: a record struck
    /// or poison below it is done with. (A commit that does not pass the struck record — the
    /// same watermark with a new map — does not end the row: that record is still the first
    /// one not committed.)
    pub fn committed(&self, partition: Partition, watermark: Offset) {
        let mut strikes = locked(&self.strikes);
        if strikes
            .get(&partition)
            .is_some_and(|(record, _)| *record < watermark)
        {
            strikes.remove(&partition);
        }
        drop(strikes);
        locked(&self.poisoned).retain(|(p, o)| *p != partition || *o >= watermark);
    }

    /// [`Transactions::open`] of each of `partitions` at the same time, one thread each; the
    /// answers in the order given. An init waits while the broker ends what an older owner
    /// left open, and librdkafka asks again only every 500 ms: a takeover after a crash took
    /// ~0.6 s a partition, one after another, in the assignment's callback. Blocking.
    pub fn open_each(&self, partitions: Vec<Partition>) -> Vec<(Partition, KafkaResult<()>)> {
        concurrently(partitions, |p| (p, self.open(p)))
    }

    /// Opens `partition`'s producer: init (fencing any older owner's, and any other producer
    /// with its transactional id, and aborting what that one left open) and begin. Blocking.
    pub fn open(&self, partition: Partition) -> KafkaResult<()> {
        let id = transactional_id(&self.group, &self.topic, partition);
        tracing::info!(partition, transactional_id = %id, "opening the transactional producer");
        let mut config = self.config.clone();
        config.set("transactional.id", &id);
        let events = PartitionEvents {
            inner: self.events.clone(),
            partition,
            fenced: self.fenced.clone(),
        };
        let producer: FutureProducer<PartitionEvents<C>> = config.create_with_context(events)?;
        producer.init_transactions(CALL_TIMEOUT)?;
        producer.begin_transaction()?;
        tracing::info!(partition, transactional_id = %id, "transactional producer opened");
        self.producers().insert(partition, producer);
        Ok(())
    }

    /// The producer of `partition`, if it is open.
    pub fn producer(&self, partition: Partition) -> Option<FutureProducer<PartitionEvents<C>>> {
        self.producers().get(&partition).cloned()
    }

    /// Whether `partition`'s open producer has failed for good (fenced): nothing it holds can
    /// commit, and nothing more can be written with it.
    pub fn is_fenced(&self, partition: Partition) -> bool {
        self.producers()
            .get(&partition)
            .is_some_and(|p| p.client().fatal_error().is_some())
    }

    /// Notes that `partition`'s producer looks fenced (a write refused so): the loop looks.
    pub fn note_fenced(&self, partition: Partition) {
        self.fenced.note(partition);
    }

    /// Whether a partition's producer was noted as fenced (no lock taken).
    pub fn any_fenced(&self) -> bool {
        self.fenced.any()
    }

    /// The partitions noted as fenced since the last call.
    pub fn take_fenced(&self) -> Vec<Partition> {
        self.fenced.take()
    }

    /// Gives `partition`'s fenced producer up: forgets its dooms and strikes, takes back what
    /// it still holds and drops it, with no commit and no abort (the broker aborted its
    /// transaction when it fenced it). [`Transactions::open`] makes a new one.
    pub fn give_up(&self, partition: Partition) {
        self.forget(partition);
        // Out of the map first: the purge and the client's destruction are not done under
        // the lock every write takes.
        let producer = self.producers().remove(&partition);
        if let Some(producer) = producer {
            purge_all(&producer);
        }
    }

    fn forget(&self, partition: Partition) {
        locked(&self.replace_on_abort).remove(&partition);
        locked(&self.doomed).remove(&partition);
        locked(&self.epochs).remove(&partition);
        locked(&self.strikes).remove(&partition);
        locked(&self.poisoned).retain(|(p, _)| *p != partition);
    }

    /// A write's share of the barrier (waits while a commit holds it).
    pub async fn share(&self) -> Share {
        self.barrier.clone().read_owned().await
    }

    /// The barrier, exclusively: waits for every write's share, at most `deadline`. Blocking;
    /// not on the runtime.
    ///
    /// While it waits, the producers of doomed partitions are purged (at once, and as more are
    /// doomed): their writes cannot commit, and librdkafka would keep them — holding their
    /// shares, so this wait — until `message.timeout.ms`. A purged write comes back and waits
    /// for the barrier behind this (see `settle`), then finds its partition rewound.
    ///
    /// The wait is queued like any writer's (new shares wait behind it) by a thread of its own,
    /// which a deadline can leave behind: it takes the barrier when the last share goes and lets
    /// it go at once. Past the deadline no write is still within its own bounds, so waiting on
    /// would only hang the consumer loop (and a SIGTERM with it).
    pub fn exclusive(&self, deadline: Duration) -> Result<Exclusive, BarrierStuck> {
        let (taken, exclusive) = sync_channel(1);
        let barrier = self.barrier.clone();
        std::thread::Builder::new()
            .name("commit-barrier".into())
            .spawn(move || {
                let _ = taken.send(futures::executor::block_on(barrier.write_owned()));
            })
            .map_err(|_| BarrierStuck(Duration::ZERO))?;
        let started = Instant::now();
        loop {
            match exclusive.recv_timeout(PURGE_DOOMED_EVERY) {
                Ok(guard) => return Ok(guard),
                Err(RecvTimeoutError::Timeout) if started.elapsed() < deadline => {
                    if self.any_doomed() {
                        self.purge_doomed();
                    }
                }
                Err(_) => return Err(BarrierStuck(deadline)),
            }
        }
    }

    /// Gives up the writes of the doomed partitions' producers.
    fn purge_doomed(&self) {
        let doomed: Vec<Partition> = locked(&self.doomed).keys().copied().collect();
        let producers = self.producers();
        for p in doomed {
            if let Some(producer) = producers.get(&p) {
                if producer.in_flight_count() > 0 {
                    locked(&self.replace_on_abort).insert(p);
                    purge_all(producer);
                }
            }
        }
    }

    /// Commits `partition`'s transaction with `offsets` (its watermark and map) and begins the
    /// next. Call under [`Transactions::exclusive`]. Blocking.
    ///
    /// If the offsets' call does not return in time, the answer is `OperationTimedOut` and the
    /// producer is left to the thread still waiting in it: the partition's abort opens a new
    /// one (see the module's documentation).
    pub fn commit(
        &self,
        partition: Partition,
        offsets: &TopicPartitionList,
        group: &Arc<ConsumerGroupMetadata>,
    ) -> KafkaResult<()> {
        let Some(producer) = self.producer(partition) else {
            return Err(KafkaError::MessageProduction(RDKafkaErrorCode::State));
        };
        let Some(sent) = send_offsets(&producer, offsets, group) else {
            locked(&self.replace_on_abort).insert(partition);
            tracing::warn!(
                partition,
                "exactlyOnce: the transaction's offsets call did not return in time \
                 (librdkafka's coordinator request without a timeout, issues #5456/#5511): the \
                 transaction is aborted by a new producer for the partition, which replays from \
                 its last commit"
            );
            return Err(KafkaError::MessageProduction(
                RDKafkaErrorCode::OperationTimedOut,
            ));
        };
        sent?;
        producer.commit_transaction(CALL_TIMEOUT)?;
        producer.begin_transaction()
    }

    /// Commits the transactions of `due` (each partition with its offsets, as
    /// [`Transactions::commit`]) at the same time, one thread each: each partition has its own
    /// producer, and a commit is several broker round trips (`AddOffsetsToTxn`,
    /// `TxnOffsetCommit`, `EndTxn`), which one after another held the barrier — every write of
    /// the stage, and the consumer loop — for the sum of them. Returns each partition's answer
    /// and how long its commit took, in the order of `due`. Call under
    /// [`Transactions::exclusive`], held until this returns: every commit has then ended, and
    /// the next transactions have begun. Blocking; each commit keeps its own bounds (the
    /// send-offsets deadline, the `EndTxn` timeout), so this takes the longest of them, not
    /// their sum.
    pub fn commit_each(
        &self,
        due: Vec<(Partition, TopicPartitionList)>,
        group: &Arc<ConsumerGroupMetadata>,
    ) -> Vec<(Partition, TopicPartitionList, KafkaResult<()>, Duration)> {
        concurrently(due, |(p, offsets)| {
            let started = Instant::now();
            let result = self.commit(p, &offsets, group);
            (p, offsets, result, started.elapsed())
        })
    }

    /// [`Transactions::abort`] of each of `partitions` at the same time, one thread each; the
    /// answers in the order given. An abort after an in-flight purge opens a new producer,
    /// whose `init_transactions` waits for the broker to finish the old transaction: librdkafka
    /// asks again every 500 ms, so such an abort takes ~0.6 s on Apache Kafka 4.1, and a
    /// membership fence purges every partition at once; one after another, they held the
    /// barrier for the sum. Call under [`Transactions::exclusive`]. Blocking.
    pub fn abort_each(&self, partitions: Vec<Partition>) -> Vec<(Partition, KafkaResult<()>)> {
        concurrently(partitions, |p| (p, self.abort(p)))
    }

    /// Aborts `partition`'s open transaction and begins the next (a rewind). Call under
    /// [`Transactions::exclusive`]. Blocking.
    ///
    /// The producer is kept, unless writes of the transaction were purged in flight: then a
    /// new one takes its place, whose init aborts the transaction with a new epoch (see the
    /// module's documentation). The old one is dropped first, without an abort of its own,
    /// which would end the transaction with the old epoch. If the new one cannot be opened,
    /// the partition has no producer, and the error is the abort's.
    pub fn abort(&self, partition: Partition) -> KafkaResult<()> {
        let Some(producer) = self.producer(partition) else {
            return Err(KafkaError::MessageProduction(RDKafkaErrorCode::State));
        };
        if !locked(&self.replace_on_abort).remove(&partition) {
            producer.abort_transaction(CALL_TIMEOUT)?;
            return producer.begin_transaction();
        }
        // Out of the map first: the client's destruction is not done under the lock every
        // write takes.
        let removed = self.producers().remove(&partition);
        drop((producer, removed));
        tracing::info!(
            partition,
            "the aborted transaction's producer is not used again (writes of it purged in \
             flight, or a call of it that did not return): a new producer with a new epoch takes \
             over, so that nothing of the old one can land in the next transaction"
        );
        let started = Instant::now();
        self.open(partition)?;
        tracing::info!(
            partition,
            took_ms = started.elapsed().as_millis() as u64,
            "the new producer took over"
        );
        Ok(())
    }

    /// Aborts `partition`'s open transaction (what it wrote since its last commit is never
    /// visible to read_committed readers) and closes its producer.
    ///
    /// Writes purged in flight, if any, may still land after this abort, with its epoch, when
    /// no transaction of theirs is open any more; the partition's next owner bumps the epoch
    /// when it opens its producer. `tests/tests/e2e/late_writes.rs` shows such a write kept out
    /// of the next owner's transaction on Apache Kafka 4.1.
    pub fn abort_and_close(&self, partition: Partition) {
        self.forget(partition);
        // Out of the map first: the abort (a round trip to the broker, or its timeout) and the
        // client's destruction are not done under the lock every write takes.
        let removed = self.producers().remove(&partition);
        if let Some(producer) = removed {
            if let Err(e) = producer.abort_transaction(CALL_TIMEOUT) {
                tracing::warn!(partition, error = %e, "abort of the open transaction failed \
                    (a fenced producer's transaction is aborted by the broker)");
            }
        }
    }

    /// Gives up every write not yet acknowledged, in every producer. Their transactions can
    /// then no longer commit: each partition that had writes out is doomed (reason `fence`;
    /// the loop aborts and rewinds it, or, if it is leaving, aborts it instead of committing).
    pub fn purge(&self) {
        let mut gave_up = Vec::new();
        for (p, producer) in self.producers().iter() {
            if producer.in_flight_count() > 0 {
                gave_up.push(*p);
                purge_all(producer);
            }
        }
        locked(&self.replace_on_abort).extend(gave_up.iter().copied());
        for p in gave_up {
            let doom = Doom {
                reason: AbortReason::Fence,
                record: None,
                epoch: None,
            };
            self.doom(p, doom);
        }
    }

    /// [`Transactions::abort_and_close`] of each of `partitions` at the same time, one thread
    /// each: an abort is a round trip to the broker when the transaction has writes, and a
    /// client's destruction takes ~0.1 s; a revocation or a stop closes every partition it
    /// has. Blocking.
    pub fn close_each(&self, partitions: Vec<Partition>) {
        concurrently(partitions, |p| self.abort_and_close(p));
    }

    /// Closes every producer, aborting what each has open.
    pub fn abort_all(&self) {
        let partitions: Vec<Partition> = self.producers().keys().copied().collect();
        self.close_each(partitions);
    }
}

/// Gives up every write of `producer` not yet acknowledged, queued or on the wire.
fn purge_all<C: ClientContext + 'static>(producer: &FutureProducer<C>) {
    producer.purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
}

/// `call` on each of `items`, each on a scoped thread of its own (the first on this one), all
/// at once; the answers in the order of `items`. A thread that cannot be started runs its call
/// here, after the others have started.
fn concurrently<T: Send, R: Send>(items: Vec<T>, call: impl Fn(T) -> R + Sync) -> Vec<R> {
    let call = &call;
    std::thread::scope(|scope| {
        let mut items = items.into_iter();
        let Some(first) = items.next() else {
            return Vec::new();
        };
        let others: Vec<Result<_, T>> = items
            .map(|item| {
                // The item goes back if the thread does not start.
                let slot = Arc::new(Mutex::new(Some(item)));
                let theirs = slot.clone();
                std::thread::Builder::new()
                    .name("txn-partition".into())
                    .spawn_scoped(scope, move || {
                        let item = locked(&theirs).take();
                        item.map(call)
                    })
                    .map_err(|_| locked(&slot).take().expect("not started, not taken"))
            })
            .collect();
        let mut answers = vec![call(first)];
        for other in others {
            answers.push(match other {
                Ok(thread) => match thread.join() {
                    Ok(answer) => answer.expect("a started thread takes its item"),
                    Err(panic) => std::panic::resume_unwind(panic),
                },
                Err(item) => call(item),
            });
        }
        answers
    })
}

/// `send_offsets_to_transaction`, waited for at most [`CALL_TIMEOUT`] + 5 s; `None` when it
/// did not return by then.
///
/// librdkafka can block in it past its own timeout when the group coordinator moves or goes
/// away: its coordinator request never times out, and a coordinator it has cached that left
/// the cluster's metadata is never looked for again (librdkafka issues #5456 and #5511, open in
/// 2026; seen here in chaos runs, and in `faults::the_coordinator_moving_under_an_exactly_once_stage_stops_nothing`
/// after a controlled shutdown of the coordinator's node). So it runs on a thread of its own;
/// past the deadline that thread keeps the producer, which is never used again.
fn send_offsets<C: ClientContext + Clone + 'static>(
    producer: &FutureProducer<C>,
    offsets: &TopicPartitionList,
    group: &Arc<ConsumerGroupMetadata>,
) -> Option<KafkaResult<()>> {
    let (producer, offsets, group) = (producer.clone(), offsets.clone(), group.clone());
    within(CALL_TIMEOUT + Duration::from_secs(5), move || {
        producer.send_offsets_to_transaction(&offsets, &group, CALL_TIMEOUT)
    })
}

/// `call`'s answer, from a thread of its own, waited for at most `deadline`; `None` past it
/// (the thread is left to finish, or not, on its own) or when no thread could be started.
fn within<T: Send + 'static>(
    deadline: Duration,
    call: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (answered, answer) = sync_channel(1);
    std::thread::Builder::new()
        .name("txn-call".into())
        .spawn(move || {
            let _ = answered.send(call());
        })
        .ok()?;
    answer.recv_timeout(deadline).ok()
}

#[cfg(test)]
mod tests;
