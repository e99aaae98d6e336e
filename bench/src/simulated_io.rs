//! The handler's simulated I/O: a wait that ends the way a reply from a server does.
//!
//! A real handler's I/O ends when the reply arrives: the kernel marks the socket readable, the
//! runtime's reactor (epoll) sees it and wakes the task on the worker that polled it. The
//! first form of P2's handler stood its I/O in with `tokio::time::sleep`, and tokio's timer
//! counts whole milliseconds: it rounds a deadline up to the next one and a parked worker's
//! timeout up again, so a 5 ms sleep lasted ~6.7 ms and no system on this runtime could come
//! within 0.75 × of the scenario's ideal (sessions ÷ 5 ms), whatever it did. That measured
//! tokio's timer, not the systems.
//!
//! Here the pending waits are kept in a heap ordered by deadline, and a `timerfd` (the kernel's
//! high-resolution timer as a file descriptor) is armed for the earliest. The fd is registered
//! with the runtime's reactor like a socket; when it fires, a relay task on the runtime ends
//! every wait that is due and arms the fd for the next. So a wait ends on the same path, with
//! the same delays, as a reply: the kernel's timer, epoll, and a worker getting to its events
//! (at once when idle, after up to 61 tasks when busy). A wait may end up to 50 µs after its
//! deadline, the kernel's default timer slack for a sleeping thread, so that waits due together
//! end together: without it the fd fired for nearly every wait, and that churn took the CPU the
//! systems needed (BENCHMARKS.md, *The simulated I/O*). A first form woke the waits from a
//! thread of its own: that thread had to be scheduled on cores the systems kept busy, and its
//! wakes went through tokio's queue for outside wakes, which a busy worker reads about every
//! 200 µs; its waits resumed 0.2–1.7 ms late.
//!
//! Each runtime that waits has its own heap, timer and relay (a bench process has one runtime;
//! a test process may run several at once). The clock's own CPU is a lock, a heap push and an
//! `Arc` per wait, and one timer read per batch of due waits. [`ceiling`] measures what it leaves
//! of P2's ideal before any system runs a record.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::runtime::{self, Handle};

/// Waits per second that `tasks` tasks reach waiting `io` each, `waits` times in a row, while
/// nothing else runs: the rate no system can pass with this handler on this machine.
pub async fn ceiling(tasks: u64, waits: u64, io: Duration) -> f64 {
    let started = Instant::now();
    let running: Vec<_> = (0..tasks)
        .map(|_| {
            tokio::spawn(async move {
                for _ in 0..waits {
                    wait(io).await;
                }
            })
        })
        .collect();
    for task in running {
        let _ = task.await;
    }
    (tasks * waits) as f64 / started.elapsed().as_secs_f64()
}

/// Waits `io`, from now. Must be polled inside a tokio runtime with I/O enabled.
pub fn wait(io: Duration) -> Wait {
    Wait {
        deadline: Instant::now() + io,
        slot: None,
    }
}

/// One pending wait. The first poll registers it with the clock; it is ready once the relay
/// has marked it done.
pub struct Wait {
    deadline: Instant,
    slot: Option<Arc<Slot>>,
}

/// What a wait and the relay share.
#[derive(Default)]
struct Slot {
    done: AtomicBool,
    waker: AtomicWaker,
}

impl Future for Wait {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = self.deadline;
        let slot = match &self.slot {
            Some(slot) => slot,
            None if Instant::now() >= deadline => return Poll::Ready(()),
            None => {
                let slot = Arc::new(Slot::default());
                add(deadline, slot.clone());
                self.slot.insert(slot)
            }
        };
        slot.waker.register(cx.waker());
        if slot.done.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// How late a wait may end so that it ends with others: the kernel's default timer slack for
/// a sleeping thread. Without it the timer fired for nearly every wait (200,000 a second in
/// P2), and the reactor's churn took CPU from the systems; with it a fire ends ~10 waits.
const SLACK: Duration = Duration::from_micros(50);

/// A pending wait in the heap, earliest deadline first (waits due together end in one batch,
/// so ties need no order).
struct Entry {
    deadline: Instant,
    slot: Arc<Slot>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.deadline == other.deadline
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.deadline.cmp(&other.deadline)
    }
}

/// One runtime's pending waits and the timer of its relay.
struct Clock {
    runtime: runtime::Id,
    heap: BinaryHeap<Reverse<Entry>>,
    /// The relay's timerfd (the relay removes the clock, under the lock, before closing it).
    timer: RawFd,
    /// The deadline the timer is armed for.
    armed: Option<Instant>,
}

/// Every runtime's clock, behind one lock (there is one runtime in a bench process; a test
/// process may have several at once).
static CLOCKS: Mutex<Vec<Clock>> = Mutex::new(Vec::new());

fn clocks() -> MutexGuard<'static, Vec<Clock>> {
    CLOCKS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn add(deadline: Instant, slot: Arc<Slot>) {
    let runtime = Handle::current();
    let id = runtime.id();
    let mut clocks = clocks();
    let at = match clocks.iter().position(|c| c.runtime == id) {
        Some(at) => at,
        None => {
            let fd = timerfd().unwrap_or_else(|e| panic!("the simulated I/O's timerfd: {e}"));
            clocks.push(Clock {
                runtime: id,
                heap: BinaryHeap::new(),
                timer: fd.as_raw_fd(),
                armed: None,
            });
            runtime.spawn(relay(id, fd));
            clocks.len() - 1
        }
    };
    let clock = &mut clocks[at];
    clock.heap.push(Reverse(Entry { deadline, slot }));
    clock.arm();
}

