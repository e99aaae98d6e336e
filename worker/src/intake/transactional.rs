//! `exactlyOnce` commits: each partition's transaction, with its offsets, and its aborts and
//! rewinds (docs/exactly-once.md).
//!
//! A commit takes the write barrier exclusively (every write of the transaction acknowledged,
//! its record's completion sent), applies the completions, and commits each partition's
//! transaction with its watermark and completed-offset map, sent with the consumer's group
//! metadata. The partitions' commits run at the same time (each partition has its own
//! producer): a commit is several broker round trips, and the barrier — every write of the
//! stage — and the consumer loop wait for the turn, which now lasts as long as its slowest
//! commit rather than the sum of them.
//!
//! A transaction that cannot commit — a write of it refused or purged (it is *doomed*, see
//! `output::transactions`), or its offsets or end refused — is aborted, and its partition
//! **rewinds**: its lease is revoked (its sessions write nothing more of its records), its books
//! start over from the committed watermark and map, read again from the group as on
//! assignment, the consumer seeks there and the next transaction begins. Other partitions go
//! on. A partition leaving this worker (revocation, stop) is not rewound: its transaction is
//! aborted when its producer closes, and the next owner replays from the last commit.
//!
//! A **fenced** producer (another producer called `init_transactions` with the partition's
//! transactional id, `output::fenced`) can neither commit nor abort: the partition is *given
//! up* — its lease revoked, its books dropped, its producer dropped without a commit (the
//! broker aborted its transaction), no record of it taken in (`Phase::Fenced`) — and the other
//! partitions go on. Either the group really moved it (this worker is a zombie and its consumer
//! learns so at a coming poll: the revocation or loss forgets it, and nothing here fights the
//! new owner for the id), or a zombie *other* process fenced it while the group still assigns
//! it here: then, after a grace of the group's session timeout (within which the group and
//! this member learn of a real move), its producer is opened again — whose init fences that
//! zombie — and the partition is rewound to its committed watermark and map like an abort's.
//! An abort that fails otherwise stops the worker.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaResult;
use rdkafka::{Offset as KafkaOffset, TopicPartitionList};
use std::sync::Arc;

use crate::commit::offset_map::DoneAbove;
use crate::commit::offsets::Partition;
use crate::config::EXACTLY_ONCE_MESSAGE_TIMEOUT_MS;
use crate::intake::book::{Book, PartitionState, Phase};
use crate::intake::rebalance::IntakeContext;
use crate::output::fenced::is_fence;
use crate::output::producer::ProducerEvents;
use crate::output::transactions::{AbortReason, Doom, Exclusive, Strike, Transactions};
use crate::record::Lease;
use crate::session::retry::RetryPolicy;

/// How long one read of the group's committed offset of a partition may take.
const COMMITTED_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a rewind keeps asking for it before the worker stops: a coordinator's move or
/// restart (seen lasting ~10–20 s in the chaos suite), well within the default
/// `max.poll.interval.ms` (300 s) the blocked consumer loop counts against.
const COMMITTED_BUDGET: Duration = Duration::from_secs(45);
/// The pause after a failed read: 0.5 s, doubled after each failure in a row, at most 4 s.
const COMMITTED_PAUSES: RetryPolicy = RetryPolicy {
    initial: Duration::from_millis(500),
    max: Duration::from_secs(4),
    multiplier: 2.0,
    max_attempts: 0,
};
/// How long a commit or a rewind waits for the write barrier: every write holding a share is
/// acknowledged, refused or timed out within `message.timeout.ms`; the rest is slack.
const BARRIER_DEADLINE: Duration = Duration::from_millis(EXACTLY_ONCE_MESSAGE_TIMEOUT_MS + 15_000);

/// The pause before the read after `failures` failed ones in a row, or `None` when that read
/// would start at or past `deadline` (`left` is what remains of the budget now).
fn pause_before_asking_again(failures: u32, left: Duration) -> Option<Duration> {
    let pause = COMMITTED_PAUSES.ceiling(failures);
    (pause < left).then_some(pause)
}

/// Whether `doom` is of a transaction of `p` aborted already: its record's lease is older than
/// the partition's (it was rewound since).
fn is_stale(book: &Book, p: Partition, doom: &Doom) -> bool {
    let lease = book.partitions.get(&p).map(|s| s.lease.epoch);
    doom.epoch.is_some_and(|e| Some(e) != lease)
}

