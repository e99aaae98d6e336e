//! The relay's third answer of its own: a `Heartbeat` refused with an error code, as a group
//! coordinator refuses one from a member it no longer knows (`UNKNOWN_MEMBER_ID`: librdkafka
//! then drops the member's partitions as *lost* and joins again) or from a group that is
//! rebalancing.
//!
//! Versions 0 … 4 are answered (flexible from 4; librdkafka 2.12 sends up to 4). The answer
//! needs only the request's header; the layout is Kafka's `HeartbeatResponse.json`: a throttle
//! time from version 1, the error code, tagged fields in flexible versions.

use super::wire::{finish, response, Reader};

/// What an answer needs of a `Heartbeat` request.
#[derive(Debug, PartialEq)]
pub struct Heartbeat {
    pub version: i16,
    pub correlation_id: i32,
}

impl Heartbeat {
    /// Reads a whole request frame (its 4-byte length first); `None` if it is not a
    /// `Heartbeat` of a version answered here, or its header is cut short.
    pub fn read(frame: &[u8]) -> Option<Self> {
        let mut r = Reader(frame.get(4..)?);
        let (key, version, correlation_id) = r.header(|v| v >= 4)?;
        (key == super::HEARTBEAT && (0..=4).contains(&version)).then_some(Self {
            version,
            correlation_id,
        })
    }

    /// The response frame (its 4-byte length first) refusing the heartbeat with `error_code`.
    pub fn refusal(&self, error_code: i16) -> Vec<u8> {
        let flexible = self.version >= 4;
        let mut w = response(self.correlation_id, flexible);
        if self.version >= 1 {
            w.extend(0i32.to_be_bytes()); // throttle time
        }
        w.extend(error_code.to_be_bytes());
        if flexible {
            w.push(0);
        }
        finish(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `Heartbeat` request of `version` as librdkafka writes it (client id `rdkafka`).
    fn request(version: i16) -> Vec<u8> {
        let mut w = vec![0; 4];
        w.extend(super::super::HEARTBEAT.to_be_bytes());
        w.extend(version.to_be_bytes());
        w.extend(77i32.to_be_bytes());
        w.extend(7i16.to_be_bytes());
        w.extend(b"rdkafka");
        if version >= 4 {
            w.push(0);
        }
        w.extend([0, 1, b'g', 0, 0, 0, 3, 0, 1, b'm']); // group, generation, member
        finish(w)
    }

    #[test]
    fn every_version_answered_is_read() {
        for version in 0..=4 {
            assert_eq!(
                Heartbeat::read(&request(version)),
                Some(Heartbeat {
                    version,
                    correlation_id: 77
                }),
                "version {version}"
            );
        }
        assert_eq!(Heartbeat::read(&request(5)), None);
        let mut commit = request(3);
        commit[5] = 8; // API key 8
        assert_eq!(Heartbeat::read(&commit), None);
    }

    #[test]
    fn a_refusal_has_the_versions_layout() {
        let refusal = |version| Heartbeat::read(&request(version)).unwrap().refusal(25);
        assert_eq!(refusal(0), [0, 0, 0, 6, 0, 0, 0, 77, 0, 25]);
        assert_eq!(refusal(3), [0, 0, 0, 10, 0, 0, 0, 77, 0, 0, 0, 0, 0, 25]);
        assert_eq!(
            refusal(4),
            [0, 0, 0, 12, 0, 0, 0, 77, 0, 0, 0, 0, 0, 0, 25, 0]
        );
    }
}
