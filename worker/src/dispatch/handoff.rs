//! The hand-off from the consumer loop to one dispatcher: records go over in batches, and the
//! bound is in records.
//!
//! The consumer loop takes records from librdkafka in bursts. Handed over one at a time, each
//! record cost a channel slot, a permit and a wake-up check: three atomic operations on cache
//! lines the dispatcher's thread writes too, so each one moved a line between cores. Now the
//! loop gathers what a turn takes for each dispatcher into one batch and hands the batch over
//! whole: those costs are paid once per batch.
//!
//! The bound is still what `dispatcherCapacity` says: records handed over and not yet taken
//! by the dispatcher. Of a batch larger than the room left, the records that fit go over, in
//! order, and the rest comes back; the consumer loop parks it (backpressure, see
//! `backpressure`). The records that come back are the batch's last, so a session's records
//! still reach its dispatcher in the order they were taken.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::record::InputRecord;

/// Records for one dispatcher, in the order the consumer loop took them.
pub type Batch = Vec<Box<InputRecord>>;

/// A hand-off bounded at `capacity` records waiting.
pub fn handoff(capacity: usize) -> (Handoff, Takeoff) {
    let (tx, rx) = mpsc::unbounded_channel();
    let waiting = Arc::new(AtomicUsize::new(0));
    let handoff = Handoff {
        tx,
        waiting: waiting.clone(),
        capacity,
    };
    (handoff, Takeoff { rx, waiting })
}

/// What of a batch was not handed over, and why.
#[derive(Debug)]
pub enum Refused {
    /// The dispatcher had room for only the records before these (maybe none).
    Full(Batch),
    /// The dispatcher is gone (shutdown): the whole batch.
    Closed(Batch),
}

/// The consumer loop's end.
pub struct Handoff {
    tx: mpsc::UnboundedSender<Batch>,
    /// Records handed over and not yet taken by the dispatcher.
    waiting: Arc<AtomicUsize>,
    capacity: usize,
}

impl Handoff {
    /// Hands over as much of `batch` as the bound has room for, from its first record on.
    pub fn offer(&self, batch: Batch) -> Result<(), Refused> {
        // Only this end adds: the count can fall between this look and the add, never rise.
        let room = self
            .capacity
            .saturating_sub(self.waiting.load(Ordering::Acquire));
        if batch.is_empty() {
            return Ok(());
        }
        if room == 0 {
            return Err(Refused::Full(batch));
        }
        let mut batch = batch;
        let rest = if batch.len() > room {
            batch.split_off(room)
        } else {
            Batch::new()
        };
        let n = batch.len();
        self.waiting.fetch_add(n, Ordering::AcqRel);
        if let Err(e) = self.tx.send(batch) {
            self.waiting.fetch_sub(n, Ordering::AcqRel);
            let mut all = e.0;
            all.extend(rest);
            return Err(Refused::Closed(all));
        }
        if rest.is_empty() {
            Ok(())
        } else {
            Err(Refused::Full(rest))
        }
    }
}

/// The dispatcher's end.
pub struct Takeoff {
    rx: mpsc::UnboundedReceiver<Batch>,
    waiting: Arc<AtomicUsize>,
}

impl Takeoff {
    /// Takes up to `limit` batches into `batches` (waiting for the first); 0 once the consumer
    /// loop's end is dropped and nothing is left.
    pub async fn take(&mut self, batches: &mut Vec<Batch>, limit: usize) -> usize {
        let taken = self.rx.recv_many(batches, limit).await;
        let records: usize = batches[batches.len() - taken..].iter().map(Vec::len).sum();
        self.waiting.fetch_sub(records, Ordering::AcqRel);
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::SessionSource;
    use crate::record::{Lease, Parts};

    fn batch(offsets: std::ops::Range<i64>) -> Batch {
        let lease = Arc::new(Lease::new(0, 1));
        offsets
            .map(|o| {
                let parts = Parts {
                    key: Some(b"s"),
                    ..Default::default()
                };
                let r =
                    InputRecord::new("t".into(), 0, o, parts, &SessionSource::Key, lease.clone());
                Box::new(r)
            })
            .collect()
    }

    fn offsets(batches: &[Batch]) -> Vec<i64> {
        batches.iter().flatten().map(|r| r.offset).collect()
    }

    #[tokio::test]
    async fn batches_arrive_whole_and_in_order_within_the_bound() {
        let (tx, mut rx) = handoff(10);
        tx.offer(batch(0..4)).unwrap();
        tx.offer(batch(4..10)).unwrap();
        let Err(Refused::Full(back)) = tx.offer(batch(10..11)) else {
            panic!("an eleventh record passes a bound of ten");
        };
        assert_eq!(back.len(), 1, "a refused batch comes back whole");
        assert!(
            tx.offer(Batch::new()).is_ok(),
            "nothing to hand over fits anywhere"
        );
        let mut got = Vec::new();
        assert_eq!(rx.take(&mut got, 8).await, 2);
        assert_eq!(offsets(&got), (0..10).collect::<Vec<_>>());
        // Taken: room again.
        tx.offer(batch(10..15)).unwrap();
        got.clear();
        rx.take(&mut got, 8).await;
        assert_eq!(offsets(&got), (10..15).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn of_a_batch_larger_than_the_room_the_first_records_go_and_the_rest_comes_back() {
        let (tx, mut rx) = handoff(4);
        tx.offer(batch(0..1)).unwrap();
        let Err(Refused::Full(rest)) = tx.offer(batch(1..9)) else {
            panic!("eight records fit in a room of three");
        };
        assert_eq!(
            offsets(&[rest]),
            (4..9).collect::<Vec<_>>(),
            "the last ones come back"
        );
        let mut got = Vec::new();
        rx.take(&mut got, 8).await;
        assert_eq!(offsets(&got), (0..4).collect::<Vec<_>>());
        // All taken: room for four again.
        tx.offer(batch(4..8)).unwrap();
        assert!(matches!(tx.offer(batch(8..9)), Err(Refused::Full(_))));
    }

    #[tokio::test]
    async fn a_gone_dispatcher_hands_the_batch_back_and_counts_nothing() {
        let (tx, rx) = handoff(4);
        drop(rx);
        let Err(Refused::Closed(back)) = tx.offer(batch(0..6)) else {
            panic!("a batch for a gone dispatcher is taken");
        };
        assert_eq!(back.len(), 6, "the whole batch, past the room too");
        assert_eq!(tx.waiting.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn the_end_of_the_consumer_loop_ends_the_takeoff_after_what_is_left() {
        let (tx, mut rx) = handoff(4);
        tx.offer(batch(0..2)).unwrap();
        drop(tx);
        let mut got = Vec::new();
        assert_eq!(rx.take(&mut got, 8).await, 1);
        assert_eq!(rx.take(&mut got, 8).await, 0);
    }
}
