//! A shutdown signal the session tasks can ask about on every record.
//!
//! tokio-util's `CancellationToken::is_cancelled` takes the token's mutex, and each session task
//! asks two of them (abort, release what is queued) before every record. A [`Signal`] is a token
//! with a flag beside it, set before the token is cancelled: asking is one atomic load, waiting
//! is the token's. Whoever has seen the flag set will find the token cancelled a moment later,
//! and whoever wakes from the token finds the flag already set.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
