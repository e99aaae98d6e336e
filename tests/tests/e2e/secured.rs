//! A cluster behind SASL_SSL (SCRAM-SHA-512, a certificate of a CA made for the test):
//! Apache Kafka started by `scripts/kafka.sh --sasl-ssl` on ports of its own. Every client
//! reaches it with the same settings — the worker's consumer, producer and lag reporter (the
//! stage's `kafka:` map, the credentials from the environment as the operator passes them),
//! the operator's lag reader, and the tools (`loadgen`, `lag`, `verify`, `dlq-replay`,
//! `create-topics`: the `sessionflow` binary) through `--kafka-config`. A wrong password leaves a worker running and
//! not ready, with the reason in its log, and takes nothing from the input.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use sessionflow_operator::kafka::Connection;
use sessionflow_tests::{http_get, tools_binary, unique, wait_until, ScriptCluster, WorkerProcess};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};
use sessionflow_worker::commit::lag;
use sessionflow_worker::kafka::client_settings::ClientSettings;

/// Ports of this test's cluster: 19440 … 19443 (the test broker uses 9092 …, chaos 19300 …).
const PORT: u16 = 19440;
/// The worker's /readyz, on a port of its own.
const METRICS_PORT: u16 = 19447;
const RECORDS: u64 = 2_000;
const SESSIONS: u64 = 50;

fn tool(args: &[&str], config: &Path, brokers: &str) -> Output {
    Command::new(tools_binary())
        .args(args)
        .args(["--brokers", brokers, "--kafka-config"])
        .arg(config)
        .env_remove("SESSIONFLOW_BROKERS")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the tool")
}

