//! A session remembers the event ids it finished recently: a record replayed upstream (an
//! earlier stage restarted and produced some outputs again, with the same
//! `sessionflow-event-id`) is completed without being processed or produced a second time.

use std::time::Duration;

use sessionflow_tests::{brokers, builtin, produce_one, RecordingHandler, Topics};
use sessionflow_worker::record::header;
use sessionflow_worker::verify::read_topic;

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

    let calls: Vec<u64> = handler.seen.lock().unwrap().attempts["s1"]
        .iter()
        .map(|(seq, _)| *seq)
        .collect();
    assert_eq!(calls, vec![1, 2, 3, 4], "each event handled once");
    assert_eq!(skipped, 2);
    let out = read_topic(&brokers(), &topics.output, None, Duration::from_secs(30)).unwrap();
    let events: Vec<&str> = out
        .iter()
        .filter_map(|r| r.header(header::EVENT_ID))
        .collect();
    assert_eq!(events, vec!["e1", "e2", "e3", "e4"]);
    topics.delete().await;
}
