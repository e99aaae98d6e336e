//! Fatal client errors are loud (issue 10, item 4): an idempotent producer that can no longer
//! guarantee order must not leave the worker running with every probe green. It goes
//! not-ready and ends with an error (the binary exits non-zero, Kubernetes restarts it), and
//! the restart replays what was in flight: nothing is lost.

use std::ffi::CString;
use std::time::Duration;

use rdkafka::bindings::{rd_kafka_resp_err_t, rd_kafka_test_fatal_error};
use rdkafka::producer::Producer;
use sessionflow_tests::{verify_pipeline, wait_until, Topics};
use sessionflow_worker::config::{BuiltinHandlerConfig, HandlerConfig, StageConfig};
use sessionflow_worker::handler::ConfiguredHandler;
use sessionflow_worker::RunningWorker;

/// A worker running `stage` with the builtin handler its config names.
async fn start(stage: StageConfig) -> RunningWorker {
    let handler = ConfiguredHandler::from_config(&stage.handler).unwrap();
    sessionflow_worker::start(stage, handler).await.unwrap()
}

use crate::produce_round_robin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_producer_error_stops_the_worker_not_ready_and_failing() {
    let topics = Topics::create("fatal", 4).await;
    produce_round_robin(&topics, 50, 60).await;
    let mut stage = topics.stage(HandlerConfig::Builtin(BuiltinHandlerConfig {
        latency_ms: 5,
        ..Default::default()
    }));
    stage.settings.shutdown_timeout_ms = Some(2_000);
    let worker = start(stage).await;
    wait_until(Duration::from_secs(60), || topics.output_count() >= 300)
        .await
        .expect("progress before the fault");
    assert!(worker.health.is_ready());

    // librdkafka's own test hook: the error an idempotent producer raises when it can no
    // longer keep its guarantees (here OUT_OF_ORDER_SEQUENCE_NUMBER).
    let reason = CString::new("injected by the test").unwrap();
    let raised = unsafe {
        rd_kafka_test_fatal_error(
            worker.producer_client().client().native_ptr(),
            rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER,
            reason.as_ptr(),
        )
    };
    assert_eq!(raised, rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);

    let health = worker.health.clone();
    let metrics = worker.metrics.clone();
    // A bound against a hang, not a timing claim: the worker must end by itself.
    let ended = tokio::time::timeout(Duration::from_secs(60), worker.wait())
        .await
        .expect("the worker stops by itself after a fatal error");
    let error = ended.expect_err("a fatal error ends the run with an error");
    eprintln!("run ended: {error:#}");
    assert!(!health.is_ready(), "not ready after a fatal error");
    assert_eq!(metrics.fatal_errors.get(), 1);

    // The restart replays what was in flight: nothing lost, order kept.
    let again = start(topics.stage(sessionflow_tests::builtin(0.0, 0.0))).await;
    topics.wait_fully_committed(Duration::from_secs(120)).await;
    again.shutdown().await.unwrap();
    let report = verify_pipeline(&topics);
    eprintln!("after a fatal producer error and a restart:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records - report.duplicates, 3_000, "{report}");
    topics.delete().await;
}
