//! The relay's answer of its own to an `OffsetFetch`: refused with an error code for the whole
//! group, as a coordinator that cannot serve the group's offsets right now refuses it
//! (`REQUEST_TIMED_OUT`, `COORDINATOR_LOAD_IN_PROGRESS`: librdkafka asks again).
//!
//! Versions 8 and 9 are answered: librdkafka 2.12 asks for up to 9, and Apache Kafka 4 serves 9
//! (older versions are never negotiated between the two). Both are flexible and carry a list of
//! groups (librdkafka sends one); the layout is Kafka's `OffsetFetchRequest.json` and
//! `OffsetFetchResponse.json`. A refusal names each group with the error and no topics.

use super::wire::{array_len, finish, response, string, Reader};

/// What an answer needs of an `OffsetFetch` request.
#[derive(Debug, PartialEq)]
pub struct Fetch {
    pub correlation_id: i32,
    /// The groups whose offsets are asked for, in the request's order.
    pub groups: Vec<String>,
}

impl Fetch {
    /// Reads a whole request frame (its 4-byte length first); `None` if it is not an
    /// `OffsetFetch` of a version answered here, or is cut short.
    pub fn read(frame: &[u8]) -> Option<Self> {
        let mut r = Reader(frame.get(4..)?);
        let (key, version, correlation_id) = r.header(|v| v >= 6)?;
        if key != super::OFFSET_FETCH || !(8..=9).contains(&version) {
            return None;
        }
        let mut groups = Vec::new();
        for _ in 0..r.array_len(true)? {
            groups.push(r.string(true)?.unwrap_or_default());
            if version >= 9 {
                r.string(true)?; // member id
                r.i32()?; // member epoch
            }
            for _ in 0..r.array_len(true)? {
                r.string(true)?; // topic
                for _ in 0..r.array_len(true)? {
                    r.i32()?; // partition
                }
                r.tags()?;
            }
            r.tags()?;
        }
        r.take(1)?; // require stable
        r.tags()?;
        Some(Self {
            correlation_id,
            groups,
        })
    }

    /// The response frame (its 4-byte length first) refusing every group with `error_code`.
    pub fn refusal(&self, error_code: i16) -> Vec<u8> {
        let mut w = response(self.correlation_id, true);
        w.extend(0i32.to_be_bytes()); // throttle time
        array_len(&mut w, self.groups.len(), true);
        for group in &self.groups {
            string(&mut w, group, true);
            array_len(&mut w, 0, true); // no topics
            w.extend(error_code.to_be_bytes());
            w.push(0); // tags
        }
        w.push(0); // tags
        finish(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::wire::uvarint;

    /// An `OffsetFetch` request of `version` as librdkafka writes it: client id `rdkafka`, one
    /// group `g` (member `m`, epoch 3 in v9) asking for partitions 0 and 2 of topic `t`.
    fn request(version: i16) -> Vec<u8> {
        let mut w = vec![0; 4];
        w.extend(super::super::OFFSET_FETCH.to_be_bytes());
        w.extend(version.to_be_bytes());
        w.extend(55i32.to_be_bytes());
        w.extend(7i16.to_be_bytes());
        w.extend(b"rdkafka");
        w.push(0); // header tags
        array_len(&mut w, 1, true);
        string(&mut w, "g", true);
        if version >= 9 {
            string(&mut w, "m", true);
            w.extend(3i32.to_be_bytes());
        }
        array_len(&mut w, 1, true);
        string(&mut w, "t", true);
        array_len(&mut w, 2, true);
        w.extend(0i32.to_be_bytes());
        w.extend(2i32.to_be_bytes());
        w.push(0); // topic tags
        uvarint(&mut w, 0); // group tags
        w.push(1); // require stable
        w.push(0); // tags
        finish(w)
    }

    #[test]
    fn versions_8_and_9_are_read_and_others_are_not() {
        for version in [8, 9] {
            assert_eq!(
                Fetch::read(&request(version)),
                Some(Fetch {
                    correlation_id: 55,
                    groups: vec!["g".to_string()],
                }),
                "version {version}"
            );
        }
        let mut v7 = request(8);
        v7[7] = 7;
        assert_eq!(Fetch::read(&v7), None);
        let whole = request(9);
        for cut in 0..whole.len() {
            assert_eq!(Fetch::read(&whole[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn a_refusal_names_the_group_with_the_error() {
        let fetch = Fetch::read(&request(9)).unwrap();
        #[rustfmt::skip]
        let expected = [
            0, 0, 0, 17, // size
            0, 0, 0, 55, 0, // correlation id, header tags
            0, 0, 0, 0, // throttle time
            2, 2, b'g', 1, 0, 7, 0, // one group "g", no topics, error 7, tags
            0, // tags
        ];
        assert_eq!(fetch.refusal(7), expected);
    }
}
