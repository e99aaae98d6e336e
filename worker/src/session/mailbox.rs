//! A session's queue: the records its dispatcher handed it and its task has not taken yet.
//!
//! Every live session has one while it has a task, and a burst of a million users means a
//! million of them, so what an empty queue costs is what matters here. tokio's unbounded
//! channel, which sessions used first, is built for many busy senders: its two halves are padded
//! to cache lines and its first block of 32 slots is allocated with it, ~850 bytes before the
//! first record. A session has one sender (its dispatcher) and one receiver (its task), and its
//! queue is short, so a `VecDeque` under a mutex that neither side ever holds across anything
//! else, with one waker for the task, does the same job in a single allocation of ~100 bytes
//! (and the deque's own slots, which grow with what is queued).
//!
//! The queue also counts the records handed over and not yet *finished* (taken and processed):
//! the dispatcher reaps a session only when that count is zero.
//!
//! And it is how a session *hibernates*: an idle session's task ends, and what the task remembers
//! (`K`: its order watch, its recent event ids) goes back to the dispatcher, which keeps it in its
//! map until the session's next record starts a new task with it, or until the session is reaped.
//! The dispatcher asks ([`Sender::ask_to_hibernate`]); the task, finding its queue empty, leaves
//! its memory in the mailbox ([`Receiver::hibernate`]); the dispatcher takes it
//! ([`Sender::hibernated`]) and drops the mailbox. Each step is one look under the lock, so a
//! record sent at any point in between is never lost: either the task sees it and goes on, or the
//! send finds the task gone and hands the record back to the dispatcher, which starts a new task.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;

use futures::task::AtomicWaker;

/// Creates a session's queue: the dispatcher's end and the task's end.
pub fn mailbox<T, K>() -> (Sender<T, K>, Receiver<T, K>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            sender: true,
            receiver: true,
            hibernate: false,
            kept: None,
        }),
        task: AtomicWaker::new(),
        unfinished: AtomicUsize::new(0),
    });
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver {
            shared,
            taken: VecDeque::new(),
            finished: 0,
        },
    )
}

struct Shared<T, K> {
    state: Mutex<State<T, K>>,
    /// The receiving task, when it waits for a record.
    task: AtomicWaker,
    /// Records sent and not yet finished by the receiver.
    unfinished: AtomicUsize,
}

struct State<T, K> {
    queue: VecDeque<T>,
    /// Each end, while it lives.
    sender: bool,
    receiver: bool,
    /// The sender asked the receiver to hibernate once nothing is queued; a send withdraws it.
    hibernate: bool,
    /// What a hibernated receiver left for the sender.
    kept: Option<K>,
}

impl<T, K> Shared<T, K> {
    fn state(&self) -> MutexGuard<'_, State<T, K>> {
        // Nothing panics while holding the lock (pushes and pops only); a poisoned lock's
        // queue is still whole.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The dispatcher's end.
pub struct Sender<T, K> {
    shared: Arc<Shared<T, K>>,
}

impl<T, K> Sender<T, K> {
    /// Queues `item` behind the earlier ones; hands it back if the receiver is gone (hibernated or
    /// ended).
    pub fn send(&self, item: T) -> Result<(), T> {
        let first = {
            let mut state = self.shared.state();
            if !state.receiver {
                return Err(item);
            }
            // Counted before the receiver can take it (and finish it).
            self.shared.unfinished.fetch_add(1, Ordering::AcqRel);
            state.queue.push_back(item);
            state.hibernate = false;
            // Behind records still queued: the send that queued the first of them wakes the
            // receiver (after this one's record is in), or it has not looked since.
            state.queue.len() == 1
        };
        if first {
            self.shared.task.wake();
        }
        Ok(())
    }

    /// Asks the receiver to hibernate once it has nothing queued (its `recv` then ends); the next
    /// send withdraws the request.
    pub fn ask_to_hibernate(&self) {
        self.shared.state().hibernate = true;
        self.shared.task.wake();
    }

