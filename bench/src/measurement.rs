//! Measurement: latency histograms, the per-record order check, CPU and memory readings.
//!
//! Every system is measured by the same code, at the same point (the bench handler), so the
//! numbers differ only by what the systems do. Latencies go into a fixed-size, lock-free
//! log-linear histogram (exact below 128 µs, ≤ 1/64 relative error above), cheap enough to
//! sit on the hot path of the raw-consumer ceiling; percentiles are read from it by nearest
//! rank. Records that never completed within a run's time cap are *censored*: they count in
//! the total, so a percentile that falls among them is reported as "above the cap" rather than
//! silently computed over the lucky records only. The order check keeps one atomic word per
//! session and verifies each handler call against the session's previous one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Sub-buckets per power of two: the relative error of a bucket is at most 1/64.
const SUB: u64 = 64;
/// Enough buckets for values up to 2^45 µs (over a year).
pub const BUCKETS: usize = (SUB as usize) * 40;

/// The bucket of value `v` (µs): exact for `v < 2·SUB`, then `SUB` buckets per octave.
pub fn bucket_index(v: u64) -> usize {
    let msb = 63 - (v | 1).leading_zeros() as u64;
    let shift = msb.saturating_sub(SUB.trailing_zeros() as u64);
    let i = (SUB * shift + (v >> shift)) as usize;
    i.min(BUCKETS - 1)
}

/// Smallest value of bucket `i`, and its width.
pub fn bucket_bounds(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < 2 * SUB {
        return (i, 1);
    }
    let shift = i / SUB - 1;
    let mantissa = i - SUB * shift;
    (mantissa << shift, 1 << shift)
}

/// The value reported for bucket `i`: its midpoint (its only value when the width is 1).
pub fn bucket_value(i: usize) -> f64 {
    let (low, width) = bucket_bounds(i);
    if width == 1 {
        low as f64
    } else {
        low as f64 + width as f64 / 2.0
    }
}

/// A histogram many threads record into.
pub struct Histogram {
    counts: Vec<AtomicU64>,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl Histogram {
    pub fn record(&self, v: u64) {
        self.counts[bucket_index(v)].fetch_add(1, Ordering::Relaxed);
    }

    /// `n` more values in bucket `i` (counts measured elsewhere); an unknown bucket is ignored.
    pub fn add(&self, i: usize, n: u64) {
        if let Some(c) = self.counts.get(i) {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub fn snapshot(&self) -> Hist {
        Hist {
            buckets: self
                .counts
                .iter()
                .enumerate()
                .filter_map(|(i, c)| {
                    let n = c.load(Ordering::Relaxed);
                    (n > 0).then_some((i as u32, n))
                })
                .collect(),
        }
    }
}

/// A histogram's contents (sparse, ascending bucket order), as children report it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Hist {
    pub buckets: Vec<(u32, u64)>,
}

impl Hist {
    #[cfg(test)]
    pub fn from_values(values: &[u64]) -> Self {
        let h = Histogram::default();
        values.iter().for_each(|v| h.record(*v));
        h.snapshot()
    }

    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|(_, n)| n).sum()
    }

    /// The `q`-quantile (0 < q ≤ 1, nearest rank) in µs, with `censored` more records known
    /// to be larger than anything recorded. `None` when the rank falls among the censored ones
    /// (or there is nothing at all).
    pub fn quantile(&self, q: f64, censored: u64) -> Option<f64> {
        let total = self.count() + censored;
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for &(i, n) in &self.buckets {
            seen += n;
            if seen >= rank {
                return Some(bucket_value(i as usize));
            }
        }
        None
    }

