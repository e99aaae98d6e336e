//! The one request the relay can answer itself: an `OffsetCommit`, refused with an error code
//! for every partition it names, as a coordinator refuses a commit it does not store.
//!
//! To answer, the relay reads the request far enough to know its version, its correlation id
//! and the partitions it commits, and writes the response of that version. Versions 2 … 9 are
//! read: Apache Kafka 4 serves 2 and up, librdkafka 2.12 asks for up to 9; from 8 on the
//! request is "flexible" (compact strings and arrays, tagged fields, header v2). The layout is
//! Kafka's `OffsetCommitRequest.json` and `OffsetCommitResponse.json`.

/// What an answer needs of an `OffsetCommit` request.
#[derive(Debug, PartialEq)]
pub struct Commit {
    pub version: i16,
    pub correlation_id: i32,
    /// Each topic with the partitions committed in it, in the request's order.
    pub topics: Vec<(String, Vec<i32>)>,
}

impl Commit {
    /// Reads a whole request frame (its 4-byte length first); `None` if it is not an
    /// `OffsetCommit` of a version read here, or is cut short.
    pub fn read(frame: &[u8]) -> Option<Self> {
        let mut r = Reader(frame.get(4..)?);
        if r.i16()? != super::OFFSET_COMMIT {
            return None;
        }
        let version = r.i16()?;
        if !(2..=9).contains(&version) {
            return None;
        }
        let flexible = version >= 8;
        let correlation_id = r.i32()?;
        r.legacy_string()?; // client id: never compact, not even in header v2
        if flexible {
            r.tags()?;
        }
        r.string(flexible)?; // group id
        r.i32()?; // generation id
        r.string(flexible)?; // member id
        if version >= 7 {
            r.string(flexible)?; // group instance id
        }
        if version <= 4 {
            r.take(8)?; // retention time
        }
        let mut topics = Vec::new();
        for _ in 0..r.array_len(flexible)? {
            let name = r.string(flexible)?.unwrap_or_default();
            let mut partitions = Vec::new();
            for _ in 0..r.array_len(flexible)? {
                partitions.push(r.i32()?);
                r.take(8)?; // committed offset
                if version >= 6 {
                    r.take(4)?; // committed leader epoch
                }
                r.string(flexible)?; // committed metadata
                if flexible {
                    r.tags()?;
                }
            }
            if flexible {
                r.tags()?;
            }
            topics.push((name, partitions));
        }
        if flexible {
            r.tags()?;
        }
        Some(Self {
            version,
            correlation_id,
            topics,
        })
    }

    /// The response frame (its 4-byte length first) refusing every partition with `error_code`.
    pub fn refusal(&self, error_code: i16) -> Vec<u8> {
        let flexible = self.version >= 8;
        let mut w = vec![0; 4];
        w.extend(self.correlation_id.to_be_bytes());
        if flexible {
            w.push(0); // the header's tagged fields: none
        }
        if self.version >= 3 {
            w.extend(0i32.to_be_bytes()); // throttle time
        }
        array_len(&mut w, self.topics.len(), flexible);
        for (name, partitions) in &self.topics {
            string(&mut w, name, flexible);
            array_len(&mut w, partitions.len(), flexible);
            for partition in partitions {
                w.extend(partition.to_be_bytes());
                w.extend(error_code.to_be_bytes());
                if flexible {
                    w.push(0);
                }
            }
            if flexible {
                w.push(0);
            }
        }
        if flexible {
            w.push(0);
        }
        let size = (w.len() - 4) as i32;
        w[..4].copy_from_slice(&size.to_be_bytes());
        w
    }
}

/// An array's length: an `i32` before flexible versions, an unsigned varint of length + 1 in
/// them (the arrays written here are never null).
fn array_len(w: &mut Vec<u8>, len: usize, flexible: bool) {
    if flexible {
        uvarint(w, len as u64 + 1);
    } else {
        w.extend((len as i32).to_be_bytes());
    }
}

/// A string (never null here): an `i16` length before flexible versions, an unsigned varint of
/// length + 1 in them.
fn string(w: &mut Vec<u8>, text: &str, flexible: bool) {
    if flexible {
        uvarint(w, text.len() as u64 + 1);
    } else {
        w.extend((text.len() as i16).to_be_bytes());
    }
    w.extend(text.as_bytes());
}

fn uvarint(w: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        w.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    w.push(n as u8);
}

