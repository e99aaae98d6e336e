//! Shared helpers of the end-to-end tests: a real broker, unique topics, stage configs,
//! recording handlers, offsets read back from Kafka.
//!
//! Every test talks to the broker named by `SESSIONFLOW_BROKERS` (`make test` starts one and
//! sets it). Each test makes its own topics and group with unique names and deletes the topics
//! when it ends, so tests run in parallel against one broker.

pub mod relay;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use sessionflow_worker::config::{
    BuiltinHandlerConfig, HandlerConfig, RetryConfig, StageSettings, CLASSIC_ONLY_KAFKA_KEYS,
};
use sessionflow_worker::record::header;
use sessionflow_worker::{Handler, HandlerError, HandlerResult, InputRecord, StageConfig};

/// The broker under test.
pub fn brokers() -> String {
    std::env::var("SESSIONFLOW_BROKERS").expect(
        "SESSIONFLOW_BROKERS is not set: run the tests with `make test` (it starts a broker), \
         or start one with scripts/kafka.sh start --port 9092 and export SESSIONFLOW_BROKERS=127.0.0.1:9092",
    )
}

/// A name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{prefix}-{}-{}-{nanos:x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// The topics of one test: input, output, DLQ. Delete them with [`Topics::delete`].
pub struct Topics {
    pub input: String,
    pub output: String,
    pub dlq: String,
    pub group: String,
}

impl Topics {
    /// Names no other test uses (`<name>-in-…`, `-out-`, `-dlq-`, `-group-`), nothing created:
    /// for a cluster of the test's own, which creates them its way.
    pub fn named(name: &str) -> Self {
        Self {
            input: unique(&format!("{name}-in")),
            output: unique(&format!("{name}-out")),
            dlq: unique(&format!("{name}-dlq")),
            group: unique(&format!("{name}-group")),
        }
    }

    pub async fn create(name: &str, partitions: i32) -> Self {
        init_telemetry();
        let t = Self::named(name);
        sessionflow_worker::kafka::topics::create(&brokers(), &[&t.input, &t.output], partitions)
            .await
            .expect("create topics");
        sessionflow_worker::kafka::topics::create(&brokers(), &[&t.dlq], 1)
            .await
            .expect("create DLQ topic");
        t
    }

    pub async fn delete(self) {
        let _ = sessionflow_worker::kafka::topics::delete(
            &brokers(),
            &[&self.input, &self.output, &self.dlq],
        )
        .await;
    }

    /// A stage from input to output with test-friendly timings.
    pub fn stage(&self, handler: HandlerConfig) -> StageConfig {
        let mut kafka = std::collections::BTreeMap::new();
        for (k, v) in test_kafka_properties() {
            kafka.insert(k.to_string(), v.to_string());
        }
        StageConfig {
            brokers: brokers(),
            group: Some(self.group.clone()),
            stage: "test".into(),
            input: self.input.clone(),
            output: Some(self.output.clone()),
            dlq: self.dlq.clone(),
            handler,
            settings: StageSettings {
                session: Some(Default::default()),
                retry: Some(RetryConfig {
                    initial_backoff_ms: 1,
                    max_backoff_ms: 20,
                    multiplier: 2.0,
                    max_attempts: 0,
                }),
                stuck: Some(Default::default()),
                commit_interval_ms: Some(200),
                shutdown_timeout_ms: Some(10_000),
                delivery: None,
            },
            rebalance: Default::default(),
            lag_interval_ms: 500,
            otlp_endpoint: None,
            dispatchers: 4,
            dispatcher_capacity: 256,
            session_idle_ms: 1_000,
            max_in_flight_per_partition: 2_000,
            prefetch_kbytes: sessionflow_worker::config::defaults::prefetch_kbytes(),
            prefetch_records: sessionflow_worker::config::defaults::prefetch_records(),
            shutdown_drain_queued: false,
            metrics_addr: None,
            kafka,
        }
    }

    /// Every end offset of `topic`'s partitions.
    pub fn end_offsets(&self, topic: &str) -> Vec<i64> {
        end_offsets(topic)
    }

    /// The group's committed offsets on the input (-1 where none).
    pub fn committed(&self) -> Vec<i64> {
        committed_offsets(&self.group, &self.input)
    }

