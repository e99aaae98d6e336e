//! Spans leave the worker over OTLP/HTTP when `otlpEndpoint` is set: a stand-in collector (an
//! HTTP server here) receives protobuf trace exports from a worker process.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use sessionflow_tests::{Topics, WorkerProcess};

use crate::produce_round_robin;

#[derive(Clone, Default)]
struct Collector {
    exports: Arc<AtomicUsize>,
    bytes: Arc<AtomicUsize>,
}

async fn traces(State(c): State<Collector>, headers: HeaderMap, body: Bytes) -> StatusCode {
    if headers
        .get("content-type")
        .is_some_and(|v| v.as_bytes() == b"application/x-protobuf")
    {
        c.exports.fetch_add(1, Ordering::Relaxed);
        c.bytes.fetch_add(body.len(), Ordering::Relaxed);
    }
    StatusCode::OK
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_otlp_http() {
    let collector = Collector::default();
    let app = Router::new()
        .route("/v1/traces", post(traces))
        .with_state(collector.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let topics = Topics::create("otlp", 2).await;
    produce_round_robin(&topics, 10, 10).await;
    let yaml = topics.stage_yaml(
        "{latencyMs: 1}",
        &format!("otlpEndpoint: http://{addr}/v1/traces"),
    );
    let worker = WorkerProcess::spawn(&yaml);
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    // A graceful stop flushes the batch of spans still in memory.
    assert!(worker.terminate().success());
    let (exports, bytes) = (
        collector.exports.load(Ordering::Relaxed),
        collector.bytes.load(Ordering::Relaxed),
    );
    eprintln!("collector received {exports} exports, {bytes} bytes");
    assert!(exports >= 1, "no OTLP export reached the collector");
    // 100 records, each a record span and an attempt span: far more than a few bytes.
    assert!(bytes > 5_000, "only {bytes} bytes of spans");
    topics.delete().await;
}
