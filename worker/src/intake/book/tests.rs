//! The book of partitions, without a broker: what each step of a partition's life (assign,
//! completions, commits and their answers, revocation, loss, the close) leaves in the book.

use std::collections::BTreeSet;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use super::*;
use crate::commit::completion::{self, CompletionSender};
use crate::commit::leader_epochs::Epoch;
use crate::commit::offsets::RESEND_AFTER_TURNS;

const TOPIC: &str = "book-input";
/// The leader epoch the test records are read at.
const EPOCH: Epoch = 7;

fn book() -> (Book, CompletionSender, Metrics) {
    let (tx, rx) = completion::channel();
    let book = Book::new(TopicName::new(TOPIC), Assigned::default(), rx);
    (book, tx, Metrics::new("book-test"))
}

/// Takes `offsets` of `p` in, as the loop's intake does.
fn take(book: &mut Book, p: Partition, offsets: impl IntoIterator<Item = Offset>) {
    for o in offsets {
        book.tracker
            .begin(p, o, EPOCH)
            .expect("offsets taken in order");
        book.partitions.get_mut(&p).expect("assigned").unreleased += 1;
    }
}

/// The completion of `offset` under `p`'s current lease.
fn done(book: &Book, p: Partition, offset: Offset) -> Completion {
    Completion {
        partition: p,
        offset,
        epoch: book.partitions[&p].lease.epoch,
        done: true,
    }
}

fn complete(book: &mut Book, p: Partition, offsets: impl IntoIterator<Item = Offset>) {
    for o in offsets {
        let c = done(book, p, o);
        book.apply(c);
    }
}

/// Each partition of the commit list with its offset and metadata.
fn listed(tpl: &TopicPartitionList) -> Vec<(Partition, Offset, String)> {
    let mut v: Vec<_> = tpl
        .elements_for_topic(TOPIC)
        .iter()
        .map(|e| {
            let KafkaOffset::Offset(o) = e.offset() else {
                panic!("a commit list carries offsets");
            };
            (e.partition(), o, e.metadata().to_string())
        })
        .collect();
    v.sort();
    v
}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<(Partition, Offset)> {
    listed(tpl).into_iter().map(|(p, o, _)| (p, o)).collect()
}

fn refused() -> KafkaResult<()> {
    Err(KafkaError::ConsumerCommit(
        RDKafkaErrorCode::RebalanceInProgress,
    ))
}

fn committed_gauge(metrics: &Metrics, p: Partition) -> i64 {
    metrics
        .committed_offset
        .with_label_values(&[TOPIC, &p.to_string()])
        .get()
}

#[test]
fn assign_takes_a_partition_in_under_a_new_lease_at_its_committed_offset() {
    let (mut book, _tx, _) = book();
    let map_text = offset_map::encode(40, 43, EPOCH, [40]).unwrap();
    let map = offset_map::decode_within(40, &map_text, 100).unwrap();
    assert!(book.assign(0, None));
    assert!(book.assign(1, Some(&(40, map))));
    // Assigned again (a cooperative rebalance adds to what is held): nothing changes.
    assert!(!book.assign(1, Some(&(99, DoneAbove::empty(99)))));

    assert_eq!(book.partitions[&0].lease.epoch, 1);
    assert_eq!(book.partitions[&1].lease.epoch, 2);
    assert_eq!(book.next_epoch, 2);
    assert_eq!(book.partitions[&1].phase, Phase::Owned);
    assert!(book.partitions[&1].phase.takes_records());
    assert_eq!(book.tracker.partition(0).unwrap().confirmed(), None);
    assert_eq!(book.tracker.partition(1).unwrap().confirmed(), Some(40));
    // The previous owner's map: 41 and 42 done, 40 not.
    let above = &book.partitions[&1].done_above;
    assert!(!above.is_done(40, EPOCH));
    assert!(above.is_done(41, EPOCH) && above.is_done(42, EPOCH));
    assert!(!book.partitions[&0].done_above.is_done(0, EPOCH));
    let assigned: BTreeSet<i32> = book.assigned.lock().unwrap().clone();
    assert_eq!(assigned, BTreeSet::from([0, 1]));
    assert_eq!(book.all_partitions().len(), 2);
}

