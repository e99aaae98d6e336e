//! Poison records, exhausted retries and records without a session land in the DLQ with every
//! header an operator needs; the session carries on with its next record.

use std::collections::HashMap;
use std::time::Duration;

use sessionflow_tests::{brokers, builtin, produce_one, RecordingHandler, Topics};
use sessionflow_tools::verify::{read_topic, Checker};
use sessionflow_worker::record::header;
use sessionflow_worker::HandlerError;

use crate::produce_round_robin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_reach_the_dlq_with_their_headers_and_the_session_goes_on() {
    let topics = Topics::create("dlq", 4).await;
    produce_round_robin(&topics, 20, 10).await;
    // One record without a key, hence without a session.
    produce_one(&topics.input, None, "orphan", &[]).await;

    let handler = RecordingHandler::new(|s, seq, _| match seq {
        3 => Err(HandlerError::Poison(format!("cannot parse {s}:{seq}"))),
        5 => Err(HandlerError::Transient("dependency down".into())),
        _ => Ok(Some(format!("{s}:{seq}").into_bytes())),
    });
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.settings.retry.get_or_insert_default().max_attempts = 3;
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    topics.wait_fully_committed(Duration::from_secs(120)).await;
    worker.shutdown().await.unwrap();

    let timeout = Duration::from_secs(30);
    let input = read_topic(&brokers(), &topics.input, None, timeout).unwrap();
    let dlq = read_topic(&brokers(), &topics.dlq, None, timeout).unwrap();
    let output = read_topic(&brokers(), &topics.output, None, timeout).unwrap();
    let by_id: HashMap<(String, u64), _> = input
        .iter()
        .filter_map(|r| Some(((r.session.clone()?, r.seq?), r)))
        .collect();

    let count = |reason: &str| {
        dlq.iter()
            .filter(|r| r.header(header::DLQ_REASON) == Some(reason))
            .count()
    };
    assert_eq!(count("poison"), 20);
    assert_eq!(count("retries-exhausted"), 20);
    assert_eq!(count("missing-session"), 1);
    assert_eq!(dlq.len(), 41);

    for d in &dlq {
        let reason = d.header(header::DLQ_REASON).unwrap();
        assert_eq!(d.header(header::SOURCE_TOPIC), Some(topics.input.as_str()));
        assert_eq!(d.header(header::STAGE), Some("test"));
        assert!(!d.header(header::DLQ_ERROR).unwrap_or_default().is_empty());
        assert!(d.header(header::EVENT_ID).is_some(), "event id on {d:?}");
        let partition: i32 = d.header(header::SOURCE_PARTITION).unwrap().parse().unwrap();
        let offset: i64 = d.header(header::SOURCE_OFFSET).unwrap().parse().unwrap();
        if reason == "missing-session" {
            assert_eq!(d.value, b"orphan");
            assert_eq!(d.session, None);
            continue;
        }
        // Original key, value and headers kept; source coordinates point at the input record.
        let key = (d.session.clone().unwrap(), d.seq.unwrap());
        let original = by_id[&key];
        assert_eq!((partition, offset), (original.partition, original.offset));
        assert_eq!(d.value, original.value);
        let (expected_seq, expected_attempts) = match reason {
            "poison" => (3, "1"),
            "retries-exhausted" => (5, "3"),
            other => panic!("unexpected reason {other}"),
        };
        assert_eq!(d.seq, Some(expected_seq));
        assert_eq!(d.header(header::ATTEMPTS), Some(expected_attempts));
    }

    // Every session continued past its failures, in order.
    let mut checker = Checker::new();
    for r in &output {
        checker.output(r.session.as_deref(), r.seq);
    }
    for r in &dlq {
        checker.dead_letter(r.session.as_deref(), r.seq);
    }
    let pairs: Vec<(&str, u64)> = input
        .iter()
        .filter_map(|r| Some((r.session.as_deref()?, r.seq?)))
        .collect();
    let report = checker.finish(Some(pairs));
    assert!(report.is_ok(), "{report}");
    assert_eq!(output.len(), 20 * 8);
    // Output records: key = session, event id set, input headers carried over.
    for r in &output {
        assert!(r.header(header::EVENT_ID).is_some());
        assert!(r.header(header::SEQ).is_some());
        assert_eq!(
            r.value,
            format!("{}:{}", r.session.as_deref().unwrap(), r.seq.unwrap()).into_bytes()
        );
    }
    handler.assert_in_order();
    topics.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_the_producer_refuses_goes_to_the_dlq_as_produce_failed() {
    let topics = Topics::create("produce-failed", 2).await;
    produce_round_robin(&topics, 5, 5).await;
    // seq 3's output is larger than the producer may send.
    let handler = RecordingHandler::new(|s, seq, _| {
        if seq == 3 {
            Ok(Some(vec![b'x'; 50_000]))
        } else {
            Ok(Some(format!("{s}:{seq}").into_bytes()))
        }
    });
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage
        .kafka
        .insert("message.max.bytes".into(), "20000".into());
    let worker = sessionflow_worker::start(stage, handler.clone())
        .await
        .unwrap();
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    assert_eq!(worker.metrics.produce_errors.get(), 5);
    worker.shutdown().await.unwrap();

    let timeout = Duration::from_secs(30);
    let dlq = read_topic(&brokers(), &topics.dlq, None, timeout).unwrap();
    assert_eq!(dlq.len(), 5);
    for d in &dlq {
        assert_eq!(d.header(header::DLQ_REASON), Some("produce-failed"));
        assert_eq!(d.seq, Some(3));
        assert!(
            d.header(header::DLQ_ERROR).unwrap().contains("too large"),
            "{d:?}"
        );
    }
    let report = sessionflow_tests::verify_pipeline(&topics);
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.records, 20, "{report}");
    topics.delete().await;
}