/// What the first half of a rewind leaves to do with a doomed partition.
enum Rewind {
    /// Nothing: its doom is stale, or it was given up (fenced).
    Nothing,
    /// Abort its transaction, then fetch it again from here (its last commit).
    From(KafkaOffset),
    /// Nothing more: the worker stops (`stop_fatally` has said why).
    Stop,
}

impl IntakeContext {
    /// Commits the transactions of `only` (all partitions when `None`); `force`: every
    /// partition not confirmed as it is (a final commit: the partitions are leaving, and one
    /// that cannot commit is left to its producer's close, which aborts it). Returns how many
    /// partitions failed.
    pub(super) fn commit_transactions(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        book: &mut Book,
        transactions: &Transactions<ProducerEvents>,
        only: Option<&[Partition]>,
        force: bool,
    ) -> usize {
        let partitions = only.map_or_else(|| book.all_partitions(), <[Partition]>::to_vec);
        if self.fatal.is_cancelled() {
            // The worker is stopping on a fatal error: nothing is committed any more.
            return book.unsettled(&partitions);
        }
        let Some(_exclusive) = self.barrier(transactions) else {
            return book.unsettled(&partitions);
        };
        book.apply_ready(&self.metrics);
        let Some(group) = consumer.group_metadata().map(Arc::new) else {
            return book.unsettled(&partitions);
        };
        let mut failed = 0;
        let mut due = Vec::new();
        let mut doomed = Vec::new();
        for p in partitions {
            // A leaving partition's doom stays: nothing of its transaction may commit, ever.
            let doom = if force {
                transactions.doom_of(p)
            } else {
                transactions.take_doom(p)
            };
            if let Some(doom) = doom.filter(|d| !is_stale(book, p, d)) {
                // Nothing of this transaction may commit.
                failed += book.unsettled(&[p]);
                if force {
                    self.count_abort(doom.reason);
                    tracing::warn!(
                        partition = p,
                        reason = doom.reason.as_str(),
                        "leaving partition's transaction cannot commit: aborted at its close; \
                         the next owner replays from the last commit"
                    );
                } else {
                    doomed.push((p, doom));
                }
                continue;
            }
            let offsets = book.commit_list(Some(&[p]), force);
            if offsets.count() > 0 {
                due.push((p, offsets));
            }
        }
        if !doomed.is_empty() && !self.rewind_transactions(consumer, book, transactions, doomed) {
            return failed;
        }
        // All at once (each partition has its own producer), still under the barrier.
        let (turn, partitions) = (Instant::now(), due.len());
        let answers = transactions.commit_each(due, &group);
        if partitions > 0 {
            tracing::debug!(
                partitions,
                ms = turn.elapsed().as_millis() as u64,
                "commit turn"
            );
        }
        let mut refused = Vec::new();
        for (p, offsets, result, took) in answers {
            self.metrics
                .transaction_commit_seconds
                .observe(took.as_secs_f64());
            failed += book.commit_answered(&result, &offsets, &self.metrics);
            match result {
                Ok(()) => {
                    self.metrics
                        .transactions
                        .with_label_values(&["committed", ""])
                        .inc();
                    self.metrics
                        .transaction_records
                        .observe(book.take_settled(p) as f64);
                    if let Some(KafkaOffset::Offset(w)) = offsets
                        .find_partition(&self.settings.input, p)
                        .map(|e| e.offset())
                    {
                        transactions.committed(p, w);
                    }
                    tracing::debug!(
                        partition = p,
                        ms = took.as_millis() as u64,
                        "transaction committed"
                    );
                }
                Err(e) if is_fence(&e) || transactions.is_fenced(p) => {
                    if force {
                        self.count_abort(AbortReason::Fenced);
                        tracing::warn!(partition = p, error = %e,
                            "exactlyOnce: leaving partition's producer is fenced: its \
                             transaction is not committed (the broker aborted it)");
                    } else {
                        self.give_up(book, transactions, p, &e);
                    }
                }
                Err(e) if force => {
                    self.count_abort(AbortReason::Commit);
                    tracing::warn!(partition = p, error = %e,
                        "transaction did not commit: aborted at its producer's close; the next \
                         owner replays from the last commit");
                }
                Err(e) => {
                    tracing::warn!(partition = p, error = %e,
                        "exactlyOnce: the transaction did not commit; aborting it and \
                         replaying the partition from its last commit");
                    let doom = Doom {
                        reason: AbortReason::Commit,
                        record: None,
                        epoch: None,
                    };
                    refused.push((p, doom));
                }
            }
        }
        if !refused.is_empty() {
            self.rewind_transactions(consumer, book, transactions, refused);
        }
        failed
    }

