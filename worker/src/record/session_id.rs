//! A session's id as the dispatchers' maps hold it: the bytes themselves when they are short.
//!
//! Every session a dispatcher knows is a map entry keyed by its id, and the id must be a copy
//! (the record's id is a view of the record's whole buffer, which the map would otherwise keep
//! alive). A burst of a million sessions is a million keys; as an `Arc<[u8]>` each was one small
//! allocation (32 bytes for a 15-byte id), and the allocator keeps books on every slab it ever
//! had, for good (BENCHMARKS.md, *Sessions hibernate*). Most ids are short (a user or conversation
//! number), so an id of up to [`INLINE`] bytes is held in the key itself, in the map's own
//! table; a longer one (a UUID's 36 characters) is shared behind an `Arc`, so a copy of the key
//! (the dispatcher lists the sessions it tends) never allocates.
//!
//! It compares as its bytes, so the map is looked up with the record's `&[u8]`.
//!
//! A record's id is hashed once, as it is taken in ([`session_hash`]): that one hash routes the
//! record to its dispatcher and finds its session in the dispatcher's map. The hash is seeded
//! at random once per process, so ids chosen to collide cannot be prepared in advance (as a
//! map seeded per instance guards against), and it means nothing outside the process.

use std::sync::Arc;

/// The longest id held inline: the key is then 24 bytes, an `Arc<[u8]>` and a tag.
pub const INLINE: usize = 22;

#[derive(Clone)]
pub enum SessionId {
    Inline { len: u8, bytes: [u8; INLINE] },
    Shared(Arc<[u8]>),
}

impl SessionId {
    pub fn new(id: &[u8]) -> Self {
        if id.len() <= INLINE {
            let mut bytes = [0; INLINE];
            bytes[..id.len()].copy_from_slice(id);
            Self::Inline {
                len: id.len() as u8,
                bytes,
            }
        } else {
            Self::Shared(id.into())
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..*len as usize],
            Self::Shared(id) => id,
        }
    }
}

impl PartialEq for SessionId {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for SessionId {}

impl std::fmt::Debug for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(self.as_bytes()))
    }
}

/// The hash of a session id within this process (see the module doc): foldhash, seeded at
/// random at the first call.
pub fn session_hash(id: &[u8]) -> u64 {
    static STATE: std::sync::LazyLock<foldhash::fast::RandomState> =
        std::sync::LazyLock::new(Default::default);
    std::hash::BuildHasher::hash_one(&*STATE, id)
}

/// FNV-1a, 64 bit: a stable, fast hash for short keys, the same on every platform.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET_BASIS, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_key_is_24_bytes_and_a_short_id_allocates_nothing() {
        assert_eq!(std::mem::size_of::<SessionId>(), 24);
        assert!(matches!(
            SessionId::new(b"session-0000001"),
            SessionId::Inline { .. }
        ));
        assert!(matches!(
            SessionId::new(&[7; INLINE]),
            SessionId::Inline { .. }
        ));
        assert!(matches!(
            SessionId::new(&[7; INLINE + 1]),
            SessionId::Shared(_)
        ));
    }

    proptest! {
        /// Any id, short or long: its bytes come back, and a table of ids found by their
        /// hashes (as a dispatcher's) finds it by its bytes and tells it from every other id.
        #[test]
        fn an_id_is_its_bytes(ids in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 0..40), 1..50)
        ) {
            let rehash = |(k, _): &(SessionId, usize)| session_hash(k.as_bytes());
            let find = |table: &hashbrown::HashTable<(SessionId, usize)>, id: &[u8]| {
                table.find(session_hash(id), |(k, _)| k.as_bytes() == id).map(|(_, i)| *i)
            };
            let mut table = hashbrown::HashTable::new();
            for (i, id) in ids.iter().enumerate() {
                let key = SessionId::new(id);
                prop_assert_eq!(key.as_bytes(), &id[..]);
                prop_assert!(key.clone() == key);
                if find(&table, id).is_none() {
                    table.insert_unique(session_hash(id), (key, i), rehash);
                }
            }
            for id in &ids {
                let first = ids.iter().position(|other| other == id).unwrap();
                prop_assert_eq!(find(&table, id), Some(first));
            }
            prop_assert_eq!(find(&table, b"not an id of the test: longer than forty bytes"), None);
        }
    }
}
