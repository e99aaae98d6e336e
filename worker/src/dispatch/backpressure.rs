//! Backpressure: what to do when the sessions cannot keep up with the fetch.
//!
//! Routing must never block the consumer loop (a blocked loop stops commits, rebalances and
//! every other partition). So when a record cannot be handed to its dispatcher, it is parked,
//! in order, in its partition's [`PendingBuffer`], and every later record of that partition is
//! parked behind it until the buffer drains (a newly fetched record must not overtake an older
//! parked one). Parked records stay "in flight" for the offset tracker, so the commit watermark
//! cannot pass them. The consumer loop drains the buffers as capacity returns.
//!
//! A partition with a parked record, or whose in-flight span reached
//! `maxInFlightPerPartition`, is *held* ([`should_hold`]): the loop stops taking records from
//! that partition's own queue (see `partition_queues`) until nothing is parked and a tenth of
//! the limit is free again ([`may_take_again`]), so that it then takes a useful batch rather
//! than one record per look. Holding costs nothing: the records wait in librdkafka's queue for
//! the partition, which stops fetching once that queue is full, and the other partitions flow
//! on. (An earlier version *paused* partitions instead, which makes librdkafka drop their
//! prefetched records, fetch them again after the resume and sometimes sleep a second before
//! it notices the resume; draining a backlog, that more than halved throughput.)
//!
//! A session that is retrying does not create intake pressure by itself: its records wait in
//! its own session queue, not in the dispatcher's channel, so other sessions keep flowing until
//! the partition's in-flight cap is reached.

use std::collections::VecDeque;

use crate::record::InputRecord;

/// Parked records of one partition, oldest first.
#[derive(Debug, Default)]
pub struct PendingBuffer {
    records: VecDeque<Box<InputRecord>>,
}

/// What became of a record offered to a dispatcher.
pub enum Offer {
    Taken,
    Full(Box<InputRecord>),
    /// The dispatcher is gone (shutdown): the record is released unprocessed.
    Closed(Box<InputRecord>),
}

impl PendingBuffer {
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn park(&mut self, record: Box<InputRecord>) {
        self.records.push_back(record);
    }

    /// Offers parked records to `offer` oldest first, stopping at the first one not taken.
    /// Returns how many were handed over and the records that can never be (closed).
    pub fn drain(
        &mut self,
        mut offer: impl FnMut(Box<InputRecord>) -> Offer,
    ) -> (usize, Vec<Box<InputRecord>>) {
        let mut handed = 0;
        let mut closed = Vec::new();
        while let Some(record) = self.records.pop_front() {
            match offer(record) {
                Offer::Taken => handed += 1,
                Offer::Full(record) => {
                    self.records.push_front(record);
                    break;
                }
                Offer::Closed(record) => closed.push(record),
            }
        }
        (handed, closed)
    }

    /// Empties the buffer (revocation, shutdown).
    pub fn take_all(&mut self) -> Vec<Box<InputRecord>> {
        self.records.drain(..).collect()
    }
}

/// When a partition must stop taking records: a record of it is parked, or too much is in
/// flight (`span`: records from the commit watermark to the newest one taken in).
pub fn should_hold(pending: usize, span: usize, max_in_flight: usize) -> bool {
    pending > 0 || span >= max_in_flight
}

/// How many records a partition that is not held may take in one burst: its in-flight room.
/// A taken record cannot be put back, so a burst takes no more than one at a time would have.
///
/// `span` counts offsets, and the records in it are at most as many: with gaps in the offsets
/// (a compacted topic, transaction markers) a burst can move the span past the limit, but the
/// records in flight stay within it (span before + room ≤ limit).
pub fn room(span: usize, max_in_flight: usize) -> usize {
    max_in_flight.saturating_sub(span).max(1)
}

