//! The completed-offset map carried in commit metadata: bounded replay after a crash.
//!
//! The contiguous watermark alone makes a restart replay everything above it, including records
//! that were finished long ago while one slow record held the watermark back. So each commit
//! also carries, in its metadata string, which offsets between the watermark and the highest
//! offset taken in are already done. On assignment the new owner decodes it and skips those
//! offsets, so what is replayed is at most what was really in flight (the idea of Confluent
//! Parallel Consumer's offset map).
//!
//! Encoding: `sf1` + `r` (run lengths) or `b` (bitset), whichever is shorter, + base64 of
//! `varint(span)` followed by the runs (alternating unfinished/done, starting with unfinished —
//! the watermark itself is unfinished by definition) or by the bitset (bit i = offset
//! watermark+i is done). Over [`MAX_METADATA`] characters the map is not sent: the commit falls
//! back to the plain watermark and the caller stops taking records for that partition until the
//! map fits again. A broker that drops commit metadata just means plain watermark behaviour.
//!
//! Pure: no Kafka types.

use base64::engine::general_purpose::STANDARD_NO_PAD;
use base64::Engine;

use crate::offsets::Offset;

/// Commit metadata larger than this is not sent (brokers cap it near 4 KB by default).
pub const MAX_METADATA: usize = 4_000;
const PREFIX: &str = "sf1";

/// Offsets at and above a committed watermark that are already done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoneAbove {
    watermark: Offset,
    /// bit i: offset watermark + i is done.
    done: Vec<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    #[error("completed-offset map would take {0} characters (cap {MAX_METADATA})")]
    TooLarge(usize),
    #[error("not a sessionflow offset map")]
    Foreign,
    #[error("corrupt offset map: {0}")]
    Corrupt(&'static str),
}

impl DoneAbove {
    /// Nothing known to be done.
    pub fn empty(watermark: Offset) -> Self {
        Self {
            watermark,
            done: Vec::new(),
        }
    }

    /// Whether `offset` is known to be done.
    pub fn is_done(&self, offset: Offset) -> bool {
        offset >= self.watermark
            && usize::try_from(offset - self.watermark)
                .ok()
                .and_then(|i| self.done.get(i).copied())
                .unwrap_or(false)
    }

    /// How many offsets are known to be done.
    pub fn count(&self) -> usize {
        self.done.iter().filter(|d| **d).count()
    }

    /// How many offsets below `end` are known to be done.
    pub fn count_below(&self, end: Offset) -> usize {
        let len = usize::try_from(end - self.watermark).unwrap_or(0);
        self.done.iter().take(len).filter(|d| **d).count()
    }
}

/// Encodes the map for a partition whose watermark is `watermark`, whose highest offset taken
/// in is `next - 1`, and whose unfinished offsets are `incomplete` (ascending, all ≥
/// `watermark`). Returns an empty string when nothing above the watermark is done.
pub fn encode(
    watermark: Offset,
    next: Offset,
    incomplete: impl IntoIterator<Item = Offset>,
) -> Result<String, MapError> {
    let span = u64::try_from(next - watermark).unwrap_or(0);
    let incomplete: Vec<u64> = incomplete
        .into_iter()
        .filter(|o| *o >= watermark && *o < next)
        .map(|o| (o - watermark) as u64)
        .collect();
    if span == 0 || incomplete.len() as u64 == span {
        return Ok(String::new());
    }
    // Run lengths, alternating unfinished / done, starting with unfinished.
    let mut runs: Vec<u64> = Vec::new();
    let mut position = 0u64;
    let mut i = 0;
    while position < span {
        let start = position;
        while i < incomplete.len() && incomplete[i] == position {
            position += 1;
            i += 1;
        }
        runs.push(position - start);
        let start = position;
        position = incomplete.get(i).copied().unwrap_or(span);
        runs.push(position - start);
    }
    let mut rle = Vec::new();
    put_varint(&mut rle, span);
    for r in &runs {
        put_varint(&mut rle, *r);
    }
    let mut bits = Vec::new();
    put_varint(&mut bits, span);
    let mut bitset = vec![0u8; span.div_ceil(8) as usize];
    let mut next_incomplete = incomplete.iter().peekable();
    for p in 0..span {
        if next_incomplete.peek() == Some(&&p) {
            next_incomplete.next();
        } else {
            bitset[(p / 8) as usize] |= 1 << (p % 8);
        }
    }
    bits.extend_from_slice(&bitset);
    let (kind, payload) = if rle.len() <= bits.len() {
        ('r', rle)
    } else {
        ('b', bits)
    };
    let text = format!("{PREFIX}{kind}{}", STANDARD_NO_PAD.encode(payload));
    if text.len() > MAX_METADATA {
        return Err(MapError::TooLarge(text.len()));
    }
    Ok(text)
}

