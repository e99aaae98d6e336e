//! A histogram's observations gathered by one task and handed to it in batches.
//!
//! Every record's handler time goes to `handler_duration_seconds`. An observation of a shared
//! Prometheus histogram is four atomic read-modify-writes on cache lines every runtime worker
//! writes (its count, its shard, the bucket, the sum), so the lines move between cores on
//! nearly every record: ~2% of the engine's CPU in P1 (BENCHMARKS.md, *One hash per record*).
//! A session task working through its queue observes here instead: the first observation of a
//! run goes to the histogram at once (a session with one record pays nothing extra), the rest are
//! counted in a [`LocalHistogram`] of the task's own and added together: at the [`BATCH`]th, at
//! the first observation [`HELD_AT_MOST`] after the oldest held one, when the task is about to
//! wait ([`Batched::waiting`]: a handler not done at its first poll, a retry's backoff, a write
//! awaiting the broker), and when the run ends (a `LocalHistogram` adds what it holds when it is
//! dropped). So a time is held only while its task keeps working without a pause, and a scrape
//! sees it that much later, never lost. A stage whose every record waits (an output awaiting its
//! acknowledgement) observes straight into the histogram, as before this module.

use std::time::{Duration, Instant};

use prometheus::local::LocalHistogram;
use prometheus::Histogram;

/// Observations held before they are added to the histogram.
pub const BATCH: u32 = 32;
/// How long an observation is held while its task works without a pause (checked at the next).
pub const HELD_AT_MOST: Duration = Duration::from_secs(1);

/// One run's observations of a histogram (the same one at every call).
#[derive(Default)]
pub struct Batched {
    /// Made at the run's second observation (it holds the histogram).
    local: Option<LocalHistogram>,
    /// Observations in `local` not yet added, and when the first of them was made.
    held: u32,
    since: Option<Instant>,
    observed: bool,
}

impl Batched {
    /// Observes `value` of `histogram`, made at `now`.
    pub fn observe(&mut self, histogram: &Histogram, value: f64, now: Instant) {
        if !self.observed {
            self.observed = true;
            histogram.observe(value);
            return;
        }
        let local = self.local.get_or_insert_with(|| histogram.local());
        local.observe(value);
        self.held += 1;
        let since = *self.since.get_or_insert(now);
        if self.held >= BATCH || now.saturating_duration_since(since) >= HELD_AT_MOST {
            self.flush();
        }
    }

    /// The task is about to wait: adds what is held, and the next observation goes to the
    /// histogram at once, as a run's first does (so a run that waits at every record holds
    /// nothing back, and pays nothing for the batch).
    pub fn waiting(&mut self) {
        self.flush();
        self.observed = false;
    }

    /// Adds what is held to the histogram.
    pub fn flush(&mut self) {
        if let Some(local) = self.local.as_ref().filter(|_| self.held > 0) {
            local.flush();
            self.held = 0;
            self.since = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::HistogramOpts;

    fn histogram() -> Histogram {
        Histogram::with_opts(HistogramOpts::new("h", "h").buckets(vec![0.001, 0.01, 1.0])).unwrap()
    }

    #[test]
    fn the_first_observation_is_seen_at_once_and_the_rest_by_the_batch() {
        let h = histogram();
        let now = Instant::now();
        let mut b = Batched::default();
        b.observe(&h, 0.0005, now);
        assert_eq!(
            h.get_sample_count(),
            1,
            "a run's first observation is not held"
        );
        for _ in 0..BATCH - 1 {
            b.observe(&h, 0.005, now);
        }
        assert_eq!(h.get_sample_count(), 1, "held until the batch is full");
        b.observe(&h, 0.005, now);
        assert_eq!(h.get_sample_count(), 1 + u64::from(BATCH));
        assert!((h.get_sample_sum() - (0.0005 + 0.005 * f64::from(BATCH))).abs() < 1e-9);
    }

    #[test]
    fn an_observation_is_held_at_most_a_while() {
        let h = histogram();
        let start = Instant::now();
        let mut b = Batched::default();
        b.observe(&h, 0.5, start);
        b.observe(&h, 0.5, start);
        assert_eq!(h.get_sample_count(), 1);
        b.observe(&h, 0.5, start + HELD_AT_MOST / 2);
        assert_eq!(h.get_sample_count(), 1);
        b.observe(&h, 0.5, start + HELD_AT_MOST);
        assert_eq!(
            h.get_sample_count(),
            4,
            "the oldest held one is a second old: all added"
        );
        b.observe(&h, 0.5, start + HELD_AT_MOST);
        assert_eq!(h.get_sample_count(), 4, "held again, from the next one on");
    }

    #[test]
    fn a_task_about_to_wait_adds_what_it_holds_and_its_next_observation_is_seen_at_once() {
        let h = histogram();
        let now = Instant::now();
        let mut b = Batched::default();
        for _ in 0..3 {
            b.observe(&h, 0.005, now);
        }
        assert_eq!(h.get_sample_count(), 1, "two held");
        b.waiting();
        assert_eq!(
            h.get_sample_count(),
            3,
            "what was held is added before the wait"
        );
        b.observe(&h, 0.5, now);
        assert_eq!(
            h.get_sample_count(),
            4,
            "after a wait, as a run's first: not held"
        );
        b.observe(&h, 0.5, now);
        assert_eq!(h.get_sample_count(), 4, "then held again");
        b.waiting();
        b.waiting();
        assert_eq!(
            h.get_sample_count(),
            5,
            "a wait with nothing held adds nothing"
        );
    }

    #[test]
    fn nothing_held_is_lost_when_the_run_ends() {
        let h = histogram();
        let now = Instant::now();
        {
            let mut b = Batched::default();
            for v in [0.0005, 0.005, 0.5, 0.5] {
                b.observe(&h, v, now);
            }
        }
        assert_eq!(h.get_sample_count(), 4);
        let families = prometheus::core::Collector::collect(&h);
        let buckets: Vec<u64> = families[0].get_metric()[0]
            .get_histogram()
            .get_bucket()
            .iter()
            .map(|b| b.cumulative_count())
            .collect();
        assert_eq!(buckets, vec![1, 2, 4], "each value in its bucket");
    }
}
