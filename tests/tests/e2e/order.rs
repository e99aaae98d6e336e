//! Guarantee 1 and 2 under transient faults: per-session order at the handler and in the
//! output, nothing lost, every offset committed.

use std::time::Duration;

use sessionflow_tests::{builtin, http_get, verify_pipeline, RecordingHandler, Topics};

use crate::produce_round_robin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stay_ordered_under_transient_faults() {
    let topics = Topics::create("order", 8).await;
    produce_round_robin(&topics, 200, 100).await;

    let handler = RecordingHandler::flaky(0.10);
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    // The HTTP endpoints a Deployment probes and Prometheus scrapes.
    let addr = worker.metrics_addr.unwrap();
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    assert_eq!(http_get(addr, "/readyz").await.0, 200);
    let (status, metrics) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("sessionflow_records_in_total{stage=\"test\"} 20000"),
        "{metrics}"
    );
    assert!(metrics.contains("sessionflow_order_violations_total{at=\"handler\",stage=\"test\"} 0"));
    let retries = worker.metrics.retries.get();
    let records_in = worker.metrics.records_in.get();
    let violations = sessionflow_tests::order_violations(&worker.metrics);
    assert_eq!(violations, 0, "the ordering watchdog saw violations");
    assert!(worker.health.is_ready());
    worker.shutdown().await.unwrap();

    // At the handler: every session saw 1..=100 in order, retries in place, never concurrently.
    let problems = handler.order_problems();
    assert!(
        problems.is_empty(),
        "order problems at the handler: {:?}",
        &problems[..problems.len().min(10)]
    );
    {
        let seen = handler.seen.lock().unwrap();
        assert_eq!(
            seen.attempts.len(),
            200,
            "every session reached the handler"
        );
        for (session, calls) in &seen.attempts {
            let last_first_attempt = calls.iter().filter(|(_, a)| *a == 1).map(|(s, _)| *s).max();
            assert_eq!(
                last_first_attempt,
                Some(100),
                "{session} did not get all its records"
            );
        }
    }
    assert_eq!(records_in, 20_000);
    assert!(
        retries > 1_000,
        "10% faults should retry about 2,200 times, got {retries}"
    );

    // In the output: in order, nothing lost, nothing duplicated, nothing in the DLQ.
    let report = verify_pipeline(&topics);
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records, 20_000, "{report}");
    assert_eq!(report.duplicates, 0, "{report}");
    assert_eq!(report.dlq_records, 0, "{report}");
    // Committed offsets equal the end offsets (checked by wait_fully_committed, re-read here
    // after shutdown's final commit).
    assert_eq!(topics.committed(), topics.end_offsets(&topics.input));
    topics.delete().await;
}
