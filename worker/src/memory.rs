//! Giving memory back after a burst of sessions.
//!
//! A burst of new sessions (a million users arriving at once) grows the heap by a few KB per
//! live session. When the burst is over and the idle sessions are reaped, the memory is free
//! again, but glibc's allocator keeps freed pages mapped, so the process's RSS stays at its
//! peak until something asks for them back — and on Kubernetes the RSS is what the memory limit
//! and the scheduler see. This watcher asks (`malloc_trim`) once the number of live sessions
//! has fallen to half of what it was at the last trim, so a steady load never trims and a large
//! reap trims a few times, not once per reaped session. Elsewhere than glibc it does nothing.

use std::time::Duration;

use prometheus::IntGauge;
use tokio_util::sync::CancellationToken;

/// How often the live-session count is looked at.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// A drop smaller than this many sessions is not worth a trim (~2 KB each).
const MIN_DROP: i64 = 1_000;

/// When to trim, from the live-session count alone.
#[derive(Debug, Default)]
pub struct TrimPolicy {
    /// Highest live-session count since the last trim.
    high: i64,
}

impl TrimPolicy {
    /// Notes the current count; true when the memory of the sessions reaped since the last trim
    /// should be given back now.
    pub fn observe(&mut self, live: i64) -> bool {
        self.high = self.high.max(live);
        let dropped = self.high - live;
        if dropped >= MIN_DROP && live <= self.high / 2 {
            self.high = live;
            true
        } else {
            false
        }
    }
}

/// Watches `live_sessions` until `stop`, trimming the heap when [`TrimPolicy`] says so.
pub async fn trim_after_reaps(live_sessions: IntGauge, stop: CancellationToken) {
    let mut policy = TrimPolicy::default();
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if policy.observe(live_sessions.get()) {
            // Walks every arena: off the async workers.
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() {
    // SAFETY: malloc_trim only hands free pages of the heap back to the kernel.
    unsafe { libc::malloc_trim(0) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_large_reap_trims_and_a_steady_load_does_not() {
        let mut p = TrimPolicy::default();
        assert!(!p.observe(300_000));
        assert!(!p.observe(290_000), "a tenth gone is not half");
        assert!(p.observe(150_000));
        assert!(!p.observe(150_000));
        assert!(p.observe(10_000));
        assert!(p.observe(0));
        assert!(!p.observe(0));
    }

    #[test]
    fn small_drops_are_not_worth_a_trim() {
        let mut p = TrimPolicy::default();
        assert!(!p.observe(900));
        assert!(!p.observe(0));
    }

    proptest! {
        /// Every trim follows a fall to at most half of the highest count since the previous
        /// trim, by at least `MIN_DROP` sessions.
        #[test]
        fn trims_follow_halvings(counts in proptest::collection::vec(0i64..1_000_000, 1..200)) {
            let mut p = TrimPolicy::default();
            let mut high = 0i64;
            for live in counts {
                high = high.max(live);
                if p.observe(live) {
                    prop_assert!(high - live >= MIN_DROP);
                    prop_assert!(live <= high / 2);
                    high = live;
                }
            }
        }
    }
}
