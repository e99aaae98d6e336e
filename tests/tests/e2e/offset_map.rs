//! Bounded replay through commit metadata, on Apache Kafka.
//!
//! A first worker finishes every record but one session's (its first record hangs); its commit
//! stays at that record's offset and carries the map of everything done above it. A second
//! worker in the same group then processes only the unfinished records. And a map too large for
//! the broker's metadata limit holds intake until it shrinks.

use std::time::Duration;

use sessionflow_tests::{
    brokers, builtin, committed_with_metadata_on, wait_until, Gate, RecordingHandler, Topics,
};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};
use sessionflow_worker::commit::offset_map;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_skips_what_the_commit_metadata_says_is_done() {
    let (brokers, topics) = (brokers(), Topics::create("map", 1).await);
    // 10 sessions × 5 records on one partition; session-000000's first record is offset 0.
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        ..LoadgenOptions::new(&brokers, &topics.input, 50, 10)
    };
    loadgen::run(&opts).await.unwrap();

    let stage = |handler_name: &str| {
        let mut s = topics.stage(builtin(0.0, 0.0));
        s.stage = handler_name.into();
        s.settings.shutdown_timeout_ms = Some(500);
        s
    };

    // First worker: session-000000 hangs on its first record; everything else finishes.
    let hanging = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .with_delay(|s, q| {
            if s == "session-000000" && q == 1 {
                Duration::from_secs(3_600)
            } else {
                Duration::ZERO
            }
        });
    let first = sessionflow_worker::start(stage("first"), hanging.clone())
        .await
        .unwrap();
    wait_until(Duration::from_secs(60), || {
        let (offset, metadata) = committed_with_metadata_on(&brokers, &topics.group, &topics.input);
        offset == 0 && offset_map::decode(0, &metadata).is_ok_and(|m| m.count() == 45)
    })
    .await
    .expect("the commit carries the map of the 45 finished records above offset 0");
    first.shutdown().await.unwrap();
    let (offset, metadata) = committed_with_metadata_on(&brokers, &topics.group, &topics.input);
    let map = offset_map::decode(offset, &metadata).unwrap();
    assert_eq!(offset, 0);
    for o in 0..50 {
        // session-000000 owns offsets 0, 10, 20, 30, 40 (round robin over 10 sessions).
        // Records of a new topic's first leader: epoch 0. The map was written at that epoch,
        // so a record of a later leader at the same offset would not count as done.
        assert_eq!(map.is_done(o, 0), o % 10 != 0, "offset {o}");
        assert!(!map.is_done(o, 1), "offset {o} of a newer leader");
    }

    // Second worker, same group: only session-000000's five records are processed again.
    let fresh = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())));
    let second = sessionflow_worker::start(stage("second"), fresh.clone())
        .await
        .unwrap();
    wait_until(Duration::from_secs(60), || {
        committed_with_metadata_on(&brokers, &topics.group, &topics.input).0 == 50
    })
    .await
    .expect("the second worker finishes the partition");
    let skipped = second.metrics.replay_skipped.get();
    second.shutdown().await.unwrap();
    {
        let seen = fresh.seen.lock().unwrap();
        let sessions: Vec<&String> = seen.attempts.keys().collect();
        assert_eq!(
            sessions,
            vec!["session-000000"],
            "only the unfinished session was replayed"
        );
        assert_eq!(seen.attempts["session-000000"].len(), 5);
    }
    assert_eq!(skipped, 45);
    topics.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_map_too_large_for_metadata_holds_intake_until_it_shrinks() {
    let (brokers, topics) = (brokers(), Topics::create("overflow", 1).await);
    // 30,000 sessions with one record each; every odd-numbered session is held in its handler
    // until the test opens the gate, so finished and unfinished offsets alternate: the map
    // needs ~30,000 runs or a 3,750-byte bitset — more than commit metadata may hold.
    let load = |records: u64, prefix: &str| LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        session_prefix: prefix.into(),
        ..LoadgenOptions::new(&brokers, &topics.input, records, records)
    };
    loadgen::run(&load(30_000, "s-")).await.unwrap();
    let gate = Gate::default();
    let handler = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .holding(
            |s, _| {
                s.strip_prefix("s-")
                    .and_then(|n| n.parse::<u64>().ok())
                    .is_some_and(|n| n % 2 == 1)
            },
            gate.clone(),
        );
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.max_in_flight_per_partition = 100_000;
    let worker = sessionflow_worker::start(stage, handler).await.unwrap();

    // Once the map outgrows commit metadata the partition is held (possibly before all
    // 30,000 records are in).
    wait_until(Duration::from_secs(120), || {
        worker.metrics.map_overflow_partitions.get() == 1
    })
    .await
    .expect("the map overflows");
    assert_eq!(
        worker.metrics.paused_partitions.get(),
        1,
        "the partition is held"
    );
    // The commit falls back to the plain watermark (no metadata) while the map is too large;
    // the watermark is offset 1, the first held record (s-000001).
    wait_until(Duration::from_secs(60), || {
        committed_with_metadata_on(&brokers, &topics.group, &topics.input) == (1, String::new())
    })
    .await
    .expect("plain watermark committed");
    // New records are not taken in while the map is too large…
    let held_at = worker.metrics.records_in.get();
    assert!(held_at < 31_000);
    loadgen::run(&load(1_000, "late-")).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        worker.metrics.records_in.get(),
        held_at,
        "intake was not held"
    );
    assert_eq!(worker.metrics.map_overflow_partitions.get(), 1);
    // …and are once the held records finish and the map shrinks.
    gate.open();
    wait_until(Duration::from_secs(120), || {
        committed_with_metadata_on(&brokers, &topics.group, &topics.input).0 == 31_000
    })
    .await
    .expect("intake resumed and the partition completed");
    assert_eq!(worker.metrics.records_in.get(), 31_000);
    assert_eq!(worker.metrics.map_overflow_partitions.get(), 0);
    assert_eq!(worker.metrics.records_out.get(), 31_000);
    worker.shutdown().await.unwrap();
    topics.delete().await;
}