    /// Waits until the group has committed every input partition to its end.
    pub async fn wait_fully_committed(&self, timeout: Duration) {
        let input = self.input.clone();
        wait_until(timeout, || self.committed() == end_offsets(&input))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "committed {:?} never reached end offsets {:?}",
                    self.committed(),
                    end_offsets(&self.input)
                )
            });
    }
}

/// Installs the worker's telemetry (logs only with `SESSIONFLOW_TEST_LOG` set, through
/// `RUST_LOG`; the OpenTelemetry layer always) once for the test process.
pub fn init_telemetry() {
    static TELEMETRY: std::sync::OnceLock<sessionflow_worker::ops::telemetry::Telemetry> =
        std::sync::OnceLock::new();
    TELEMETRY.get_or_init(|| {
        if std::env::var_os("SESSIONFLOW_TEST_LOG").is_none() {
            std::env::set_var("RUST_LOG", "off");
        }
        sessionflow_worker::ops::telemetry::init(
            sessionflow_worker::ops::telemetry::LogFormat::Text,
        )
    });
}

/// librdkafka settings that make tests fast and stay Kafka-legal (classic protocol: a KIP-848
/// stage drops the session and heartbeat ones, see [`Topics::stage_yaml_on`]).
pub fn test_kafka_properties() -> Vec<(&'static str, &'static str)> {
    vec![
        ("fetch.wait.max.ms", "100"),
        ("session.timeout.ms", "6000"),
        ("heartbeat.interval.ms", "500"),
        ("linger.ms", "2"),
    ]
}

/// A builtin handler config.
pub fn builtin(transient_rate: f64, poison_rate: f64) -> HandlerConfig {
    HandlerConfig::Builtin(BuiltinHandlerConfig {
        transient_rate,
        poison_rate,
        latency_ms: 0,
        seed: 7,
        ..Default::default()
    })
}

fn partition_count(consumer: &BaseConsumer, topic: &str) -> i32 {
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    md.topics()[0].partitions().len() as i32
}

/// A producer of transactional id `id` on the test broker, its transactions initialised (which
/// fences an older producer of the id). Its transaction timeout is long (120 s, the worker's),
/// so an open transaction that ends within a test was ended by a fence, not by the broker.
pub fn transactional_producer(id: &str) -> rdkafka::producer::BaseProducer {
    use rdkafka::producer::Producer;
    let p: rdkafka::producer::BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", id)
        .set("transaction.timeout.ms", "120000")
        .create()
        .expect("transactional producer");
    p.init_transactions(Duration::from_secs(30))
        .expect("init_transactions");
    p
}

/// High watermarks of every partition of `topic`.
pub fn end_offsets(topic: &str) -> Vec<i64> {
    end_offsets_on(&brokers(), topic)
}

/// Committed offsets of `group` on `topic` (-1 where nothing is committed).
pub fn committed_offsets(group: &str, topic: &str) -> Vec<i64> {
    committed_offsets_on(&brokers(), group, topic)
}

/// Polls `condition` every 100 ms until it holds or `timeout` passes.
pub async fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> Result<(), ()> {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a [`RecordingHandler`] saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// Per session: the `sessionflow-seq` of every attempt, in call order.
    pub attempts: HashMap<String, Vec<(u64, u32)>>,
    /// Sessions currently inside the handler.
    active: std::collections::HashSet<String>,
    /// Times a session was entered while already inside the handler.
    pub concurrent_entries: u64,
    /// Per session: when its last successful call finished.
    pub finished_at: HashMap<String, Instant>,
}

/// Decides a record's fate in a [`RecordingHandler`]: `(session, seq, attempt) -> result`.
pub type Fate = dyn Fn(&str, u64, u32) -> HandlerResult + Send + Sync;
/// How long a [`RecordingHandler`] works on a record: `(session, seq) -> delay`.
pub type Delay = dyn Fn(&str, u64) -> Duration + Send + Sync;

/// Which records a [`RecordingHandler`] holds until its [`Gate`] opens: `(session, seq)`.
pub type Held = dyn Fn(&str, u64) -> bool + Send + Sync;

