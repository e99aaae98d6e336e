//! Rebalance safety with several worker processes in one group: scale 1 → 3 → 1 while 100k
//! records over 1,000 sessions flow. Revoked partitions are drained and committed before they
//! move, so nothing is lost, no session is reordered, and replays stay within the in-flight
//! window. Run for the three group protocols: classic eager and cooperative, and KIP-848.

use std::time::Duration;

use sessionflow_tests::{
    assert_replays_within, verify_pipeline, wait_until, Topics, WorkerProcess,
};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};

async fn scale_one_three_one(strategy: &str) {
    let topics = Topics::create(&format!("scale-{strategy}"), 8).await;
    let max_in_flight = 400;
    let yaml = topics.stage_yaml(
        "{transientRate: 0.02, latencyMs: 40, seed: 11}",
        &format!(
            "maxInFlightPerPartition: {max_in_flight}\nrebalance: {{strategy: {strategy}, drainTimeoutMs: 4000}}\n\
             shutdownTimeoutMs: 4000"
        ),
    );
    let a = WorkerProcess::spawn(&yaml);
    // Records keep arriving while the group changes.
    let load = {
        let opts = LoadgenOptions {
            choice: SessionChoice::RoundRobin,
            ..LoadgenOptions::new(&sessionflow_tests::brokers(), &topics.input, 100_000, 1_000)
        };
        tokio::spawn(async move { loadgen::run(&opts).await })
    };
    wait_until(Duration::from_secs(120), || topics.output_count() >= 15_000)
        .await
        .expect("one worker makes progress");
    let b = WorkerProcess::spawn(&yaml);
    let c = WorkerProcess::spawn(&yaml);
    let at_three = topics.output_count();
    wait_until(Duration::from_secs(120), || {
        topics.output_count() >= at_three + 30_000
    })
    .await
    .expect("three workers make progress");
    assert!(b.terminate().success());
    assert!(c.terminate().success());
    load.await.unwrap().expect("loadgen");
    topics.wait_fully_committed(Duration::from_secs(240)).await;
    assert!(a.terminate().success());

    let report = verify_pipeline(&topics);
    eprintln!("scale 1→3→1 ({strategy}), 3 workers from {at_three} outputs:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, 100_000, "{report}");
    // Four group changes; each can replay at most the in-flight window of the partitions
    // that moved.
    assert_replays_within(&report, 4 * 8 * max_in_flight as u64);
    topics.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_out_and_in_cooperative() {
    scale_one_three_one("cooperative").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_out_and_in_eager() {
    scale_one_three_one("eager").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_out_and_in_consumer_protocol() {
    scale_one_three_one("consumer").await;
}
