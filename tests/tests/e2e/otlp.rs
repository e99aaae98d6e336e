//! Spans leave the worker over OTLP/HTTP when `otlpEndpoint` is set: a stand-in collector (an
//! HTTP server here) receives protobuf trace exports from a worker process — of the records the
//! head sampler (`OTEL_TRACES_SAMPLER`) picks, following the `traceparent`'s sampled flag.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use sessionflow_tests::{produce_one, Topics, WorkerProcess};

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

/// Runs a worker exporting to a stand-in collector over `topics` (already produced), with
/// `env`, until everything is committed; (exports, bytes) the collector received.
async fn exported(topics: &Topics, env: &[(&str, &str)]) -> (usize, usize) {
    let collector = Collector::default();
    let app = Router::new()
        .route("/v1/traces", post(traces))
        .with_state(collector.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let yaml = topics.stage_yaml(
        "{latencyMs: 1}",
        &format!("otlpEndpoint: http://{addr}/v1/traces"),
    );
    let worker =
        WorkerProcess::spawn_with_env(&yaml, &[], std::process::Stdio::inherit(), "warn", env);
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    // A graceful stop flushes the batch of spans still in memory.
    assert!(worker.terminate().success());
    let (exports, bytes) = (
        collector.exports.load(Ordering::Relaxed),
        collector.bytes.load(Ordering::Relaxed),
    );
    eprintln!("collector received {exports} exports, {bytes} bytes");
    (exports, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_otlp_http() {
    let topics = Topics::create("otlp", 2).await;
    produce_round_robin(&topics, 10, 10).await;
    // Records without a traceparent are roots: every one sampled at always_on.
    let (exports, bytes) =
        exported(&topics, &[("OTEL_TRACES_SAMPLER", "parentbased_always_on")]).await;
    assert!(exports >= 1, "no OTLP export reached the collector");
    // 100 records, each a record span and an attempt span: far more than a few bytes.
    assert!(bytes > 5_000, "only {bytes} bytes of spans");
    topics.delete().await;
}

/// 100 records whose traceparents carry `flags`, over 10 sessions.
async fn produce_traced(topics: &Topics, flags: &str) {
    for i in 0..100u64 {
        let tp = format!("00-{:032x}-{:016x}-{flags}", 0xabc0_0000 + i, i + 1);
        let key = format!("s{}", i % 10);
        produce_one(&topics.input, Some(&key), "v", &[("traceparent", &tp)]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_sampler_follows_the_traceparents_sampled_flag() {
    // Not sampled upstream: no span at all, nothing exported (the ratio applies to roots only).
    let topics = Topics::create("otlp-unsampled", 2).await;
    produce_traced(&topics, "00").await;
    let (exports, bytes) = exported(&topics, &[]).await;
    assert_eq!(
        (exports, bytes),
        (0, 0),
        "spans of unsampled records were exported"
    );
    topics.delete().await;
    // Sampled upstream: every record's spans are exported, although the ratio is 1 %.
    let topics = Topics::create("otlp-sampled", 2).await;
    produce_traced(&topics, "01").await;
    let (exports, bytes) = exported(&topics, &[]).await;
    assert!(exports >= 1, "no OTLP export reached the collector");
    assert!(
        bytes > 5_000,
        "only {bytes} bytes of spans for 100 sampled records"
    );
    topics.delete().await;
}

#[test]
fn a_bad_sampler_setting_exits_2_naming_the_variable() {
    for (var, value) in [
        ("OTEL_TRACES_SAMPLER", "sometimes"),
        ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
    ] {
        let out = std::process::Command::new(sessionflow_tests::worker_binary())
            // The variables are read before the config file, which is not there.
            .args(["run", "--config", "/nonexistent/sessionflow.yaml"])
            .env("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
            .env(var, value)
            .output()
            .expect("run the worker binary");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {stderr}");
        assert!(stderr.contains(var), "{var}={value}: {stderr}");
    }
}