/// Holds chosen records inside a [`RecordingHandler`] until the test opens it: a hang the
/// test ends when it wants, not after a duration that a slow machine may outrun.
#[derive(Clone)]
pub struct Gate(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for Gate {
    fn default() -> Self {
        Self(Arc::new(tokio::sync::watch::Sender::new(false)))
    }
}

impl Gate {
    /// Lets every held record (and every later one) through.
    pub fn open(&self) {
        self.0.send_replace(true);
    }

    async fn passed(&self) {
        let _ = self.0.subscribe().wait_for(|open| *open).await;
    }
}

/// A handler that records the order in which each session's records reach it.
#[derive(Clone)]
pub struct RecordingHandler {
    pub seen: Arc<Mutex<Seen>>,
    fate: Arc<Fate>,
    delay: Arc<Delay>,
    hold: Option<(Arc<Held>, Gate)>,
}

impl RecordingHandler {
    pub fn new(fate: impl Fn(&str, u64, u32) -> HandlerResult + Send + Sync + 'static) -> Self {
        Self {
            seen: Arc::default(),
            fate: Arc::new(fate),
            delay: Arc::new(|_, _| Duration::ZERO),
            hold: None,
        }
    }

    /// Holds the records `held` picks inside the handler until `gate` opens.
    pub fn holding(
        mut self,
        held: impl Fn(&str, u64) -> bool + Send + Sync + 'static,
        gate: Gate,
    ) -> Self {
        self.hold = Some((Arc::new(held), gate));
        self
    }

    pub fn with_delay(
        mut self,
        delay: impl Fn(&str, u64) -> Duration + Send + Sync + 'static,
    ) -> Self {
        self.delay = Arc::new(delay);
        self
    }

    /// Passes every record through, failing transiently on a deterministic `rate` of attempts.
    pub fn flaky(rate: f64) -> Self {
        Self::new(move |session, seq, attempt| {
            let h = sessionflow_worker::record::session_id::stable_hash(
                format!("{session}/{seq}/{attempt}").as_bytes(),
            )
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
            if ((h >> 11) as f64 / (1u64 << 53) as f64) < rate {
                Err(HandlerError::Transient("flaky".into()))
            } else {
                Ok(Some(format!("{session}:{seq}").into_bytes()))
            }
        })
    }

    /// Fails the test with the problems [`order_problems`](Self::order_problems) finds.
    pub fn assert_in_order(&self) {
        let problems = self.order_problems();
        assert!(problems.is_empty(), "{problems:?}");
    }

    /// Checks that every session's first attempts saw seq 1, 2, 3… and retries repeated the
    /// record in front of them. Returns the problems found.
    pub fn order_problems(&self) -> Vec<String> {
        let seen = self.seen.lock().unwrap();
        let mut problems = Vec::new();
        if seen.concurrent_entries > 0 {
            problems.push(format!("{} concurrent entries", seen.concurrent_entries));
        }
        for (session, calls) in &seen.attempts {
            let mut expected_next = 1;
            let mut current: Option<(u64, u32)> = None;
            for &(seq, attempt) in calls {
                match current {
                    Some((cur, a)) if attempt > 1 => {
                        if seq != cur || attempt != a + 1 {
                            problems.push(format!(
                                "{session}: attempt {attempt} of seq {seq} after attempt {a} of seq {cur}"
                            ));
                        }
                    }
                    _ => {
                        if attempt != 1 || seq != expected_next {
                            problems.push(format!(
                                "{session}: seq {seq} (attempt {attempt}) where seq {expected_next} was due"
                            ));
                        }
                        expected_next = seq + 1;
                    }
                }
                current = Some((seq, attempt));
            }
        }
        problems
    }
}

fn seq_of(record: &InputRecord) -> u64 {
    record
        .header(header::SEQ)
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
        .unwrap_or(0)
}

impl Handler for RecordingHandler {
    async fn handle(&self, record: &InputRecord, attempt: u32) -> HandlerResult {
        let session = record.session_str().into_owned();
        let seq = seq_of(record);
        {
            let mut seen = self.seen.lock().unwrap();
            if !seen.active.insert(session.clone()) {
                seen.concurrent_entries += 1;
            }
            seen.attempts
                .entry(session.clone())
                .or_default()
                .push((seq, attempt));
        }
        // Leaves the session's "inside the handler" state even when the call is cancelled.
        let _inside = Inside {
            seen: &self.seen,
            session: &session,
        };
        let delay = (self.delay)(&session, seq);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if let Some((held, gate)) = &self.hold {
            if held(&session, seq) {
                gate.passed().await;
            }
        }
        let result = (self.fate)(&session, seq, attempt);
        if result.is_ok() {
            let mut seen = self.seen.lock().unwrap();
            seen.finished_at.insert(session.clone(), Instant::now());
        }
        result
    }
}

struct Inside<'a> {
    seen: &'a Mutex<Seen>,
    session: &'a str,
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.active.remove(self.session);
        }
    }
}

