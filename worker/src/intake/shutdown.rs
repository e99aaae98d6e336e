//! The stop: drain, final commit, leave the group.
//!
//! Shutdown keeps serving the consumer while it drains (rebalances, commit answers,
//! `max.poll.interval.ms`), commits progress as it goes, keeps its write fence *before* it
//! leaves the group (results on their way land or are purged first, so none lands after the
//! next owner's), and reports a final commit that failed as a failure of the run. It is the
//! consumer loop's last act, so these are methods of [`IntakeLoop`].

use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer};

use crate::intake::book::{Book, Leaving};
use crate::intake::rebalance::DRAIN_CHECK;
use crate::intake::{IntakeError, IntakeLoop};

/// How long shutdown waits for the answers of the deliveries it purged.
const PURGE_ANSWERS: Duration = Duration::from_secs(2);
/// How long a refused final commit is tried again (a rebalance under way at shutdown).
const FINAL_COMMIT_RETRIES: Duration = Duration::from_secs(5);

impl IntakeLoop {
    /// Commits every watermark synchronously on this thread (the final commit). Returns how
    /// many partitions failed.
    fn commit_now(&self) -> usize {
        let ctx = self.ctx();
        if let Some(transactions) = self.producer.transactions() {
            let mut book = ctx.book();
            return ctx.commit_transactions(&self.consumer, &mut book, transactions, None, true);
        }
        let tpl = ctx.book().commit_list(None, true);
        if tpl.count() == 0 {
            return 0;
        }
        let result = self.consumer.commit(&tpl, CommitMode::Sync);
        ctx.book().commit_answered(&result, &tpl, &ctx.metrics)
    }

    /// Stop taking records, let sessions finish their current record (or, with
    /// `shutdownDrainQueued`, everything queued) up to the deadline while still serving the
    /// consumer and committing progress, wait for the results on their way, commit, close.
    pub(super) fn shutdown(mut self) -> Result<(), IntakeError> {
        let ctx = self.consumer.context();
        ctx.health.set_ready(false);
        if self.tokens.fatal.is_cancelled() {
            // The producer cannot write any more: nothing in flight will settle.
            self.tokens.abort.cancel();
        }
        if !ctx.settings.shutdown_drain_queued {
            self.tokens.release_queued.cancel();
        }
        // No new records reach the sessions: dispatchers end when their senders are gone.
        // Parked records are released uncommitted.
        self.dispatchers.clear();
        {
            let mut book = ctx.book();
            for p in &book.all_partitions() {
                book.drop_pending(*p);
            }
        }
        let deadline = Instant::now() + ctx.settings.shutdown_timeout;
        if !self.serve_until(deadline, |book| book.unreleased_total() == 0) {
            tracing::warn!(
                unfinished = ctx.book().unreleased_total(),
                "shutdown deadline passed; unfinished records will be replayed"
            );
        }
        self.tokens.abort.cancel();
        self.fence_before_leaving();
        let last = self.committer.borrow_mut().finish();
        if let Some(a) = last {
            ctx.book()
                .commit_answered(&a.result, &a.offsets, &ctx.metrics);
        }
        let failed = self.final_commit(deadline + ctx.settings.shutdown_fence_timeout);
        let metrics = ctx.metrics.clone();
        let fatal = self.tokens.fatal.clone();
        let transactions = self.producer.transactions().cloned();
        let closed = self.close();
        // exactlyOnce: what is still open (nothing committed after the last commit) is aborted.
        if let Some(transactions) = transactions {
            transactions.abort_all();
        }
        let failed = match closed {
            // The close's revocation committed what the final commit could not.
            Some(0) if failed > 0 => {
                tracing::info!(
                    failed,
                    "the final commit was refused, the close's revocation committed it"
                );
                0
            }
            _ => failed,
        };
        let result = match failed {
            0 => {
                tracing::info!("final watermarks committed");
                Ok(())
            }
            failed => {
                metrics.final_commit_failures.inc();
                tracing::error!(
                    failed,
                    "final commit failed; progress since the last \
                    confirmed commit will be replayed"
                );
                Err(IntakeError::FinalCommit(format!(
                    "{failed} partition(s) not committed"
                )))
            }
        };
        if fatal.is_cancelled() {
            Err(IntakeError::Fatal)
        } else {
            result
        }
    }

