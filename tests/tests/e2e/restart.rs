//! Guarantee 2 across process death: kill the worker process mid-run (SIGKILL: no drain, no
//! final commit), start it again, and nothing is lost and order still holds. Replays are
//! allowed (at-least-once), counted, and bounded by the in-flight limit. A graceful stop
//! (SIGTERM) drains and commits, so a restart replays nothing.

use std::time::Duration;

use sessionflow_tests::{
    assert_replays_within, verify_pipeline, wait_until, Topics, WorkerProcess,
};

use crate::produce_round_robin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_restarts_without_loss() {
    let topics = Topics::create("restart", 8).await;
    produce_round_robin(&topics, 100, 200).await;
    let yaml = topics.stage_yaml("{transientRate: 0.05, latencyMs: 20, seed: 3}", "");

    let first = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(120), || topics.output_count() >= 3_000)
        .await
        .expect("the first worker made progress");
    first.kill();
    let produced_before_kill = topics.output_count();
    assert!(
        produced_before_kill < 20_000,
        "killed too late to test anything"
    );

    let second = WorkerProcess::spawn(&yaml);
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    second.kill();

    let report = verify_pipeline(&topics);
    eprintln!("after kill -9 at {produced_before_kill} outputs and restart:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.lost, 0);
    assert_eq!(report.records - report.duplicates, 20_000, "{report}");
    topics.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_kills_lose_nothing_and_replay_at_most_the_in_flight_window() {
    let topics = Topics::create("kills", 8).await;
    produce_round_robin(&topics, 200, 100).await;
    let max_in_flight = 200;
    let yaml = topics.stage_yaml(
        "{transientRate: 0.05, latencyMs: 10, seed: 5}",
        &format!("maxInFlightPerPartition: {max_in_flight}"),
    );
    let mut kills = 0;
    for round in 1..=5 {
        let worker = WorkerProcess::spawn(&yaml);
        let target = round * 3_000;
        let reached =
            wait_until(Duration::from_secs(120), || topics.output_count() >= target).await;
        worker.kill();
        assert!(reached.is_ok(), "round {round}: no progress to {target}");
        kills += 1;
    }
    let last = WorkerProcess::spawn(&yaml);
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    last.terminate();

    let report = verify_pipeline(&topics);
    eprintln!("after {kills} kill -9:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, 20_000, "{report}");
    // A kill replays at most what lay between the committed watermark and the newest record
    // taken in, per partition: maxInFlightPerPartition (plus a record parked while held,
    // and the commit interval's worth of progress).
    assert_replays_within(&report, kills * 8 * (max_in_flight as u64 + 100));
    topics.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_then_restart_processes_nothing_twice() {
    let topics = Topics::create("sigterm", 8).await;
    produce_round_robin(&topics, 100, 100).await;
    // A small in-flight window, so the stop finds most records not yet taken in. Everything
    // taken in is drained (`shutdownDrainQueued`): by default the records queued behind each
    // session's current one are released to the next owner, and on a broker that drops commit
    // metadata (nisshi) the ones finished above them are then replayed (see `shutdown`).
    let yaml = topics.stage_yaml(
        "{transientRate: 0.1, latencyMs: 20, seed: 9}",
        "maxInFlightPerPartition: 100\nshutdownDrainQueued: true",
    );
    let first = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(120), || topics.output_count() >= 2_000)
        .await
        .expect("progress");
    let status = first.terminate();
    assert!(status.success(), "graceful stop exits 0, got {status}");
    let stopped_at = topics.output_count();
    assert!(stopped_at < 10_000, "stopped too late to test anything");

    let second = WorkerProcess::spawn(&yaml);
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    assert!(second.terminate().success());

    let report = verify_pipeline(&topics);
    eprintln!("SIGTERM at {stopped_at} outputs, restart:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.duplicates, 0, "{report}");
    assert_eq!(report.records, 10_000, "{report}");
    topics.delete().await;
}