/// Reads Kafka's primitive types from the front of a request.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn i16(&mut self) -> Option<i16> {
        Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    fn uvarint(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.take(1)?[0];
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    /// A nullable string with an `i16` length (-1: null).
    fn legacy_string(&mut self) -> Option<Option<String>> {
        let len = self.i16()?;
        self.text(usize::try_from(len).ok())
    }

    /// A nullable string: compact (varint length + 1, 0: null) in flexible versions.
    fn string(&mut self, flexible: bool) -> Option<Option<String>> {
        if !flexible {
            return self.legacy_string();
        }
        let len = self.uvarint()?;
        self.text(len.checked_sub(1).map(|n| n as usize))
    }

    fn text(&mut self, len: Option<usize>) -> Option<Option<String>> {
        match len {
            None => Some(None),
            Some(n) => Some(Some(String::from_utf8_lossy(self.take(n)?).into_owned())),
        }
    }

    /// An array's length: compact (varint length + 1) in flexible versions; null reads as empty.
    fn array_len(&mut self, flexible: bool) -> Option<usize> {
        if flexible {
            Some(self.uvarint()?.saturating_sub(1) as usize)
        } else {
            Some(usize::try_from(self.i32()?).unwrap_or(0))
        }
    }

    /// Skips a block of tagged fields (a count, then each tag's number, size and bytes).
    fn tags(&mut self) -> Option<()> {
        for _ in 0..self.uvarint()? {
            self.uvarint()?;
            let size = self.uvarint()?;
            self.take(usize::try_from(size).ok()?)?;
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `OffsetCommit` request of `version` as librdkafka writes it: client id `rdkafka`,
    /// group `g`, topic `t` with partitions 0 and 3 (metadata on the first, null on the second),
    /// and in flexible versions one unknown tagged field on the first partition.
    fn request(version: i16) -> Vec<u8> {
        let flexible = version >= 8;
        let nullable = |w: &mut Vec<u8>, text: Option<&str>| match (text, flexible) {
            (Some(t), _) => string(w, t, flexible),
            (None, true) => w.push(0),
            (None, false) => w.extend((-1i16).to_be_bytes()),
        };
        let mut w = vec![0; 4];
        w.extend(8i16.to_be_bytes());
        w.extend(version.to_be_bytes());
        w.extend(41i32.to_be_bytes());
        w.extend(7i16.to_be_bytes());
        w.extend(b"rdkafka");
        if flexible {
            w.push(0);
        }
        string(&mut w, "g", flexible);
        w.extend(5i32.to_be_bytes());
        string(&mut w, "member-1", flexible);
        if version >= 7 {
            nullable(&mut w, None);
        }
        if version <= 4 {
            w.extend((-1i64).to_be_bytes());
        }
        array_len(&mut w, 1, flexible);
        string(&mut w, "t", flexible);
        array_len(&mut w, 2, flexible);
        for (partition, metadata) in [(0i32, Some("map")), (3, None)] {
            w.extend(partition.to_be_bytes());
            w.extend(1_000i64.to_be_bytes());
            if version >= 6 {
                w.extend((-1i32).to_be_bytes());
            }
            nullable(&mut w, metadata);
            if flexible && partition == 0 {
                w.extend([1, 9, 2, 0xab, 0xcd]); // one tag (9) of two bytes
            } else if flexible {
                w.push(0);
            }
        }
        if flexible {
            w.extend([0, 0]); // the topic's tags, the body's tags
        }
        let size = (w.len() - 4) as i32;
        w[..4].copy_from_slice(&size.to_be_bytes());
        w
    }

    #[test]
    fn every_version_read_gives_the_partitions_committed() {
        for version in 2..=9 {
            assert_eq!(
                Commit::read(&request(version)),
                Some(Commit {
                    version,
                    correlation_id: 41,
                    topics: vec![("t".to_string(), vec![0, 3])],
                }),
                "version {version}"
            );
        }
    }

    #[test]
    fn other_requests_versions_and_cut_frames_are_not_read() {
        let mut produce = request(9);
        produce[5] = 0; // API key 0
        assert_eq!(Commit::read(&produce), None);
        let mut v10 = request(9);
        v10[7] = 10;
        assert_eq!(Commit::read(&v10), None);
        let whole = request(9);
        for cut in 0..whole.len() {
            assert_eq!(Commit::read(&whole[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn a_refusal_names_every_partition_with_the_error_in_the_versions_layout() {
        let commit = Commit::read(&request(7)).unwrap();
        #[rustfmt::skip]
        let classic = [
            0, 0, 0, 31, // size
            0, 0, 0, 41, // correlation id
            0, 0, 0, 0, // throttle time
            0, 0, 0, 1, 0, 1, b't', // one topic, "t"
            0, 0, 0, 2, 0, 0, 0, 0, 0, 27, 0, 0, 0, 3, 0, 27, // partitions 0 and 3: error 27
        ];
        assert_eq!(commit.refusal(27), classic);

        let commit = Commit::read(&request(9)).unwrap();
        #[rustfmt::skip]
        let flexible = [
            0, 0, 0, 29, // size
            0, 0, 0, 41, 0, // correlation id, no header tags
            0, 0, 0, 0,
            2, 2, b't', // one topic (1 + 1), "t" (1 + 1)
            3, 0, 0, 0, 0, 0, 27, 0, 0, 0, 0, 3, 0, 27, 0, // two partitions, each with no tags
            0, 0, // the topic's tags, the body's
        ];
        assert_eq!(commit.refusal(27), flexible);
    }

    #[test]
    fn varints_past_one_byte_read_back() {
        for n in [0u64, 1, 127, 128, 300, 16_384, u32::MAX as u64] {
            let mut w = Vec::new();
            uvarint(&mut w, n);
            assert_eq!(Reader(&w).uvarint(), Some(n));
        }
    }
}
