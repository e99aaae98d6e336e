//! Backpressure: what to do when the sessions cannot keep up with the fetch.
//!
//! Routing must never block the consumer loop (a blocked loop stops heartbeats, commits and
//! every other partition). So when a record cannot be handed to its dispatcher, it is parked,
//! in order, in its partition's [`PendingBuffer`], and every later record of that partition is
//! parked behind it until the buffer drains (a newly fetched record must not overtake an older
//! parked one). Parked records stay "in flight" for the offset tracker, so the commit watermark
//! cannot pass them. The consumer loop drains the buffers as capacity returns.
//!
//! A partition is *paused* only when its buffer reaches [`park_limit`] records or its in-flight
//! span reaches `maxInFlightPerPartition`: a dispatcher that is full for a moment (the common
//! case under load) costs a short park, not a pause. Pausing is expensive: librdkafka drops a
//! paused partition's prefetched records and fetches them again after the resume, and its
//! fetcher may sleep up to a second before it notices the resume. A paused partition resumes
//! only when its buffer is empty and the pressure is below the resume mark.
//!
//! A session that is retrying does not create intake pressure by itself: its records wait in
//! its own session queue, not in the dispatcher's channel, so other sessions keep flowing until
//! the partition's in-flight cap is reached.

use std::collections::VecDeque;

use crate::record::InputRecord;

/// Records of one paused partition, oldest first.
#[derive(Debug, Default)]
pub struct PendingBuffer {
    records: VecDeque<InputRecord>,
}

/// What became of a record offered to a dispatcher.
pub enum Offer {
    Taken,
    Full(InputRecord),
    /// The dispatcher is gone (shutdown): the record is released unprocessed.
    Closed(InputRecord),
}

impl PendingBuffer {
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn park(&mut self, record: InputRecord) {
        self.records.push_back(record);
    }

    /// Offers parked records to `offer` oldest first, stopping at the first one not taken.
    /// Returns how many were handed over and the records that can never be (closed).
    pub fn drain(
        &mut self,
        mut offer: impl FnMut(InputRecord) -> Offer,
    ) -> (usize, Vec<InputRecord>) {
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
    pub fn take_all(&mut self) -> Vec<InputRecord> {
        self.records.drain(..).collect()
    }
}

/// Records a partition may park before it is paused: one dispatcher channel's worth. With the
/// in-flight cap, it bounds what a partition holds in memory.
pub fn park_limit(dispatcher_capacity: usize) -> usize {
    dispatcher_capacity.max(1)
}

/// When a partition must be paused: its parked records reached `park_limit`, or too much is in
/// flight (`span`: records from the commit watermark to the newest one taken in).
pub fn should_pause(pending: usize, park_limit: usize, span: usize, max_in_flight: usize) -> bool {
    pending >= park_limit || span >= max_in_flight
}

/// When a paused partition may fetch again: nothing parked, the in-flight span below the resume
/// mark, and the dispatcher that refused a record has room again (free ≥ the same fraction).
pub fn may_resume(
    pending: usize,
    span: usize,
    max_in_flight: usize,
    dispatcher_free: usize,
    dispatcher_capacity: usize,
    resume_below: f64,
) -> bool {
    let mark = |capacity: usize| (capacity as f64 * resume_below).floor() as usize;
    pending == 0
        && span <= mark(max_in_flight)
        && dispatcher_capacity.saturating_sub(dispatcher_free) <= mark(dispatcher_capacity)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Lease;
    use std::sync::Arc;

    fn rec(offset: i64) -> InputRecord {
        InputRecord {
            topic: "t".into(),
            partition: 0,
            offset,
            key: None,
            value: None,
            headers: vec![],
            session: Some("s".into()),
            event_id: String::new(),
            lease: Arc::new(Lease::new(0, 0)),
        }
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
    fn pause_and_resume_marks() {
        assert!(should_pause(4, 4, 0, 10), "the park limit reached");
        assert!(!should_pause(3, 4, 0, 10), "a short park does not pause");
        assert!(should_pause(0, 4, 10, 10));
        assert!(!should_pause(0, 4, 9, 10));
        assert_eq!(park_limit(0), 1);
        // Resume only with an empty buffer, in-flight at or under half, dispatcher half free.
        assert!(may_resume(0, 5, 10, 50, 100, 0.5));
        assert!(!may_resume(1, 0, 10, 100, 100, 0.5));
        assert!(!may_resume(0, 6, 10, 100, 100, 0.5));
        assert!(!may_resume(0, 0, 10, 49, 100, 0.5));
    }
}
