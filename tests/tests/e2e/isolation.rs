//! Guarantee 3: a slow session delays only itself — even when it shares the one partition with
//! every other session (where Kafka's per-partition order would make all of them wait).

use std::time::{Duration, Instant};

use sessionflow_tests::{builtin, RecordingHandler, Topics};

use crate::produce_round_robin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_session_does_not_delay_the_others() {
    let topics = Topics::create("isolation", 1).await;
    // 50 sessions × 20 records, interleaved on a single partition; session-000000 is slow.
    produce_round_robin(&topics, 50, 20).await;
    let slow = "session-000000";
    let handler = RecordingHandler::new(|s, q, _| Ok(Some(format!("{s}:{q}").into_bytes())))
        .with_delay(move |s, _| {
            if s == slow {
                Duration::from_secs(2)
            } else {
                Duration::ZERO
            }
        });
    let started = Instant::now();
    let worker = sessionflow_worker::start(topics.stage(builtin(0.0, 0.0)), handler.clone())
        .await
        .unwrap();
    // The slow session needs 20 × 2 s; wait until the other 49 are done.
    sessionflow_tests::wait_until(Duration::from_secs(60), || {
        let seen = handler.seen.lock().unwrap();
        seen.finished_at.keys().filter(|s| *s != slow).count() == 49
            && seen
                .attempts
                .iter()
                .filter(|(s, _)| *s != slow)
                .all(|(_, calls)| calls.len() >= 20)
    })
    .await
    .expect("the fast sessions finished");
    let (others_done, slow_progress) = {
        let seen = handler.seen.lock().unwrap();
        let last_other = seen
            .finished_at
            .iter()
            .filter(|(s, _)| *s != slow)
            .map(|(_, t)| *t)
            .max()
            .unwrap();
        (
            last_other.duration_since(started),
            seen.attempts[slow].len(),
        )
    };
    // When all 49 fast sessions are complete, the slow one has started at most a few of its
    // 20 records: it did not hold the others behind it.
    assert!(
        slow_progress < 20,
        "the others finished only after the slow session ({slow_progress} of its records done; \
         others done after {others_done:?})"
    );
    handler.assert_in_order();
    worker.shutdown().await.unwrap();
    topics.delete().await;
}
