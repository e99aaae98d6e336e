//! The transactions' unit tests, without a broker: a call's deadline, commits at the same time,
//! the barrier, dooms and strikes.

use rdkafka::client::DefaultClientContext;

use super::*;

fn transactions() -> Transactions<DefaultClientContext> {
    Transactions::new(ClientConfig::new(), "g", "t", DefaultClientContext)
}

#[test]
fn a_call_that_does_not_return_in_time_is_left_behind_not_waited_for() {
    assert_eq!(within(Duration::from_secs(60), || 7), Some(7));
    let refused = within(Duration::from_secs(60), || -> KafkaResult<()> {
        Err(KafkaError::MessageProduction(RDKafkaErrorCode::State))
    });
    assert_eq!(
        refused.unwrap().unwrap_err().rdkafka_error_code(),
        Some(RDKafkaErrorCode::State)
    );
    let stuck = within(Duration::from_millis(50), || {
        std::thread::sleep(Duration::from_secs(5));
    });
    assert_eq!(stuck, None);
}

#[test]
fn a_turns_commits_run_at_the_same_time_and_answer_in_their_partitions_order() {
    // Each call waits until every call has started: one after another, the first would
    // wait alone (here until the bound, then answer false).
    let started = Mutex::new(0usize);
    let all_started = std::sync::Condvar::new();
    let n = 8;
    let answers = concurrently((0..n).collect(), |i: usize| {
        let mut count = locked(&started);
        *count += 1;
        all_started.notify_all();
        let (count, _) = all_started
            .wait_timeout_while(count, Duration::from_secs(10), |c| *c < n)
            .unwrap();
        // Later items answer first: the answers still come in the items' order.
        drop(count);
        std::thread::sleep(Duration::from_millis((n - i) as u64));
        (i, *locked(&started) == n)
    });
    assert_eq!(
        answers,
        (0..n).map(|i| (i, true)).collect::<Vec<_>>(),
        "every commit of the turn started before any ended, answers in order"
    );
    assert!(concurrently(Vec::<u8>::new(), |_| ()).is_empty());
    assert_eq!(concurrently(vec![3], |i| i * 2), vec![6]);
}

#[test]
fn a_share_kept_past_the_deadline_is_an_error_not_a_hang_and_the_barrier_recovers() {
    let t = transactions();
    let share = futures::executor::block_on(t.share());
    let short = Duration::from_millis(50);
    assert_eq!(t.exclusive(short).err(), Some(BarrierStuck(short)));
    // The waiter left behind is queued: a new share waits for it, gets through once it
    // has taken and dropped the barrier.
    drop(share);
    let again = futures::executor::block_on(t.share());
    drop(again);
    let exclusive = t
        .exclusive(Duration::from_secs(60))
        .expect("no share is out");
    // While it is held, no write can take a share.
    assert!(t.barrier.clone().try_read_owned().is_err());
    drop(exclusive);
    assert!(t.barrier.clone().try_read_owned().is_ok());
}

fn write(record: Offset, epoch: u64) -> Doom {
    Doom {
        reason: AbortReason::Write,
        record: Some(record),
        epoch: Some(epoch),
    }
}

#[test]
fn a_record_named_by_three_aborts_in_a_row_is_poison_until_committed() {
    let t = transactions();
    assert_eq!(t.strike(0, Some(5)), Strike::Counted(1));
    assert_eq!(t.strike(0, Some(5)), Strike::Counted(2));
    assert!(!t.is_poisoned(0, 5));
    assert_eq!(t.strike(0, Some(5)), Strike::Poisoned);
    assert!(t.is_poisoned(0, 5) && !t.is_poisoned(1, 5) && !t.is_poisoned(0, 6));
    // Its dead letter's transaction aborted too: no more rounds.
    assert_eq!(t.strike(0, Some(5)), Strike::DeadLetterAborted);
    t.committed(0, 6);
    assert!(!t.is_poisoned(0, 5));
}

#[test]
fn another_record_or_a_commit_past_the_record_starts_the_count_again() {
    let t = transactions();
    assert_eq!(t.strike(0, Some(5)), Strike::Counted(1));
    assert_eq!(t.strike(0, Some(5)), Strike::Counted(2));
    assert_eq!(t.strike(0, Some(7)), Strike::Counted(1));
    assert_eq!(t.strike(0, Some(5)), Strike::Counted(1));
    // An abort naming no record (a purge) does not break the row.
    assert_eq!(t.strike(0, None), Strike::Counted(0));
    assert_eq!(t.strike(0, Some(5)), Strike::Counted(2));
    // A commit below the record (the same watermark with a new map) does not end the row.
    t.committed(0, 5);
    assert_eq!(t.strike(0, Some(5)), Strike::Poisoned);
    // Per partition; a commit past the record ends its row.
    assert_eq!(t.strike(1, Some(8)), Strike::Counted(1));
    assert_eq!(t.strike(1, Some(8)), Strike::Counted(2));
    t.committed(1, 9);
    assert_eq!(t.strike(1, Some(8)), Strike::Counted(1));
}

#[test]
fn the_doom_kept_names_the_write_that_doomed_the_open_transaction() {
    let t = transactions();
    t.since(0, 4);
    assert!(!t.any_doomed() && t.take_doomed().is_empty());
    // From a lease older than the open transaction's: dropped.
    t.doom(0, write(9, 3));
    assert!(t.take_doomed().is_empty());
    // Refused because the transaction was doomed already (no record), then the write that
    // doomed it: that one is named.
    t.doom(
        0,
        Doom {
            record: None,
            ..write(0, 4)
        },
    );
    t.doom(0, write(11, 4));
    t.doom(0, write(12, 4));
    assert_eq!(t.take_doomed(), vec![(0, write(11, 4))]);
    assert!(!t.any_doomed());
    // A purge dooms whatever is open, and stays.
    let purge = Doom {
        reason: AbortReason::Fence,
        record: None,
        epoch: None,
    };
    t.doom(0, write(11, 4));
    t.doom(0, purge);
    t.doom(0, write(13, 5));
    assert_eq!(t.take_doom(0), Some(purge));
    // A rewind drops what was noted of the transaction it aborted.
    t.doom(0, write(14, 5));
    t.since(0, 6);
    assert_eq!(t.take_doom(0), None);
}
