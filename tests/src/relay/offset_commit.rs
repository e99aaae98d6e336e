//! One of the two requests the relay can answer itself: an `OffsetCommit`, refused with an error code
//! for every partition it names, as a coordinator refuses a commit it does not store.
//!
//! To answer, the relay reads the request far enough to know its version, its correlation id
//! and the partitions it commits, and writes the response of that version. Versions 2 … 9 are
//! read: Apache Kafka 4 serves 2 and up, librdkafka 2.12 asks for up to 9; from 8 on the
//! request is "flexible" (compact strings and arrays, tagged fields, header v2). The layout is
//! Kafka's `OffsetCommitRequest.json` and `OffsetCommitResponse.json`.

use super::wire::{array_len, finish, response, string, Reader};

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
        let (key, version, correlation_id) = r.header(|v| v >= 8)?;
        if key != super::OFFSET_COMMIT || !(2..=9).contains(&version) {
            return None;
        }
        let flexible = version >= 8;
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
        let mut w = response(self.correlation_id, flexible);
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
        finish(w)
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
}
