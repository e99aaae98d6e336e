//! Leader epochs where rdkafka has no word for them: on a record read, and on an offset
//! committed.
//!
//! librdkafka keeps the leader epoch with every record it hands out, and sends one with every
//! committed offset (KIP-320), but rdkafka's `Message` and `TopicPartitionList` show neither.
//! The engine needs both (see `leader_epochs`): the epoch of each record taken in, to tell a
//! rewritten log from a refetch, and the epoch of the last record below a committed watermark,
//! so that a new owner's librdkafka validates where it starts against the log (and moves back
//! to the truncation point, instead of skipping what was rewritten below the watermark).

use rdkafka::bindings::{
    rd_kafka_message_leader_epoch, rd_kafka_topic_partition_list_find,
    rd_kafka_topic_partition_set_leader_epoch,
};
use rdkafka::message::BorrowedMessage;
use rdkafka::TopicPartitionList;

use crate::commit::leader_epochs::Epoch;
use crate::intake::fetched::FetchedMessage;

/// The leader epoch a record was read at; -1 where the broker reported none.
pub trait ReadAtEpoch {
    fn leader_epoch(&self) -> Epoch;
}

impl ReadAtEpoch for FetchedMessage<'_> {
    fn leader_epoch(&self) -> Epoch {
        // SAFETY: the record is live for the view's lifetime; the call only reads it.
        unsafe { rd_kafka_message_leader_epoch(self.raw()) }
    }
}

impl ReadAtEpoch for BorrowedMessage<'_> {
    fn leader_epoch(&self) -> Epoch {
        // SAFETY: `ptr` is the live record this borrow holds; the call only reads it.
        unsafe { rd_kafka_message_leader_epoch(self.ptr()) }
    }
}

/// Sets the leader epoch committed with `topic`/`partition`'s offset in `tpl` (nothing when
/// the list has no such element).
pub fn set_committed_epoch(
    tpl: &mut TopicPartitionList,
    topic: &str,
    partition: i32,
    epoch: Epoch,
) {
    let Ok(topic) = std::ffi::CString::new(topic) else {
        return;
    };
    // SAFETY: `tpl` owns a live list for the call (borrowed mutably: nothing else touches it);
    // the element found belongs to it, and the setter writes only that element.
    unsafe {
        let el = rd_kafka_topic_partition_list_find(tpl.ptr(), topic.as_ptr(), partition);
        if !el.is_null() {
            rd_kafka_topic_partition_set_leader_epoch(el, epoch);
        }
    }
}

/// The leader epoch committed with `topic`/`partition`'s offset in `tpl`, if any.
pub fn committed_epoch(tpl: &TopicPartitionList, topic: &str, partition: i32) -> Option<Epoch> {
    let topic = std::ffi::CString::new(topic).ok()?;
    // SAFETY: as above, reading only.
    let epoch = unsafe {
        let el = rd_kafka_topic_partition_list_find(tpl.ptr(), topic.as_ptr(), partition);
        if el.is_null() {
            return None;
        }
        rdkafka::bindings::rd_kafka_topic_partition_get_leader_epoch(el)
    };
    (epoch >= 0).then_some(epoch)
}

#[cfg(test)]
mod tests {
    use rdkafka::Offset;

    use super::*;

    #[test]
    fn the_epoch_set_on_an_element_is_read_back_and_survives_a_copy() {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset("in", 3, Offset::Offset(40))
            .unwrap();
        tpl.add_partition_offset("in", 4, Offset::Offset(50))
            .unwrap();
        assert_eq!(committed_epoch(&tpl, "in", 3), None);
        set_committed_epoch(&mut tpl, "in", 3, 7);
        set_committed_epoch(&mut tpl, "in", 9, 1); // no such element: nothing
        assert_eq!(committed_epoch(&tpl, "in", 3), Some(7));
        assert_eq!(committed_epoch(&tpl, "in", 4), None);
        // The commit thread sends a copy of the list.
        assert_eq!(committed_epoch(&tpl.clone(), "in", 3), Some(7));
    }
}
