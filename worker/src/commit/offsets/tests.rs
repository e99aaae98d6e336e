//! The offset tracker's tests: examples of each rule, then properties over random orders.

use super::*;
use proptest::prelude::*;

#[test]
fn a_confirmed_unchanged_watermark_is_settled_until_anything_moves() {
    let mut p = PartitionOffsets::default();
    assert!(!p.is_settled(), "nothing begun");
    for o in 10..=12 {
        p.begin(o, 0).unwrap();
    }
    p.complete(10).unwrap();
    assert!(!p.is_settled(), "never committed");
    p.mark_sent(11);
    assert!(!p.is_settled(), "on its way");
    p.commit_confirmed(11);
    assert!(p.is_settled());
    // Completing above the watermark changes the map: no longer settled.
    p.complete(12).unwrap();
    assert!(!p.is_settled(), "the map changed");
    p.mark_sent(11);
    p.commit_failed(11);
    assert!(!p.is_settled(), "the map's commit failed");
    p.mark_sent(11);
    p.commit_confirmed(11);
    assert!(p.is_settled());
    p.complete(11).unwrap();
    assert!(!p.is_settled(), "the watermark moved");
}

#[test]
fn the_room_a_burst_took_is_given_back_once_it_has_stood_mostly_empty_for_a_while() {
    let mut p = PartitionOffsets::default();
    for o in 0..10_000 {
        p.begin(o, 0).unwrap();
    }
    let burst = p.in_flight.slots.capacity();
    assert!(burst >= 10_000);
    for o in 0..5_000 {
        p.complete(o).unwrap();
    }
    for _ in 0..2 * SPARE_TURNS {
        p.tick();
    }
    assert_eq!(
        p.in_flight.slots.capacity(),
        burst,
        "half still in flight: kept"
    );
    for o in 5_000..9_990 {
        p.complete(o).unwrap();
    }
    for _ in 1..SPARE_TURNS {
        p.tick();
    }
    assert_eq!(p.in_flight.slots.capacity(), burst, "not yet long enough");
    // A swing back up starts the count again.
    for o in 10_000..15_000 {
        p.begin(o, 0).unwrap();
    }
    p.tick();
    for o in 9_990..14_990 {
        p.complete(o).unwrap();
    }
    for _ in 1..SPARE_TURNS {
        p.tick();
    }
    assert_eq!(
        p.in_flight.slots.capacity(),
        burst,
        "counted from the swing"
    );
    p.tick();
    let rest = p.in_flight.slots.capacity();
    assert!(
        rest < burst / 8,
        "{burst} slots kept with 10 in flight: {rest}"
    );
    assert!(rest >= RESTING_SLOTS);
    assert_eq!(
        p.in_flight_offsets().collect::<Vec<_>>(),
        (14_990..15_000).collect::<Vec<_>>()
    );
    for _ in 0..2 * SPARE_TURNS {
        p.tick();
    }
    assert_eq!(
        p.in_flight.slots.capacity(),
        rest,
        "at rest: no reallocation per turn"
    );
}

#[test]
fn watermark_stops_at_the_first_unfinished_offset() {
    let mut p = PartitionOffsets::default();
    assert_eq!(p.watermark(), None);
    for o in 100..=104 {
        p.begin(o, 0).unwrap();
    }
    assert_eq!(p.watermark(), Some(100));
    p.complete(100).unwrap();
    p.complete(101).unwrap();
    p.complete(103).unwrap();
    p.complete(104).unwrap();
    // 102 still running: 104 done must not let the commit pass 102.
    assert_eq!(p.watermark(), Some(102));
    assert_eq!(p.span(), 3);
    p.complete(102).unwrap();
    assert_eq!(p.watermark(), Some(105));
    assert_eq!(p.span(), 0);
}

#[test]
fn gaps_in_the_offset_space_do_not_block_the_watermark() {
    let mut p = PartitionOffsets::default();
    p.begin(10, 0).unwrap();
    p.begin(15, 0).unwrap(); // 11..14 compacted away
    p.complete(10).unwrap();
    assert_eq!(p.watermark(), Some(15));
    p.complete(15).unwrap();
    assert_eq!(p.watermark(), Some(16));
}