    /// Aborts and rewinds every doomed partition still owned (see the module doc). Called by
    /// the loop every turn; does nothing (and takes no lock) when none is doomed. Waits while
    /// the membership fence is closed (the group's committed offsets cannot be read then).
    pub(super) fn abort_doomed(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        book: &mut Book,
        transactions: &Transactions<ProducerEvents>,
    ) {
        if !self.may_touch_transactions() {
            return;
        }
        if !transactions.any_doomed() && !transactions.any_fenced() {
            return;
        }
        // The barrier first: while it waits, the doomed partitions' writes are purged.
        let Some(_exclusive) = self.barrier(transactions) else {
            return;
        };
        for p in transactions.take_fenced() {
            let owned = book
                .partitions
                .get(&p)
                .is_some_and(|s| s.phase == Phase::Owned);
            if owned && transactions.is_fenced(p) {
                self.give_up(book, transactions, p, &"its producer's fatal error");
            }
        }
        let owned: Vec<(Partition, Doom)> = transactions
            .take_doomed()
            .into_iter()
            .filter(|(p, _)| {
                // One leaving is not rewound: its close aborts it.
                book.partitions
                    .get(p)
                    .is_some_and(|s| s.phase == Phase::Owned)
            })
            .collect();
        self.rewind_transactions(consumer, book, transactions, owned);
    }

    /// Aborts the transactions of the `doomed` partitions and rewinds each to its committed
    /// watermark and map; the aborts at the same time (each partition has its own producer).
    /// Call under the barrier, exclusively. False when the worker stops instead.
    fn rewind_transactions(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        book: &mut Book,
        transactions: &Transactions<ProducerEvents>,
        doomed: Vec<(Partition, Doom)>,
    ) -> bool {
        let mut rewinds = Vec::new();
        for (p, doom) in doomed {
            match self.prepare_rewind(consumer, book, transactions, p, doom) {
                Rewind::Nothing => {}
                Rewind::Stop => return false,
                Rewind::From(from) => rewinds.push((p, from)),
            }
        }
        let partitions = rewinds.iter().map(|&(p, _)| p).collect();
        let aborted = transactions.abort_each(partitions);
        for ((p, from), (_, result)) in rewinds.into_iter().zip(aborted) {
            if !self.finish_rewind(consumer, book, transactions, p, from, result) {
                return false;
            }
        }
        true
    }

    /// The first half of a rewind, before the abort: counts the abort against the record that
    /// doomed it and starts `p`'s books over from its last commit, under a new lease. Call
    /// under the barrier, exclusively.
    fn prepare_rewind(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        book: &mut Book,
        transactions: &Transactions<ProducerEvents>,
        p: Partition,
        doom: Doom,
    ) -> Rewind {
        if !book.partitions.contains_key(&p) || is_stale(book, p, &doom) {
            return Rewind::Nothing;
        }
        if transactions.is_fenced(p) {
            // No abort can help: the broker aborted it, and the producer can do no more.
            self.give_up(book, transactions, p, &"its producer is fenced");
            return Rewind::Nothing;
        }
        self.count_abort(doom.reason);
        match transactions.strike(p, doom.record) {
            Strike::Counted(n) => {
                tracing::warn!(partition = p, reason = doom.reason.as_str(),
                record = doom.record, aborts_in_a_row = n,
                "exactlyOnce: transaction aborted; replaying the partition from its last commit")
            }
            Strike::Poisoned => tracing::warn!(
                partition = p,
                record = doom.record,
                "exactlyOnce: this record's write made its partition's transactions abort \
                 again and again: on the replay it goes to the DLQ (transaction-abort)"
            ),
            Strike::DeadLetterAborted => {
                self.stop_fatally(
                    p,
                    &format!(
                        "exactlyOnce: the dead letter of poison record {:?} aborted its \
                     transaction too; the worker stops rather than loop",
                        doom.record
                    ),
                );
                return Rewind::Stop;
            }
        }
        match self.restart_from_commit(consumer, book, transactions, p) {
            Some(from) => Rewind::From(from),
            None => Rewind::Stop,
        }
    }