    /// The cumulative distribution: (upper bound of each bucket in µs, fraction of `total`
    /// at or below it), where `total` includes `censored` records.
    pub fn cdf(&self, censored: u64) -> Vec<(f64, f64)> {
        let total = (self.count() + censored).max(1) as f64;
        let mut seen = 0;
        self.buckets
            .iter()
            .map(|&(i, n)| {
                seen += n;
                let (low, width) = bucket_bounds(i as usize);
                ((low + width) as f64, seen as f64 / total)
            })
            .collect()
    }
}

/// Per-session order of handler calls, checked per record.
///
/// A session's word holds the last sequence number that *finished* and whether a record is
/// inside the handler. A first attempt of `seq` is in order only if `seq - 1` finished and
/// nothing is inside; a retry only if `seq` is the record inside; a finish only if `seq` is
/// inside. Anything else is a violation (a later record overtook, or ran alongside, an
/// earlier one); the word is then set to what this call implies, so one fault counts once.
pub struct OrderCheck {
    sessions: Vec<AtomicU64>,
    violations: AtomicU64,
}

const INSIDE: u64 = 1;

impl OrderCheck {
    pub fn new(sessions: usize) -> Self {
        Self {
            sessions: (0..sessions).map(|_| AtomicU64::new(0)).collect(),
            violations: AtomicU64::new(0),
        }
    }

    /// The check's own memory: a word per session.
    pub fn bytes(&self) -> u64 {
        std::mem::size_of_val(self.sessions.as_slice()) as u64
    }

    fn word(&self, sid: u32) -> Option<&AtomicU64> {
        let w = self.sessions.get(sid as usize);
        if w.is_none() {
            self.violations.fetch_add(1, Ordering::Relaxed);
        }
        w
    }