#[test]
fn misuse_is_reported() {
    let mut p = PartitionOffsets::default();
    p.begin(5, 0).unwrap();
    assert_eq!(
        p.begin(5, 0),
        Err(OffsetError::NotIncreasing { offset: 5, next: 6 })
    );
    assert_eq!(p.complete(7), Err(OffsetError::NotInFlight { offset: 7 }));
    p.complete(5).unwrap();
    assert_eq!(p.complete(5), Err(OffsetError::NotInFlight { offset: 5 }));
}

#[test]
fn an_offset_read_again_at_a_newer_leader_epoch_is_a_rewrite_not_a_replay() {
    let mut p = PartitionOffsets::default();
    for o in 0..10 {
        p.begin(o, 4).unwrap();
    }
    for o in 10..20 {
        p.begin(o, 6).unwrap();
    }
    // Fetched again, same records: refused as a replay.
    assert_eq!(
        p.begin(12, 6),
        Err(OffsetError::NotIncreasing {
            offset: 12,
            next: 20
        })
    );
    // The log truncated at 12 and rewritten by the leader of epoch 7.
    assert_eq!(
        p.begin(12, 7),
        Err(OffsetError::Rewritten {
            offset: 12,
            epoch: 7
        })
    );
    // A commit carries the epoch of the record below its watermark.
    assert_eq!(p.epoch_below(10), Some(4));
    assert_eq!(p.epoch_below(11), Some(6));
    assert_eq!(p.epoch_below(0), None);
    assert_eq!(p.newest_epoch(), 6);
    assert_eq!(PartitionOffsets::default().newest_epoch(), UNKNOWN);
}

#[test]
fn commit_candidate_only_when_the_watermark_moved() {
    let mut t = OffsetTracker::new();
    t.begin(0, 0, 0).unwrap();
    t.begin(1, 7, 0).unwrap();
    assert_eq!(t.commit_candidates(), vec![(0, 0), (1, 7)]);
    t.partition_mut(0).unwrap().mark_sent(0);
    t.partition_mut(1).unwrap().mark_sent(7);
    assert!(t.commit_candidates().is_empty());
    t.partition_mut(0).unwrap().commit_confirmed(0);
    t.partition_mut(1).unwrap().commit_confirmed(7);
    assert!(t.commit_candidates().is_empty());
    t.complete(1, 7).unwrap();
    assert_eq!(t.commit_candidates(), vec![(1, 8)]);
}

#[test]
fn a_failed_commit_is_sent_again_and_an_unanswered_one_after_a_few_turns() {
    let mut p = PartitionOffsets::default();
    p.begin(0, 0).unwrap();
    p.complete(0).unwrap();
    p.mark_sent(1);
    assert_eq!(p.commit_candidate(), None);
    p.commit_failed(1);
    assert!(p.is_failing());
    assert_eq!(
        p.commit_candidate(),
        Some(1),
        "a failure is retried at once"
    );
    p.mark_sent(1);
    for _ in 0..RESEND_AFTER_TURNS {
        assert_eq!(p.commit_candidate(), None);
        p.tick();
    }
    assert_eq!(p.commit_candidate(), Some(1), "no answer: sent again");
    p.mark_sent(1);
    p.commit_confirmed(1);
    assert!(!p.is_failing());
    assert_eq!(p.confirmed(), Some(1));
    assert_eq!(
        p.commit_candidate(),
        None,
        "idle and confirmed: nothing to send"
    );
}

#[test]
fn a_stalled_commit_counts_as_failing_until_answered() {
    let mut p = PartitionOffsets::default();
    for o in 0..300 {
        p.begin(o, 0).unwrap();
        p.complete(o).unwrap();
    }
    p.set_confirmed(0);
    p.begin(300, 0).unwrap();
    p.mark_sent(300);
    assert!(p.commit_stalled());
    assert!(p.is_failing());
    assert!(!p.commit_stalled(), "reported once");
    assert_eq!(
        p.replay_span(),
        301,
        "everything since the last confirmed commit"
    );
    p.commit_confirmed(300);
    assert!(!p.is_failing());
    assert_eq!(p.replay_span(), 1);
    assert!(!p.commit_stalled(), "nothing on its way");
}

