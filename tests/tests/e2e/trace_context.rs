//! W3C trace context crosses the stage: the `traceparent` of an input record is the parent of
//! the record's span; output and DLQ records carry the same trace with the stage's own span,
//! and the handler runs inside a child span of it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sessionflow_tests::{brokers, builtin, produce_one, RecordingHandler, Topics};
use sessionflow_tools::verify::read_topic;
use sessionflow_worker::record::header;
use sessionflow_worker::HandlerError;

/// (trace id, parent span id) of a traceparent.
fn parts(traceparent: &str) -> (String, String) {
    let p: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(p.len(), 4, "malformed traceparent {traceparent}");
    (p[1].to_string(), p[2].to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traceparent_is_continued_into_outputs_dead_letters_and_handler_calls() {
    let topics = Topics::create("trace", 1).await;
    let mut sent = HashMap::new();
    for seq in 1..=6u64 {
        let trace = format!("{:032x}", 0xabc0_0000 + seq);
        let span = format!("{:016x}", 0x1000 + seq);
        let tp = format!("00-{trace}-{span}-01");
        let headers = [(header::SEQ, seq.to_string()), (header::TRACEPARENT, tp)];
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        produce_one(&topics.input, Some("s1"), "v", &headers).await;
        sent.insert(seq, (trace, span));
    }
    // The handler notes the trace context it runs in.
    let in_handler: Arc<Mutex<HashMap<u64, String>>> = Arc::default();
    let seen = in_handler.clone();
    let handler = RecordingHandler::new(|_, seq, _| {
        if seq == 4 {
            Err(HandlerError::Poison("bad".into()))
        } else {
            Ok(Some(b"out".to_vec()))
        }
    });
    let recording = handler.clone();
    let tracing_handler = TracingHandler {
        inner: recording,
        seen,
    };
    let worker = sessionflow_worker::start(topics.stage(builtin(0.0, 0.0)), tracing_handler)
        .await
        .unwrap();
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    worker.shutdown().await.unwrap();

    let timeout = Duration::from_secs(30);
    let out = read_topic(&brokers(), &topics.output, None, timeout).unwrap();
    let dlq = read_topic(&brokers(), &topics.dlq, None, timeout).unwrap();
    assert_eq!((out.len(), dlq.len()), (5, 1));
    let in_handler = in_handler.lock().unwrap().clone();
    for r in out.iter().chain(dlq.iter()) {
        let seq = r.seq.unwrap();
        let (trace, input_span) = &sent[&seq];
        let (out_trace, out_span) = parts(r.header(header::TRACEPARENT).expect("traceparent"));
        assert_eq!(&out_trace, trace, "seq {seq}: same trace downstream");
        assert_ne!(
            &out_span, input_span,
            "seq {seq}: the stage's own span, not the input's"
        );
        let (handler_trace, handler_span) = parts(&in_handler[&seq]);
        assert_eq!(
            &handler_trace, trace,
            "seq {seq}: the handler runs in the trace"
        );
        assert_ne!(
            handler_span, out_span,
            "seq {seq}: the attempt is a child span"
        );
    }
    handler.assert_in_order();
    topics.delete().await;
}

/// Wraps a handler and records the `traceparent` visible inside each call.
struct TracingHandler {
    inner: RecordingHandler,
    seen: Arc<Mutex<HashMap<u64, String>>>,
}

impl sessionflow_worker::Handler for TracingHandler {
    async fn handle(
        &self,
        record: &sessionflow_worker::InputRecord,
        attempt: u32,
    ) -> sessionflow_worker::HandlerResult {
        if let (Some(seq), Some(tp)) = (
            record.seq(),
            sessionflow_worker::ops::telemetry::traceparent(record),
        ) {
            self.seen.lock().unwrap().insert(seq, tp);
        }
        self.inner.handle(record, attempt).await
    }
}