/// The ordering watchdog's count (`sessionflow_order_violations_total`, intake + handler).
pub fn order_violations(metrics: &sessionflow_worker::ops::metrics::Metrics) -> u64 {
    ["intake", "handler"]
        .iter()
        .map(|at| metrics.order_violations.with_label_values(&[at]).get())
        .sum()
}

/// The worker binary built next to the test binary, or the one `SESSIONFLOW_WORKER_BIN` names
/// (to run the process tests against another build, e.g. an older commit's).
pub fn worker_binary() -> PathBuf {
    match std::env::var_os("SESSIONFLOW_WORKER_BIN") {
        Some(bin) => PathBuf::from(bin),
        None => workspace_binary("sessionflow-worker"),
    }
}

/// The tools' binary (`sessionflow`: create-topics, loadgen, verify, lag, dlq-replay), built next
/// to the test binary.
pub fn tools_binary() -> PathBuf {
    workspace_binary("sessionflow")
}

/// A binary of the workspace, built next to the test binary.
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = dir.join(name);
    assert!(
        bin.exists(),
        "{} not found: build it first (`cargo build --workspace`; `make test` does)",
        bin.display()
    );
    bin
}

/// A worker running as its own process (`sessionflow-worker run`), for tests about process
/// death and several group members.
pub struct WorkerProcess {
    child: std::process::Child,
    _config: TempFile,
}

impl WorkerProcess {
    /// Starts the binary on a config file written from `yaml`.
    pub fn spawn(yaml: &str) -> Self {
        Self::spawn_logging(yaml, &[], std::process::Stdio::inherit())
    }

    /// Like [`spawn`](Self::spawn), each line the worker logs prefixed with `[label] ` (on the
    /// test's stderr), so that the logs of several workers of one test can be told apart.
    pub fn spawn_labelled(yaml: &str, label: &str) -> Self {
        use std::io::{BufRead, Write};
        let mut worker = Self::spawn_logging(yaml, &[], std::process::Stdio::piped());
        let stderr = worker.child.stderr.take().expect("piped stderr");
        let label = label.to_string();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let _ = writeln!(std::io::stderr().lock(), "[{label}] {line}");
            }
        });
        worker
    }

    /// Like [`spawn`](Self::spawn), with extra arguments and stderr sent to `stderr`.
    pub fn spawn_logging(yaml: &str, args: &[&str], stderr: std::process::Stdio) -> Self {
        // SESSIONFLOW_WORKER_LOG=info (or debug) shows more of the workers while debugging.
        let level = std::env::var("SESSIONFLOW_WORKER_LOG").unwrap_or_else(|_| "warn".into());
        Self::spawn_logging_at(yaml, args, stderr, &level)
    }

    /// Like [`spawn_logging`](Self::spawn_logging), logging at `level` (`RUST_LOG`).
    pub fn spawn_logging_at(
        yaml: &str,
        args: &[&str],
        stderr: std::process::Stdio,
        level: &str,
    ) -> Self {
        Self::spawn_with_env(yaml, args, stderr, level, &[])
    }

    /// Like [`spawn_logging_at`](Self::spawn_logging_at), with extra environment variables
    /// (e.g. the SASL credentials the operator passes from a Secret).
    pub fn spawn_with_env(
        yaml: &str,
        args: &[&str],
        stderr: std::process::Stdio,
        level: &str,
        env: &[(&str, &str)],
    ) -> Self {
        panics_on_stdout();
        let config = TempFile::with_text("sessionflow-config", ".yaml", yaml);
        let child = std::process::Command::new(worker_binary())
            .envs(env.iter().copied())
            .args(args)
            .args(["run", "--config"])
            .arg(&config.0)
            // The config names its cluster (nisshi or a test's mock); `--brokers` would
            // otherwise come from this variable and override it.
            .env_remove("SESSIONFLOW_BROKERS")
            .env("RUST_LOG", level)
            .stdout(std::process::Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start the worker binary");
        Self {
            child,
            _config: config,
        }
    }

    /// True while the process has not exited.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("wait").is_none()
    }

    /// How the process ended, once it has.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("wait")
    }

    /// Waits up to `within` for `line` in the worker's log at `log`, while the worker runs;
    /// panics, with the log, if the worker stops first (`what` names the event in the message)
    /// or the line does not come.
    pub async fn wait_for_log(
        &mut self,
        log: &std::path::Path,
        line: &str,
        what: &str,
        within: Duration,
    ) {
        let read = || std::fs::read_to_string(log).unwrap_or_default();
        let seen = wait_until(within, || read().contains(line) || !self.running()).await;
        assert!(
            self.running(),
            "the worker stopped on the {what}:\n{}",
            read()
        );
        assert!(seen.is_ok(), "no {what} within {within:?}:\n{}", read());
    }

    /// SIGSTOP: the whole process freezes (heartbeats included), as a stalled node would.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} failed");
    }

    /// SIGKILL: no drain, no final commit.
    pub fn kill(mut self) {
        self.child.kill().expect("kill");
        self.child.wait().expect("wait");
    }

    /// SIGTERM, then wait for the graceful stop; returns the exit status. A worker that has not
    /// stopped after 60 s is killed and the test fails.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the worker did not stop within 60 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for WorkerProcess {
    /// A test that fails (panics) before it stops its workers must not leave them running: they
    /// would hold their metrics ports and groups for the tests after it. Killed, not stopped:
    /// a failed test's verdict is made.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A file removed when dropped.