/// When a held partition may take records again: nothing parked, and a tenth of the in-flight
/// limit free (at least one record).
pub fn may_take_again(pending: usize, span: usize, max_in_flight: usize) -> bool {
    pending == 0 && span + (max_in_flight / 10).max(1) <= max_in_flight
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Lease;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn rec(offset: i64) -> Box<InputRecord> {
        let parts = crate::record::Parts {
            key: Some(b"s"),
            ..Default::default()
        };
        let source = crate::record::SessionSource::Key;
        let lease = Arc::new(Lease::new(0, 0));
        Box::new(InputRecord::new(
            "t".into(),
            0,
            offset,
            parts,
            &source,
            lease,
        ))
    }

    #[test]
    fn drain_keeps_order_and_stops_at_the_first_refusal() {
        let mut b = PendingBuffer::default();
        for o in 0..5 {
            b.park(rec(o));
        }
        let mut taken = Vec::new();
        let (handed, closed) = b.drain(|r| {
            if taken.len() < 2 {
                taken.push(r.offset);
                Offer::Taken
            } else {
                Offer::Full(r)
            }
        });
        assert_eq!((handed, closed.len()), (2, 0));
        assert_eq!(taken, vec![0, 1]);
        assert_eq!(b.len(), 3);
        let (handed, _) = b.drain(|r| {
            taken.push(r.offset);
            Offer::Taken
        });
        assert_eq!(handed, 3);
        assert_eq!(taken, vec![0, 1, 2, 3, 4]);
        assert!(b.is_empty());
    }

    #[test]
    fn hold_and_release_marks() {
        assert!(should_hold(1, 0, 10), "a parked record holds");
        assert!(should_hold(0, 10, 10), "the in-flight limit holds");
        assert!(!should_hold(0, 9, 10));
        assert!(may_take_again(0, 9_000, 10_000));
        assert!(!may_take_again(0, 9_001, 10_000), "a tenth must be free");
        assert!(!may_take_again(1, 0, 10_000), "nothing may be parked");
        assert!(
            may_take_again(0, 1, 2),
            "tiny limits leave room for one record"
        );
        assert!(!may_take_again(0, 2, 2));
        assert!(may_take_again(0, 0, 1));
    }

    proptest::proptest! {
        /// A partition released from a hold is never held again at once, and one that should
        /// be held is never free to take records: the two marks cannot disagree.
        #[test]
        fn the_marks_agree(pending in 0usize..3, span in 0usize..50_000, max in 1usize..50_000) {
            if may_take_again(pending, span, max) {
                proptest::prop_assert!(!should_hold(pending, span, max));
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// The consumer loop's rules, with the real offset tracker: a partition not held takes
        /// a burst of at most its room, is held at the limit, and takes again once a tenth is
        /// free; sessions finish records in any order and commits follow. Whatever the gaps in
        /// the offsets, the records in flight never pass the limit, and every record is taken
        /// and finished in the end.
        #[test]
        fn gaps_in_the_offsets_never_put_more_records_in_flight_than_the_limit(
            steps in prop::collection::vec(prop_oneof![4 => Just(1i64), 1 => 2i64..60], 1..300),
            cap in 1usize..40,
            burst in 1usize..300,
            picks in prop::collection::vec(any::<prop::sample::Index>(), 1..64),
        ) {
            use crate::commit::offsets::PartitionOffsets;
            let offsets: Vec<i64> = steps
                .iter()
                .scan(0, |at, s| {
                    *at += s;
                    Some(*at)
                })
                .collect();
            let mut tracker = PartitionOffsets::default();
            let (mut next, mut in_flight, mut held) = (0, Vec::new(), false);
            let mut turn = 0;
            while next < offsets.len() || !in_flight.is_empty() {
                turn += 1;
                prop_assert!(turn < 100_000, "no progress: {} of {} taken", next, offsets.len());
                if !held && next < offsets.len() {
                    let take = room(tracker.replay_span(), cap)
                        .min(burst)
                        .min(offsets.len() - next);
                    for &o in &offsets[next..next + take] {
                        tracker.begin(o, 0).unwrap();
                        in_flight.push(o);
                        held |= should_hold(0, tracker.replay_span(), cap);
                    }
                    next += take;
                }
                prop_assert!(
                    in_flight.len() <= cap,
                    "{} records in flight, limit {}", in_flight.len(), cap
                );
                // A session finishes one of the records in flight, any of them.
                if !in_flight.is_empty() {
                    let pick = picks[turn % picks.len()].index(in_flight.len());
                    let done = in_flight.swap_remove(pick);
                    tracker.complete(done).unwrap();
                }
                if let Some(w) = tracker.commit_candidate() {
                    tracker.mark_sent(w);
                    tracker.commit_confirmed(w);
                }
                let span = tracker.replay_span();
                held = if held { !may_take_again(0, span, cap) } else { should_hold(0, span, cap) };
            }
        }
    }
}
