//! The membership fence judged on a thread of its own.
//!
//! The consumer loop judges the fence every turn, but it blocks in places (a revocation's drain,
//! an assignment's `committed_offsets`): this timer keeps judging it meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::intake::rebalance::IntakeContext;

/// How often the membership fence is judged on its own thread.
const FENCE_TICK: Duration = Duration::from_millis(100);

/// The membership fence judged on a timer of its own. The consumer loop judges it every
/// turn, but its thread blocks for seconds at a time in a revocation's drain and final commit,
/// in `committed_offsets` of an assignment and in metadata requests; during a cooperative
/// rebalance the partitions it still holds keep writing meanwhile, and a coordinator silent
/// past two thirds of the session timeout must close the gate then too.
pub(super) struct FenceTimer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FenceTimer {
    pub(super) fn start(consumer: Arc<BaseConsumer<IntakeContext>>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("membership-fence".into())
            .spawn(move || {
                while !stopped.load(Ordering::Acquire) {
                    consumer.context().judge_membership();
                    std::thread::sleep(FENCE_TICK);
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for FenceTimer {
    /// Ends the thread (and its hold on the consumer) before the consumer is closed.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
