//! Which dispatcher (and which producer lane) a session belongs to.
//!
//! Every record of a session must reach the same dispatcher, or two session tasks could run the
//! same session at once and order would be lost. We hash the session id with a stable hash
//! (FNV-1a, identical on every platform and Rust release) and map it to one of N buckets with
//! Lamping & Veach's *jump consistent hash*: when N grows to N+1, only about 1/(N+1) of the
//! sessions move, and they all move to the new bucket. It needs no ring in memory and no
//! virtual nodes, and it is pure, so it is tested here without I/O.

use crate::record::session_id::stable_hash;

/// Jump consistent hash: maps `key` onto `0..buckets`. `buckets` must be at least 1.
pub fn jump_hash(mut key: u64, buckets: u32) -> u32 {
    assert!(buckets > 0, "jump_hash needs at least one bucket");
    let mut bucket: i64 = -1;
    let mut next: i64 = 0;
    while next < i64::from(buckets) {
        bucket = next;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        next = ((bucket + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
    }
    bucket as u32
}

/// Routes session ids onto a fixed number of buckets (dispatchers, producer lanes).
#[derive(Debug, Clone, Copy)]
pub struct SessionRouter {
    buckets: u32,
}

impl SessionRouter {
    /// A router over `buckets` buckets (at least 1).
    pub fn new(buckets: usize) -> Self {
        let buckets = u32::try_from(buckets.max(1)).unwrap_or(u32::MAX);
        Self { buckets }
    }

    pub fn buckets(&self) -> usize {
        self.buckets as usize
    }

    /// The bucket that owns `session`.
    pub fn route(&self, session: &[u8]) -> usize {
        jump_hash(stable_hash(session), self.buckets) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        assert_eq!(stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(stable_hash(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn one_bucket_takes_everything() {
        let r = SessionRouter::new(1);
        for i in 0..1000 {
            assert_eq!(r.route(format!("s{i}").as_bytes()), 0);
        }
    }

    #[test]
    fn sessions_spread_evenly() {
        let r = SessionRouter::new(8);
        let mut counts = [0usize; 8];
        for i in 0..80_000 {
            counts[r.route(format!("session-{i}").as_bytes())] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "uneven spread: {counts:?}");
        }
    }

    #[test]
    fn growing_by_one_moves_about_one_in_n_plus_one_and_only_to_the_new_bucket() {
        for n in 1..=32u32 {
            let sessions = 20_000;
            let mut moved = 0;
            for i in 0..sessions {
                let key = stable_hash(format!("conversation-{i}").as_bytes());
                let (before, after) = (jump_hash(key, n), jump_hash(key, n + 1));
                if before != after {
                    assert_eq!(after, n, "a moved session must go to the new bucket");
                    moved += 1;
                }
            }
            let expected = sessions as f64 / f64::from(n + 1);
            let ratio = f64::from(moved) / expected;
            assert!(
                (0.85..1.15).contains(&ratio),
                "n={n}: moved {moved}, expected ~{expected}"
            );
        }
    }

    proptest! {
        #[test]
        fn always_in_range_and_deterministic(key in any::<u64>(), n in 1u32..10_000) {
            let b = jump_hash(key, n);
            prop_assert!(b < n);
            prop_assert_eq!(b, jump_hash(key, n));
        }

        /// Shrinking from n to m < n keeps every session whose bucket is still below m.
        #[test]
        fn shrinking_keeps_sessions_of_surviving_buckets(key in any::<u64>(), n in 2u32..512, m in 1u32..512) {
            prop_assume!(m < n);
            let big = jump_hash(key, n);
            if big < m {
                prop_assert_eq!(jump_hash(key, m), big);
            }
        }
    }
}