#[test]
fn completions_move_the_watermark_and_stale_ones_are_ignored() {
    let (mut book, tx, metrics) = book();
    book.assign(0, None);
    take(&mut book, 0, 10..14);
    assert_eq!(book.unreleased(&[0]), 4);

    tx.send(done(&book, 0, 11)).unwrap();
    book.apply_ready(&metrics);
    assert_eq!(book.tracker.partition(0).unwrap().watermark(), Some(10));
    assert_eq!(book.unreleased(&[0]), 3);
    assert_eq!(metrics.in_flight.get(), 3);

    // From an earlier assignment of the partition (another lease): ignored.
    let stale = Completion {
        epoch: book.partitions[&0].lease.epoch - 1,
        ..done(&book, 0, 10)
    };
    // From a partition not held: ignored.
    let foreign = Completion {
        partition: 5,
        ..done(&book, 0, 10)
    };
    // Released unprocessed (revoked, aborted): no longer unreleased, but not done.
    let released = Completion {
        done: false,
        ..done(&book, 0, 10)
    };
    for c in [stale, foreign, released] {
        tx.send(c).unwrap();
    }
    book.apply_ready(&metrics);
    assert_eq!(book.tracker.partition(0).unwrap().watermark(), Some(10));
    assert_eq!(book.unreleased(&[0]), 2);
    assert_eq!(metrics.in_flight.get(), 3);

    complete(&mut book, 0, [12, 13]);
    assert_eq!(book.tracker.partition(0).unwrap().watermark(), Some(10));
    assert_eq!(book.unreleased(&[0]), 0);
    assert_eq!(book.unreleased_total(), 0);
    // 10 was released, never completed: the watermark waits at it (it is replayed).
    book.apply_ready(&metrics);
    assert_eq!(metrics.in_flight.get(), 1);
}

#[test]
fn commit_list_sends_each_watermark_once_with_its_map_and_leader_epoch() {
    let (mut book, _tx, _) = book();
    book.assign(0, None);
    book.assign(1, None);
    book.assign(2, Some(&(5, DoneAbove::empty(5))));
    take(&mut book, 0, 10..14);
    complete(&mut book, 0, [10, 12]);

    let tpl = book.commit_list(None, false);
    // Partition 0 at its contiguous watermark; 1 and 2 have taken nothing in.
    let sent = listed(&tpl);
    assert_eq!(sent.len(), 1);
    let (p, w, metadata) = &sent[0];
    assert_eq!((*p, *w), (0, 11));
    assert_eq!(
        metadata,
        &offset_map::encode(11, 14, EPOCH, [11, 13]).unwrap()
    );
    let map = offset_map::decode_within(11, metadata, 100).unwrap();
    assert!(map.is_done(12, EPOCH));
    assert!(!map.is_done(11, EPOCH) && !map.is_done(13, EPOCH));
    // The epoch of the record below the watermark (10), for the next owner's check.
    assert_eq!(kafka_epoch::committed_epoch(&tpl, TOPIC, 0), Some(EPOCH));

    // Sent and unanswered: not sent again at the next intervals...
    for _ in 1..RESEND_AFTER_TURNS {
        assert_eq!(book.commit_list(None, false).count(), 0);
    }
    // ... until it has gone unanswered for RESEND_AFTER_TURNS of them.
    assert_eq!(partitions_of(&book.commit_list(None, false)), vec![(0, 11)]);
    // A forced (final) commit sends what is not confirmed, whatever is on its way.
    assert_eq!(partitions_of(&book.commit_list(None, true)), vec![(0, 11)]);
    // Only the partitions asked for (a revocation's).
    assert_eq!(book.commit_list(Some(&[1, 2]), true).count(), 0);

    // A completion changes the map: sent again at the next interval.
    complete(&mut book, 0, [13]);
    let again = listed(&book.commit_list(None, false));
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].0, again[0].1), (0, 11));
    assert_eq!(again[0].2, offset_map::encode(11, 14, EPOCH, [11]).unwrap());
}

