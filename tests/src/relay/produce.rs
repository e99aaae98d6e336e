//! The relay's other answer of its own: a `Produce` request refused with an error code for
//! every partition it writes, as a leader refuses a batch it does not store (not enough
//! replicas, a request timed out, a batch too large, a topic the client may not write).
//!
//! Read and answered in versions 3 … 10: Apache Kafka 4 serves 3 and up, librdkafka 2.12
//! writes up to 10 (one topic and one partition a request); from 9 on the request is flexible.
//! The layout is Kafka's `ProduceRequest.json` and `ProduceResponse.json`; a refused partition
//! answers base offset, append time and log start offset -1, no record errors, no message.

use super::wire::{array_len, finish, null_string, response, string, Reader};

/// What an answer needs of a `Produce` request.
#[derive(Debug, PartialEq)]
pub struct Produce {
    pub version: i16,
    pub correlation_id: i32,
    /// Each topic with the partitions written in it, in the request's order.
    pub topics: Vec<(String, Vec<i32>)>,
}

impl Produce {
    /// Reads a whole request frame (its 4-byte length first); `None` if it is not a `Produce`
    /// of a version read here, or is cut short.
    pub fn read(frame: &[u8]) -> Option<Self> {
        let mut r = Reader(frame.get(4..)?);
        let (key, version, correlation_id) = r.header(|v| v >= 9)?;
        if key != super::PRODUCE || !(3..=10).contains(&version) {
            return None;
        }
        let flexible = version >= 9;
        r.string(flexible)?; // transactional id
        r.take(2 + 4)?; // acks, timeout
        let mut topics = Vec::new();
        for _ in 0..r.array_len(flexible)? {
            let name = r.string(flexible)?.unwrap_or_default();
            let mut partitions = Vec::new();
            for _ in 0..r.array_len(flexible)? {
                partitions.push(r.i32()?);
                r.skip_bytes(flexible)?; // the records
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

    /// Whether the request writes to `topic`.
    pub fn writes(&self, topic: &str) -> bool {
        self.topics.iter().any(|(name, _)| name == topic)
    }

    /// The response frame (its 4-byte length first) refusing every partition with `error_code`.
    pub fn refusal(&self, error_code: i16) -> Vec<u8> {
        let flexible = self.version >= 9;
        let mut w = response(self.correlation_id, flexible);
        array_len(&mut w, self.topics.len(), flexible);
        for (name, partitions) in &self.topics {
            string(&mut w, name, flexible);
            array_len(&mut w, partitions.len(), flexible);
            for partition in partitions {
                w.extend(partition.to_be_bytes());
                w.extend(error_code.to_be_bytes());
                w.extend((-1i64).to_be_bytes()); // base offset
                w.extend((-1i64).to_be_bytes()); // log append time
                if self.version >= 5 {
                    w.extend((-1i64).to_be_bytes()); // log start offset
                }
                if self.version >= 8 {
                    array_len(&mut w, 0, flexible); // record errors
                    null_string(&mut w, flexible); // error message
                }
                if flexible {
                    w.push(0);
                }
            }
            if flexible {
                w.push(0);
            }
        }
        w.extend(0i32.to_be_bytes()); // throttle time
        if flexible {
            w.push(0);
        }
        finish(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `Produce` request of `version` as librdkafka writes it: no transactional id, acks -1,
    /// topic `out`, partition 2 with a 5-byte stand-in for a record batch.
    fn request(version: i16) -> Vec<u8> {
        let flexible = version >= 9;
        let mut w = vec![0; 4];
        w.extend(0i16.to_be_bytes());
        w.extend(version.to_be_bytes());
        w.extend(7i32.to_be_bytes());
        w.extend(7i16.to_be_bytes());
        w.extend(b"rdkafka");
        if flexible {
            w.push(0);
        }
        null_string(&mut w, flexible);
        w.extend((-1i16).to_be_bytes());
        w.extend(30_000i32.to_be_bytes());
        array_len(&mut w, 1, flexible);
        string(&mut w, "out", flexible);
        array_len(&mut w, 1, flexible);
        w.extend(2i32.to_be_bytes());
        if flexible {
            w.push(6); // 5 bytes + 1
        } else {
            w.extend(5i32.to_be_bytes());
        }
        w.extend([1, 2, 3, 4, 5]);
        if flexible {
            w.extend([0, 0, 0]); // the partition's, the topic's and the body's tags
        }
        finish(w)
    }

    #[test]
    fn every_version_read_gives_the_partitions_written() {
        for version in 3..=10 {
            let produce = Produce::read(&request(version));
            assert_eq!(
                produce,
                Some(Produce {
                    version,
                    correlation_id: 7,
                    topics: vec![("out".to_string(), vec![2])],
                }),
                "version {version}"
            );
            assert!(produce.as_ref().is_some_and(|p| p.writes("out")));
            assert!(produce.is_some_and(|p| !p.writes("dlq")));
        }
    }

    #[test]
    fn other_requests_versions_and_cut_frames_are_not_read() {
        let mut fetch = request(10);
        fetch[5] = 1;
        assert_eq!(Produce::read(&fetch), None);
        let mut v11 = request(10);
        v11[7] = 11;
        assert_eq!(Produce::read(&v11), None);
        let whole = request(10);
        for cut in 0..whole.len() {
            assert_eq!(Produce::read(&whole[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn a_refusal_names_every_partition_with_the_error_in_the_versions_layout() {
        let produce = Produce::read(&request(7)).unwrap();
        let mut classic = vec![0, 0, 0, 7]; // correlation id
        classic.extend([0, 0, 0, 1, 0, 3, b'o', b'u', b't']); // one topic, "out"
        classic.extend([0, 0, 0, 1, 0, 0, 0, 2, 0, 19]); // partition 2: error 19
        classic.extend([0xff; 24]); // base offset, append time, log start offset: -1
        classic.extend([0, 0, 0, 0]); // throttle time
        assert_eq!(produce.refusal(19)[4..], classic[..]);
        assert_eq!(
            produce.refusal(19)[..4],
            (classic.len() as i32).to_be_bytes()
        );

        let produce = Produce::read(&request(10)).unwrap();
        let mut flexible = vec![0, 0, 0, 7, 0]; // correlation id, no header tags
        flexible.extend([2, 4, b'o', b'u', b't']); // one topic (1 + 1), "out" (3 + 1)
        flexible.extend([2, 0, 0, 0, 2, 0, 19]); // one partition, 2: error 19
        flexible.extend([0xff; 24]);
        flexible.extend([1, 0, 0]); // no record errors, no message, no tags
        flexible.extend([0, 0, 0, 0, 0, 0]); // the topic's tags, throttle time, the body's tags
        assert_eq!(produce.refusal(19)[4..], flexible[..]);
    }
}