pub struct TempFile(pub PathBuf);

impl TempFile {
    pub fn with_text(prefix: &str, suffix: &str, text: &str) -> Self {
        let path = std::env::temp_dir().join(unique(prefix) + suffix);
        std::fs::write(&path, text).expect("write temp file");
        Self(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Topics {
    /// A stage config file for the worker binary: builtin handler with the given settings
    /// (`{transientRate: …, latencyMs: …}`), plus extra top-level YAML lines.
    pub fn stage_yaml(&self, builtin: &str, extra: &str) -> String {
        self.stage_yaml_on(&brokers(), builtin, extra)
    }

    /// [`stage_yaml`](Self::stage_yaml) for the cluster at `brokers` (e.g. librdkafka's mock).
    pub fn stage_yaml_on(&self, brokers: &str, builtin: &str, extra: &str) -> String {
        // KIP-848 stages take their session timeout and heartbeat from the broker (which
        // scripts/kafka.sh sets to the same 6 s and 500 ms).
        let kip848 = extra.contains("strategy: consumer");
        let kafka: String = test_kafka_properties()
            .iter()
            .filter(|(k, _)| !(kip848 && CLASSIC_ONLY_KAFKA_KEYS.contains(k)))
            .map(|(k, v)| format!("  {k}: '{v}'\n"))
            .collect();
        format!(
            "brokers: {brokers}\ngroup: {group}\nstage: test\ninput: {input}\noutput: {output}\n\
             dlq: {dlq}\nhandler:\n  builtin: {builtin}\n\
             retry: {{initialBackoffMs: 1, maxBackoffMs: 10}}\ncommitIntervalMs: 200\n\
             metricsAddr: null\n{extra}\nkafka:\n{kafka}",
            group = self.group,
            input = self.input,
            output = self.output,
            dlq = self.dlq,
        )
    }

    /// Records in the output topic (sum of its end offsets).
    pub fn output_count(&self) -> i64 {
        end_offsets(&self.output).iter().sum()
    }
}

/// Asserts that the replays (duplicates in the output) stay within `bound`, and reports them.
pub fn assert_replays_within(report: &sessionflow_tools::verify::VerifyReport, bound: u64) {
    eprintln!("replayed {} records (bound {bound})", report.duplicates);
    assert!(
        report.duplicates <= bound,
        "{} replays > {bound}",
        report.duplicates
    );
}

/// Reads the output and DLQ back and checks them against the input.
pub fn verify_pipeline(topics: &Topics) -> sessionflow_tools::verify::VerifyReport {
    verify_on(&brokers(), topics)
}

/// Produces one record with the given key, value and headers, and waits for its ack.
pub async fn produce_one(topic: &str, key: Option<&str>, value: &str, headers: &[(&str, &str)]) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    static PRODUCER: std::sync::OnceLock<FutureProducer> = std::sync::OnceLock::new();
    let producer = PRODUCER.get_or_init(|| {
        ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .create()
            .expect("producer")
    });
    let hs = headers.iter().fold(OwnedHeaders::new(), |hs, (k, v)| {
        hs.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        })
    });
    let mut record = FutureRecord::<str, str>::to(topic)
        .payload(value)
        .headers(hs);
    if let Some(k) = key {
        record = record.key(k);
    }
    producer
        .send(record, Duration::from_secs(10))
        .await
        .expect("produce");
}