    /// The second half of a rewind, once `p`'s abort answered `aborted`: has the consumer
    /// fetch `p` again from its last commit, gives `p` up if its producer turned out fenced,
    /// or stops the worker if the abort failed otherwise (false).
    fn finish_rewind(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        book: &mut Book,
        transactions: &Transactions<ProducerEvents>,
        p: Partition,
        from: KafkaOffset,
        aborted: KafkaResult<()>,
    ) -> bool {
        match aborted {
            Ok(()) => self.seek_back(consumer, book, p, from),
            Err(e) if is_fence(&e) || transactions.is_fenced(p) => {
                self.give_up(book, transactions, p, &e);
                true
            }
            Err(e) => {
                self.stop_fatally(p, &format!("exactlyOnce: the abort failed ({e})"));
                false
            }
        }
    }

    /// Starts `p`'s books over from the group's committed watermark and map (read again, as on
    /// assignment), under a new lease: its sessions write nothing more of its records (call
    /// under the barrier: none is writing now). Returns where to seek, or `None` (and the
    /// worker stops) when the committed offset cannot be read.
    fn restart_from_commit(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        book: &mut Book,
        transactions: &Transactions<ProducerEvents>,
        p: Partition,
    ) -> Option<KafkaOffset> {
        let committed = match self.read_committed(consumer, p) {
            Ok(c) => self.committed_maps(&c).remove(&p),
            Err(e) => {
                self.stop_fatally(
                    p,
                    &format!(
                        "exactlyOnce: the committed offset to rewind to could not be read \
                         within {COMMITTED_BUDGET:?} ({e})"
                    ),
                );
                return None;
            }
        };
        book.next_epoch += 1;
        let lease = Arc::new(Lease::new(p, book.next_epoch));
        let (from, done_above) = match committed {
            Some((w, map)) => (KafkaOffset::Offset(w), map),
            None => (KafkaOffset::Beginning, DoneAbove::empty(0)),
        };
        if let Some(state) = book.partitions.get_mut(&p) {
            state.lease.revoke();
            *state = PartitionState::new(lease.clone(), done_above);
        }
        transactions.since(p, lease.epoch);
        book.tracker.revoke(p);
        book.tracker.assign(p);
        if let (KafkaOffset::Offset(w), Some(o)) = (from, book.tracker.partition_mut(p)) {
            o.set_confirmed(w);
        }
        Some(from)
    }

