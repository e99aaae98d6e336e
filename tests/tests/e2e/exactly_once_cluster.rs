//! An exactly-once stage on a three-node Apache Kafka cluster through every membership fault
//! at once (issue 35's end-to-end must-show): while records flow, a worker joins the group, one
//! is frozen (SIGSTOP) past its session timeout and resumed with its queued requests, one is
//! killed (-9) and one stopped (SIGTERM). Afterwards the read_committed output has every
//! non-poison input record exactly once, in order per session; the read_committed DLQ has every
//! poison record exactly once (poison decided as the builtin handler decides it, from its seed
//! and the record's event id, so the expected set is computed here, not read from the worker);
//! and the group's committed offsets are the input's end offsets.
//!
//! The cluster is started for the test (`scripts/kafka.sh --nodes 3`, ports of its own): topics
//! with replication factor 3 and `min.insync.replicas` 2, the transaction state log and the
//! offsets topic on the three nodes (kafka.sh sets both for N > 1). The input is produced all
//! along the faults by a task of the test, so each fault meets records in flight whatever the
//! machine's speed; each step waits (bounded) for what it needs — the group's members, the
//! committed offsets moving — and fails naming it. Each step's end is printed on stdout with
//! the seconds since the test began (stderr carries the workers' logs), so a failed run shows
//! how far it got.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, TopicPartitionList};
use sessionflow_tests::{wait_until, ScriptCluster, Topics, WorkerProcess};
use sessionflow_tools::verify::{read_topic, SeqRecord};
use sessionflow_worker::config::BuiltinHandlerConfig;
use sessionflow_worker::handler::builtin::BuiltinHandler;
use sessionflow_worker::record::{header, Lease, Parts, SessionSource};
use sessionflow_worker::InputRecord;

/// Ports of this test's cluster: 19500 … 19510 (the test broker uses 9092 …, chaos 19300 …,
/// the SASL_SSL test 19440 …, the truncation test 19460 …, metrics ports 19480 … 19491, the
/// transaction probe test 19520 … 19527).
const PORT: u16 = 19500;
const PARTITIONS: i32 = 6;
const SESSIONS: u64 = 200;
/// The input's pace: records per tick of [`TICK`] (600 records a second).
const PER_TICK: u64 = 30;
const TICK: Duration = Duration::from_millis(50);
/// How far the committed input offsets must move after each fault before the next one.
const STEP: i64 = 1_500;
const POISON_RATE: f64 = 0.01;
const SEED: u64 = 35;
/// Generous bounds for one step on a loaded 2-core machine (a session timeout is 6 s).
const WAIT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_stage_on_three_nodes_survives_a_join_a_freeze_a_kill_and_a_stop() {
    let began = Instant::now();
    let cluster = ScriptCluster::start(PORT, &["--nodes", "3"]);
    let brokers = cluster.bootstrap.clone();
    let topics = Topics::named("eos3");
    create_topics(&brokers, &topics).await;

    let input = Input::start(&brokers, &topics.input);
    let run = Run {
        brokers: &brokers,
        topics: &topics,
        input: &input,
        began,
    };
    let yaml = |name: &str| {
        let builtin = format!(
            "{{transientRate: 0.02, poisonRate: {POISON_RATE}, latencyMs: 5, seed: {SEED}}}"
        );
        format!(
            "{}  client.id: '{name}'\n",
            topics.stage_yaml_on(&brokers, &builtin, "delivery: exactlyOnce")
        )
    };

    // Two workers, then a third joins.
    let mut a = WorkerProcess::spawn_labelled(&yaml("worker-a"), "a");
    let b = WorkerProcess::spawn_labelled(&yaml("worker-b"), "b");
    let at = run
        .step("two workers", 0, |m| m.are(&["worker-a", "worker-b"]))
        .await;
    let c = WorkerProcess::spawn_labelled(&yaml("worker-c"), "c");
    let all = ["worker-a", "worker-b", "worker-c"];
    let at = run.step("worker-c joined", at, |m| m.are(&all)).await;

    // A frozen past its session timeout: the group gives its partitions away (the new owners'
    // init_transactions fence its producers and abort what it left open).
    a.pause();
    let at = run
        .step("worker-a frozen and expelled", at, |m| {
            m.are(&["worker-b", "worker-c"])
        })
        .await;
    // Resumed with its queued requests: it rejoins, or stops if a fence stops it.
    a.resume();
    let at = run.step("worker-a resumed", at, |m| m.stable).await;
    let a_after_resume = a.running();

    // B killed: no drain, no commit; its open transactions are aborted by the next owners.
    b.kill();
    let at = run
        .step("worker-b killed", at, |m| {
            m.stable && !m.names.contains(&"worker-b".to_string())
        })
        .await;
    // C stopped: it drains, commits what it can and leaves. From here on a worker that is
    // gone is replaced, as its Deployment would (A may have stopped on a fence, see above).
    let c_status = c.terminate();
    let mut workers = vec![a];
    let mut spares = 0;
    let mut keep_one = || {
        if !workers.iter_mut().any(|w| w.running()) {
            spares += 1;
            let name = format!("spare-{spares}");
            workers.push(WorkerProcess::spawn_labelled(&yaml(&name), &name));
        }
    };
    run.step_with("worker-c stopped", at, |m| m.stable, &mut keep_one)
        .await;

    // The input stops; the workers left drain it.
    let total = input.stop().await;
    let mut last = None;
    let drained = wait_until(Duration::from_secs(180), || {
        keep_one();
        last = run.offsets().or(last.take());
        last.as_ref()
            .is_some_and(|(committed, end)| committed == end)
    })
    .await;
    assert!(
        drained.is_ok(),
        "committed never reached the end offsets within 180 s: (committed, end) {last:?}"
    );
    for mut w in workers {
        if w.running() {
            w.terminate();
        }
    }
    println!(
        "{:.0?} drained: input {total} records; worker-a running after its resume: \
         {a_after_resume}; worker-c's exit on SIGTERM: {c_status}; spare workers started: {spares}",
        began.elapsed()
    );

    check_exactly_once(&brokers, &topics, total);
    let mut last = None;
    let read = wait_until(Duration::from_secs(30), || {
        last = run.offsets();
        last.is_some()
    })
    .await;
    assert!(read.is_ok(), "the offsets could not be read within 30 s");
    let (committed, end) = last.expect("read");
    assert_eq!(committed, end, "committed == end after the workers stopped");
    drop(cluster);
}

