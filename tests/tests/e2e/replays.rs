//! A session remembers the event ids it finished recently: a record replayed upstream (an
//! earlier stage restarted and produced some outputs again, with the same
//! `sessionflow-event-id`) is completed without being processed or produced a second time.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sessionflow_tests::{brokers, builtin, RecordingHandler, Topics};
use sessionflow_worker::record::header;
use sessionflow_worker::verify::read_topic;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_replays_are_not_processed_twice() {
    let topics = Topics::create("replays", 1).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    // e1 e2 e3, then an upstream replay of e2 e3, then e4.
    for (seq, event) in [
        (1, "e1"),
        (2, "e2"),
        (3, "e3"),
        (2, "e2"),
        (3, "e3"),
        (4, "e4"),
    ] {
        let s = seq.to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: header::SEQ,
                value: Some(s.as_bytes()),
            })
            .insert(Header {
                key: header::EVENT_ID,
                value: Some(event.as_bytes()),
            });
        producer
            .send(
                FutureRecord::to(&topics.input)
                    .key("s1")
                    .payload(event)
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
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
