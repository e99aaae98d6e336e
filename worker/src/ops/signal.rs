//! Signals between the engine's threads: the shutdown signal the session tasks ask about on
//! every record, and the doorbell the consumer loop sleeps on.
//!
//! tokio-util's `CancellationToken::is_cancelled` takes the token's mutex, and each session task
//! asks two of them (abort, release what is queued) before every record. A [`Signal`] is a token
//! with a flag beside it, set before the token is cancelled: asking is one atomic load, waiting
//! is the token's. Whoever has seen the flag set will find the token cancelled a moment later,
//! and whoever wakes from the token finds the flag already set.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

#[derive(Clone, Default)]
pub struct Signal {
    raised: Arc<AtomicBool>,
    token: CancellationToken,
}

impl Signal {
    pub fn cancel(&self) {
        self.raised.store(true, Ordering::Release);
        self.token.cancel();
    }

    pub fn is_cancelled(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    /// Completes once the signal is cancelled.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.token.cancelled()
    }
}

/// What the consumer loop waits on when it took nothing: rung (from librdkafka's threads) when a
/// partition queue gets records while empty, and by the commit thread when a commit is
/// answered, since a partition held at its in-flight cap may take records again only then.
#[derive(Debug, Default)]
pub struct Doorbell {
    rung: Mutex<bool>,
    ring: Condvar,
}

impl Doorbell {
    pub fn ring(&self) {
        *self.rung.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.ring.notify_one();
    }

    /// Waits until rung (since the last wait) or `timeout`; true when rung.
    pub fn wait(&self, timeout: Duration) -> bool {
        let rung = self.rung.lock().unwrap_or_else(|p| p.into_inner());
        let (mut rung, _) = self
            .ring
            .wait_timeout_while(rung, timeout, |rung| !*rung)
            .unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *rung)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_cancel_is_seen_by_asking_and_by_waiting_on_every_clone() {
        let signal = Signal::default();
        let clone = signal.clone();
        assert!(!clone.is_cancelled());
        let waiting = tokio::spawn(async move {
            clone.cancelled().await;
            clone.is_cancelled()
        });
        tokio::task::yield_now().await;
        signal.cancel();
        assert!(signal.is_cancelled());
        assert!(
            waiting.await.unwrap(),
            "the flag is set before the token wakes anyone"
        );
    }
}