    /// The final commit. A rebalance may be under way as the worker stops (other members
    /// joining or leaving at once), and the broker then refuses commits of the old generation:
    /// serve the consumer (the revocation commits what it takes away) and try again until
    /// `until` (the stop's own deadline, at least [`FINAL_COMMIT_RETRIES`] from now) before
    /// calling it a failure; partitions already confirmed as they are are not sent again.
    /// Returns how many partitions failed the last try; the close's revocation gets one more
    /// chance (see [`IntakeLoop::close`]).
    fn final_commit(&self, until: Instant) -> usize {
        let until = until.max(Instant::now() + FINAL_COMMIT_RETRIES);
        loop {
            let failed = self.commit_now();
            // exactlyOnce: a refused transactional commit leaves its transaction abortable (it
            // is aborted at the close); no retry can commit it.
            if failed == 0 || Instant::now() >= until || self.producer.transactions().is_some() {
                return failed;
            }
            tracing::info!(
                failed,
                "final commit refused; serving the group and trying again"
            );
            let pause = Instant::now() + DRAIN_CHECK * 4;
            while Instant::now() < pause {
                self.serve_events_only();
                std::thread::sleep(DRAIN_CHECK / 5);
            }
        }
    }

    /// Keeps the group served — its events (rebalances), commit answers, commits of progress
    /// every interval, the liveness heartbeat — while completions come in, until `done` or
    /// `deadline`. Returns whether `done` was reached. Shutdown waits this way: a member that
    /// stops polling for `max.poll.interval.ms` is dropped from the group, and its commits then
    /// fail.
    fn serve_until(&self, deadline: Instant, done: impl Fn(&Book) -> bool) -> bool {
        let ctx = self.ctx();
        let mut last_commit = Instant::now();
        loop {
            ctx.health.beat();
            ctx.judge_membership();
            {
                let mut book = ctx.book();
                book.apply_ready(&ctx.metrics);
                if done(&book) {
                    return true;
                }
                if Instant::now() >= deadline {
                    return false;
                }
                if let Ok(c) = book.completions.recv_timeout(DRAIN_CHECK) {
                    book.apply(c);
                }
            }
            self.serve_events_only();
            self.take_commit_answers();
            if last_commit.elapsed() >= ctx.settings.commit_interval {
                self.commit_in_background(true);
                last_commit = Instant::now();
            }
        }
    }

    /// The write fence of a shutdown, kept while this worker is still a member of the group.
    /// Once it leaves, the next owner redoes what was not done; a result of this worker landing
    /// after that would end a session on an older record. So: no new write (the leases are
    /// revoked), wait — serving the group — for the results on their way, and give up (purge
    /// from the producer, which then never sends them) what is still out at the deadline.
    fn fence_before_leaving(&self) {
        let ctx = self.ctx();
        let leases = {
            let mut book = ctx.book();
            let all = book.all_partitions();
            book.revoke(&all)
        };
        let fence = Instant::now() + ctx.settings.shutdown_fence_timeout;
        if self.serve_until(fence, |_| Book::writes_in_flight(&leases) == 0) {
            return;
        }
        let out = Book::writes_in_flight(&leases);
        self.producer.purge();
        tracing::warn!(
            out,
            "results still unacknowledged at the shutdown fence: given up before leaving the \
             group (their records are replayed by the next owner)"
        );
        // The purge answers every delivery at once; the writers then drop their permits.
        self.serve_until(Instant::now() + PURGE_ANSWERS, |_| {
            Book::writes_in_flight(&leases) == 0
        });
        let late = Book::writes_in_flight(&leases);
        if late > 0 {
            ctx.metrics.late_writes.inc_by(late);
            tracing::error!(
                late,
                "results still unacknowledged after the purge; they may land after the next \
                 owner's"
            );
        }
    }

    /// Serves the consumer's events (rebalances, commit answers) without taking records: any
    /// record still in the main queue is left uncommitted, for the next owner.
    fn serve_events_only(&self) {
        self.serve_main_queue(|_| {});
    }

    /// Leaves the group. The revocation this triggers commits what is not confirmed yet;
    /// returns how many partitions it failed to commit, `None` if no revocation ran.
    pub(super) fn close(self) -> Option<usize> {
        // Its thread holds the consumer too: end it before the consumer is closed.
        self.committer.borrow_mut().finish();
        self.ctx().book().start_closing();
        self.consumer.unsubscribe();
        // Serve the revocation that unsubscribing triggers, briefly.
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until && self.consumer.assignment().is_ok_and(|a| a.count() > 0) {
            self.consumer.poll(Duration::from_millis(50));
        }
        let unconfirmed = match self.ctx().book().leaving {
            Leaving::Closing { unconfirmed } => unconfirmed,
            Leaving::No => None,
        };
        drop(self.fence_timer.take());
        drop(self.consumer);
        unconfirmed
    }
}