    /// `p`'s committed offset and metadata, asked again after a failure until
    /// `COMMITTED_BUDGET` is spent: a coordinator moving or restarting answers `NOT_COORDINATOR`
    /// or nothing for a while, and a rewind without its offset cannot go on. A partition the
    /// answer names with an error of its own is a failed read too, not "never committed" (that
    /// would replay the partition from its beginning).
    fn read_committed(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        p: Partition,
    ) -> KafkaResult<TopicPartitionList> {
        let deadline = Instant::now() + COMMITTED_BUDGET;
        let mut failures = 0;
        loop {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&self.settings.input, p);
            let left = deadline.saturating_duration_since(Instant::now());
            let read = consumer
                .committed_offsets(tpl, left.min(COMMITTED_TIMEOUT))
                .and_then(|c| match c.find_partition(&self.settings.input, p) {
                    Some(e) => e.error().map(|()| c),
                    None => Ok(c),
                });
            let error = match read {
                Ok(c) => return Ok(c),
                Err(e) => e,
            };
            failures += 1;
            let left = deadline.saturating_duration_since(Instant::now());
            let pause = match pause_before_asking_again(failures, left) {
                Some(pause) if !self.fatal.is_cancelled() => pause,
                _ => return Err(error),
            };
            tracing::warn!(partition = p, error = %error, retry_in_ms = pause.as_millis() as u64,
                "exactlyOnce: the committed offset to rewind to could not be read; asking again");
            std::thread::sleep(pause);
        }
    }

    /// Has the consumer fetch `p` again `from` its last commit: librdkafka drops what it had
    /// fetched from before the seek (its fetch version). False (and the worker stops) when
    /// the seek fails.
    fn seek_back(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        book: &Book,
        p: Partition,
        from: KafkaOffset,
    ) -> bool {
        if let Err(e) = consumer.seek(&self.settings.input, p, from, COMMITTED_TIMEOUT) {
            self.stop_fatally(
                p,
                &format!("exactlyOnce: the seek back to the last commit failed ({e})"),
            );
            return false;
        }
        self.metrics.in_flight.set(book.tracker.in_flight() as i64);
        tracing::info!(partition = p, ?from, "partition rewound to its last commit");
        true
    }

    /// Gives `p` up: its producer is fenced (see the module doc). Nothing of its open
    /// transaction commits (the broker aborted it when it fenced the producer); its lease is
    /// revoked (its sessions write nothing more of it), its books are dropped and its records
    /// are not taken in (`Phase::Fenced`) until [`IntakeContext::reopen_fenced`] or its
    /// revocation. Call under the barrier, exclusively.
    fn give_up(
        &self,
        book: &mut Book,
        transactions: &Transactions<ProducerEvents>,
        p: Partition,
        cause: &dyn std::fmt::Display,
    ) {
        let Some(state) = book.partitions.get_mut(&p) else {
            return;
        };
        self.count_abort(AbortReason::Fenced);
        let given_up = state.unreleased;
        book.next_epoch += 1;
        state.lease.revoke();
        *state = PartitionState::new(
            Arc::new(Lease::new(p, book.next_epoch)),
            DoneAbove::empty(0),
        );
        state.phase = Phase::Fenced {
            since: Instant::now(),
        };
        book.tracker.revoke(p);
        book.tracker.assign(p);
        transactions.give_up(p);
        self.metrics.in_flight.set(book.tracker.in_flight() as i64);
        tracing::warn!(
            partition = p,
            cause = %cause,
            given_up,
            grace_ms = self.settings.session_timeout.as_millis() as u64,
            "exactlyOnce: the partition's transactional producer is fenced (another producer \
             has its transactional id): the partition is given up — its open transaction is \
             not committed (the broker aborted it), its records in flight are dropped, nothing \
             more of it is written; the other partitions go on. If the group still assigns it \
             here after the grace, its producer is opened again and it replays from its last \
             commit"
        );
    }

    /// Reopens the partitions given up for a fence ([`IntakeContext::give_up`]) that the
    /// group still assigns to this worker a grace after: the group's session timeout, within
    /// which a member the group gave up on learns it at its next heartbeat (and the
    /// revocation or loss forgets the partition here). Their new producer's init fences
    /// whoever has the transactional id; then they rewind to their last commit (read after the
    /// init, as on assignment). Called by the loop now and then; does nothing while the
    /// membership fence is closed.
    pub(super) fn reopen_fenced(
        &self,
        consumer: &BaseConsumer<IntakeContext>,
        book: &mut Book,
        transactions: &Transactions<ProducerEvents>,
    ) {
        if !self.may_touch_transactions() {
            return;
        }
        let grace = self.settings.session_timeout;
        let due: Vec<Partition> = book
            .partitions
            .iter()
            .filter(|(_, s)| matches!(s.phase, Phase::Fenced { since } if since.elapsed() >= grace))
            .map(|(p, _)| *p)
            .collect();
        if due.is_empty() {
            return;
        }
        let assigned = consumer.assignment().unwrap_or_default();
        for p in due {
            if assigned.find_partition(&self.settings.input, p).is_none() {
                continue; // leaving: its revocation forgets it
            }
            if let Err(e) = transactions.open(p) {
                if is_fence(&e) || transactions.is_fenced(p) {
                    // Fenced again at once: another grace.
                    transactions.give_up(p);
                    if let Some(state) = book.partitions.get_mut(&p) {
                        state.phase = Phase::Fenced {
                            since: Instant::now(),
                        };
                    }
                    tracing::warn!(partition = p, error = %e,
                        "exactlyOnce: the given-up partition's producer could not be reopened; \
                         trying again after another grace");
                    continue;
                }
                self.stop_fatally(
                    p,
                    &format!("exactlyOnce: the partition's producer could not be reopened ({e})"),
                );
                return;
            }
            let Some(_exclusive) = self.barrier(transactions) else {
                return;
            };
            tracing::warn!(
                partition = p,
                "exactlyOnce: the group still assigns the given-up partition here after the \
                 grace: its transactional producer is reopened (fencing whoever had its id) \
                 and it replays from its last commit"
            );
            let Some(from) = self.restart_from_commit(consumer, book, transactions, p) else {
                return;
            };
            if !self.seek_back(consumer, book, p, from) {
                return;
            }
        }
    }

    /// Whether the loop may abort, rewind or reopen partitions now: not after a fatal error,
    /// and not while the membership fence is closed (the group's committed offsets cannot be
    /// read then, and a write may not go).
    fn may_touch_transactions(&self) -> bool {
        !self.fatal.is_cancelled() && self.producer.gate().is_open()
    }

    /// The write barrier, exclusively, or `None` (and the worker stops: the restart replays
    /// from the last committed transactions) when it is not released in time.
    fn barrier(&self, transactions: &Transactions<ProducerEvents>) -> Option<Exclusive> {
        match transactions.exclusive(BARRIER_DEADLINE) {
            Ok(exclusive) => Some(exclusive),
            Err(e) => {
                self.metrics.fatal_errors.inc();
                self.health.fail();
                tracing::error!(
                    "exactlyOnce: {e}: a write is stuck; the worker stops (the \
                    restart replays from the last committed transactions)"
                );
                self.fatal.cancel();
                None
            }
        }
    }

    fn count_abort(&self, reason: AbortReason) {
        self.metrics
            .transactions
            .with_label_values(&["aborted", reason.as_str()])
            .inc();
    }

    fn stop_fatally(&self, p: Partition, message: &str) {
        self.metrics.fatal_errors.inc();
        self.health.fail();
        tracing::error!(partition = p, "{message}");
        self.fatal.cancel();
    }

    /// `exactlyOnce`: opens the transactional producers of newly assigned `partitions` —
    /// before their committed offsets are read, so that no older owner can commit behind this
    /// one's back. False (and the worker stops) when one cannot be opened.
    pub(super) fn open_transactions(&self, partitions: &[Partition]) -> bool {
        let Some(transactions) = self.producer.transactions() else {
            return true;
        };
        let closed = partitions
            .iter()
            .copied()
            .filter(|&p| transactions.producer(p).is_none())
            .collect();
        for (p, opened) in transactions.open_each(closed) {
            if let Err(e) = opened {
                self.stop_fatally(
                    p,
                    &format!(
                        "exactlyOnce: the partition's transactional producer could not be opened \
                     ({e}; exactlyOnce needs a broker with transactions, Apache Kafka ≥ 2.5); \
                     the worker stops"
                    ),
                );
                return false;
            }
        }
        true
    }

    /// `exactlyOnce`: aborts what `partitions` have open and closes their producers, all at
    /// once (after their last commit, this aborts only the empty transaction begun after it).
    pub(super) fn close_transactions(&self, partitions: &[Partition]) {
        if let Some(transactions) = self.producer.transactions() {
            transactions.close_each(partitions.to_vec());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reads a rewind makes before it gives up, each taking `read` to fail: the pauses
    /// between them, simulated on a clock of the test's own.
    fn pauses_until_given_up(read: Duration) -> Vec<Duration> {
        let (mut spent, mut failures, mut pauses) = (Duration::ZERO, 0, Vec::new());
        loop {
            spent += read.min(COMMITTED_BUDGET.saturating_sub(spent));
            failures += 1;
            match pause_before_asking_again(failures, COMMITTED_BUDGET.saturating_sub(spent)) {
                Some(pause) => {
                    pauses.push(pause);
                    spent += pause;
                }
                None => return pauses,
            }
        }
    }

    #[test]
    fn a_rewind_asks_again_with_doubling_pauses_within_its_budget() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|&m| Duration::from_millis(m))
                .collect::<Vec<_>>()
        };
        // Refused at once (NOT_COORDINATOR): 0.5 s doubling to 4 s, until 45 s are spent.
        let quick = pauses_until_given_up(Duration::from_millis(5));
        assert_eq!(quick[..6], ms(&[500, 1_000, 2_000, 4_000, 4_000, 4_000]));
        // 13 pauses (43.5 s) between 14 reads; a fourteenth pause would end past the budget.
        assert_eq!(quick.len(), 13, "{quick:?}");
        assert_eq!(
            quick.iter().sum::<Duration>(),
            Duration::from_millis(43_500)
        );
        // Each read timing out (a coordinator that does not answer, 10 s each): four reads.
        let slow = pauses_until_given_up(COMMITTED_TIMEOUT);
        assert_eq!(slow, ms(&[500, 1_000, 2_000]));
    }

    #[test]
    fn no_read_starts_at_or_past_the_deadline() {
        assert_eq!(
            pause_before_asking_again(1, Duration::from_millis(500)),
            None
        );
        assert_eq!(
            pause_before_asking_again(1, Duration::from_millis(501)),
            Some(Duration::from_millis(500))
        );
        assert_eq!(pause_before_asking_again(9, Duration::from_secs(4)), None);
        assert_eq!(pause_before_asking_again(9, Duration::ZERO), None);
    }
}