/// A partition resumed from a committed map (assignment, or an exactlyOnce rewind) and taken
/// in again only part of the way commits a map that still marks done what the resumed map
/// marked done beyond that part. Seen on three Kafka nodes (6 Dec): a commit 200 ms after a
/// rewind wrote a map with 165 offsets done where the map it resumed from had 208; the next
/// rewind replayed the other 43, whose outputs were committed already: twice in the output.
#[test]
fn a_resumed_map_keeps_what_it_marks_done_until_those_offsets_are_taken_in_again() {
    let (mut book, _tx, _) = book();
    // Committed by the previous owner: 100 unfinished, 101..=108 done, 109 unfinished.
    let text = offset_map::encode(100, 110, EPOCH, [100, 109]).unwrap();
    let resumed = offset_map::decode_within(100, &text, 100).unwrap();
    book.assign(0, Some(&(100, resumed)));
    // Taken in again up to 102: 100 processed, 101 and 102 skipped as done (the intake
    // completes them).
    take(&mut book, 0, 100..103);
    complete(&mut book, 0, 100..103);

    let sent = listed(&book.commit_list(None, false));
    assert_eq!(sent.len(), 1);
    assert_eq!((sent[0].0, sent[0].1), (0, 103));
    let map = offset_map::decode_within(103, &sent[0].2, 100).unwrap();
    let done: Vec<Offset> = (100..115).filter(|o| map.is_done(*o, EPOCH)).collect();
    assert_eq!(done, (103..=108).collect::<Vec<_>>());
    // Once taken in past the resumed map, the tracker alone says what is done.
    take(&mut book, 0, 103..111);
    complete(&mut book, 0, [103, 104, 105, 106, 107, 108, 110]);
    let sent = listed(&book.commit_list(None, false));
    assert_eq!(sent[0].1, 109);
    let map = offset_map::decode_within(109, &sent[0].2, 100).unwrap();
    let done: Vec<Offset> = (100..115).filter(|o| map.is_done(*o, EPOCH)).collect();
    assert_eq!(done, vec![110]);
}

#[test]
fn commit_answered_confirms_on_success_and_sends_again_on_error() {
    let (mut book, _tx, metrics) = book();
    book.assign(0, None);
    book.assign(1, None);
    take(&mut book, 0, 0..3);
    take(&mut book, 1, 0..2);
    complete(&mut book, 0, 0..3);
    complete(&mut book, 1, [0]);
    let tpl = book.commit_list(None, false);
    assert_eq!(partitions_of(&tpl), vec![(0, 3), (1, 1)]);

    assert_eq!(book.commit_answered(&Ok(()), &tpl, &metrics), 0);
    let o = book.tracker.partition(0).unwrap();
    assert_eq!(o.confirmed(), Some(3));
    assert!(o.is_settled() && !o.is_failing());
    assert_eq!(committed_gauge(&metrics, 0), 3);
    assert_eq!(committed_gauge(&metrics, 1), 1);
    assert_eq!(metrics.commit_errors.get(), 0);
    // Confirmed as it is: nothing to send, not even by a forced commit.
    assert_eq!(book.commit_list(None, false).count(), 0);
    assert_eq!(book.commit_list(None, true).count(), 0);
    assert_eq!(book.unsettled(&[0, 1]), 0);

    // Progress, and its commit refused.
    complete(&mut book, 1, [1]);
    let tpl = book.commit_list(None, false);
    assert_eq!(partitions_of(&tpl), vec![(1, 2)]);
    assert_eq!(book.commit_answered(&refused(), &tpl, &metrics), 1);
    let o = book.tracker.partition(1).unwrap();
    assert_eq!(o.confirmed(), Some(1));
    assert!(o.is_failing() && !o.is_settled());
    assert_eq!(committed_gauge(&metrics, 1), 1);
    assert_eq!(metrics.commit_errors.get(), 1);
    assert_eq!(metrics.commit_failing_partitions.get(), 1);
    assert_eq!(book.unsettled(&[0, 1]), 1);
    // Sent again at the very next interval, not after RESEND_AFTER_TURNS.
    let tpl = book.commit_list(None, false);
    assert_eq!(partitions_of(&tpl), vec![(1, 2)]);
    assert_eq!(book.commit_answered(&Ok(()), &tpl, &metrics), 0);
    assert_eq!(committed_gauge(&metrics, 1), 2);
    assert_eq!(metrics.commit_failing_partitions.get(), 0);
    assert_eq!(book.unsettled(&[0, 1]), 0);
}

