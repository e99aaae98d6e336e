//! Which dispatcher a session belongs to.
//!
//! Every record of a session must reach the same dispatcher, or two session tasks could run the
//! same session at once and order would be lost. The record's session hash (taken once, at
//! intake: `record::session_id::session_hash`) is mapped onto the N dispatchers by a multiply
//! and a shift (Lemire's *fast range*): the same hash always lands in the same bucket, and a
//! uniform hash spreads evenly. N is fixed for a process's life (the stage's `dispatchers`), so
//! nothing here needs a consistent hash's small movement when N changes; the jump consistent
//! hash this replaced cost a few dependent float divisions per record (BENCHMARKS.md, *One hash
//! per record*). It is pure, so it is tested here without I/O.

/// Routes session hashes onto a fixed number of buckets (the dispatchers).
#[derive(Debug, Clone, Copy)]
pub struct SessionRouter {
    buckets: u64,
}

impl SessionRouter {
    /// A router over `buckets` buckets (at least 1).
    pub fn new(buckets: usize) -> Self {
        Self {
            buckets: buckets.max(1) as u64,
        }
    }

    pub fn buckets(&self) -> usize {
        self.buckets as usize
    }

    /// The bucket that owns the session of hash `session_hash`: the hash's place in
    /// `0..2^64`, scaled to `0..buckets`.
    pub fn route(&self, session_hash: u64) -> usize {
        ((u128::from(session_hash) * u128::from(self.buckets)) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::session_id::session_hash;
    use proptest::prelude::*;

    #[test]
    fn one_bucket_takes_everything() {
        let r = SessionRouter::new(1);
        for i in 0..1000 {
            assert_eq!(r.route(session_hash(format!("s{i}").as_bytes())), 0);
        }
        assert_eq!(SessionRouter::new(0).buckets(), 1, "at least one bucket");
    }

    #[test]
    fn sessions_spread_evenly() {
        for n in [2usize, 3, 8, 13] {
            let r = SessionRouter::new(n);
            let mut counts = vec![0usize; n];
            let sessions = 10_000 * n;
            for i in 0..sessions {
                counts[r.route(session_hash(format!("session-{i}").as_bytes()))] += 1;
            }
            for c in &counts {
                assert!(
                    (9_000..11_000).contains(c),
                    "n={n}: uneven spread: {counts:?}"
                );
            }
        }
    }

    #[test]
    fn the_buckets_are_the_hash_ranges_in_order() {
        let r = SessionRouter::new(4);
        let quarter = 1u64 << 62;
        for (hash, bucket) in [
            (0, 0),
            (quarter - 1, 0),
            (quarter, 1),
            (2 * quarter, 2),
            (3 * quarter - 1, 2),
            (3 * quarter, 3),
            (u64::MAX, 3),
        ] {
            assert_eq!(r.route(hash), bucket, "hash {hash:#x}");
        }
    }

    proptest! {
        /// Every record of a session, however many, goes to one bucket in range.
        #[test]
        fn a_session_always_lands_in_one_bucket_in_range(id in proptest::collection::vec(any::<u8>(), 1..64), n in 1usize..10_000) {
            let r = SessionRouter::new(n);
            let b = r.route(session_hash(&id));
            prop_assert!(b < n);
            prop_assert_eq!(b, r.route(session_hash(&id.clone())));
        }
    }
}
