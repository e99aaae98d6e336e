//! No result after handover (issue 10, items 1 and 9): a handler call that outlives the
//! revocation drain must not write anything once its partition has moved on.
//!
//! Handler calls here are several times longer than `rebalance.drainTimeoutMs`: every so often
//! a record's first attempt is slow (an LLM call), while workers join and leave the group. The
//! old owner's drain times out with those calls still running; when they return, their results
//! must be dropped (the new owner redoes the records), or a session's output would end on an
//! older record after a newer one (`1,2,1`) — which `verify` counts as a stale end. A worker
//! frozen past its session timeout (SIGSTOP) comes back to find its partitions *lost*: it
//! must drop them without a drain or a commit, and write nothing for them.

use std::time::Duration;

use sessionflow_tests::{verify_pipeline, wait_until, Topics, WorkerProcess};
use sessionflow_worker::loadgen::{self, LoadgenOptions, SessionChoice};

/// Short sessions whose first attempts are often 12 × the drain timeout: when a partition
/// moves, its new owner usually finishes a session (it redoes the slow record quickly: the
/// slow draw depends on the worker process) before the old owner's call returns — so a result
/// written by the old owner then would be the session's last output, older than the one
/// before it.
const SLOW: &str = "{latencyMs: 5, slowRate: 0.3, slowMs: 6000, seed: 21}";
const SESSIONS: u64 = 60;
const PER_SESSION: u64 = 6;

async fn joins_and_leaves_with_calls_longer_than_the_drain(strategy: &str) {
    let topics = Topics::create(&format!("handover-{strategy}"), 4).await;
    let yaml = topics.stage_yaml(
        SLOW,
        &format!(
            "rebalance: {{strategy: {strategy}, drainTimeoutMs: 500}}\nshutdownTimeoutMs: 1000"
        ),
    );
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        ..LoadgenOptions::new(
            &sessionflow_tests::brokers(),
            &topics.input,
            SESSIONS * PER_SESSION,
            SESSIONS,
        )
    };
    loadgen::run(&opts).await.expect("loadgen");
    let a = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(60), || topics.output_count() >= 60)
        .await
        .expect("the first worker makes progress");
    // A worker joins while slow calls run on every partition…
    let b = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(60), || topics.output_count() >= 150)
        .await
        .expect("two workers make progress");
    // …and leaves while they run again.
    let status = b.terminate();
    assert!(status.success(), "leaving worker exits 0, got {status}");
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    assert!(a.terminate().success());

    let report = verify_pipeline(&topics);
    eprintln!("handover ({strategy}), slow calls 12 × the drain:\n{report}");
    assert_eq!(report.stale_ends, 0, "{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(
        report.records - report.duplicates + report.dlq_records,
        SESSIONS * PER_SESSION,
        "{report}"
    );
    topics.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_calls_longer_than_the_drain_write_nothing_after_handover_eager() {
    joins_and_leaves_with_calls_longer_than_the_drain("eager").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_calls_longer_than_the_drain_write_nothing_after_handover_cooperative() {
    joins_and_leaves_with_calls_longer_than_the_drain("cooperative").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_frozen_past_its_session_timeout_drops_its_lost_partitions() {
    let topics = Topics::create("lost", 4).await;
    let yaml = topics.stage_yaml(
        "{latencyMs: 5, seed: 4}",
        "rebalance: {strategy: cooperative, drainTimeoutMs: 500}",
    );
    let produce = |records: u64, seed: u64| {
        let opts = LoadgenOptions {
            choice: SessionChoice::RoundRobin,
            seed,
            session_prefix: format!("s{seed}-"),
            ..LoadgenOptions::new(&sessionflow_tests::brokers(), &topics.input, records, 80)
        };
        async move { loadgen::run(&opts).await.expect("loadgen") }
    };
    let a = WorkerProcess::spawn(&yaml);
    let b = WorkerProcess::spawn(&yaml);
    produce(2_000, 1).await;
    topics.wait_fully_committed(Duration::from_secs(120)).await;
    // Frozen for longer than session.timeout.ms (6 s): the group gives its partitions to `a`
    // while new records arrive. Back, `b` finds its assignment lost; it must drop it without a
    // drain or a commit, rejoin, and the group must converge.
    b.pause();
    produce(2_000, 2).await;
    wait_until(Duration::from_secs(60), || topics.output_count() >= 3_000)
        .await
        .expect("the other member takes over");
    tokio::time::sleep(Duration::from_secs(2)).await;
    b.resume();
    produce(1_000, 3).await;
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    assert!(b.terminate().success());
    assert!(a.terminate().success());

    let report = verify_pipeline(&topics);
    eprintln!("member frozen past its session timeout:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, 5_000, "{report}");
    topics.delete().await;
}