    /// What the receiver left when it hibernated; `None` while it runs (or if it ended without
    /// hibernation).
    pub fn hibernated(&self) -> Option<K> {
        let mut state = self.shared.state();
        if state.receiver {
            return None;
        }
        state.kept.take()
    }

    /// Records sent and not yet finished by the receiver.
    pub fn unfinished(&self) -> usize {
        self.shared.unfinished.load(Ordering::Acquire)
    }
}

impl<T, K> Drop for Sender<T, K> {
    fn drop(&mut self) {
        self.shared.state().sender = false;
        self.shared.task.wake();
    }
}

/// The session task's end.
///
/// It takes what is queued all at once, into a queue of its own, so a burst of records costs
/// one look under the lock, not one per record; and it tells the sender about the records it
/// finished at that look too, not with an atomic operation each.
pub struct Receiver<T, K> {
    shared: Arc<Shared<T, K>>,
    /// Taken from the shared queue, not yet handed out.
    taken: VecDeque<T>,
    /// Finished since the sender's count was last told.
    finished: usize,
}

impl<T, K> Receiver<T, K> {
    /// The next record, or `None` once nothing is left and the sender is gone or has asked
    /// this end to hibernate (see [`Receiver::hibernate`]).
    pub async fn recv(&mut self) -> Option<T> {
        poll_fn(|cx| {
            if let Some(ready) = self.try_recv() {
                return Poll::Ready(ready);
            }
            self.shared.task.register(cx.waker());
            // Sent (or closed) between the first look and the registration: its wake-up may
            // have found no waker yet.
            match self.try_recv() {
                Some(ready) => Poll::Ready(ready),
                None => Poll::Pending,
            }
        })
        .await
    }

    /// The next record if one is queued, without waiting.
    pub fn try_next(&mut self) -> Option<T> {
        self.try_recv().flatten()
    }

    /// `Some(Some(item))` when one is queued, `Some(None)` when none will come, `None` to wait.
    fn try_recv(&mut self) -> Option<Option<T>> {
        if let Some(item) = self.taken.pop_front() {
            return Some(Some(item));
        }
        // A burst leaves the deque's slots behind; an idle session keeps a few. (Not after
        // every short run of records: growing again would cost more than the slots.)
        if self.taken.capacity() > BURST_SLOTS {
            self.taken.shrink_to(IDLE_SLOTS);
        }
        let mut state = tell_finished(&self.shared, &mut self.finished);
        if !state.queue.is_empty() {
            // The sender goes on with the (empty) deque this end had.
            std::mem::swap(&mut state.queue, &mut self.taken);
            return Some(self.taken.pop_front());
        }
        if !state.sender || state.hibernate {
            Some(None)
        } else {
            None
        }
    }

    /// Called when `recv` ended: `Ok` when this end is done, having left `kept` for the sender and
    /// detached (the sender still asks it to hibernate, or is gone, and nothing is queued);
    /// otherwise `kept` comes back (a record came meanwhile: take it). A detached
    /// receiver takes nothing more: later sends come back to the sender.
    pub fn hibernate(&mut self, kept: K) -> Result<(), K> {
        let mut state = tell_finished(&self.shared, &mut self.finished);
        // Never with records left behind: the sender may have sent some after `recv` ended
        // and then gone (its end dropped), and those must still be taken (or released).
        let left = !state.queue.is_empty() || !self.taken.is_empty();
        if left || (state.sender && !state.hibernate) {
            return Err(kept);
        }
        state.receiver = false;
        state.kept = Some(kept);
        Ok(())
    }

    /// One record taken earlier is finished: the sender may count the session idle once this
    /// end next looks at the queue (it does before it waits, and before it hibernates).
    pub fn finished(&mut self) {
        self.finished += 1;
    }
}

impl<T, K> Drop for Receiver<T, K> {
    fn drop(&mut self) {
        // Nothing will take what is still queued: drop it now (outside the lock), not when the
        // sender goes too.
        let left = {
            let mut state = tell_finished(&self.shared, &mut self.finished);
            state.receiver = false;
            std::mem::take(&mut state.queue)
        };
        drop(left);
    }
}

/// Locks the queue, and tells the sender's count (under the lock) about the records the
/// receiver finished since it last did.
fn tell_finished<'a, T, K>(
    shared: &'a Shared<T, K>,
    finished: &mut usize,
) -> MutexGuard<'a, State<T, K>> {
    let state = shared.state();
    let n = std::mem::take(finished);
    if n > 0 {
        shared.unfinished.fetch_sub(n, Ordering::AcqRel);
    }
    state
}