#[test]
fn a_late_answer_for_a_revoked_partition_does_not_bring_it_back() {
    let (mut book, _tx, metrics) = book();
    book.assign(0, None);
    book.assign(1, None);
    take(&mut book, 0, 0..4);
    take(&mut book, 1, 0..2);
    complete(&mut book, 0, 0..3);
    complete(&mut book, 1, 0..2);
    // The commit thread's commit, on its way when the revocation comes.
    let in_flight = book.commit_list(None, false);
    assert_eq!(partitions_of(&in_flight), vec![(0, 3), (1, 2)]);

    // The revocation of 0: drain, stop its writes, final commit (refused), forget.
    let leases = book.start_draining(&[0]);
    assert_eq!(book.partitions[&0].phase, Phase::Draining);
    assert!(leases[0].is_draining() && !leases[0].is_revoked());
    complete(&mut book, 0, [3]);
    book.revoke(&[0]);
    assert_eq!(book.partitions[&0].phase, Phase::Revoked);
    assert!(leases[0].is_revoked());
    let last = book.commit_list(Some(&[0]), true);
    assert_eq!(partitions_of(&last), vec![(0, 4)]);
    assert_eq!(book.commit_answered(&refused(), &last, &metrics), 1);
    assert_eq!(book.unsettled(&[0]), 1);
    book.forget(&[0]);

    // The late answer: a success for 0 (and 1, still held).
    assert_eq!(book.commit_answered(&Ok(()), &in_flight, &metrics), 0);
    assert!(!book.partitions.contains_key(&0));
    assert!(book.tracker.partition(0).is_none());
    assert!(!book.assigned.lock().unwrap().contains(&0));
    assert_eq!(book.unsettled(&[0]), 0);
    assert_eq!(committed_gauge(&metrics, 0), 0);
    // Partition 1 takes its answer.
    assert_eq!(book.tracker.partition(1).unwrap().confirmed(), Some(2));
    assert_eq!(committed_gauge(&metrics, 1), 2);
    assert_eq!(metrics.commit_failing_partitions.get(), 0);

    // 0 comes back (a later rebalance) at what the broker holds now, under a new lease:
    // the old assignment's completions and answers do not touch it.
    let old_epoch = leases[0].epoch;
    assert!(book.assign(0, Some(&(9, DoneAbove::empty(9)))));
    assert!(book.partitions[&0].lease.epoch > old_epoch);
    book.apply(Completion {
        partition: 0,
        offset: 3,
        epoch: old_epoch,
        done: true,
    });
    assert_eq!(book.unreleased(&[0]), 0);
    assert_eq!(book.commit_answered(&Ok(()), &in_flight, &metrics), 0);
    assert_eq!(book.tracker.partition(0).unwrap().confirmed(), Some(9));
}