/// A plain HTTP/1.1 GET on loopback: (status code, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// A metadata consumer on `brokers` (any cluster, e.g. librdkafka's mock), in `group`.
fn metadata_consumer_on(brokers: &str, group: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer")
}

/// High watermarks of every partition of `topic` on `brokers`.
pub fn end_offsets_on(brokers: &str, topic: &str) -> Vec<i64> {
    let c = metadata_consumer_on(brokers, "sessionflow-tests-metadata");
    (0..partition_count(&c, topic))
        .map(|p| {
            // A partition just created may not have its leader yet (seen on 6 Dec:
            // NOT_LEADER_FOR_PARTITION 2 s into a test).
            asked_until_answered(&format!("watermarks of {topic} [{p}]"), 20, || {
                c.fetch_watermarks(topic, p, Duration::from_secs(10))
            })
            .1
        })
        .collect()
}

/// Committed offsets of `group` on `topic` at `brokers` (-1 where nothing is committed).
pub fn committed_offsets_on(brokers: &str, group: &str, topic: &str) -> Vec<i64> {
    offsets_or_unset(&committed_list_on(brokers, group, topic))
}

/// The committed offset of `group` on partition 0 of `topic` at `brokers`, with its metadata
/// (the offset map the workers commit): (-1, "") when nothing is committed.
pub fn committed_with_metadata_on(brokers: &str, group: &str, topic: &str) -> (i64, String) {
    let got = committed_list_on(brokers, group, topic);
    let e = got.find_partition(topic, 0).expect("partition 0");
    match e.offset() {
        Offset::Offset(o) => (o, e.metadata().to_string()),
        _ => (-1, String::new()),
    }
}

fn committed_list_on(brokers: &str, group: &str, topic: &str) -> TopicPartitionList {
    let c = metadata_consumer_on(brokers, group);
    let mut tpl = TopicPartitionList::new();
    for p in 0..partition_count(&c, topic) {
        tpl.add_partition(topic, p);
    }
    // A cluster just started, or a group new to its coordinator, may be refused for a while
    // (NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS).
    asked_until_answered(&format!("committed offsets of {group}"), 15, || {
        c.committed_offsets(tpl.clone(), Duration::from_secs(10))
    })
}

