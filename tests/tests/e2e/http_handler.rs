//! The HTTP handler end to end: a real HTTP service decides each record's fate by status code,
//! and sees the session, event id, attempt and the record's own headers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use sessionflow_tests::{brokers, Topics};
use sessionflow_tools::verify::read_topic;
use sessionflow_worker::config::{HandlerConfig, HttpHandlerConfig};
use sessionflow_worker::handler::ConfiguredHandler;
use sessionflow_worker::record::header;

type Calls = Arc<Mutex<Vec<HashMap<String, String>>>>;

async fn service(
    State(calls): State<Calls>,
    headers: HeaderMap,
    body: String,
) -> (StatusCode, String) {
    let h: HashMap<String, String> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or_default().to_string()))
        .collect();
    let seq: u64 = h.get(header::SEQ).and_then(|v| v.parse().ok()).unwrap_or(0);
    let attempt: u32 = h
        .get(header::ATTEMPT)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let session = h.get(header::SESSION).cloned().unwrap_or_default();
    calls.lock().unwrap().push(h);
    match (seq, attempt) {
        (2, _) => (StatusCode::UNPROCESSABLE_ENTITY, "bad input".into()),
        (4, 1) => (StatusCode::SERVICE_UNAVAILABLE, "try later".into()),
        (5, 1) => (StatusCode::TOO_MANY_REQUESTS, "slow down".into()),
        (6, _) => (StatusCode::NO_CONTENT, String::new()),
        _ => (StatusCode::OK, format!("{session}:{seq}:{}", body.len())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_status_codes_decide_the_fate_of_records() {
    let calls: Calls = Arc::default();
    let app = Router::new()
        .route("/process", post(service))
        .with_state(calls.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let topics = Topics::create("http", 2).await;
    crate::produce_round_robin(&topics, 5, 8).await;
    let handler_config = HandlerConfig::Http(HttpHandlerConfig {
        url: format!("http://{addr}/process"),
        timeout_ms: 5_000,
    });
    let handler = ConfiguredHandler::from_config(&handler_config).unwrap();
    let worker = sessionflow_worker::start(topics.stage(handler_config), handler)
        .await
        .unwrap();
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    worker.shutdown().await.unwrap();

    let output = read_topic(&brokers(), &topics.output, None, Duration::from_secs(30)).unwrap();
    let dlq = read_topic(&brokers(), &topics.dlq, None, Duration::from_secs(30)).unwrap();
    // 422 → poison → DLQ; 503/429 → retried and then 200; 204 → no output.
    assert_eq!(dlq.len(), 5);
    assert!(dlq
        .iter()
        .all(|r| r.seq == Some(2) && r.header(header::DLQ_REASON) == Some("poison")));
    assert!(dlq
        .iter()
        .all(|r| r.header(header::DLQ_ERROR).unwrap().contains("422")));
    let mut per_session: HashMap<String, Vec<u64>> = HashMap::new();
    for r in &output {
        per_session
            .entry(r.session.clone().unwrap())
            .or_default()
            .push(r.seq.unwrap());
        let body = String::from_utf8(r.value.clone()).unwrap();
        assert!(
            body.starts_with(&format!(
                "{}:{}:",
                r.session.as_deref().unwrap(),
                r.seq.unwrap()
            )),
            "{body}"
        );
    }
    assert_eq!(per_session.len(), 5);
    for seqs in per_session.values() {
        assert_eq!(seqs, &vec![1, 3, 4, 5, 7, 8]);
    }
    {
        let calls = calls.lock().unwrap();
        // 8 records + one retry each for seq 4 and 5, per session.
        assert_eq!(calls.len(), 5 * 10);
        for c in calls.iter() {
            assert!(c.contains_key(header::EVENT_ID));
            assert!(c.contains_key(header::SESSION));
            assert!(
                c.contains_key(header::SEQ),
                "the record's own headers travel too"
            );
        }
    }
    topics.delete().await;
}
