//! Backpressure: with tiny dispatchers and a slow handler the partitions are held (nothing more
//! taken from their queues), records parked, and released — nothing dropped, order kept,
//! memory bounded. A held partition holds only itself: the others' records do not
//! wait behind its own.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sessionflow_tests::{brokers, builtin, verify_pipeline, Gate, RecordingHandler, Topics};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};

use crate::produce_round_robin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_dispatchers_hold_and_release_partitions_without_loss() {
    let topics = Topics::create("backpressure", 2).await;
    produce_round_robin(&topics, 50, 20).await;
    let handler = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .with_delay(|_, _| Duration::from_millis(3));
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.dispatchers = 1;
    stage.dispatcher_capacity = 2;
    stage.max_in_flight_per_partition = 64;
    // Holds are short and frequent here: read the lag often enough to see one.
    stage.lag_interval_ms = 50;
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();

    // Sample the worker's own gauges while it runs.
    let (max_held, max_pending, max_in_flight, lag_while_held) = (
        Arc::new(AtomicI64::new(0)),
        Arc::new(AtomicI64::new(0)),
        Arc::new(AtomicI64::new(0)),
        Arc::new(AtomicI64::new(0)),
    );
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let m = worker.metrics.clone();
        let input = topics.input.clone();
        let (p, q, f, l, d) = (
            max_held.clone(),
            max_pending.clone(),
            max_in_flight.clone(),
            lag_while_held.clone(),
            done.clone(),
        );
        tokio::spawn(async move {
            while !d.load(Ordering::Relaxed) {
                let held = m.paused_partitions.get();
                p.fetch_max(held, Ordering::Relaxed);
                if held > 0 {
                    // The lag gauge comes from the broker on its own timer: it must keep
                    // reporting the backlog while partitions are held.
                    let lag: i64 = (0..2)
                        .filter_map(|part| {
                            m.partition_lag
                                .get_metric_with_label_values(&[&input, &part.to_string()])
                                .ok()
                        })
                        .map(|g| g.get())
                        .sum();
                    l.fetch_max(lag, Ordering::Relaxed);
                }
                q.fetch_max(m.pending_records.get(), Ordering::Relaxed);
                f.fetch_max(m.in_flight.get(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    topics.wait_fully_committed(Duration::from_secs(120)).await;
    done.store(true, Ordering::Relaxed);
    sampler.await.unwrap();
    // Once everything is committed, the reported lag of every partition drops to 0.
    let input = topics.input.clone();
    let lag_now = || -> i64 {
        (0..2)
            .map(|p| {
                worker
                    .metrics
                    .partition_lag
                    .with_label_values(&[&input, &p.to_string()])
                    .get()
            })
            .sum()
    };
    sessionflow_tests::wait_until(Duration::from_secs(30), || lag_now() == 0)
        .await
        .expect("reported lag drops to 0");
    let held_at_end = worker.metrics.paused_partitions.get();
    worker.shutdown().await.unwrap();

    let (held, pending, in_flight) = (
        max_held.load(Ordering::Relaxed),
        max_pending.load(Ordering::Relaxed),
        max_in_flight.load(Ordering::Relaxed),
    );
    eprintln!(
        "max held partitions {held}, max parked records {pending}, max in flight {in_flight}"
    );
    assert!(held >= 1, "the partitions were never held");
    assert!(
        lag_while_held.load(Ordering::Relaxed) > 0,
        "no lag reported while held"
    );
    assert_eq!(held_at_end, 0, "a partition stayed held");
    // Bounded: a partition is held once a record of it is parked and at its in-flight cap, and
    // a burst taken from librdkafka is no larger than the partition's in-flight room, so what
    // is parked is at most the rest of one burst per partition and at most the cap is in
    // flight — not the 1,000 waiting in the topic.
    assert!(pending <= 2 * 64, "{pending} records parked");
    assert!(in_flight <= 2 * 64, "{in_flight} records in flight");
    let report = verify_pipeline(&topics);
    assert!(report.is_ok(), "{report}");
    assert_eq!((report.records, report.duplicates), (1_000, 0), "{report}");
    handler.assert_in_order();
    topics.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_partition_does_not_hold_the_others() {
    let topics = Topics::create("held-alone", 2).await;
    produce_round_robin(&topics, 20, 100).await;
    // session-000000's first record never finishes until the gate opens: its partition reaches
    // its in-flight cap and is held, with most of its records still waiting in librdkafka.
    let gate = Gate::default();
    let handler = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .holding(|s, q| s == "session-000000" && q == 1, gate.clone());
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.max_in_flight_per_partition = 50;
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    sessionflow_tests::wait_until(Duration::from_secs(60), || {
        worker.metrics.paused_partitions.get() == 1
    })
    .await
    .expect("the hung session's partition is held");
    // Records produced now, to both partitions, arrive behind the held partition's waiting
    // ones. The other partition takes its own and finishes them.
    let late = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        session_prefix: "late-".into(),
        ..LoadgenOptions::new(&brokers(), &topics.input, 200, 20)
    };
    loadgen::run(&late).await.unwrap();
    let ends = topics.end_offsets(&topics.input);
    let free = sessionflow_tests::wait_until(Duration::from_secs(60), || {
        let committed = topics.committed();
        (0..2).any(|p| committed[p] == ends[p])
    })
    .await;
    let committed = topics.committed();
    assert!(
        free.is_ok(),
        "no partition finished while one was held: committed {committed:?}, ends {ends:?}"
    );
    assert_eq!(worker.metrics.paused_partitions.get(), 1);
    assert!(
        (0..2).any(|p| committed[p] < ends[p]),
        "the held partition cannot have finished: {committed:?}"
    );
    gate.open();
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    worker.shutdown().await.unwrap();
    let report = verify_pipeline(&topics);
    assert!(report.is_ok(), "{report}");
    assert_eq!((report.records, report.duplicates), (2_200, 0), "{report}");
    handler.assert_in_order();
    topics.delete().await;
}

/// The in-flight cap counts from the last commit the broker confirmed, so a partition that
/// reaches it is held until a commit is confirmed. With the commit interval an hour away, only
/// the early commits (once the replay span reaches half the cap and the watermark has gained an
/// eighth of it, see `offsets`) can release it: a backlog of thirty caps drains, and the
/// group's committed offset follows it, long before the interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_commits_release_a_held_partition_without_the_interval() {
    const CAP: i64 = 64;
    let topics = Topics::create("early-commit", 1).await;
    produce_round_robin(&topics, 40, 50).await;
    let records: i64 = topics.end_offsets(&topics.input).iter().sum();
    let handler = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())));
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.max_in_flight_per_partition = CAP as usize;
    stage.settings.commit_interval_ms = Some(3_600_000);
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();

    let output = topics.output.clone();
    let written = || -> i64 { topics.end_offsets(&output).iter().sum() };
    sessionflow_tests::wait_until(Duration::from_secs(60), || written() == records)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{} of {records} records drained with a cap of {CAP}, committed {:?}: \
                 the held partition was not released by early commits",
                written(),
                topics.committed()
            )
        });
    // Within the cap of the end (what is left above the last early commit is less than the
    // span that would want another one), and no longer held once the worker has the answer.
    let held = || worker.metrics.paused_partitions.get();
    sessionflow_tests::wait_until(Duration::from_secs(30), || {
        topics.committed()[0] >= records - CAP && held() == 0
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "committed {:?} of {records}, {} partition(s) held",
            topics.committed(),
            held()
        )
    });
    worker.shutdown().await.unwrap();
    topics.wait_fully_committed(Duration::from_secs(30)).await;
    let report = verify_pipeline(&topics);
    assert!(report.is_ok(), "{report}");
    assert_eq!((report.records, report.duplicates), (2_000, 0), "{report}");
    handler.assert_in_order();
    topics.delete().await;
}