#[test]
fn a_refused_final_commit_is_not_recorded_as_committed() {
    let (mut book, _tx, metrics) = book();
    for p in 0..3 {
        book.assign(p, None);
    }
    take(&mut book, 0, 0..5);
    take(&mut book, 1, 0..5);
    complete(&mut book, 0, 0..5);
    complete(&mut book, 1, 0..2);
    // 2 took nothing in: nothing to commit.

    let last = book.commit_list(None, true);
    assert_eq!(partitions_of(&last), vec![(0, 5), (1, 2)]);
    assert_eq!(book.commit_answered(&refused(), &last, &metrics), 2);
    for p in [0, 1] {
        let o = book.tracker.partition(p).unwrap();
        assert_eq!(o.confirmed(), None);
        assert!(o.is_failing() && !o.is_settled());
        assert_eq!(committed_gauge(&metrics, p), 0);
    }
    // Counted per partition, and what a close's revocation counts as not committed.
    assert_eq!(metrics.commit_errors.get(), 2);
    assert_eq!(metrics.commit_failing_partitions.get(), 2);
    assert_eq!(book.unsettled(&[0, 1, 2]), 2);

    // Tried again (the final commit's retries): the same watermarks, and accepted.
    let again = book.commit_list(None, true);
    assert_eq!(partitions_of(&again), vec![(0, 5), (1, 2)]);
    assert_eq!(book.commit_answered(&Ok(()), &again, &metrics), 0);
    assert_eq!(book.unsettled(&[0, 1, 2]), 0);
    assert_eq!(committed_gauge(&metrics, 0), 5);
    assert_eq!(metrics.commit_failing_partitions.get(), 0);
}

#[test]
fn forget_drops_the_partition_and_revokes_its_lease() {
    let (mut book, _tx, metrics) = book();
    book.assign(0, None);
    book.assign(1, None);
    take(&mut book, 0, 0..3);
    take(&mut book, 1, 0..1);
    let lease = book.partitions[&0].lease.clone();
    let version = book.assignment_version;

    book.forget(&[0]);
    assert!(lease.is_revoked());
    assert!(!book.partitions.contains_key(&0));
    assert!(book.tracker.partition(0).is_none());
    assert_eq!(*book.assigned.lock().unwrap(), BTreeSet::from([1]));
    assert_eq!(book.assignment_version, version + 1);
    assert_eq!(book.unreleased(&[0]), 0);
    assert_eq!(book.unreleased_total(), 1);
    // Its records finishing later change nothing.
    book.apply(Completion {
        partition: 0,
        offset: 0,
        epoch: lease.epoch,
        done: true,
    });
    book.apply_ready(&metrics);
    assert_eq!(metrics.in_flight.get(), 1);
    assert_eq!(partitions_of(&book.commit_list(None, true)), vec![(1, 0)]);
}

#[test]
fn unsettled_counts_the_partitions_with_progress_not_confirmed_as_it_is() {
    let (mut book, _tx, metrics) = book();
    for p in 0..4 {
        book.assign(p, None);
    }
    // 0: nothing taken in. 1: progress never sent. 2: confirmed. 3: sent, unanswered.
    for p in 1..4 {
        take(&mut book, p, 0..2);
        complete(&mut book, p, 0..2);
    }
    let tpl = book.commit_list(Some(&[2]), false);
    book.commit_answered(&Ok(()), &tpl, &metrics);
    book.commit_list(Some(&[3]), false);

    assert_eq!(book.unsettled(&[0]), 0);
    assert_eq!(book.unsettled(&[1]), 1);
    assert_eq!(book.unsettled(&[2]), 0);
    assert_eq!(book.unsettled(&[3]), 1);
    assert_eq!(book.unsettled(&[0, 1, 2, 3, 9]), 2);
    // And the records still unreleased, per partition and in all.
    take(&mut book, 2, 2..5);
    assert_eq!(book.unreleased(&[1, 2]), 3);
    assert_eq!(book.unreleased_total(), 3);
    // Records taken in are no progress while none is done: still settled.
    assert_eq!(book.unsettled(&[2]), 0);
    complete(&mut book, 2, [2]);
    assert_eq!(book.unsettled(&[2]), 1);
}