impl Clock {
    /// Arms the timer for the earliest wait, unless it is armed for it already.
    fn arm(&mut self) {
        let Some(Reverse(first)) = self.heap.peek() else {
            return;
        };
        let at = first.deadline + SLACK;
        if self.armed.is_some_and(|armed| armed <= at) {
            return;
        }
        // An all-zero value disarms a timerfd: a wait already due fires in a nanosecond.
        let left = at
            .saturating_duration_since(Instant::now())
            .max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: left.as_secs() as libc::time_t,
                tv_nsec: left.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: `timer` is the relay's open timerfd (see the field) and `spec` is a valid
        // itimerspec.
        let rc = unsafe { libc::timerfd_settime(self.timer, 0, &spec, std::ptr::null_mut()) };
        assert_eq!(rc, 0, "timerfd_settime: {}", io::Error::last_os_error());
        self.armed = Some(at);
    }

    /// Takes every wait due by `now` and arms the timer for the next.
    fn take_due(&mut self, now: Instant, due: &mut Vec<Arc<Slot>>) {
        while let Some(Reverse(e)) = self.heap.peek() {
            if e.deadline > now {
                break;
            }
            due.push(self.heap.pop().unwrap().0.slot);
        }
        self.armed = None;
        self.arm();
    }
}

fn timerfd() -> io::Result<OwnedFd> {
    // SAFETY: timerfd_create takes two integers and returns a new fd or -1.
    let fd = unsafe {
        libc::timerfd_create(
            libc::CLOCK_MONOTONIC,
            libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A runtime's relay: its timer, registered with the runtime's reactor. Dropped (the runtime
/// shut down), it removes its clock first and closes the timer after, when its field drops.
struct Relay {
    runtime: runtime::Id,
    timer: AsyncFd<OwnedFd>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        clocks().retain(|c| c.runtime != self.runtime);
    }
}

/// Ends due waits whenever the timer fires.
async fn relay(runtime: runtime::Id, fd: OwnedFd) {
    // SAFETY: the `OwnedFd` is the open timerfd and stays open, the same fd, for as long as
    // the `AsyncFd` that owns it.
    let timer = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
    let relay = Relay {
        runtime,
        timer: timer.unwrap_or_else(|e| panic!("the simulated I/O needs a runtime with I/O: {e}")),
    };
    let mut due = Vec::new();
    loop {
        let Ok(mut ready) = relay.timer.readable().await else {
            return;
        };
        let read = ready.try_io(|fd| {
            let mut expirations = [0u8; 8];
            // SAFETY: reads at most 8 bytes into an 8-byte buffer from an open fd.
            let n = unsafe { libc::read(fd.as_raw_fd(), expirations.as_mut_ptr().cast(), 8) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        });
        if read.is_err() {
            // Not fired yet (re-armed since it was readable): `try_io` cleared the readiness.
            continue;
        }
        if let Some(clock) = clocks().iter_mut().find(|c| c.runtime == runtime) {
            clock.take_due(Instant::now(), &mut due);
        }
        for slot in due.drain(..) {
            slot.done.store(true, Ordering::Release);
            slot.waker.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wait_never_ends_early() {
        let io = Duration::from_millis(3);
        let waits: Vec<_> = (0..200)
            .map(|i| {
                tokio::spawn(async move {
                    // Spread the starts so that deadlines arrive out of order and interleave.
                    tokio::task::yield_now().await;
                    let d = io + Duration::from_micros((i * 37) % 500);
                    let started = Instant::now();
                    wait(d).await;
                    (started.elapsed(), d)
                })
            })
            .collect();
        for w in waits {
            let (took, d) = w.await.unwrap();
            assert!(took >= d, "{took:?} < {d:?}");
        }
    }

    #[tokio::test]
    async fn an_earlier_wait_is_not_held_behind_a_later_one() {
        // A long wait first: the clock sleeps towards its deadline. A short one after it must
        // wake the clock, or it would end with the long one.
        let long = tokio::spawn(wait(Duration::from_secs(3_600)));
        tokio::task::yield_now().await;
        let short = tokio::time::timeout(Duration::from_secs(60), wait(Duration::from_millis(1)));
        assert!(
            short.await.is_ok(),
            "the short wait ended with the long one"
        );
        long.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_ceiling_never_passes_tasks_over_the_wait() {
        let r = ceiling(50, 5, Duration::from_millis(20)).await;
        assert!(r > 0.0 && r <= 50.0 / 0.020, "{r}");
    }

    #[test]
    fn a_runtime_after_another_has_ended_gets_its_own_relay() {
        for _ in 0..2 {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let id = runtime.block_on(async {
                let w =
                    tokio::time::timeout(Duration::from_secs(60), wait(Duration::from_millis(1)));
                assert!(
                    w.await.is_ok(),
                    "the wait was left to an ended runtime's relay"
                );
                Handle::current().id()
            });
            drop(runtime);
            assert!(
                !clocks().iter().any(|c| c.runtime == id),
                "the ended runtime's clock is gone"
            );
        }
    }

    #[test]
    fn a_wait_already_due_is_ready_without_the_clock() {
        let mut w = wait(Duration::ZERO);
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut w).poll(&mut cx).is_ready());
        assert!(w.slot.is_none());
    }
}
