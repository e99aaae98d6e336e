//! Settling a record: writing its result under its lease and waiting for the broker's word.
//!
//! A record is *settled* when its output (or, failing that, its dead letter) has been
//! acknowledged by the broker; only then is it completed (its offset may be committed), only
//! then does its event id enter the session's recent-event cache, and only then does the
//! session take its next record. Waiting for the acknowledgement before the next record — as
//! Confluent Parallel Consumer does — is what keeps a failed produce from reordering a
//! session: if output *n* is refused after librdkafka's retries, output *n+1* has not even been
//! computed yet; *n* goes to the DLQ (acknowledged) first, and a crash in between replays *n*
//! before anything of *n+1* exists. The cost is one produce round trip per record of the same
//! session, hidden by the other sessions running meanwhile (BENCHMARKS.md has the numbers).
//!
//! Every write happens under a [`WritePermit`] of the record's lease, so a record whose
//! partition was revoked while its handler ran is released instead of written: the new owner
//! redoes it, and the old owner never writes after it. Before the permit, the write passes the
//! membership fence (see `membership`): while the group coordinator is silent it waits, and a
//! write the fence purged is written again once it opens.
//!
//! In `exactlyOnce` a refused write (output or dead letter) dooms its transaction: nothing more
//! of it can commit, so the record is released, not dead-lettered in the same transaction, and
//! the consumer loop aborts and rewinds the partition (`output::transactions`). A record whose
//! writes made its partition's transactions abort [`POISON_ABORTS`] times in a row is written
//! as a dead letter (reason `transaction-abort`) instead of its output.
//!
//! A dead letter the broker refuses is retried with backoff for as long as it takes (dropping
//! it would lose the record), counted, logged with the record, reported by the stuck timer and
//! reflected in readiness, so an alert or an operator can act.

use std::time::Instant;

use rand::Rng;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::ops::health::Health;
use crate::ops::metrics::Metrics;
use crate::ops::signal::Signal;
use crate::output::producer::{StageProducer, WriteError};
use crate::output::transactions::{AbortReason, Doom, POISON_ABORTS};
use crate::record::DlqReason;
use crate::record::InputRecord;
use crate::session::retry::RetryPolicy;
use crate::session::stuck::StuckWatch;

/// What a record's processing produced, to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Processed; the payload of its output record, if any.
    Output(Option<Vec<u8>>),
    /// To the DLQ.
    DeadLetter {
        reason: DlqReason,
        error: String,
        attempts: u32,
    },
}

/// How settling ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Its result is acknowledged; the record is completed.
    Done,
    /// Not written (its partition moved, or shutdown aborted or gave it up); the record is
    /// released.
    Released,
}

/// Backoff between tries of a dead letter the broker refused.
pub const DLQ_RETRY: RetryPolicy = RetryPolicy {
    initial: std::time::Duration::from_millis(200),
    max: std::time::Duration::from_secs(10),
    multiplier: 2.0,
    max_attempts: 0,
};

/// What settling needs from the stage.
pub struct Settler<'a> {
    pub producer: &'a StageProducer,
    pub metrics: &'a Metrics,
    pub health: &'a Health,
    /// Cancelled when the shutdown deadline passes: stop retrying refused dead letters.
    pub abort: &'a Signal,
}

