//! Stuck records: a handler call that never returns is cut off after `stuck.timeoutMs`, goes to
//! the DLQ as `stuck`, and its partition keeps committing; a busy partition whose records merely
//! wait in their session's queue is never reported.

use std::time::Duration;

use sessionflow_tests::{builtin, verify_pipeline, RecordingHandler, Topics};
use sessionflow_tools::verify::read_topic;
use sessionflow_worker::config::{StuckActionConfig, StuckConfig};
use sessionflow_worker::record::header;

use crate::produce_round_robin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_handler_call_is_dead_lettered_as_stuck() {
    let topics = Topics::create("stuck", 4).await;
    produce_round_robin(&topics, 20, 10).await;
    let hung = "session-000003";
    let handler = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .with_delay(move |s, q| {
            if s == hung && q == 2 {
                Duration::from_secs(3_600) // never, as far as the test is concerned
            } else {
                Duration::ZERO
            }
        });
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.settings.stuck = Some(StuckConfig {
        timeout_ms: 1_000,
        action: StuckActionConfig::Dlq,
    });
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    // The partition of the hung record commits to its end: the record was let go.
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    assert_eq!(worker.metrics.stuck_records.get(), 1);
    assert_eq!(worker.metrics.stuck_now.get(), 0);
    worker.shutdown().await.unwrap();

    let dlq = read_topic(
        &sessionflow_tests::brokers(),
        &topics.dlq,
        None,
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(dlq.len(), 1, "{dlq:?}");
    assert_eq!(dlq[0].header(header::DLQ_REASON), Some("stuck"));
    assert_eq!(
        (dlq[0].session.as_deref(), dlq[0].seq),
        (Some(hung), Some(2))
    );
    // Everyone else unaffected, and the hung session carried on with seq 3..10.
    let report = verify_pipeline(&topics);
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records, 199, "{report}");
    handler.assert_in_order();
    topics.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_partition_is_not_reported_stuck() {
    let topics = Topics::create("busy", 1).await;
    // 10 sessions × 60 records at 30 ms each: records wait up to ~1.8 s in their session's
    // queue, well past the 500 ms stuck timeout, but no handler call takes that long.
    produce_round_robin(&topics, 10, 60).await;
    let handler = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .with_delay(|_, _| Duration::from_millis(30));
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.settings.stuck = Some(StuckConfig {
        timeout_ms: 500,
        action: StuckActionConfig::Dlq,
    });
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    assert_eq!(worker.metrics.stuck_records.get(), 0);
    worker.shutdown().await.unwrap();
    let report = verify_pipeline(&topics);
    assert!(report.is_ok(), "{report}");
    assert_eq!((report.records, report.dlq_records), (600, 0), "{report}");
    topics.delete().await;
}
