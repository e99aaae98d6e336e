//! Shutdown that keeps its promise (issue 10, item 10).
//!
//! A worker told to stop with a long backlog queued behind its sessions — slow handler calls,
//! and `max.poll.interval.ms` shorter than it would take to drain them all — must keep serving
//! the consumer while it drains (or librdkafka leaves the group and the final commit fails),
//! finish only the record each session is working on, release the rest to the next owner,
//! and commit what it finished. The restarted worker then redoes almost nothing: a rolling
//! restart costs about one handler call, not the whole in-flight backlog.

use std::time::Duration;

use sessionflow_tests::{verify_pipeline, wait_until, Topics, WorkerProcess};

use crate::produce_round_robin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_long_backlog_finishes_current_records_and_replays_almost_nothing() {
    let topics = Topics::create("shutdown", 4).await;
    let sessions = 40;
    produce_round_robin(&topics, sessions, 100).await;
    // 200 ms per call: each session's backlog takes ~20 s, longer than max.poll.interval.ms.
    let yaml = topics.stage_yaml(
        "{latencyMs: 200, seed: 2}",
        "rebalance: {drainTimeoutMs: 2000}\nshutdownTimeoutMs: 20000",
    ) + "  max.poll.interval.ms: '10000'\n";
    let first = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(60), || topics.output_count() >= 400)
        .await
        .expect("progress");
    let status = first.terminate();
    assert!(status.success(), "a graceful stop exits 0, got {status}");
    let stopped_at = topics.output_count();
    assert!(
        stopped_at < 2_000,
        "stopped too late to test anything ({stopped_at})"
    );

    let second = WorkerProcess::spawn(&yaml);
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    assert!(second.terminate().success());

    let report = verify_pipeline(&topics);
    eprintln!("SIGTERM at {stopped_at} outputs with a 20 s backlog, restart:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, 4_000, "{report}");
    // What the first worker finished it committed; at most the record each session was on
    // when the stop came can be redone.
    assert!(
        report.duplicates <= sessions,
        "{} records processed twice (at most {sessions} expected)",
        report.duplicates
    );
    topics.delete().await;
}