fn stage_yaml(brokers: &str, ca: &Path, topic: &str, group: &str, metrics: Option<u16>) -> String {
    format!(
        "brokers: {brokers}\ngroup: {group}\nstage: secured\ninput: {topic}\noutput: {topic}.out\n\
         dlq: {topic}.dlq\nhandler:\n  builtin: {{poisonRate: 0.01, seed: 3}}\n\
         retry: {{initialBackoffMs: 1, maxBackoffMs: 10}}\ncommitIntervalMs: 200\n\
         metricsAddr: {metrics}\nkafka:\n  security.protocol: SASL_SSL\n  \
         sasl.mechanism: SCRAM-SHA-512\n  ssl.ca.location: {ca}\n  fetch.wait.max.ms: '100'\n  \
         session.timeout.ms: '6000'\n  heartbeat.interval.ms: '500'\n",
        ca = ca.display(),
        metrics = metrics.map_or("null".to_string(), |p| format!("127.0.0.1:{p}")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_reaches_a_sasl_ssl_cluster_and_a_wrong_password_only_makes_it_unready() {
    let cluster = ScriptCluster::start(PORT, &["--sasl-ssl"]);
    let secure = cluster.secure_dir();
    let config = secure.join("client.properties");
    let ca = secure.join("ca.pem");
    let brokers = cluster.bootstrap.clone();
    let settings = ClientSettings::for_tool(&brokers, Some(&config), &[], |_| None).unwrap();
    let (user, password) = {
        let props: std::collections::BTreeMap<_, _> = settings.properties().collect();
        (
            props["sasl.username"].to_string(),
            props["sasl.password"].to_string(),
        )
    };
    // Without the settings the cluster cannot be reached: the listener really is secured.
    let plain = Command::new(tools_binary())
        .args([
            "create-topics",
            "--brokers",
            &brokers,
            "--partitions",
            "1",
            "never",
        ])
        .env("RUST_LOG", "off")
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(
        !plain.success(),
        "a plaintext client reached the SASL_SSL listener"
    );

    // The tools: create the topics, produce.
    let topic = unique("secured");
    let out = tool(
        &[
            "create-topics",
            "--partitions",
            "4",
            &topic,
            &format!("{topic}.out"),
            &format!("{topic}.dlq"),
        ],
        &config,
        &brokers,
    );
    assert!(
        out.status.success(),
        "create-topics: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        kafka: settings
            .properties()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..LoadgenOptions::new(&brokers, &topic, RECORDS, SESSIONS)
    };
    loadgen::run(&opts).await.expect("loadgen over SASL_SSL");

    // A worker whose password is wrong: running, not ready, the reason in its log, nothing taken.
    let wrong_group = unique("secured-wrong");
    let log_path = std::env::temp_dir().join(unique("secured-wrong") + ".log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut wrong = WorkerProcess::spawn_with_env(
        &stage_yaml(&brokers, &ca, &topic, &wrong_group, Some(METRICS_PORT)),
        &[],
        Stdio::from(log),
        "info",
        &[
            ("SESSIONFLOW_SASL_USERNAME", &user),
            ("SESSIONFLOW_SASL_PASSWORD", "not-the-password"),
        ],
    );
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], METRICS_PORT));
    let mut unready_seen = 0;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(
            wrong.running(),
            "a wrong password made the worker exit:\n{}",
            read(&log_path)
        );
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            let (status, _) = http_get(addr, "/readyz").await;
            assert_ne!(status, 200, "ready with a wrong password");
            unready_seen += 1;
        }
    }
    assert!(
        unready_seen > 0,
        "/readyz never answered:\n{}",
        read(&log_path)
    );
    let logged = read(&log_path);
    assert!(
        logged.to_lowercase().contains("authentication"),
        "the log does not say the login failed:\n{logged}"
    );
    assert!(wrong.running());
    let _ = wrong.terminate();
    // The group's coordinator may still be loading on this fresh cluster: ask until it answers.
    let mut wrong_lag = None;
    let _ = wait_until(Duration::from_secs(60), || {
        wrong_lag = lag::read(&settings, &wrong_group, &topic, Duration::from_secs(10)).ok();
        wrong_lag.is_some()
    })
    .await;
    let wrong_lag = wrong_lag.expect("the wrong group's offsets never became readable");
    assert!(
        wrong_lag.iter().all(|l| l.committed.is_none()),
        "the worker with a wrong password committed: {wrong_lag:?}"
    );
    let _ = std::fs::remove_file(&log_path);

    // The worker with the right credentials, from the environment as the operator gives them.
    let group = unique("secured-group");
    let worker = WorkerProcess::spawn_with_env(
        &stage_yaml(&brokers, &ca, &topic, &group, None),
        &[],
        Stdio::inherit(),
        "warn",
        &[
            ("SESSIONFLOW_SASL_USERNAME", &user),
            ("SESSIONFLOW_SASL_PASSWORD", &password),
        ],
    );
    let drained = wait_until(Duration::from_secs(120), || {
        lag::read(&settings, &group, &topic, Duration::from_secs(10))
            .map(|l| lag::total(&l) == 0 && l.iter().all(|p| p.committed.is_some()))
            .unwrap_or(false)
    })
    .await;
    assert!(
        drained.is_ok(),
        "the stage did not drain the input over SASL_SSL"
    );

    // The operator's lag reader, with the same settings.
    let operator_lag = Connection::with(settings.clone())
        .read_lag(&group, &topic)
        .await
        .expect("the operator's lag reader over SASL_SSL");
    assert_eq!(lag::total(&operator_lag), 0, "{operator_lag:?}");
    assert_eq!(operator_lag.len(), 4);

    // The tools: lag, verify, dlq-replay.
    let out = tool(
        &["lag", "--group", &group, "--topic", &topic],
        &config,
        &brokers,
    );
    assert!(
        out.status.success(),
        "lag: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("total lag 0"));
    let out = tool(
        &[
            "verify",
            "--topic",
            &format!("{topic}.out"),
            "--input",
            &topic,
            "--dlq",
            &format!("{topic}.dlq"),
        ],
        &config,
        &brokers,
    );
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "verify: {report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tool(
        &["dlq-replay", "--dlq", &format!("{topic}.dlq"), "--dry-run"],
        &config,
        &brokers,
    );
    let replayed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "dlq-replay: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(replayed.contains("would replay"), "{replayed}");
    assert!(worker.terminate().success());
    drop(cluster);
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}
