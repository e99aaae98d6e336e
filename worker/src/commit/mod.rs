//! The commit path: which offsets are safe to commit, and committing them.
//!
//! Sessions finish out of order, so a partition's commit point is the contiguous watermark of
//! finished records ([`offsets`], with the leader epoch each offset was read at:
//! [`leader_epochs`]); the finished records above it travel as the completed-offset map in the
//! commit metadata ([`offset_map`]). Finished records come back to the consumer loop over
//! [`completion`]; the commits run on a thread of their own, each one answered ([`committer`]).
//! [`lag`] reads the same commits back from the broker: the lag the operator scales on.
//! [`exactly_once`] holds the pure decisions of the exactly-once design (docs/exactly-once.md):
//! the transactional id, the span within which every map fits, the transaction's timeouts.

pub mod committer;
pub mod completion;
pub mod exactly_once;
pub mod lag;
pub mod leader_epochs;
pub mod offset_map;
pub mod offsets;