/// Slots an emptied queue keeps (a pointer each, for boxed records)…
const IDLE_SLOTS: usize = 4;
/// …once it has grown beyond this many.
const BURST_SLOTS: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[tokio::test]
    async fn records_come_out_in_the_order_they_went_in_then_none_once_the_sender_is_gone() {
        let (tx, mut rx) = mailbox::<_, ()>();
        for i in 0..100 {
            tx.send(i).unwrap();
        }
        drop(tx);
        for i in 0..100 {
            assert_eq!(rx.recv().await, Some(i));
        }
        assert_eq!(rx.recv().await, None);
    }

    #[tokio::test]
    async fn a_waiting_receiver_wakes_for_a_record_and_for_the_sender_leaving() {
        let (tx, mut rx) = mailbox::<_, ()>();
        let task = tokio::spawn(async move {
            let first = rx.recv().await;
            let then = rx.recv().await;
            (first, then)
        });
        tokio::task::yield_now().await;
        tx.send("a").unwrap();
        tokio::task::yield_now().await;
        drop(tx);
        assert_eq!(task.await.unwrap(), (Some("a"), None));
    }

    #[test]
    fn a_record_for_a_gone_receiver_comes_back() {
        let (tx, rx) = mailbox::<_, ()>();
        drop(rx);
        assert_eq!(tx.send(7), Err(7));
        assert_eq!(tx.unfinished(), 0);
    }

    #[test]
    fn what_is_queued_when_the_receiver_goes_is_dropped_with_it() {
        let record = Arc::new(());
        let (tx, rx) = mailbox::<_, ()>();
        tx.send(record.clone()).unwrap();
        tx.send(record.clone()).unwrap();
        assert_eq!(Arc::strong_count(&record), 3);
        drop(rx);
        assert_eq!(
            Arc::strong_count(&record),
            1,
            "still queued for a receiver that is gone"
        );
    }

    #[test]
    fn a_record_counts_as_unfinished_until_the_receiver_says_so_and_looks_again() {
        let (tx, mut rx) = mailbox::<_, ()>();
        tx.send(1).unwrap();
        tx.send(2).unwrap();
        assert_eq!(tx.unfinished(), 2);
        assert_eq!(rx.try_next(), Some(1));
        assert_eq!(tx.unfinished(), 2, "taken is not finished");
        rx.finished();
        assert_eq!(rx.try_next(), Some(2), "taken with the first: no look");
        assert_eq!(tx.unfinished(), 2, "finished, but not told yet");
        tx.send(3).unwrap();
        assert_eq!(rx.try_next(), Some(3), "a look at the queue");
        assert_eq!(
            tx.unfinished(),
            2,
            "told of the first; the second and third are taken"
        );
        rx.finished();
        rx.finished();
        assert_eq!(rx.try_next(), None);
        assert_eq!(tx.unfinished(), 0, "told before it would wait");
    }

    #[test]
    fn a_burst_is_taken_at_one_look() {
        let (tx, mut rx) = mailbox::<_, ()>();
        for i in 0..10 {
            tx.send(i).unwrap();
        }
        assert_eq!(rx.try_next(), Some(0));
        assert!(rx.shared.state().queue.is_empty(), "all of it taken");
        tx.send(10).unwrap();
        let rest: Vec<_> = std::iter::from_fn(|| rx.try_next()).collect();
        assert_eq!(rest, (1..11).collect::<Vec<_>>(), "taken first, then sent");
    }

    #[test]
    fn emptied_queues_give_their_burst_back() {
        let (tx, mut rx) = mailbox::<_, ()>();
        for burst in 0..2 {
            for i in 0..1_000 {
                tx.send(burst * 1_000 + i).unwrap();
            }
            for i in 0..1_000 {
                assert_eq!(rx.try_next(), Some(burst * 1_000 + i));
            }
        }
        assert_eq!(rx.try_next(), None);
        assert!(
            rx.shared.state().queue.capacity() <= IDLE_SLOTS,
            "the sender's"
        );
        assert!(rx.taken.capacity() <= IDLE_SLOTS, "the receiver's");
    }

    #[tokio::test]
    async fn a_hibernated_receiver_leaves_its_memory_and_later_records_come_back() {
        let (tx, mut rx) = mailbox::<_, &str>();
        tx.send(1).unwrap();
        tx.ask_to_hibernate();
        assert_eq!(rx.recv().await, Some(1), "what is queued comes first");
        rx.finished();
        assert_eq!(rx.recv().await, None);
        assert_eq!(tx.hibernated(), None, "not hibernated yet");
        assert_eq!(rx.hibernate("memory"), Ok(()));
        assert_eq!(tx.hibernated(), Some("memory"));
        assert_eq!(tx.send(2), Err(2), "a hibernated receiver takes nothing");
        assert_eq!(tx.unfinished(), 0);
    }

    #[tokio::test]
    async fn a_record_sent_after_the_ask_withdraws_it() {
        let (tx, mut rx) = mailbox::<_, &str>();
        tx.ask_to_hibernate();
        tx.send(1).unwrap();
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(rx.try_recv(), None, "waits for the next record");
        assert_eq!(rx.hibernate("memory"), Err("memory"));
        assert_eq!(tx.hibernated(), None);
    }

    /// The race `hibernation_loses_nothing_and_hands_the_memory_on` found under load: `recv`
    /// ended on the ask, then the sender sent and went away before `hibernate`. The record is
    /// still taken, not dropped with the receiver.
    #[tokio::test]
    async fn a_record_sent_just_before_the_sender_left_is_taken_before_hibernating() {
        let (tx, mut rx) = mailbox::<_, &str>();
        tx.ask_to_hibernate();
        assert_eq!(rx.recv().await, None);
        tx.send(1).unwrap();
        drop(tx);
        assert_eq!(
            rx.hibernate("memory"),
            Err("memory"),
            "a record is left: take it"
        );
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(rx.recv().await, None, "the sender is gone");
        assert_eq!(rx.hibernate("memory"), Ok(()));
    }

    #[tokio::test]
    async fn a_record_sent_between_the_end_of_recv_and_hibernate_keeps_the_receiver() {
        let (tx, mut rx) = mailbox::<_, &str>();
        tx.ask_to_hibernate();
        assert_eq!(rx.recv().await, None);
        tx.send(1).unwrap();
        assert_eq!(
            rx.hibernate("memory"),
            Err("memory"),
            "a record came: take it"
        );
        // Asked again with the record still queued (the dispatcher asks only idle sessions,
        // but the queue is what decides).
        tx.ask_to_hibernate();
        assert_eq!(
            rx.hibernate("memory"),
            Err("memory"),
            "a record is queued: take it"
        );
        assert_eq!(tx.hibernated(), None);
        assert_eq!(rx.recv().await, Some(1));
    }

    #[test]
    fn a_receiver_not_asked_does_not_hibernate_and_one_whose_sender_left_is_done() {
        let (tx, mut rx) = mailbox::<u8, &str>();
        assert_eq!(rx.hibernate("memory"), Err("memory"));
        drop(tx);
        assert_eq!(rx.try_recv(), Some(None));
        assert_eq!(rx.hibernate("memory"), Ok(()));
    }

    /// The sender sends each record the moment the previous one is finished, which is when the
    /// receiver goes back to wait: a wake-up lost between its look and its registration would
    /// leave it waiting for good.
    #[test]
    fn a_record_sent_while_the_receiver_goes_to_wait_still_wakes_it() {
        const ROUNDS: usize = 200_000;
        let (tx, mut rx) = mailbox::<_, ()>();
        let receiver = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let mut got = 0;
                while rx.recv().await.is_some() {
                    got += 1;
                    rx.finished();
                }
                got
            })
        });
        for i in 0..ROUNDS {
            tx.send(i).unwrap();
            while tx.unfinished() > 0 {
                std::hint::spin_loop();
            }
        }
        drop(tx);
        assert_eq!(receiver.join().unwrap(), ROUNDS);
    }

    /// A receiver task for the hibernation test: takes records, checking each against what its
    /// predecessors remembered, until it hibernates or the sender is gone.
    async fn remembering_receiver(
        mut rx: Receiver<usize, usize>,
        mut next: usize,
        seen: Arc<Mutex<Vec<(usize, usize)>>>,
    ) {
        loop {
            while let Some(i) = rx.recv().await {
                seen.lock().unwrap().push((i, next));
                next += 1;
                rx.finished();
            }
            match rx.hibernate(next) {
                Ok(()) => return,
                Err(kept) => next = kept,
            }
        }
    }

    proptest! {
        /// Across two threads, whatever the interleaving: every record once, in order.
        #[test]
        fn across_threads_every_record_arrives_once_in_order(n in 0usize..2_000) {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .build()
                .unwrap();
            let got = runtime.block_on(async move {
                let (tx, mut rx) = mailbox::<_, ()>();
                let receiver = tokio::spawn(async move {
                    let mut got = Vec::new();
                    while let Some(i) = rx.recv().await {
                        got.push(i);
                        rx.finished();
                    }
                    got
                });
                let sender = std::thread::spawn(move || {
                    for i in 0..n {
                        tx.send(i).unwrap();
                        if i % 64 == 0 {
                            std::thread::yield_now();
                        }
                    }
                });
                sender.join().unwrap();
                receiver.await.unwrap()
            });
            prop_assert_eq!(got, (0..n).collect::<Vec<_>>());
        }
    }

    proptest! {
        // Explicit: the interleavings are the point, and each case is cheap (~5 ms).
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Hibernation under races: the sender asks its receiver to hibernate at random moments and
        /// starts a new one, with the memory the last one left, whenever a record comes back.
        /// Every record arrives once, in order, and each receiver starts where the last one
        /// stopped.
        #[test]
        fn hibernation_loses_nothing_and_hands_the_memory_on(
            asks in proptest::collection::vec(proptest::bool::weighted(0.3), 1..1_500)
        ) {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .build()
                .unwrap();
            let handle = runtime.handle().clone();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let n = asks.len();
            let receivers = runtime.block_on({
                let seen = seen.clone();
                async move {
                    tokio::task::spawn_blocking(move || {
                        let (mut tx, rx) = mailbox::<usize, usize>();
                        let first = remembering_receiver(rx, 0, seen.clone());
                        let mut receivers = vec![handle.spawn(first)];
                        for (i, ask) in asks.into_iter().enumerate() {
                            if ask {
                                tx.ask_to_hibernate();
                                if i % 3 == 0 {
                                    std::thread::yield_now();
                                }
                            }
                            if let Err(back) = tx.send(i) {
                                let next = tx.hibernated().expect("it left by hibernating");
                                let (new_tx, rx) = mailbox();
                                tx = new_tx;
                                let receiver = remembering_receiver(rx, next, seen.clone());
                                receivers.push(handle.spawn(receiver));
                                tx.send(back).unwrap();
                            }
                        }
                        receivers
                    })
                    .await
                    .unwrap()
                }
            });
            runtime.block_on(async {
                for r in receivers {
                    r.await.unwrap();
                }
            });
            let seen = seen.lock().unwrap();
            prop_assert_eq!(seen.len(), n);
            for (at, &(i, next)) in seen.iter().enumerate() {
                prop_assert_eq!(i, at, "record {} arrived at position {}", i, at);
                prop_assert_eq!(next, at, "receiver's memory {} at record {}", next, at);
            }
        }
    }
}