#[test]
fn an_old_failure_after_a_newer_success_changes_nothing() {
    let mut p = PartitionOffsets::default();
    for o in 0..10 {
        p.begin(o, 0).unwrap();
        p.complete(o).unwrap();
    }
    p.mark_sent(10);
    p.commit_confirmed(10);
    p.commit_failed(5);
    assert!(!p.is_failing());
    assert_eq!(p.commit_candidate(), None);
}

#[test]
fn the_replay_span_counts_from_the_last_confirmed_commit() {
    let mut p = PartitionOffsets::default();
    p.set_confirmed(100);
    for o in 100..150 {
        p.begin(o, 0).unwrap();
        p.complete(o).unwrap();
    }
    p.mark_sent(150);
    p.commit_confirmed(150);
    for o in 150..400 {
        p.begin(o, 0).unwrap();
        p.complete(o).unwrap();
    }
    p.begin(400, 0).unwrap();
    assert_eq!(p.span(), 1);
    assert_eq!(p.replay_span(), 251, "150..=400 would be replayed");
    p.mark_sent(400);
    p.commit_failed(400);
    assert_eq!(p.replay_span(), 251, "still, while the commit fails");
    p.mark_sent(400);
    p.commit_confirmed(400);
    assert_eq!(p.replay_span(), 1, "confirmed: only the unfinished record");
}

#[test]
fn completions_after_revoke_are_ignored() {
    let mut t = OffsetTracker::new();
    t.begin(3, 1, 0).unwrap();
    assert!(t.revoke(3).is_some());
    assert_eq!(t.complete(3, 1), Ok(false));
    assert!(t.commit_candidates().is_empty());
}

#[test]
fn an_early_commit_waits_for_half_the_cap_and_an_eighth_of_it_gained() {
    const CAP: usize = 80;
    let mut p = PartitionOffsets::default();
    p.set_confirmed(0);
    for o in 0..39 {
        p.begin(o, 0).unwrap();
    }
    for o in 0..20 {
        p.complete(o).unwrap();
    }
    assert!(
        !p.wants_early_commit(CAP),
        "39 in the span, below half of 80"
    );
    p.begin(39, 0).unwrap();
    assert!(p.wants_early_commit(CAP), "40 in the span, 20 gained");
    p.mark_sent(20);
    p.commit_confirmed(20);
    for o in 40..60 {
        p.begin(o, 0).unwrap();
    }
    for o in 20..29 {
        p.complete(o).unwrap();
    }
    assert_eq!(p.replay_span(), 40);
    assert!(!p.wants_early_commit(CAP), "9 gained, less than an eighth");
    p.complete(29).unwrap();
    assert!(p.wants_early_commit(CAP), "10 gained, an eighth");
    p.mark_sent(30);
    assert!(!p.wants_early_commit(CAP), "already on its way");
}

#[test]
fn an_early_commit_needs_no_gain_before_the_first_confirmed_one_or_with_a_tiny_cap() {
    let mut p = PartitionOffsets::default();
    for o in 0..4 {
        p.begin(o, 0).unwrap();
    }
    p.complete(0).unwrap();
    assert!(p.wants_early_commit(8), "nothing confirmed yet");
    p.mark_sent(1);
    p.commit_confirmed(1);
    p.complete(1).unwrap();
    assert!(
        p.wants_early_commit(4),
        "a cap below 8 asks for one offset gained"
    );
    assert!(!p.wants_early_commit(64), "a span of 3 is below half of 64");
}

/// A strategy for "n offsets with gaps, completed in an arbitrary order".
fn offsets_and_order() -> impl Strategy<Value = (Vec<Offset>, Vec<usize>)> {
    prop::collection::vec(1i64..4, 1..200).prop_flat_map(|steps| {
        let offsets: Vec<Offset> = steps
            .iter()
            .scan(0i64, |acc, s| {
                *acc += s;
                Some(*acc)
            })
            .collect();
        let order: Vec<usize> = (0..offsets.len()).collect();
        (Just(offsets), Just(order).prop_shuffle())
    })
}