/// `ask` until it answers, up to `retries` more times a second apart (a broker's transient
/// refusals: a coordinator loading, a partition without its leader yet); panics naming `what`
/// with the last error.
fn asked_until_answered<T>(
    what: &str,
    retries: u32,
    mut ask: impl FnMut() -> rdkafka::error::KafkaResult<T>,
) -> T {
    let mut asked = 0;
    loop {
        match ask() {
            Ok(answer) => return answer,
            Err(e) if asked < retries => {
                asked += 1;
                eprintln!("{what}: {e}; asking again");
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// The offsets of `tpl` in its order (a committed-offsets answer), -1 where a partition has
/// none (nothing committed).
pub fn offsets_or_unset(tpl: &TopicPartitionList) -> Vec<i64> {
    tpl.elements()
        .iter()
        .map(|e| match e.offset() {
            Offset::Offset(o) => o,
            _ => -1,
        })
        .collect()
}

/// Waits until the group of `topics` has committed every input partition at `brokers` to its
/// end offset (lag 0, what the operator's autoscaler sees). On timeout, returns the committed
/// and end offsets last read.
pub async fn wait_committed_to_end_on(
    brokers: &str,
    topics: &Topics,
    timeout: Duration,
) -> Result<(), (Vec<i64>, Vec<i64>)> {
    let read = || {
        (
            committed_offsets_on(brokers, &topics.group, &topics.input),
            end_offsets_on(brokers, &topics.input),
        )
    };
    match wait_until(timeout, || {
        let (committed, end) = read();
        committed == end
    })
    .await
    {
        Ok(()) => Ok(()),
        Err(()) => Err(read()),
    }
}

/// Like [`verify_pipeline`], against the cluster at `brokers` (e.g. librdkafka's mock cluster)
/// instead of `SESSIONFLOW_BROKERS`.
pub fn verify_on(brokers: &str, topics: &Topics) -> sessionflow_tools::verify::VerifyReport {
    sessionflow_tools::verify::run(&sessionflow_tools::verify::VerifyOptions {
        kafka: brokers.into(),
        topic: topics.output.clone(),
        dlq: Some(topics.dlq.clone()),
        input: Some(topics.input.clone()),
        session_header: None,
        timeout: Duration::from_secs(60),
    })
    .expect("verify")
}

/// Repeats a test's panic message on stdout (once per test process; later calls do nothing).
///
/// A panic is printed to stderr, after everything the test's worker processes logged there
/// (they inherit it): thousands of lines in the long tests. A run's summary, CI's among them,
/// shows a failed test's stdout first and may cut its stderr short, so the one line that says
/// what failed was the line cut. Called by the helpers that start workers and clusters.
pub fn panics_on_stdout() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            println!("test panicked: {info}");
            default(info);
        }));
    });
}

/// A cluster of Apache Kafka started for one test by `scripts/kafka.sh` on ports of its own
/// (e.g. with a SASL_SSL listener, or three nodes), stopped and deleted when dropped.
pub struct ScriptCluster {
    port: u16,
    /// The bootstrap list the script printed.
    pub bootstrap: String,
}