#[test]
fn a_commit_unanswered_for_long_counts_its_partitions_as_failing_once() {
    let (mut book, _tx, metrics) = book();
    book.assign(0, None);
    book.assign(1, None);
    take(&mut book, 0, 0..2);
    complete(&mut book, 0, 0..2);
    let tpl = book.commit_list(None, false);
    assert_eq!(partitions_of(&tpl), vec![(0, 2)]);

    book.commit_stalled(&metrics);
    assert!(book.tracker.partition(0).unwrap().is_failing());
    assert!(!book.tracker.partition(1).unwrap().is_failing());
    assert_eq!(metrics.commit_errors.get(), 1);
    assert_eq!(metrics.commit_failing_partitions.get(), 1);
    // Still stalled at the next check: counted once per stall.
    book.commit_stalled(&metrics);
    assert_eq!(metrics.commit_errors.get(), 1);
    assert_eq!(metrics.commit_failing_partitions.get(), 1);

    // The answer comes at last.
    assert_eq!(book.commit_answered(&Ok(()), &tpl, &metrics), 0);
    assert!(!book.tracker.partition(0).unwrap().is_failing());
    assert_eq!(metrics.commit_failing_partitions.get(), 0);
    // Nothing on its way: no stall.
    book.commit_stalled(&metrics);
    assert_eq!(metrics.commit_errors.get(), 1);
    assert_eq!(metrics.commit_failing_partitions.get(), 0);
}

#[test]
fn a_commit_is_urgent_once_the_replay_span_reaches_half_the_cap() {
    let (mut book, _tx, metrics) = book();
    book.assign(0, None);
    let cap = 8;
    take(&mut book, 0, 0..3);
    complete(&mut book, 0, 0..3);
    assert!(!book.commit_urgent(cap, false));
    take(&mut book, 0, 3..4);
    // Span 4 of a cap of 8, nothing confirmed yet.
    assert!(book.commit_urgent(cap, false));
    let tpl = book.commit_list(None, false);
    // On its way: not urgent again.
    assert!(!book.commit_urgent(cap, false));
    book.commit_answered(&Ok(()), &tpl, &metrics);
    assert!(!book.commit_urgent(cap, false));
}

/// Two partitions at a small cap, one commit outstanding at a time: the answer that gives
/// partition 0 its room back must not be followed at once by a commit that carries only
/// partition 1's progress, or the two take turns in alternate commits for the whole drain.
#[test]
fn an_early_commit_after_an_answer_waits_for_the_records_the_answer_let_in() {
    let (mut book, _tx, metrics) = book();
    let cap = 8;
    for p in 0..2 {
        book.assign(p, None);
        take(&mut book, p, 0..8);
        complete(&mut book, p, 0..8);
    }
    let tpl = book.commit_list(None, false);
    book.commit_answered(&Ok(()), &tpl, &metrics);
    // The answer's turn: both partitions take their next cap's worth; partition 1's handler
    // is done at once, partition 0's records are still running.
    for p in 0..2 {
        take(&mut book, p, 8..16);
    }
    complete(&mut book, 1, 8..16);
    assert!(
        book.commit_urgent(cap, false),
        "partition 1 has 8 to commit"
    );
    assert!(
        !book.early_commit_gathered(Duration::ZERO),
        "partition 0's records, let in by the answer, are still running"
    );
    complete(&mut book, 0, 8..16);
    assert!(book.early_commit_gathered(Duration::ZERO), "all done");
    let carried: Vec<_> = listed(&book.commit_list(None, false))
        .into_iter()
        .map(|(p, o, _)| (p, o))
        .collect();
    assert_eq!(carried, [(0, 16), (1, 16)], "one commit carries both");
    // A slow handler is waited for no longer than the gather.
    take(&mut book, 0, 16..17);
    assert!(!book.early_commit_gathered(Duration::ZERO));
    assert!(book.early_commit_gathered(EARLY_COMMIT_GATHER));
}

