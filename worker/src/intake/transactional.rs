//! `exactlyOnce` commits: each partition's transaction, with its offsets (docs/exactly-once.md).
//!
//! A commit takes the write barrier exclusively (every write of the transaction acknowledged,
//! its record's completion sent), applies the completions, and commits each partition's
//! transaction with its watermark and completed-offset map, sent with the consumer's group
//! metadata. A transaction that does not commit stops the worker: no later transaction is
//! committed, the open ones are aborted at the stop, and the restart replays from the last
//! committed one. (Rewinding the partition instead of stopping is the design's next step.)

use std::time::Instant;

use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::commit::offsets::Partition;
use crate::intake::book::Book;
use crate::intake::rebalance::IntakeContext;
use crate::output::producer::ProducerEvents;
use crate::output::transactions::Transactions;

impl IntakeContext {
    /// Commits the transactions of `only` (all partitions when `None`); `force`: every
    /// partition not confirmed as it is (a final commit). Returns how many partitions failed.
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
        let _exclusive = transactions.exclusive();
        book.apply_ready(&self.metrics);
        let Some(group) = consumer.group_metadata() else {
            return book.unsettled(&partitions);
        };
        let mut failed = 0;
        for p in partitions {
            let offsets = book.commit_list(Some(&[p]), force);
            if offsets.count() == 0 {
                continue;
            }
            let started = Instant::now();
            let result = transactions.commit(p, &offsets, &group);
            self.metrics
                .transaction_commit_seconds
                .observe(started.elapsed().as_secs_f64());
            self.metrics
                .transactions
                .with_label_values(&[if result.is_ok() {
                    "committed"
                } else {
                    "failed"
                }])
                .inc();
            failed += book.commit_answered(&result, &offsets, &self.metrics);
            match result {
                Ok(()) => tracing::debug!(
                    partition = p,
                    ms = started.elapsed().as_millis() as u64,
                    "transaction committed"
                ),
                Err(e) => {
                    self.metrics.fatal_errors.inc();
                    self.health.fail();
                    tracing::error!(partition = p, error = %e,
                        "exactlyOnce: a transaction did not commit; the worker stops (its open \
                         transactions are aborted, the restart replays from the last committed \
                         one)");
                    self.fatal.cancel();
                    return failed;
                }
            }
        }
        failed
    }

    /// `exactlyOnce`: opens the transactional producers of newly assigned `partitions` —
    /// before their committed offsets are read, so that no older owner can commit behind this
    /// one's back. False (and the worker stops) when one cannot be opened.
    pub(super) fn open_transactions(&self, partitions: &[Partition]) -> bool {
        let Some(transactions) = self.producer.transactions() else {
            return true;
        };
        for p in partitions {
            if transactions.producer(*p).is_some() {
                continue;
            }
            if let Err(e) = transactions.open(*p) {
                self.metrics.fatal_errors.inc();
                self.health.fail();
                tracing::error!(partition = p, error = %e,
                    "exactlyOnce: the partition's transactional producer could not be opened; \
                     the worker stops");
                self.fatal.cancel();
                return false;
            }
        }
        true
    }

    /// `exactlyOnce`: aborts what `partitions` have open and closes their producers (after
    /// their last commit, this aborts only the empty transaction begun after it).
    pub(super) fn close_transactions(&self, partitions: &[Partition]) {
        if let Some(transactions) = self.producer.transactions() {
            for p in partitions {
                transactions.abort_and_close(*p);
            }
        }
    }
}
