//! `--log-format json`: one JSON object per line, and the lines about a record carry its
//! session, partition, offset and event id.

use std::time::Duration;

use sessionflow_tests::{TempFile, Topics, WorkerProcess};

use crate::produce_round_robin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_name_the_record() {
    let topics = Topics::create("logs", 1).await;
    produce_round_robin(&topics, 3, 3).await;
    let log = TempFile::with_text("sessionflow-log", ".jsonl", "");
    let file = std::fs::File::create(&log.0).unwrap();
    // Every record is poison, so each one is logged on its way to the DLQ.
    let worker = WorkerProcess::spawn_logging(
        &topics.stage_yaml("{poisonRate: 1.0}", ""),
        &["--log-format", "json"],
        file.into(),
    );
    topics.wait_fully_committed(Duration::from_secs(60)).await;
    assert!(worker.terminate().success());

    let text = std::fs::read_to_string(&log.0).unwrap();
    let mut dlq_lines = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            line.starts_with('{') && line.ends_with('}'),
            "not a JSON object: {line}"
        );
        if line.contains("\"record to DLQ\"") {
            dlq_lines += 1;
            for field in [
                "\"session\":",
                "\"partition\":",
                "\"offset\":",
                "\"event_id\":",
            ] {
                assert!(line.contains(field), "{field} missing in {line}");
            }
        }
    }
    assert_eq!(dlq_lines, 9, "{text}");
    topics.delete().await;
}