/// Decodes commit metadata written by [`encode`] for a commit at `watermark`. Empty metadata
/// (nothing done above, or a broker that dropped it) decodes to an empty map.
pub fn decode(watermark: Offset, metadata: &str) -> Result<DoneAbove, MapError> {
    if metadata.is_empty() {
        return Ok(DoneAbove::empty(watermark));
    }
    let rest = metadata.strip_prefix(PREFIX).ok_or(MapError::Foreign)?;
    let mut chars = rest.chars();
    let kind = chars.next().ok_or(MapError::Corrupt("no kind"))?;
    let payload = STANDARD_NO_PAD
        .decode(chars.as_str())
        .map_err(|_| MapError::Corrupt("bad base64"))?;
    let mut input = payload.as_slice();
    let span = get_varint(&mut input)?;
    if span > (MAX_METADATA as u64) * 8 * 1024 {
        return Err(MapError::Corrupt("span too large"));
    }
    let mut done = vec![false; span as usize];
    match kind {
        'r' => {
            let mut position = 0u64;
            let mut is_done = false;
            while !input.is_empty() {
                let run = get_varint(&mut input)?;
                let end = position.checked_add(run).filter(|e| *e <= span);
                let end = end.ok_or(MapError::Corrupt("runs exceed span"))?;
                if is_done {
                    done[position as usize..end as usize].fill(true);
                }
                position = end;
                is_done = !is_done;
            }
            if position != span {
                return Err(MapError::Corrupt("runs do not cover span"));
            }
        }
        'b' => {
            if input.len() as u64 != span.div_ceil(8) {
                return Err(MapError::Corrupt("bitset length"));
            }
            for (p, d) in done.iter_mut().enumerate() {
                *d = input[p / 8] & (1 << (p % 8)) != 0;
            }
        }
        _ => return Err(MapError::Corrupt("unknown kind")),
    }
    Ok(DoneAbove { watermark, done })
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(input: &mut &[u8]) -> Result<u64, MapError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = input
            .split_first()
            .ok_or(MapError::Corrupt("truncated varint"))?;
        *input = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(MapError::Corrupt("varint too long"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nothing_done_above_encodes_empty() {
        assert_eq!(encode(10, 10, []).unwrap(), "");
        assert_eq!(encode(10, 13, [10, 11, 12]).unwrap(), "");
        assert_eq!(decode(10, "").unwrap().count(), 0);
    }

    #[test]
    fn round_trip_small() {
        // 100 unfinished; 101, 102 done; 103 unfinished; 104 done.
        let text = encode(100, 105, [100, 103]).unwrap();
        let map = decode(100, &text).unwrap();
        let done: Vec<i64> = (95..110).filter(|o| map.is_done(*o)).collect();
        assert_eq!(done, vec![101, 102, 104]);
    }

    #[test]
    fn long_runs_prefer_rle_and_scattered_prefer_bitset() {
        let rle = encode(0, 100_000, [0]).unwrap();
        assert!(rle.starts_with("sf1r") && rle.len() < 16, "{rle}");
        let scattered: Vec<i64> = (0..2_000).step_by(2).collect();
        let bits = encode(0, 2_000, scattered).unwrap();
        assert!(bits.starts_with("sf1b"), "{bits}");
    }

    #[test]
    fn too_large_is_refused() {
        let scattered: Vec<i64> = (0..100_000).step_by(2).collect();
        assert!(matches!(
            encode(0, 100_000, scattered),
            Err(MapError::TooLarge(_))
        ));
    }

    #[test]
    fn foreign_and_corrupt_metadata_are_errors() {
        assert_eq!(decode(0, "hello"), Err(MapError::Foreign));
        assert!(matches!(decode(0, "sf1r!!!"), Err(MapError::Corrupt(_))));
        assert!(matches!(decode(0, "sf1x"), Err(MapError::Corrupt(_))));
    }

    proptest! {
        #[test]
        fn round_trips(watermark in 0i64..1_000_000, span in 1u64..3_000, seed in any::<u64>()) {
            // The watermark itself is unfinished; others unfinished by a seeded pattern.
            let next = watermark + span as i64;
            let incomplete: Vec<i64> = (watermark..next)
                .filter(|o| *o == watermark || (crate::routing::stable_hash(&(o ^ seed as i64).to_le_bytes()) % 7 == 0))
                .collect();
            match encode(watermark, next, incomplete.iter().copied()) {
                Ok(text) => {
                    let map = decode(watermark, &text).unwrap();
                    for o in watermark - 2..next + 2 {
                        let expected = o > watermark && o < next && !incomplete.contains(&o);
                        prop_assert_eq!(map.is_done(o), expected, "offset {}", o);
                    }
                }
                Err(MapError::TooLarge(n)) => prop_assert!(n > MAX_METADATA),
                Err(e) => prop_assert!(false, "{}", e),
            }
        }
    }
}