#[test]
fn in_exactly_once_a_commit_is_urgent_only_from_three_quarters_of_the_cap() {
    let (mut book, _tx, metrics) = book();
    book.assign(0, None);
    let cap = 16;
    take(&mut book, 0, 0..8);
    complete(&mut book, 0, 0..3);
    // Span 8 of 16: urgent in atLeastOnce, not yet in exactlyOnce (a commit turn there stops
    // the loop and every write for its round trips).
    assert!(book.commit_urgent(cap, false));
    assert!(!book.commit_urgent(cap, true));
    take(&mut book, 0, 8..12);
    // Span 12: three quarters.
    assert!(book.commit_urgent(cap, true));
    let tpl = book.commit_list(None, false);
    book.commit_answered(&Ok(()), &tpl, &metrics);
    // Confirmed at 3, the span from there 12; 2 more done gain less than 3/16 of the cap (3)
    // in exactlyOnce, an eighth (2) in atLeastOnce.
    take(&mut book, 0, 12..15);
    complete(&mut book, 0, 3..5);
    assert!(book.commit_urgent(cap, false));
    assert!(!book.commit_urgent(cap, true));
    complete(&mut book, 0, 5..6);
    assert!(book.commit_urgent(cap, true));
}

#[test]
fn the_phases_move_the_lease_along() {
    let (mut book, _tx, _) = book();
    for p in 0..3 {
        book.assign(p, None);
    }
    let draining = book.start_draining(&[0, 1, 7]);
    assert_eq!(draining.len(), 2);
    assert!(draining.iter().all(|l| l.is_draining() && !l.is_revoked()));
    let revoked = book.revoke(&[0]);
    let lost = book.lose(&[1]);
    assert!(revoked[0].is_revoked() && lost[0].is_revoked());
    let phases: Vec<Phase> = (0..3).map(|p| book.partitions[&p].phase).collect();
    assert_eq!(phases, vec![Phase::Revoked, Phase::Lost, Phase::Owned]);
    let takes: Vec<bool> = phases.iter().map(|p| p.takes_records()).collect();
    assert_eq!(takes, vec![false, false, true]);
    assert!(!book.partitions[&2].lease.is_draining());
    // The close's revocation finds the stop's fence up: the partition stays revoked.
    book.revoke(&[2]);
    book.start_draining(&[2]);
    assert_eq!(book.partitions[&2].phase, Phase::Revoked);
}

#[test]
fn closing_counts_what_the_close_s_revocations_left_unconfirmed() {
    let (mut book, _tx, metrics) = book();
    for p in 0..3 {
        book.assign(p, None);
        take(&mut book, p, 0..2);
        complete(&mut book, p, 0..2);
    }
    // A member's revocation is not counted here.
    book.count_close_commit(&[0]);
    assert_eq!(book.leaving, Leaving::No);

    book.start_closing();
    assert_eq!(book.leaving, Leaving::Closing { unconfirmed: None });
    // A revocation whose commit was accepted: none left unconfirmed.
    let tpl = book.commit_list(Some(&[0]), true);
    book.commit_answered(&Ok(()), &tpl, &metrics);
    book.count_close_commit(&[0]);
    assert_eq!(
        book.leaving,
        Leaving::Closing {
            unconfirmed: Some(0)
        }
    );
    // One whose commit was refused, and one whose progress was never sent: added up.
    let tpl = book.commit_list(Some(&[1]), true);
    book.commit_answered(&refused(), &tpl, &metrics);
    book.count_close_commit(&[1]);
    book.count_close_commit(&[2]);
    assert_eq!(
        book.leaving,
        Leaving::Closing {
            unconfirmed: Some(2)
        }
    );
}

/// `sessionflow_transaction_records`: a commit takes the records settled since the last one —
/// completed, not released, under the partition's current lease — and counts from zero again.
#[test]
fn a_commit_takes_the_records_settled_since_the_last_one() {
    let (mut book, _tx, _metrics) = book();
    assert!(book.assign(0, None));
    take(&mut book, 0, 0..5);
    complete(&mut book, 0, 0..3);
    let mut released = done(&book, 0, 3);
    released.done = false;
    book.apply(released);
    let mut stale = done(&book, 0, 4);
    stale.epoch += 1;
    book.apply(stale);
    assert_eq!(
        book.take_settled(0),
        3,
        "done under the lease, not released, not stale"
    );
    assert_eq!(book.take_settled(0), 0, "counted from zero again");
    complete(&mut book, 0, [4]);
    assert_eq!(book.take_settled(0), 1);
    assert_eq!(book.take_settled(9), 0, "a partition not in the book");
}