proptest! {
    /// Under any completion order, the watermark never passes an unfinished offset, never
    /// moves backwards, and reaches one past the last offset when everything is done.
    #[test]
    fn never_commits_past_an_incomplete_offset((offsets, order) in offsets_and_order()) {
        let mut p = PartitionOffsets::default();
        for &o in &offsets {
            p.begin(o, 0).unwrap();
        }
        let mut done = vec![false; offsets.len()];
        let mut last = p.watermark().unwrap();
        for i in order {
            p.complete(offsets[i]).unwrap();
            done[i] = true;
            let w = p.watermark().unwrap();
            prop_assert!(w >= last, "watermark moved back from {} to {}", last, w);
            last = w;
            for (j, &o) in offsets.iter().enumerate() {
                if o < w {
                    prop_assert!(done[j], "watermark {} passed unfinished offset {}", w, o);
                }
            }
            // And it is the highest such point: the offset at the watermark (if begun) is
            // unfinished.
            if let Some(j) = offsets.iter().position(|&o| o == w) {
                prop_assert!(!done[j]);
            }
        }
        prop_assert_eq!(p.watermark(), Some(offsets.last().unwrap() + 1));
        prop_assert_eq!(p.in_flight(), 0);
    }

    /// Whatever the order of sends, answers and turns, a watermark that is not confirmed
    /// is never left without a send pending or coming: the partition converges to
    /// committed = processed once the broker answers.
    #[test]
    fn unconfirmed_watermarks_are_always_sent_again(
        events in prop::collection::vec(0u8..4, 1..200),
    ) {
        let mut p = PartitionOffsets::default();
        p.begin(0, 0).unwrap();
        p.complete(0).unwrap();
        let mut in_flight: Vec<Offset> = Vec::new();
        for e in events {
            match e {
                0 => if let Some(w) = p.commit_candidate() { p.mark_sent(w); in_flight.push(w); },
                1 => if let Some(w) = in_flight.pop() { p.commit_failed(w); },
                2 => { in_flight.clear(); } // answers lost
                _ => p.tick(),
            }
        }
        // Answers lost for good: within RESEND_AFTER_TURNS turns the watermark is sent again.
        let mut sent_again = p.confirmed() == Some(1);
        for _ in 0..=RESEND_AFTER_TURNS {
            if p.commit_candidate() == Some(1) {
                sent_again = true;
                break;
            }
            p.tick();
        }
        prop_assert!(sent_again);
    }

    /// The in-flight deque answers like the ordered set it replaced, with gaps between
    /// offsets and completions that are repeated or of offsets never begun.
    #[test]
    fn in_flight_behaves_like_an_ordered_set(
        ops in prop::collection::vec((0u8..3, 1i64..5, any::<u16>()), 1..500),
    ) {
        let mut p = PartitionOffsets::default();
        let mut model = std::collections::BTreeSet::new();
        let mut next: Offset = 0;
        for (op, step, pick) in ops {
            match op {
                0 => {
                    next += step;
                    p.begin(next, 0).unwrap();
                    model.insert(next);
                }
                1 if !model.is_empty() => {
                    let o = *model.iter().nth(pick as usize % model.len()).unwrap();
                    p.complete(o).unwrap();
                    model.remove(&o);
                }
                _ => {
                    // Anything up to one past the newest: done, never begun, or in flight.
                    let o = Offset::from(pick) % (next + 2);
                    prop_assert_eq!(p.complete(o).is_ok(), model.remove(&o));
                }
            }
            prop_assert_eq!(p.in_flight(), model.len());
            prop_assert_eq!(p.oldest_in_flight(), model.first().copied());
            prop_assert_eq!(p.in_flight_offsets().collect::<Vec<_>>(),
                model.iter().copied().collect::<Vec<_>>());
            if next > 0 {
                prop_assert_eq!(p.watermark(), Some(model.first().copied().unwrap_or(next + 1)));
            }
        }
    }

    /// Interleaving begins and completes (the live pattern) keeps the same invariant.
    #[test]
    fn interleaved_begin_and_complete(ops in prop::collection::vec(any::<(bool, u8)>(), 1..400)) {
        let mut p = PartitionOffsets::default();
        let mut next: Offset = 0;
        let mut open: Vec<Offset> = Vec::new();
        for (is_begin, pick) in ops {
            if is_begin || open.is_empty() {
                p.begin(next, 0).unwrap();
                open.push(next);
                next += 1;
            } else {
                let o = open.remove(pick as usize % open.len());
                p.complete(o).unwrap();
            }
            let w = p.watermark().unwrap();
            let expected = open.iter().min().copied().unwrap_or(next);
            prop_assert_eq!(w, expected);
        }
    }
}
