//! How finished records find their way back to the consumer loop.
//!
//! The offset tracker has a single owner, the consumer loop, so nothing else locks it. Session
//! tasks and producer acknowledgements report "this offset is done" over an unbounded channel
//! instead; the channel is bounded in practice by the records in flight, which the consumer
//! loop itself caps per partition.

use std::sync::mpsc;

use crate::commit::offsets::{Offset, Partition};
use crate::record::InputRecord;

/// A record is done: processed and its output acknowledged, or written to the DLQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub partition: Partition,
    pub offset: Offset,
    /// The assignment the record was taken under; completions of an older assignment of the
    /// same partition are ignored.
    pub epoch: u64,
    /// True when the record is done; false when it is released unprocessed (its partition was
    /// revoked, or shutdown aborted it): it stops counting as running but stays uncommitted.
    pub done: bool,
}

impl Completion {
    pub fn done(record: &InputRecord) -> Self {
        Self {
            partition: record.partition,
            offset: record.offset,
            epoch: record.lease.epoch,
            done: true,
        }
    }

    pub fn released(record: &InputRecord) -> Self {
        Self {
            done: false,
            ..Self::done(record)
        }
    }
}

pub type CompletionSender = mpsc::Sender<Completion>;
pub type CompletionReceiver = mpsc::Receiver<Completion>;

pub fn channel() -> (CompletionSender, CompletionReceiver) {
    mpsc::channel()
}