/// Dead letters replayed after the fault is fixed, while the stage keeps running: `dlq-replay`
/// sends the selected records back to their source topic with new event ids and without their
/// old sequence numbers. The running sessions would otherwise skip them (their recent event-id
/// cache holds the dead-lettered ids) and count them as order violations (their sequence went
/// past them); instead each is processed exactly once and the watchdog stays at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_dead_letters_are_processed_once_by_the_fixed_stage() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use sessionflow_tools::replay::{self, Selection, REPLAY_OF};

    let topics = Topics::create("dlq-replay", 4).await;
    produce_round_robin(&topics, 20, 10).await;
    let fixed = Arc::new(AtomicBool::new(false));
    let is_fixed = fixed.clone();
    let handler = RecordingHandler::new(move |s, seq, _| match seq {
        3 if !is_fixed.load(Ordering::SeqCst) => {
            Err(HandlerError::Poison(format!("cannot parse {s}:{seq}")))
        }
        7 if !is_fixed.load(Ordering::SeqCst) => {
            Err(HandlerError::Transient("dependency down".into()))
        }
        _ => Ok(Some(format!("{s}:{seq}").into_bytes())),
    });
    let mut stage = topics.stage(builtin(0.0, 0.0));
    stage.settings.retry.get_or_insert_default().max_attempts = 2;
    stage.session_idle_ms = 600_000;
    let worker = sessionflow_worker::start(stage, handler).await.unwrap();
    topics.wait_fully_committed(Duration::from_secs(120)).await;

    let timeout = Duration::from_secs(30);
    let dlq = read_topic(&brokers(), &topics.dlq, None, timeout).unwrap();
    let poison_ids: Vec<String> = dlq
        .iter()
        .filter(|d| d.header(header::DLQ_REASON) == Some("poison"))
        .map(|d| d.header(header::EVENT_ID).unwrap().to_string())
        .collect();
    assert_eq!((dlq.len(), poison_ids.len()), (40, 20));

    // The fault is fixed; replay only the poison ones (a dry run first produces nothing).
    fixed.store(true, Ordering::SeqCst);
    let poison = Selection {
        reason: Some("poison".into()),
        ..Selection::default()
    };
    let dry = replay::run(&brokers(), &topics.dlq, &poison, None, true)
        .await
        .unwrap();
    assert_eq!(dry.replayed.get(&topics.input), Some(&20));
    assert_eq!(
        sessionflow_tests::end_offsets(&topics.input)
            .iter()
            .sum::<i64>(),
        200
    );
    let done = replay::run(&brokers(), &topics.dlq, &poison, None, false)
        .await
        .unwrap();
    assert_eq!(
        (done.replayed.get(&topics.input), done.skipped),
        (Some(&20), 20)
    );
    topics.wait_fully_committed(Duration::from_secs(120)).await;

    let violations = sessionflow_tests::order_violations(&worker.metrics);
    let (records_in, skipped) = (
        worker.metrics.records_in.get(),
        worker.metrics.replay_skipped.get(),
    );
    worker.shutdown().await.unwrap();
    assert_eq!(
        (records_in, skipped),
        (220, 0),
        "replayed records are new, not skipped"
    );
    assert_eq!(violations, 0, "replayed records are not order violations");

    let output = read_topic(&brokers(), &topics.output, None, timeout).unwrap();
    let mut replayed_of: Vec<String> = output
        .iter()
        .filter_map(|r| r.header(REPLAY_OF).map(str::to_string))
        .collect();
    replayed_of.sort();
    let mut expected = poison_ids.clone();
    expected.sort();
    assert_eq!(
        replayed_of, expected,
        "each poison record processed once after the replay"
    );
    topics.delete().await;
}
