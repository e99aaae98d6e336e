//! Guarantee 2 across process death: kill the worker process mid-run (SIGKILL: no drain, no
//! final commit), start it again, and nothing is lost and order still holds. Replays are
//! allowed (at-least-once) and counted.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sessionflow_tests::{brokers, end_offsets, test_kafka_properties, worker_binary, Topics};
use sessionflow_worker::verify::{self, VerifyOptions};

use crate::produce_round_robin;

fn config_file(topics: &Topics, latency_ms: u64) -> tempfile_path::TempPath {
    let kafka: String = test_kafka_properties()
        .iter()
        .map(|(k, v)| format!("  {k}: '{v}'\n"))
        .collect();
    let yaml = format!(
        "brokers: {brokers}\ngroup: {group}\nstage: restart\ninput: {input}\noutput: {output}\n\
         dlq: {dlq}\nhandler:\n  builtin: {{transientRate: 0.05, latencyMs: {latency_ms}, seed: 3}}\n\
         retry: {{initialBackoffMs: 1, maxBackoffMs: 10}}\ncommitIntervalMs: 200\n\
         metricsAddr: null\nkafka:\n{kafka}",
        brokers = brokers(),
        group = topics.group,
        input = topics.input,
        output = topics.output,
        dlq = topics.dlq,
    );
    tempfile_path::write(&yaml)
}

/// Minimal temp file handling (removed on drop).
mod tempfile_path {
    pub struct TempPath(pub std::path::PathBuf);
    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    pub fn write(text: &str) -> TempPath {
        let path =
            std::env::temp_dir().join(sessionflow_tests::unique("sessionflow-config") + ".yaml");
        std::fs::write(&path, text).unwrap();
        TempPath(path)
    }
}

fn spawn_worker(config: &std::path::Path) -> Child {
    Command::new(worker_binary())
        .args(["run", "--config"])
        .arg(config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the worker binary")
}

fn output_count(topic: &str) -> i64 {
    end_offsets(topic).iter().sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_restarts_without_loss() {
    let topics = Topics::create("restart", 8).await;
    produce_round_robin(&topics, 100, 200).await;
    let config = config_file(&topics, 20);

    let mut first = spawn_worker(&config.0);
    sessionflow_tests::wait_until(Duration::from_secs(120), || {
        output_count(&topics.output) >= 3_000
    })
    .await
    .expect("the first worker made progress");
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    let produced_before_kill = output_count(&topics.output);
    assert!(
        produced_before_kill < 20_000,
        "killed too late to test anything"
    );

    let mut second = spawn_worker(&config.0);
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    second.kill().unwrap();
    second.wait().unwrap();

    let report = verify::run(&VerifyOptions {
        brokers: brokers(),
        topic: topics.output.clone(),
        dlq: Some(topics.dlq.clone()),
        input: Some(topics.input.clone()),
        session_header: None,
        timeout: Duration::from_secs(60),
    })
    .unwrap();
    eprintln!("after kill -9 at {produced_before_kill} outputs and restart:\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.lost, 0);
    assert_eq!(report.records - report.duplicates, 20_000, "{report}");
    topics.delete().await;
}