/// What the steps of the test look at.
struct Run<'a> {
    brokers: &'a str,
    topics: &'a Topics,
    input: &'a Input,
    /// When the test began (the steps print the time since).
    began: Instant,
}

impl Run<'_> {
    /// The group's committed offsets (-1 where none) and the end offsets of the input, or
    /// `None` when they could not be read now (a coordinator still loading, a leader moving).
    fn offsets(&self) -> Option<(Vec<i64>, Vec<i64>)> {
        let (topic, group) = (&self.topics.input, &self.topics.group);
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .ok()?;
        let mut tpl = TopicPartitionList::new();
        let mut end = Vec::new();
        for p in 0..PARTITIONS {
            tpl.add_partition(topic, p);
            end.push(c.fetch_watermarks(topic, p, Duration::from_secs(5)).ok()?.1);
        }
        let committed = c.committed_offsets(tpl, Duration::from_secs(5)).ok()?;
        Some((sessionflow_tests::offsets_or_unset(&committed), end))
    }

    /// The sum of the group's committed input offsets, when it can be read.
    fn committed(&self) -> Option<i64> {
        let (committed, _) = self.offsets()?;
        Some(committed.iter().map(|o| (*o).max(0)).sum())
    }

    /// Waits until the committed input offsets are `STEP` past `from` and the group's members
    /// are as `want` wants; returns the committed sum, or fails naming the step.
    async fn step(&self, what: &str, from: i64, want: impl Fn(&Members) -> bool) -> i64 {
        self.step_with(what, from, want, || {}).await
    }

    /// [`step`](Self::step), calling `tick` at each look.
    async fn step_with(
        &self,
        what: &str,
        from: i64,
        want: impl Fn(&Members) -> bool,
        mut tick: impl FnMut(),
    ) -> i64 {
        let mut last = (0, Members::default());
        let done = wait_until(WAIT, || {
            tick();
            last = (
                self.committed().unwrap_or(last.0),
                group_members(self.brokers, &self.topics.group),
            );
            last.0 >= from + STEP && want(&last.1)
        })
        .await;
        assert!(
            done.is_ok(),
            "{what}: not within {WAIT:?}; committed {} (wanted {} or more), group {:?}, input \
             produced {}",
            last.0,
            from + STEP,
            last.1,
            self.input.produced()
        );
        println!(
            "{:.0?} {what}: committed {} of {} produced, group {:?}",
            self.began.elapsed(),
            last.0,
            self.input.produced(),
            last.1
        );
        last.0
    }
}