impl Settler<'_> {
    /// Whether settling `outcome` writes a record (an output, a dead letter).
    fn writes(&self, outcome: &Outcome) -> bool {
        match outcome {
            Outcome::Output(payload) => payload.is_some() && self.producer.has_output(),
            Outcome::DeadLetter { .. } => true,
        }
    }

    /// Writes `outcome` for `record` and waits until it is acknowledged (then completes the
    /// record) or can no longer be written by this worker (then releases it). `watch`, when
    /// given, keeps timing the record: a write that keeps failing is reported as stuck.
    pub async fn settle(
        &self,
        record: &InputRecord,
        outcome: Outcome,
        mut watch: Option<&mut StuckWatch>,
        started: Instant,
    ) -> Settled {
        let mut outcome = outcome;
        let mut refusals: u32 = 0;
        let mut blocked = BlockedWrite {
            health: self.health,
            metrics: self.metrics,
            counted: false,
        };
        loop {
            // The membership fence first: while the coordinator is silent, wait (a revoked
            // partition or the shutdown's abort ends the wait: released).
            let passed = self.producer.gate().is_open() || self.wait_at_gate(record).await;
            if !self.writes(&outcome) {
                // Nothing to fence: a look at the lease decides, without a permit (taking and
                // dropping one is four atomic writes to lines that every session of the
                // partition shares).
                if !passed || record.lease.is_revoked() {
                    self.producer.release(record);
                    return Settled::Released;
                }
                self.producer.complete(record);
                return Settled::Done;
            }
            // exactlyOnce: held from before the write until the record's completion is sent,
            // so a commit's offsets count every write of its transaction (`transactions`).
            let share = self.producer.share().await;
            let Some(permit) = record.lease.begin_write().filter(|_| passed) else {
                self.producer.release(record);
                return Settled::Released;
            };
            if matches!(outcome, Outcome::Output(_)) && self.is_poisoned(record) {
                outcome = Outcome::DeadLetter {
                    reason: DlqReason::TransactionAbort,
                    error: format!(
                        "its output made {POISON_ABORTS} transactions of its partition abort \
                         in a row (exactlyOnce)"
                    ),
                    attempts: 1,
                };
            }
            let written = match &outcome {
                // Not reached: settled above, without a permit.
                Outcome::Output(None) => Ok(()),
                Outcome::Output(Some(payload)) => {
                    match self.producer.write_output(record, payload, &permit).await {
                        // Written, or taken back (purged): settled below, as a dead letter is.
                        Err(e) if !e.is_purged() && self.dooms(record, &e) => {
                            drop(permit);
                            self.producer.release(record);
                            return Settled::Released;
                        }
                        Err(e) if !e.is_purged() => {
                            // After librdkafka's retries: this output will not land. Nothing
                            // of the session's next record exists yet, so the DLQ comes first.
                            self.metrics.produce_errors.inc();
                            // A timed-out write may still have been stored: the dead letter
                            // then stands beside an output (at-least-once, README "No loss").
                            // The DLQ record says so, for whoever replays it.
                            let error = if e.may_have_landed() {
                                format!("{e} (timed out: the output may also have been written)")
                            } else {
                                e.to_string()
                            };
                            tracing::warn!(error = %error, partition = record.partition,
                                offset = record.offset, session = %record.session_str(),
                                "output not written; sending the record to the DLQ");
                            outcome = Outcome::DeadLetter {
                                reason: DlqReason::ProduceFailed,
                                error,
                                attempts: 1,
                            };
                            continue;
                        }
                        written => written,
                    }
                }
                Outcome::DeadLetter {
                    reason,
                    error,
                    attempts,
                } => {
                    if refusals == 0 {
                        tracing::warn!(reason = reason.as_str(), error, partition = record.partition,
                            offset = record.offset, session = %record.session_str(),
                            event_id = %record.event_id(), "record to DLQ");
                    }
                    self.producer
                        .write_dead_letter(record, *reason, error, *attempts, &permit)
                        .await
                }
            };
            drop(permit);
            match written {
                Ok(()) => {
                    self.producer.complete(record);
                    return Settled::Done;
                }
                Err(e) if e.is_purged() => {
                    self.metrics.writes_taken_back.inc();
                    if self.purged_by_the_fence(record) {
                        continue;
                    }
                    self.producer.release(record);
                    return Settled::Released;
                }
                Err(e) if self.dooms(record, &e) => {
                    self.producer.release(record);
                    return Settled::Released;
                }
                Err(e) => {
                    // Only a dead letter gets here (an output that will not land became one).
                    refusals += 1;
                    self.metrics.dlq_write_errors.inc();
                    blocked.set();
                    tracing::error!(error = %e, refusals, partition = record.partition,
                        offset = record.offset, session = %record.session_str(),
                        event_id = %record.event_id(),
                        "dead letter refused; retrying (the record stays uncommitted)");
                    // Not across the wait: a commit must not wait for a refused dead letter.
                    drop(share);
                    let delay = DLQ_RETRY.delay(refusals, rand::rng().random::<f64>());
                    let sleep = tokio::time::sleep(delay);
                    tokio::pin!(sleep);
                    loop {
                        let armed = watch.as_ref().is_some_and(|w| w.armed());
                        tokio::select! {
                            _ = &mut sleep => break,
                            _ = self.abort.cancelled() => {
                                self.producer.release(record);
                                return Settled::Released;
                            }
                            _ = expired(watch.as_deref()), if armed => {
                                // Already on its way to the DLQ: report only.
                                if let Some(w) = watch.as_deref_mut() {
                                    w.fire(record, self.metrics, started);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// `exactlyOnce`: a refused write dooms its transaction (see the module doc); true when it
    /// did, and the record is to be released (the rewind replays it).
    fn dooms(&self, record: &InputRecord, error: &WriteError) -> bool {
        let Some(transactions) = self.producer.transactions() else {
            return false;
        };
        if error.is_fence() || transactions.is_fenced(record.partition) {
            // Not the record's doing: the partition's producer was fenced. The loop gives the
            // partition up (nothing of its transaction commits) and replays it if it is still
            // this worker's after a grace.
            transactions.note_fenced(record.partition);
            return true;
        }
        // Refused at once because the transaction is doomed already: not this record's doing.
        let innocent = matches!(
            error,
            WriteError::Refused(KafkaError::MessageProduction(RDKafkaErrorCode::State))
        );
        self.metrics.produce_errors.inc();
        tracing::warn!(%error, partition = record.partition, offset = record.offset,
            session = %record.session_str(),
            "exactlyOnce: write refused; the partition's transaction is aborted and replayed");
        let doom = Doom {
            reason: AbortReason::Write,
            record: (!innocent).then_some(record.offset),
            epoch: Some(record.lease.epoch),
        };
        transactions.doom(record.partition, doom);
        true
    }

    /// `exactlyOnce`: whether `record`'s writes made its partition's transactions abort too
    /// often: it is written as a dead letter.
    fn is_poisoned(&self, record: &InputRecord) -> bool {
        self.producer
            .transactions()
            .is_some_and(|t| t.is_poisoned(record.partition, record.offset))
    }

    /// Waits at the closed membership fence: true once it opens, false when the record's
    /// partition is revoked or the shutdown aborts meanwhile.
    async fn wait_at_gate(&self, record: &InputRecord) -> bool {
        tokio::select! {
            passed = self.producer.gate().pass(&record.lease) => passed,
            _ = self.abort.cancelled() => false,
        }
    }

    /// A purged write whose partition is still this worker's, whose stop has not come and
    /// whose producer has not failed was taken back by the membership fence: it is written
    /// again once the gate opens. (A stop purges only after revoking every lease; a fatal
    /// error purges the client's queues itself, and its records are released for the restart,
    /// or, for a fenced partition producer, for the partition's replay.)
    fn purged_by_the_fence(&self, record: &InputRecord) -> bool {
        !record.lease.is_revoked()
            && !self.abort.is_cancelled()
            && !self.producer.has_failed_for(record.partition)
    }
}

async fn expired(watch: Option<&StuckWatch>) {
    match watch {
        Some(w) => w.expired().await,
        None => std::future::pending().await,
    }
}

/// Counts a record whose dead letter is being refused, once, until it lands or is given up.
struct BlockedWrite<'a> {
    health: &'a Health,
    metrics: &'a Metrics,
    counted: bool,
}

impl BlockedWrite<'_> {
    fn set(&mut self) {
        if !self.counted {
            self.counted = true;
            self.health.write_blocked(true);
            self.metrics.blocked_writes.inc();
        }
    }
}

impl Drop for BlockedWrite<'_> {
    fn drop(&mut self) {
        if self.counted {
            self.health.write_blocked(false);
            self.metrics.blocked_writes.dec();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::commit::completion::{Completion, CompletionReceiver};
    use crate::record::SessionSource;
    use crate::record::{Lease, Parts};

    /// A stage without an output topic, whose producer never connects.
    fn terminal_stage() -> (StageProducer, CompletionReceiver, Metrics, Arc<Health>) {
        let metrics = Metrics::new("test");
        let health = Arc::new(Health::default());
        let (producer, done) = crate::output::producer::terminal_stage(&metrics, &health);
        (producer, done, metrics, health)
    }

    #[tokio::test]
    async fn an_outcome_that_writes_nothing_is_settled_by_a_look_at_the_lease() {
        let (producer, done, metrics, health) = terminal_stage();
        let abort = Signal::default();
        let settler = Settler {
            producer: &producer,
            metrics: &metrics,
            health: &health,
            abort: &abort,
        };
        let lease = Arc::new(Lease::new(2, 7));
        let parts = Parts {
            key: Some(b"s"),
            ..Default::default()
        };
        let record = InputRecord::new("t".into(), 2, 5, parts, &SessionSource::Key, lease.clone());
        let nothing = Outcome::Output(None);
        // An output where the stage has no output topic is dropped: nothing written either.
        let dropped = Outcome::Output(Some(b"result".to_vec()));
        for outcome in [&nothing, &dropped] {
            let settled = settler
                .settle(&record, outcome.clone(), None, Instant::now())
                .await;
            assert_eq!(settled, Settled::Done, "{outcome:?} under a live lease");
            assert_eq!(done.try_recv(), Ok(Completion::done(&record)));
        }
        // Draining: the record's handler may still finish, and its result is still taken.
        lease.drain();
        let settled = settler
            .settle(&record, nothing.clone(), None, Instant::now())
            .await;
        assert_eq!(settled, Settled::Done, "draining, not revoked");
        assert_eq!(done.try_recv(), Ok(Completion::done(&record)));
        // Revoked: the next owner has the partition; released, as a write would be.
        lease.revoke();
        for outcome in [nothing, dropped] {
            let settled = settler.settle(&record, outcome, None, Instant::now()).await;
            assert_eq!(settled, Settled::Released);
            assert_eq!(done.try_recv(), Ok(Completion::released(&record)));
        }
        assert_eq!(lease.writes_in_flight(), 0);
    }
}
