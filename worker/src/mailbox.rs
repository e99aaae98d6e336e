//! A session's queue: the records its dispatcher handed it and its task has not taken yet.
//!
//! Every live session has one, and a burst of a million users means a million of them, most
//! idle, so what an empty queue costs is what matters here. tokio's unbounded channel, which
//! sessions used first, is built for many busy senders: its two halves are padded to cache
//! lines and its first block of 32 slots is allocated with it, ~850 bytes before the first
//! record. A session has one sender (its dispatcher) and one receiver (its task), and its queue
//! is short, so a `VecDeque` under a mutex that neither side ever holds across anything else,
//! with one waker for the task, does the same job in a single allocation of ~100 bytes (and
//! the deque's own slots, which grow with what is queued).
//!
//! The queue also counts the records handed over and not yet *finished* (taken and processed):
//! the dispatcher reaps a session only when that count is zero.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;

use futures::task::AtomicWaker;

/// Creates a session's queue: the dispatcher's end and the task's end.
pub fn mailbox<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            sender: true,
            receiver: true,
        }),
        task: AtomicWaker::new(),
        unfinished: AtomicUsize::new(0),
    });
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver { shared },
    )
}

struct Shared<T> {
    state: Mutex<State<T>>,
    /// The receiving task, when it waits for a record.
    task: AtomicWaker,
    /// Records sent and not yet finished by the receiver.
    unfinished: AtomicUsize,
}

struct State<T> {
    queue: VecDeque<T>,
    /// Each end, while it lives.
    sender: bool,
    receiver: bool,
}

impl<T> Shared<T> {
    fn state(&self) -> MutexGuard<'_, State<T>> {
        // Nothing panics while holding the lock (pushes and pops only); a poisoned lock's
        // queue is still whole.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The dispatcher's end.
pub struct Sender<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Sender<T> {
    /// Queues `item` behind the earlier ones; hands it back if the receiver is gone.
    pub fn send(&self, item: T) -> Result<(), T> {
        {
            let mut state = self.shared.state();
            if !state.receiver {
                return Err(item);
            }
            // Counted before the receiver can take it (and finish it).
            self.shared.unfinished.fetch_add(1, Ordering::AcqRel);
            state.queue.push_back(item);
        }
        self.shared.task.wake();
        Ok(())
    }

    /// Records sent and not yet finished by the receiver.
    pub fn unfinished(&self) -> usize {
        self.shared.unfinished.load(Ordering::Acquire)
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        self.shared.state().sender = false;
        self.shared.task.wake();
    }
}

/// The session task's end.
pub struct Receiver<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Receiver<T> {
    /// The next record, or `None` once the sender is gone and nothing is left.
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

    /// `Some(Some(item))` when one is queued, `Some(None)` when none will come, `None` to wait.
    fn try_recv(&mut self) -> Option<Option<T>> {
        let mut state = self.shared.state();
        match state.queue.pop_front() {
            Some(item) => {
                // A burst leaves the deque's slots behind; an idle session keeps a few. (Not
                // after every short run of records: growing again would cost more than the
                // slots.)
                if state.queue.is_empty() && state.queue.capacity() > BURST_SLOTS {
                    state.queue.shrink_to(IDLE_SLOTS);
                }
                Some(Some(item))
            }
            None if !state.sender => Some(None),
            None => None,
        }
    }

    /// One record taken earlier is finished: the sender may count the session idle.
    pub fn finished(&self) {
        self.shared.unfinished.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        // Nothing will take what is still queued: drop it now (outside the lock), not when the
        // sender goes too.
        let left = {
            let mut state = self.shared.state();
            state.receiver = false;
            std::mem::take(&mut state.queue)
        };
        drop(left);
    }
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
        let (tx, mut rx) = mailbox();
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
        let (tx, mut rx) = mailbox();
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
        let (tx, rx) = mailbox();
        drop(rx);
        assert_eq!(tx.send(7), Err(7));
        assert_eq!(tx.unfinished(), 0);
    }

    #[test]
    fn what_is_queued_when_the_receiver_goes_is_dropped_with_it() {
        let record = Arc::new(());
        let (tx, rx) = mailbox();
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

    #[tokio::test]
    async fn a_record_counts_as_unfinished_until_the_receiver_says_so() {
        let (tx, mut rx) = mailbox();
        tx.send(1).unwrap();
        tx.send(2).unwrap();
        assert_eq!(tx.unfinished(), 2);
        rx.recv().await.unwrap();
        assert_eq!(tx.unfinished(), 2, "taken is not finished");
        rx.finished();
        assert_eq!(tx.unfinished(), 1);
    }

    #[tokio::test]
    async fn an_emptied_queue_gives_its_burst_back() {
        let (tx, mut rx) = mailbox();
        for i in 0..1_000 {
            tx.send(i).unwrap();
        }
        while !rx.shared.state().queue.is_empty() {
            rx.recv().await.unwrap();
        }
        assert!(rx.shared.state().queue.capacity() <= IDLE_SLOTS);
    }

    /// The sender sends each record the moment the previous one is finished, which is when the
    /// receiver goes back to wait: a wake-up lost between its look and its registration would
    /// leave it waiting for good.
    #[test]
    fn a_record_sent_while_the_receiver_goes_to_wait_still_wakes_it() {
        const ROUNDS: usize = 200_000;
        let (tx, mut rx) = mailbox();
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

    proptest! {
        /// Across two threads, whatever the interleaving: every record once, in order.
        #[test]
        fn across_threads_every_record_arrives_once_in_order(n in 0usize..2_000) {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .build()
                .unwrap();
            let got = runtime.block_on(async move {
                let (tx, mut rx) = mailbox();
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
}