/// Input, output (`PARTITIONS` each) and a one-partition DLQ, each with replication factor 3
/// and `min.insync.replicas` 2.
async fn create_topics(brokers: &str, topics: &Topics) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let topic = |name, partitions| {
        NewTopic::new(name, partitions, TopicReplication::Fixed(3)).set("min.insync.replicas", "2")
    };
    let created = admin
        .create_topics(
            &[
                topic(&topics.input, PARTITIONS),
                topic(&topics.output, PARTITIONS),
                topic(&topics.dlq, 1),
            ],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create topics");
    assert!(created.iter().all(|r| r.is_ok()), "{created:?}");
    // Every partition led and fully replicated before the input starts.
    let ready = || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .expect("metadata client");
        [&topics.input, &topics.output, &topics.dlq]
            .iter()
            .all(|t| {
                c.fetch_metadata(Some(t), Duration::from_secs(5))
                    .ok()
                    .and_then(|md| {
                        let t = md.topics().first()?;
                        Some(
                            !t.partitions().is_empty()
                                && t.partitions()
                                    .iter()
                                    .all(|p| p.leader() > 0 && p.isr().len() == 3),
                        )
                    })
                    .unwrap_or(false)
            })
    };
    wait_until(Duration::from_secs(60), ready)
        .await
        .expect("the topics' partitions led, with 3 in sync, within 60 s");
}

/// The group's members (their `client.id`) and whether it is stable, as DescribeGroups tells.
#[derive(Debug, Default)]
struct Members {
    stable: bool,
    names: Vec<String>,
}

impl Members {
    /// Stable, with exactly these members.
    fn are(&self, names: &[&str]) -> bool {
        let mut got: Vec<&str> = self.names.iter().map(String::as_str).collect();
        got.sort_unstable();
        self.stable && got == names
    }
}

fn group_members(brokers: &str, group: &str) -> Members {
    let c: BaseConsumer = match ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
    {
        Ok(c) => c,
        Err(_) => return Members::default(),
    };
    let Ok(list) = c.fetch_group_list(Some(group), Duration::from_secs(5)) else {
        return Members::default();
    };
    list.groups()
        .first()
        .map(|g| Members {
            stable: g.state() == "Stable",
            names: g
                .members()
                .iter()
                .map(|m| m.client_id().to_string())
                .collect(),
        })
        .unwrap_or_default()
}

/// The input, produced by a task at a steady pace until stopped: `SESSIONS` sessions in turn,
/// each record keyed by its session with its per-session `sessionflow-seq` (as `loadgen`
/// writes them), by an idempotent producer (acks=all), so the input itself has no duplicate.
struct Input {
    stop: Arc<AtomicBool>,
    produced: Arc<AtomicU64>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<u64>>>,
}

impl Input {
    fn start(brokers: &str, topic: &str) -> Self {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .create()
            .expect("producer");
        let stop = Arc::new(AtomicBool::new(false));
        let produced = Arc::new(AtomicU64::new(0));
        let topic = topic.to_string();
        let task = tokio::spawn({
            let (stop, produced) = (stop.clone(), Arc::clone(&produced));
            async move {
                let mut seqs = vec![0u64; SESSIONS as usize];
                let mut acks = Vec::new();
                let mut n = 0u64;
                let mut tick = tokio::time::interval(TICK);
                while !stop.load(Ordering::Acquire) {
                    tick.tick().await;
                    for _ in 0..PER_TICK {
                        let s = (n % SESSIONS) as usize;
                        seqs[s] += 1;
                        n += 1;
                        let session = format!("s{s:03}");
                        let seq = seqs[s].to_string();
                        let value = format!("{session}/{seq}");
                        let record = FutureRecord::to(&topic)
                            .key(&session)
                            .payload(&value)
                            .headers(OwnedHeaders::new().insert(Header {
                                key: header::SEQ,
                                value: Some(seq.as_bytes()),
                            }));
                        let ack = producer.send_result(record).map_err(|(e, _)| e);
                        acks.push(ack.expect("an input record queued"));
                    }
                    produced.store(n, Ordering::Release);
                }
                for (i, ack) in futures::future::join_all(acks)
                    .await
                    .into_iter()
                    .enumerate()
                {
                    match ack {
                        Ok(Ok(_)) => {}
                        Ok(Err((e, _))) => panic!("input record {i} not acknowledged: {e}"),
                        Err(_) => panic!("input record {i}: the producer went away"),
                    }
                }
                n
            }
        });
        Self {
            stop,
            produced,
            task: std::sync::Mutex::new(Some(task)),
        }
    }

    fn produced(&self) -> u64 {
        self.produced.load(Ordering::Acquire)
    }

