//! `exactlyOnce` asks the brokers first whether they take its transactions
//! (`output::transaction_probe`), on Apache Kafka started for the test with a broker setting
//! of its own (`scripts/kafka.sh --set`):
//! - a broker whose `transaction.max.timeout.ms` is below the worker's `transaction.timeout.ms`
//!   refuses: the worker exits with code 2, naming the setting, and never joins its group
//!   (before the probe it joined, took its partitions and stopped with exit 1 at the first
//!   assignment — a crash loop under a Deployment);
//! - a broker that cannot host the transaction log (one node, the log's replication factor
//!   3) gives no coordinator: the worker stays alive and not ready, asking again, joins
//!   nothing, and stops cleanly on SIGTERM.

use std::time::Duration;

use sessionflow_tests::{
    committed_offsets_on, http_get, unique, wait_until, ScriptCluster, Topics, WorkerProcess,
};
use sessionflow_tools::loadgen::{self, LoadgenOptions};

/// Ports of this test's broker: 19520 … 19523 (the test broker uses 9092 …, chaos 19300 …, the
/// SASL_SSL test 19440 …, the truncation test 19460 …, metrics ports 19480 … 19491, the 3-node
/// exactly-once test 19500 … 19510).
const PORT: u16 = 19520;
/// The worker's /readyz and /healthz.
const METRICS_PORT: u16 = 19527;

/// A broker started with `settings`, the stage's topics on it, and records in the input.
async fn broker_with(settings: &[&str], name: &str) -> (ScriptCluster, Topics) {
    let args: Vec<&str> = settings.iter().flat_map(|s| ["--set", *s]).collect();
    let cluster = ScriptCluster::start(PORT, &args);
    let topics = cluster.create_stage_topics(name, 2).await;
    loadgen::run(&LoadgenOptions::new(
        &cluster.bootstrap,
        &topics.input,
        200,
        10,
    ))
    .await
    .expect("loadgen");
    (cluster, topics)
}

fn exactly_once_yaml(cluster: &ScriptCluster, topics: &Topics) -> String {
    topics
        .stage_yaml_on(&cluster.bootstrap, "{seed: 1}", "delivery: exactlyOnce")
        .replace(
            "metricsAddr: null",
            &format!("metricsAddr: 127.0.0.1:{METRICS_PORT}"),
        )
}

/// The worker's log so far.
fn log_of(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_refuses_brokers_that_cannot_take_its_transactions() {
    // 1. The broker's transaction.max.timeout.ms (60 s) is below the worker's 120 s.
    let (cluster, topics) =
        broker_with(&["transaction.max.timeout.ms=60000"], "probe-timeout").await;
    let log = std::env::temp_dir().join(unique("probe-timeout") + ".log");
    let mut worker = WorkerProcess::spawn_logging_at(
        &exactly_once_yaml(&cluster, &topics),
        &[],
        std::fs::File::create(&log).expect("log file").into(),
        "sessionflow_worker=info",
    );
    let mut status = None;
    wait_until(Duration::from_secs(90), || {
        status = worker.exit_status();
        status.is_some()
    })
    .await
    .unwrap_or_else(|_| panic!("the worker did not stop on the refusal:\n{}", log_of(&log)));
    let said = log_of(&log);
    assert_eq!(status.unwrap().code(), Some(2), "{said}");
    assert!(
        said.contains("exactlyOnce cannot run on these brokers")
            && said.contains("transaction.max.timeout.ms is lower; raise it to at least 120000"),
        "the refusal does not name the setting:\n{said}"
    );
    assert!(
        !said.contains("partition assigned"),
        "the worker joined its group before asking:\n{said}"
    );
    assert!(
        committed_offsets_on(&cluster.bootstrap, &topics.group, &topics.input)
            .iter()
            .all(|o| *o < 0),
        "nothing may be committed"
    );
    drop(worker);
    drop(cluster);
    let _ = std::fs::remove_file(&log);

    // 2. No coordinator: one node cannot host a transaction log of replication factor 3.
    let (cluster, topics) = broker_with(
        &["transaction.state.log.replication.factor=3"],
        "probe-no-coordinator",
    )
    .await;
    let log = std::env::temp_dir().join(unique("probe-no-coordinator") + ".log");
    let mut worker = WorkerProcess::spawn_logging_at(
        &exactly_once_yaml(&cluster, &topics),
        &[],
        std::fs::File::create(&log).expect("log file").into(),
        "sessionflow_worker=info",
    );
    let addr = format!("127.0.0.1:{METRICS_PORT}").parse().unwrap();
    // Asked twice without an answer: the first ask's warning, then the second ask begun.
    wait_until(Duration::from_secs(90), || {
        log_of(&log).contains("no transaction coordinator answered")
    })
    .await
    .unwrap_or_else(|_| panic!("no word of the missing coordinator:\n{}", log_of(&log)));
    for _ in 0..3 {
        assert!(worker.running(), "the worker stopped:\n{}", log_of(&log));
        assert_eq!(
            http_get(addr, "/readyz").await.0,
            503,
            "ready without transactions"
        );
        assert_eq!(
            http_get(addr, "/healthz").await.0,
            200,
            "not alive while asking"
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let said = log_of(&log);
    assert!(
        !said.contains("partition assigned"),
        "the worker joined its group before its transactions could work:\n{said}"
    );
    let status = worker.terminate();
    assert!(
        status.success(),
        "SIGTERM while asking: {status:?}\n{}",
        log_of(&log)
    );
    let _ = std::fs::remove_file(&log);
}