impl ScriptCluster {
    /// `scripts/kafka.sh start --port PORT ARGS…`; panics with the script's output if it fails.
    pub fn start(port: u16, args: &[&str]) -> Self {
        panics_on_stdout();
        let out = std::process::Command::new(kafka_script())
            .args(["start", "--port", &port.to_string()])
            .args(args)
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("run scripts/kafka.sh");
        if !out.status.success() {
            // Nodes it started before it gave up would outlive the test, on ports the next
            // run of the test needs.
            let _ = std::process::Command::new(kafka_script())
                .args(["stop", "--port", &port.to_string()])
                .status();
            panic!("scripts/kafka.sh start failed");
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let bootstrap = stdout
            .lines()
            .last()
            .expect("kafka.sh prints the bootstrap list last")
            .trim()
            .to_string();
        Self { port, bootstrap }
    }

    /// A stage's topics of names no other test uses ([`Topics::named`]), created here: input and
    /// output of `partitions` partitions, a DLQ of one.
    pub async fn create_stage_topics(&self, name: &str, partitions: i32) -> Topics {
        let topics = Topics::named(name);
        self.create_topics(&[
            (&topics.input, partitions),
            (&topics.output, partitions),
            (&topics.dlq, 1),
        ])
        .await;
        topics
    }

    /// Creates `topics` (each a name and its partitions) on this cluster, one replica each.
    pub async fn create_topics(&self, topics: &[(&str, i32)]) {
        self.create_replicated_topics(topics, 1).await;
    }

    /// [`create_stage_topics`](Self::create_stage_topics) with `replicas` replicas of each
    /// partition (the cluster's `min.insync.replicas` applies: one less than its nodes).
    pub async fn create_replicated_stage_topics(
        &self,
        name: &str,
        partitions: i32,
        replicas: i32,
    ) -> Topics {
        let topics = Topics::named(name);
        self.create_replicated_topics(
            &[
                (&topics.input, partitions),
                (&topics.output, partitions),
                (&topics.dlq, 1),
            ],
            replicas,
        )
        .await;
        topics
    }

    /// Creates `topics` (each a name and its partitions) with `replicas` replicas each.
    pub async fn create_replicated_topics(&self, topics: &[(&str, i32)], replicas: i32) {
        use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
        let admin: AdminClient<rdkafka::client::DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .create()
            .expect("admin client");
        let new: Vec<NewTopic> = topics
            .iter()
            .map(|(name, partitions)| {
                NewTopic::new(name, *partitions, TopicReplication::Fixed(replicas))
            })
            .collect();
        let created = admin
            .create_topics(
                &new,
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
            )
            .await
            .expect("create topics");
        assert!(created.iter().all(|r| r.is_ok()), "{created:?}");
    }

    /// The node id (`node.id`, 1-based) of the broker leading each partition of `topic` now,
    /// by partition (one metadata request).
    pub fn leaders(&self, topic: &str) -> Vec<i32> {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .create()
            .expect("metadata client");
        let md = c
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .expect("metadata");
        let mut partitions: Vec<(i32, i32)> = md.topics()[0]
            .partitions()
            .iter()
            .map(|p| (p.id(), p.leader()))
            .collect();
        partitions.sort_unstable();
        partitions.into_iter().map(|(_, leader)| leader).collect()
    }

    /// The node id of `group`'s coordinator now: the leader of the partition of
    /// `__consumer_offsets` that Kafka keeps the group in (the group id's Java hash code, its
    /// absolute value, modulo the topic's partitions). The topic exists once a group has asked
    /// for its coordinator.
    pub fn group_coordinator(&self, group: &str) -> i32 {
        let hash = group
            .encode_utf16()
            .fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)));
        // Kafka's `Utils.abs`: `Integer.MIN_VALUE` maps to 0.
        let hash = if hash == i32::MIN { 0 } else { hash.abs() };
        let leaders = self.leaders("__consumer_offsets");
        assert!(!leaders.is_empty(), "no __consumer_offsets yet");
        leaders[hash as usize % leaders.len()]
    }

    /// The pid of node `i` (0-based, as `scripts/kafka.sh` counts: node id `i + 1`).
    pub fn node_pid(&self, i: usize) -> u32 {
        let out = self.node_command("pid", i);
        let pid = String::from_utf8_lossy(&out.stdout).trim().to_string();
        pid.parse()
            .unwrap_or_else(|_| panic!("no pid for node {i}: {pid:?}"))
    }

    /// `scripts/kafka.sh COMMAND --port P --node I` for this cluster's node `i`.
    fn node_command(&self, command: &str, i: usize) -> std::process::Output {
        std::process::Command::new(kafka_script())
            .args([
                command,
                "--port",
                &self.port.to_string(),
                "--node",
                &i.to_string(),
            ])
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("kafka.sh {command}: {e}"))
    }

    /// `kill -9` of node `i`: a crash. Returns once the process is gone.
    pub fn kill_node(&self, i: usize) {
        self.signal_node(i, "-KILL", Duration::from_secs(10));
    }

    /// SIGTERM of node `i`: a controlled shutdown (the controller moves its leaderships
    /// away, the group coordinators it hosts among them, before it exits). Returns once the
    /// process is gone.
    pub fn stop_node(&self, i: usize) {
        self.signal_node(i, "-TERM", Duration::from_secs(60));
    }

    fn signal_node(&self, i: usize, signal: &str, within: Duration) {
        let pid = self.node_pid(i).to_string();
        let sent = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("kill");
        assert!(sent.success(), "kill {signal} {pid}");
        let gone = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |stat| stat.split_whitespace().nth(2) == Some("Z"))
        };
        let deadline = std::time::Instant::now() + within;
        while !gone() {
            assert!(
                std::time::Instant::now() < deadline,
                "node {i} (pid {pid}) still runs {within:?} after kill {signal}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts node `i` again after [`kill_node`](Self::kill_node) or
    /// [`stop_node`](Self::stop_node) (it rejoins the cluster and catches up on its own).
    pub fn restart_node(&self, i: usize) {
        let out = self.node_command("restart-node", i);
        assert!(out.status.success(), "restart of node {i}");
    }

    /// The folder with the CA, and `client.properties`, of a `--sasl-ssl` cluster.
    pub fn secure_dir(&self) -> PathBuf {
        let out = std::process::Command::new(kafka_script())
            .args(["secure-dir", "--port", &self.port.to_string()])
            .output()
            .expect("run scripts/kafka.sh");
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    }
}

impl Drop for ScriptCluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new(kafka_script())
            .args(["stop", "--port", &self.port.to_string()])
            .status();
    }
}

/// `scripts/kafka.sh` of this checkout.
pub fn kafka_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/kafka.sh")
}