    /// A handler call starts for `seq` (1-based) of `sid`, attempt `attempt` (1-based).
    pub fn enter(&self, sid: u32, seq: u64, attempt: u32) {
        let Some(w) = self.word(sid) else { return };
        let expected = if attempt <= 1 {
            (seq.saturating_sub(1)) << 1
        } else {
            ((seq.saturating_sub(1)) << 1) | INSIDE
        };
        let now = ((seq.saturating_sub(1)) << 1) | INSIDE;
        if w.swap(now, Ordering::AcqRel) != expected {
            self.violations.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The call for `seq` of `sid` succeeded: the record is finished.
    pub fn finish(&self, sid: u32, seq: u64) {
        let Some(w) = self.word(sid) else { return };
        let inside = ((seq.saturating_sub(1)) << 1) | INSIDE;
        if w.swap(seq << 1, Ordering::AcqRel) != inside {
            self.violations.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// The count of a check made elsewhere (a system in another process checks its own order).
    pub fn set_violations(&self, n: u64) {
        self.violations.store(n, Ordering::Relaxed);
    }

    pub fn violations(&self) -> u64 {
        self.violations.load(Ordering::Relaxed)
    }
}

/// Wall-clock microseconds since the epoch: the one clock both the producing parent and the
/// consuming child read, so a latency can span the two processes.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// CPU seconds (user + system) this process has used so far.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes into the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// CPU seconds (user + system) process `pid` has used so far, from `/proc/<pid>/stat`.
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_cpu_ticks(&stat).map(|ticks| ticks as f64 / clock_ticks_per_second())
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` line, in clock ticks.
pub fn parse_stat_cpu_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may contain spaces; fields are counted after its ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state), so field n is at index n - 3.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// This process's resident set size now and its peak so far, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rss {
    pub now: u64,
    pub peak: u64,
}

pub fn rss() -> Rss {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    parse_status_rss(&status)
}

/// Process `pid`'s resident set size now and its peak so far (zero when it is gone).
pub fn process_rss(pid: u32) -> Rss {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    parse_status_rss(&status)
}

/// `VmRSS` and `VmHWM` of a `/proc/<pid>/status` text, in bytes.
pub fn parse_status_rss(status: &str) -> Rss {
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    Rss {
        now: field("VmRSS:"),
        peak: field("VmHWM:"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_values_have_their_own_bucket() {
        for v in 0..128 {
            assert_eq!(bucket_bounds(bucket_index(v)), (v, 1));
            assert_eq!(bucket_value(bucket_index(v)), v as f64);
        }
    }

    #[test]
    fn every_value_falls_inside_its_bucket_within_one_64th() {
        let mut v = 1u64;
        while v < (1u64 << 44) {
            for x in [v, v + 1, v + v / 3, 2 * v - 1] {
                let i = bucket_index(x);
                let (low, width) = bucket_bounds(i);
                assert!(
                    low <= x && x < low + width,
                    "{x} not in [{low}, {})",
                    low + width
                );
                assert!(
                    width as f64 <= (low as f64 / 64.0).max(1.0),
                    "{x}: width {width}"
                );
            }
            v *= 2;
        }
    }

    #[test]
    fn buckets_are_contiguous_and_ascending() {
        for i in 0..BUCKETS - 1 {
            let (low, width) = bucket_bounds(i);
            assert_eq!(bucket_bounds(i + 1).0, low + width, "bucket {i}");
        }
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let h = Hist::from_values(&(1..=100).collect::<Vec<_>>());
        assert_eq!(h.count(), 100);
        assert_eq!(h.quantile(0.5, 0), Some(50.0));
        assert_eq!(h.quantile(0.99, 0), Some(99.0));
        assert_eq!(h.quantile(0.999, 0), Some(100.0));
        assert_eq!(h.quantile(1.0, 0), Some(100.0));
        assert_eq!(Hist::default().quantile(0.5, 0), None);
    }

    #[test]
    fn large_quantiles_are_within_the_bucket_error() {
        let values: Vec<u64> = (1..=10_000).map(|i| i * 1_000).collect();
        let h = Hist::from_values(&values);
        let p50 = h.quantile(0.5, 0).unwrap();
        assert!(
            (p50 - 5_000_000.0).abs() / 5_000_000.0 < 1.0 / 64.0,
            "{p50}"
        );
    }

    #[test]
    fn censored_records_push_quantiles_out_of_reach() {
        let h = Hist::from_values(&[10; 98]);
        // 98 seen, 2 never finished: p98 is known, p99 is "above the cap".
        assert_eq!(h.quantile(0.98, 2), Some(10.0));
        assert_eq!(h.quantile(0.99, 2), None);
        let cdf = h.cdf(2);
        assert_eq!(cdf, vec![(11.0, 0.98)]);
    }

    #[test]
    fn order_check_accepts_in_place_retries() {
        let o = OrderCheck::new(2);
        o.enter(0, 1, 1);
        o.enter(0, 1, 2); // retry of the record inside
        o.finish(0, 1);
        o.enter(1, 1, 1); // another session interleaves
        o.enter(0, 2, 1);
        o.finish(0, 2);
        o.finish(1, 1);
        assert_eq!(o.violations(), 0);
    }

    #[test]
    fn order_check_counts_overtaking_and_overlap() {
        let o = OrderCheck::new(1);
        o.enter(0, 2, 1); // seq 1 never ran: overtaken
        o.finish(0, 2);
        assert_eq!(o.violations(), 1);
        o.enter(0, 3, 1);
        o.enter(0, 4, 1); // 3 still inside: overlap
        assert_eq!(o.violations(), 2);
        o.finish(0, 4);
        o.enter(0, 4, 1); // again: a duplicate going backwards
        assert_eq!(o.violations(), 3);
        let unknown = OrderCheck::new(1);
        unknown.enter(5, 1, 1);
        assert_eq!(unknown.violations(), 1);
    }

    #[test]
    fn parses_proc_files() {
        let stat = "1234 (nis shi) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0";
        assert_eq!(parse_stat_cpu_ticks(stat), Some(300));
        let status = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(
            parse_status_rss(status),
            Rss {
                now: 1024 * 1024,
                peak: 2048 * 1024
            }
        );
    }
}
