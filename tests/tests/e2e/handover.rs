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
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};

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
async fn handler_calls_longer_than_the_drain_write_nothing_after_handover_consumer_protocol() {
    joins_and_leaves_with_calls_longer_than_the_drain("consumer").await;
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

/// A worker told to stop while its results are still on their way must not leave the group
/// with them out (issue 10, item 1; the chaos run of seed 1796107210 ended with 119 sessions
/// ending stale this way, after a SIGTERM during a burst of refused produces). Once it has
/// left, the next owner redoes those records and goes on with the sessions; a result of the
/// old owner landing then ends a session on an older record than one already written.
///
/// Here worker `a`'s producer holds every output for 40 s before sending it (`linger.ms`: a
/// stand-in for a produce that is slow to go out, deterministic where refusals and retries
/// are not), while worker `b` writes at once. `a` is told to stop with its sessions' results
/// all still on their way: it must give them up (purged from the producer, never sent) before
/// it leaves, so that nothing of it lands after `b` took its partitions over — even though its
/// process then goes on closing down for a while.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_with_results_on_their_way_gives_them_up_before_leaving() {
    const SESSIONS: u64 = 40;
    const PER_SESSION: u64 = 120;
    let topics = Topics::create("stop-lingering", 4).await;
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
    let yaml = topics.stage_yaml(
        "{latencyMs: 5, seed: 5}",
        "rebalance: {strategy: cooperative, drainTimeoutMs: 500}\nshutdownTimeoutMs: 2000",
    );
    let lingering = yaml.replace("linger.ms: '2'", "linger.ms: '40000'");
    assert_ne!(lingering, yaml, "the test's linger.ms is in the config");
    let (a, log) = spawn_logged(&lingering, "stopped-worker", "info");
    let b = WorkerProcess::spawn(&yaml);
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    // Both hold partitions; `b`'s sessions make progress, `a`'s wait for their first results.
    wait_until(Duration::from_secs(90), || {
        read_log().contains("partition assigned") && topics.output_count() >= 600
    })
    .await
    .unwrap_or_else(|()| panic!("both workers take partitions; `a` said:\n{}", read_log()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stopped = tokio::task::spawn_blocking(move || a.terminate())
        .await
        .expect("stop");
    let said = read_log();
    let _ = std::fs::remove_file(&log);
    eprintln!(
        "the stopped worker said:\n{}",
        said.lines()
            .filter(|l| l.contains("sessionflow_worker"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        stopped.success(),
        "the stopped worker exits 0, got {stopped}"
    );
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    assert!(b.terminate().success());
    let report = verify_pipeline(&topics);
    eprintln!("stopped with results on their way:\n{report}");
    assert_eq!(report.stale_ends, 0, "{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(
        report.records - report.duplicates + report.dlq_records,
        SESSIONS * PER_SESSION,
        "{report}"
    );
    topics.delete().await;
}

/// A member serves its rebalance however many events are waiting before it. librdkafka's log
/// lines are events on the consumer's main queue, like rebalances, and `poll` serves one event
/// per call and then answers `None`, as it does for an empty queue: a loop that stopped at the
/// first `None` served one event per turn. With debug logging on (hundreds of events a second),
/// a revocation waited behind the backlog until the group had gone on without the member —
/// which meanwhile went on writing for partitions that had new owners (chaos seed
/// 1796124295, run with librdkafka's `debug: cgrp,protocol`).
///
/// Here worker `a` has librdkafka log everything it can (`debug: all`, and the worker's log
/// level lets librdkafka's debug lines through) while worker `b` joins an eager group: `a`
/// must give its partitions up with a revocation — not find them lost later — and no session
/// may end on an older record. Apache Kafka waits for a member's rejoin up to its
/// `max.poll.interval.ms` (5 min by default): 10 s here, so that a revocation held back by
/// the flood costs the member its partitions, as in the chaos run (one event per turn held it
/// back for ~60 s on this test's flood).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_flooded_with_log_events_serves_its_rebalance_in_time() {
    const SESSIONS: u64 = 20;
    const RECORDS: u64 = 3_000;
    let topics = Topics::create("event-flood", 4).await;
    let produce = |seed: u64| {
        let opts = LoadgenOptions {
            choice: SessionChoice::RoundRobin,
            seed,
            session_prefix: format!("s{seed}-"),
            ..LoadgenOptions::new(
                &sessionflow_tests::brokers(),
                &topics.input,
                RECORDS,
                SESSIONS,
            )
        };
        async move { loadgen::run(&opts).await.expect("loadgen") }
    };
    produce(1).await;
    let yaml = topics
        .stage_yaml(
            "{latencyMs: 20, seed: 6}",
            "rebalance: {strategy: eager, drainTimeoutMs: 500}",
        )
        .replace("kafka:\n", "kafka:\n  max.poll.interval.ms: '10000'\n");
    let flooded = yaml.replace("kafka:\n", "kafka:\n  debug: all\n");
    assert_ne!(flooded, yaml, "the config has a kafka section");
    // librdkafka emits only what the worker's log level lets through.
    let (a, log) = spawn_logged(&flooded, "flooded-worker", "info,librdkafka=debug");
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    // `a` works through the first records, then idles: its loop turns slowly, and events
    // pile up faster than one a turn before `b` comes.
    wait_until(Duration::from_secs(90), || {
        topics.output_count() >= RECORDS as i64
    })
    .await
    .unwrap_or_else(|()| panic!("`a` makes progress; it said:\n{}", read_log()));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let b = WorkerProcess::spawn(&yaml);
    produce(2).await;
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    let stopped_a = a.terminate();
    assert!(b.terminate().success());
    let said = read_log();
    let _ = std::fs::remove_file(&log);
    let engine: Vec<&str> = said
        .lines()
        .filter(|l| l.contains("sessionflow_worker"))
        .collect();
    eprintln!("the flooded worker said:\n{}", engine.join("\n"));
    let flood = said
        .lines()
        .filter(|l| l.contains("DEBUG librdkafka"))
        .count();
    eprintln!("librdkafka debug lines: {flood}");
    assert!(
        flood >= 1_000,
        "`a` was flooded: {flood} librdkafka debug lines"
    );
    assert!(stopped_a.success(), "`a` exits 0, got {stopped_a}");
    assert!(
        !said.contains("partitions lost"),
        "the group gave up on `a` before it served its revocation"
    );
    let first = |what: &str| engine.iter().position(|l| l.contains(what));
    assert!(
        first("partition revoked") < first("stop requested"),
        "`a` hands partitions over when `b` joins, before it is stopped"
    );
    let report = verify_pipeline(&topics);
    eprintln!("a member flooded with log events:\n{report}");
    assert_eq!(report.stale_ends, 0, "{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(
        report.records - report.duplicates + report.dlq_records,
        2 * RECORDS,
        "{report}"
    );
    topics.delete().await;
}

/// A worker process logging at `level` to a file of its own (named after `name`), for a test
/// that reads what it said; the test removes the file when it is done.
fn spawn_logged(yaml: &str, name: &str, level: &str) -> (WorkerProcess, std::path::PathBuf) {
    let log = std::env::temp_dir().join(sessionflow_tests::unique(name) + ".log");
    let worker = WorkerProcess::spawn_logging_at(
        yaml,
        &[],
        std::fs::File::create(&log).expect("log file").into(),
        level,
    );
    (worker, log)
}
