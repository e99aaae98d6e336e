//! Which dispatcher a session belongs to.
//!
//! Every record of a session must reach the same dispatcher, or two session tasks could run the
//! same session at once and order would be lost. The record's session hash (taken once, at
//! intake: `record::session_id::session_hash`) is mapped onto the N dispatchers by a multiply
//! and a shift (Lemire's *fast range*) of its low 32 bits: the same hash always lands in the
//! same bucket, and a uniform hash spreads evenly. Not of its high bits: the dispatcher's map
//! finds the session by the same hash, and hashbrown tags each entry with the hash's top 7 bits.
//! Routed by those, a dispatcher's sessions would share their top bits (three of them with 8
//! dispatchers), and a lookup would compare ids of more entries whose tags match by chance.
//!
//! N is fixed for a process's life (the stage's `dispatchers`), so nothing here needs a consistent hash's small movement when N changes; the jump consistent
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
        let buckets = u32::try_from(buckets.max(1)).unwrap_or(u32::MAX);
        Self {
            buckets: u64::from(buckets),
        }
    }

    pub fn buckets(&self) -> usize {
        self.buckets as usize
    }

    /// The bucket that owns the session of hash `session_hash`: the place of its low 32 bits
    /// in `0..2^32`, scaled to `0..buckets`.
    pub fn route(&self, session_hash: u64) -> usize {
        ((u64::from(session_hash as u32) * self.buckets) >> 32) as usize
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
    fn the_buckets_are_the_ranges_of_the_low_half_in_order() {
        let r = SessionRouter::new(4);
        let quarter = 1u64 << 30;
        for (low, bucket) in [
            (0, 0),
            (quarter - 1, 0),
            (quarter, 1),
            (2 * quarter, 2),
            (3 * quarter - 1, 2),
            (3 * quarter, 3),
            (u64::from(u32::MAX), 3),
        ] {
            for high in [0, 0xdead_beef, u64::from(u32::MAX)] {
                let hash = high << 32 | low;
                assert_eq!(r.route(hash), bucket, "hash {hash:#x}");
            }
        }
    }

    /// The sessions of one dispatcher still differ in the hash's top 7 bits, which its map
    /// (hashbrown) keeps as each entry's tag: each of the 128 tags is about equally common.
    #[test]
    fn a_dispatchers_sessions_keep_every_tag() {
        let r = SessionRouter::new(8);
        let mut tags = [0usize; 128];
        let mut mine = 0;
        for i in 0..400_000 {
            let hash = session_hash(format!("conversation-{i}").as_bytes());
            if r.route(hash) == 0 {
                tags[(hash >> 57) as usize] += 1;
                mine += 1;
            }
        }
        let even = mine / 128;
        for (tag, n) in tags.iter().enumerate() {
            assert!(
                (even * 8 / 10..even * 12 / 10).contains(n),
                "tag {tag}: {n} of {mine} sessions (even: {even})"
            );
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