    /// Stops the input; the number of records, each acknowledged.
    async fn stop(&self) -> u64 {
        self.stop.store(true, Ordering::Release);
        let task = self.task.lock().unwrap().take().expect("the input runs");
        task.await.expect("the input task")
    }
}

/// `(session, seq)` of a record the test wrote (key and `sessionflow-seq`).
fn id(r: &SeqRecord) -> (String, u64) {
    (
        r.session.clone().expect("a session (key)"),
        r.seq.expect("a sessionflow-seq header"),
    )
}

/// Every non-poison input record exactly once in the read_committed output, in order per
/// session; every poison one exactly once in the read_committed DLQ, and not in the output.
fn check_exactly_once(brokers: &str, topics: &Topics, total: u64) {
    let read = |topic: &str| {
        read_topic(brokers, topic, None, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("reading {topic}: {e:#}"))
    };
    let input = read(&topics.input);
    assert_eq!(input.len() as u64, total, "the input has every record once");
    let handler = BuiltinHandler::new(BuiltinHandlerConfig {
        poison_rate: POISON_RATE,
        seed: SEED,
        ..Default::default()
    });
    let lease = Arc::new(Lease::new(0, 0));
    let mut want: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut poison: HashSet<(String, u64)> = HashSet::new();
    for r in &input {
        let headers: Vec<(&str, Option<&[u8]>)> = r
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), Some(v.as_bytes())))
            .collect();
        let parts = Parts {
            key: r.key.as_deref(),
            value: Some(&r.value),
            headers: &headers,
        };
        let record = InputRecord::new(
            topics.input.as_str().into(),
            r.partition,
            r.offset,
            parts,
            &SessionSource::Key,
            lease.clone(),
        );
        let (session, seq) = id(r);
        if handler.is_poison(&record) {
            poison.insert((session, seq));
        } else {
            want.entry(session).or_default().push(seq);
        }
    }
    assert!(!poison.is_empty(), "the input has poison records");

    // The output, partition by partition in offset order: a session's records are in one
    // partition (keyed), so this is each session's order.
    let mut got: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut where_: HashMap<String, Vec<String>> = HashMap::new();
    for r in read(&topics.output) {
        let (session, seq) = id(&r);
        got.entry(session.clone()).or_default().push(seq);
        where_.entry(session).or_default().push(format!(
            "seq {seq} at output {}/{} from {}",
            r.partition,
            r.offset,
            r.header(header::EVENT_ID).unwrap_or("?")
        ));
    }
    let mut wrong = Vec::new();
    for (session, seqs) in &want {
        let out = got.remove(session).unwrap_or_default();
        if &out != seqs {
            let first = out.iter().zip(seqs).position(|(a, b)| a != b);
            if wrong.len() < 3 {
                // Where the first difference was written: which output offsets, from which
                // input records (the event id ends with the input partition and offset).
                let at = first.unwrap_or(seqs.len().min(out.len()));
                let written = where_.get(session).map_or(&[][..], Vec::as_slice);
                let around = &written[at.saturating_sub(2)..(at + 3).min(written.len())];
                println!("{session} around its first difference: {around:#?}");
            }
            wrong.push(format!(
                "{session}: {} records out, {} wanted; first difference at {first:?}",
                out.len(),
                seqs.len(),
            ));
        }
    }
    wrong.extend(
        got.keys()
            .map(|s| format!("{s}: only poison records, yet in the output")),
    );
    assert!(
        wrong.is_empty(),
        "{} of {} sessions not exactly once and in order in the output: {:?}",
        wrong.len(),
        want.len(),
        &wrong[..wrong.len().min(10)]
    );

    let mut dead: HashMap<(String, u64), u32> = HashMap::new();
    for r in read(&topics.dlq) {
        *dead.entry(id(&r)).or_default() += 1;
    }
    let not_once: Vec<_> = poison
        .iter()
        .filter(|p| dead.get(*p) != Some(&1))
        .map(|p| (p, dead.get(p).copied().unwrap_or(0)))
        .collect();
    let not_poison: Vec<_> = dead.keys().filter(|d| !poison.contains(*d)).collect();
    assert!(
        not_once.is_empty() && not_poison.is_empty(),
        "the DLQ: poison records not there exactly once (record, times): {not_once:?}; \
         records there that are not poison: {not_poison:?}"
    );

    let report = sessionflow_tests::verify_on(brokers, topics);
    println!(
        "{total} input records: {} exactly once in the output, {} poison exactly once in the \
         DLQ; verify:\n{report}",
        total as usize - poison.len(),
        poison.len()
    );
    assert!(report.is_ok() && report.duplicates == 0, "{report}");
}
