//! A session remembers the event ids it finished recently: a record replayed upstream (an
//! earlier stage restarted and produced some outputs again, with the same
//! `sessionflow-event-id`) is completed without being processed or produced a second time.

use std::time::Duration;

use sessionflow_tests::{
    brokers, builtin, order_violations, produce_one, wait_until, RecordingHandler, Topics,
};
use sessionflow_tools::verify::read_topic;
use sessionflow_worker::record::header;

/// The sequence numbers `session`'s handler calls were made with, in order.
fn handled(handler: &RecordingHandler, session: &str) -> Vec<u64> {
    handler.seen.lock().unwrap().attempts[session]
        .iter()
        .map(|(seq, _)| *seq)
        .collect()
}

/// The event ids on the stage's output, in order.
fn output_events(topics: &Topics) -> Vec<String> {
    read_topic(&brokers(), &topics.output, None, Duration::from_secs(30))
        .unwrap()
        .iter()
        .filter_map(|r| r.header(header::EVENT_ID).map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_replays_are_not_processed_twice() {
    let topics = Topics::create("replays", 1).await;
    // e1 e2 e3, then an upstream replay of e2 e3, then e4.
    let records = [
        (1, "e1"),
        (2, "e2"),
        (3, "e3"),
        (2, "e2"),
        (3, "e3"),
        (4, "e4"),
    ];
    for (seq, event) in records {
        let seq = seq.to_string();
        let headers = [(header::SEQ, seq.as_str()), (header::EVENT_ID, event)];
        produce_one(&topics.input, Some("s1"), event, &headers).await;
    }
    let handler = RecordingHandler::new(|_, seq, _| Ok(Some(format!("out-{seq}").into_bytes())));
    let worker = sessionflow_worker::start(topics.stage(builtin(0.0, 0.0)), handler.clone())
        .await
        .unwrap();
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    let skipped = worker.metrics.replay_skipped.get();
    worker.shutdown().await.unwrap();

    let calls = handled(&handler, "s1");
    assert_eq!(calls, vec![1, 2, 3, 4], "each event handled once");
    assert_eq!(skipped, 2);
    let events = output_events(&topics);
    assert_eq!(events, vec!["e1", "e2", "e3", "e4"]);
    topics.delete().await;
}

/// A session hibernates when idle (its task ends, what it remembers waits in the dispatcher's map):
/// an upstream replay arriving after that is still recognised, because the session's next
/// task starts with the event ids the last one settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_after_the_session_hibernated_is_still_skipped() {
    let topics = Topics::create("replays-hibernated", 1).await;
    let produce = |seq: u64, event: &'static str| {
        let topic = topics.input.clone();
        async move {
            let seq = seq.to_string();
            let headers = [(header::SEQ, seq.as_str()), (header::EVENT_ID, event)];
            produce_one(&topic, Some("s1"), event, &headers).await;
        }
    };
    produce(1, "e1").await;
    produce(2, "e2").await;
    let handler = RecordingHandler::new(|_, seq, _| Ok(Some(format!("out-{seq}").into_bytes())));
    let mut stage = topics.stage(builtin(0.0, 0.0));
    // Hibernated, never reaped while the test runs.
    stage.session_idle_ms = 600_000;
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    let metrics = &worker.metrics;
    wait_until(Duration::from_secs(30), || {
        metrics.active_sessions.get() == 0 && metrics.sessions.get() == 1
    })
    .await
    .expect("the idle session hibernates");
    // The upstream stage restarted: e2 again, then e3.
    produce(2, "e2").await;
    produce(3, "e3").await;
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    let skipped = metrics.replay_skipped.get();
    let violations = order_violations(metrics);
    worker.shutdown().await.unwrap();

    let calls = handled(&handler, "s1");
    assert_eq!(calls, vec![1, 2, 3], "each event handled once");
    assert_eq!(skipped, 1);
    assert_eq!(violations, 0);
    let events = output_events(&topics);
    assert_eq!(events, vec!["e1", "e2", "e3"]);
    topics.delete().await;
}
