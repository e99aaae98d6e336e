//! Exactly-once stages (docs/exactly-once.md), on the broker under test. First the Kafka
//! premises of the design, with the clients the worker uses and no worker: one transactional
//! producer per input partition (`commit::exactly_once::transactional_id`) fences an older
//! owner's, and the completed-offset map rides the transaction's offset commit. Then the
//! worker in `delivery: exactlyOnce`, killed and stopped while records flow: every record once
//! in the read_committed output (or the DLQ), in order per session.
//!
//! Needs a broker with transactions (Apache Kafka; a single node needs
//! `transaction.state.log.replication.factor=1`, which `scripts/kafka.sh` sets).

use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{Message, Offset, TopicPartitionList};
use sessionflow_tests::{
    brokers, transactional_producer, verify_pipeline, wait_until, Topics, WorkerProcess,
};
use sessionflow_worker::commit::exactly_once::transactional_id;
use sessionflow_worker::commit::offset_map;

const T: Duration = Duration::from_secs(30);

fn send(p: &BaseProducer, topic: &str, value: &str) {
    p.send(BaseRecord::to(topic).key("s1").payload(value))
        .map_err(|(e, _)| e)
        .expect("send");
    p.flush(T).expect("flush");
}

/// What a consumer with `isolation` reads of partition 0 of `topic`, from the start, until
/// `want` records (then a second more, for extras) or `within`.
fn read(topic: &str, isolation: &str, want: usize, within: Duration) -> Vec<String> {
    let extra = Duration::from_secs(1);
    consume(topic, isolation, 1, want, within, extra)
        .into_iter()
        .map(|(v, _)| v)
        .collect()
}

fn committed(group: &str, topic: &str) -> (i64, String) {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, 0);
    let got = c.committed_offsets(tpl, T).unwrap();
    let e = got.find_partition(topic, 0).unwrap();
    match e.offset() {
        Offset::Offset(o) => (o, e.metadata().to_string()),
        _ => (-1, String::new()),
    }
}

fn offsets(topic: &str, offset: i64, metadata: &str) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(offset))
        .unwrap();
    tpl.find_partition(topic, 0).unwrap().set_metadata(metadata);
    tpl
}

/// The owner of input partition 0 commits a transaction (an output, the input offset with a
/// completed-offset map), then writes into a second one and freezes. The partition's next
/// owner opens a producer with the same transactional id: the frozen owner's open transaction
/// is aborted at once (read_committed readers are not held until its timeout), its late writes
/// and its commit are refused, and only committed outputs are visible, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_owners_transactional_id_fences_the_old_owner_and_the_map_rides_the_transaction() {
    let topics = Topics::create("eos-fence", 1).await;
    let id = transactional_id(&topics.group, &topics.input, 0);

    // A member of the stage's group: its group metadata goes with each transaction's offsets.
    let member: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", &topics.group)
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .create()
        .expect("member");
    member.subscribe(&[&topics.input]).expect("subscribe");
    let deadline = Instant::now() + T;
    while member.assignment().map_or(0, |a| a.count()) == 0 {
        assert!(Instant::now() < deadline, "never assigned");
        let _ = member.poll(Duration::from_millis(100));
    }
    let group = member.group_metadata().expect("group metadata");

    // The first owner: offsets 2 and 4 unfinished, 3 and 5 done.
    let map = offset_map::encode(2, 6, 0, [2, 4]).expect("map");
    assert!(!map.is_empty());
    let old = transactional_producer(&id);
    old.begin_transaction().unwrap();
    send(&old, &topics.output, "old-committed");
    old.send_offsets_to_transaction(&offsets(&topics.input, 2, &map), &group, T)
        .expect("offsets in the transaction");
    old.commit_transaction(T).expect("commit");
    let (offset, metadata) = committed(&topics.group, &topics.input);
    assert_eq!(offset, 2);
    assert_eq!(
        metadata, map,
        "the map rides the transactional offset commit"
    );
    let done = offset_map::decode(2, &metadata).expect("decodes");
    assert!(done.is_done(3, 0) && done.is_done(5, 0) && !done.is_done(4, 0));

    // It writes into its next transaction, and is frozen before committing.
    old.begin_transaction().unwrap();
    send(&old, &topics.output, "old-open");

    // The partition's next owner: same id. Its init aborts the old open transaction.
    let new = transactional_producer(&id);
    new.begin_transaction().unwrap();
    send(&new, &topics.output, "new-committed");
    new.send_offsets_to_transaction(&offsets(&topics.input, 6, ""), &group, T)
        .expect("offsets in the new owner's transaction");
    new.commit_transaction(T).expect("new owner's commit");

    // The old owner resumes: a late write and its commit are refused by the broker.
    let _ = old.send(BaseRecord::to(&topics.output).key("s1").payload("old-late"));
    let _ = old.flush(Duration::from_secs(10));
    let late = old.send_offsets_to_transaction(&offsets(&topics.input, 9, ""), &group, T);
    let end = old.commit_transaction(T);
    assert!(
        late.is_err() || end.is_err(),
        "the fenced owner committed: {late:?} {end:?}"
    );
    assert!(end.is_err(), "the fenced owner's commit: {end:?}");

    // Well within the old transaction's 120 s timeout: the fence aborted it.
    let visible = read(&topics.output, "read_committed", 2, Duration::from_secs(20));
    assert_eq!(visible, ["old-committed", "new-committed"]);
    let raw = read(
        &topics.output,
        "read_uncommitted",
        3,
        Duration::from_secs(10),
    );
    assert!(
        raw.contains(&"old-open".to_string()),
        "the aborted write is in the log, only not visible: {raw:?}"
    );
    assert!(!raw.contains(&"old-late".to_string()), "{raw:?}");
    assert_eq!(
        committed(&topics.group, &topics.input),
        (6, String::new()),
        "the new owner's offsets stand"
    );

    drop(member);
    topics.delete().await;
}

/// A worker in `exactlyOnce` is killed (-9) mid-flow, the next one stopped with SIGTERM
/// mid-flow, a third finishes: the read_committed output has every record exactly once (the
/// poison ones in the DLQ, once), in order per session, and the group committed to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_stage_killed_and_stopped_mid_flow_outputs_every_record_once() {
    let topics = Topics::create("eos-kill", 4).await;
    // Enough that the SIGTERM comes mid-flow on an idle machine too (10,000 were all written
    // before it in one run).
    let total = 30_000;
    crate::produce_round_robin(&topics, 100, 300).await;
    let yaml = topics.stage_yaml(
        "{transientRate: 0.05, poisonRate: 0.01, latencyMs: 5, seed: 11}",
        "delivery: exactlyOnce",
    );

    let first = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(120), || topics.output_count() >= 2_000)
        .await
        .expect("the first worker made progress");
    first.kill();
    let at_kill = topics.output_count();

    let second = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(120), || {
        topics.output_count() >= at_kill + 2_000
    })
    .await
    .expect("the second worker made progress");
    let status = second.terminate();
    let at_stop = topics.output_count();
    assert!(at_stop < total, "stopped too late to test anything");

    let third = WorkerProcess::spawn(&yaml);
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    third.terminate();

    let report = verify_pipeline(&topics);
    eprintln!(
        "exactlyOnce, kill -9 at {at_kill} and SIGTERM ({status}) at {at_stop} output offsets:\n{report}"
    );
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.duplicates, 0, "{report}");
    assert_eq!(
        report.records + report.dlq_records,
        total as u64,
        "{report}"
    );
    assert!(report.dlq_records > 0, "{report}");
    topics.delete().await;
}

/// A worker in `exactlyOnce` is frozen (SIGSTOP) past its session timeout with records in
/// flight; a second one takes its partitions over (its producers' init aborts what the frozen
/// one left open) and goes on; the frozen one is resumed with its queued requests. Nothing it
/// writes after the takeover is visible: the read_committed output has every record once, in
/// order per session, and no session ends on an older record than the new owner wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_exactly_once_worker_resumed_after_the_takeover_writes_nothing_visible() {
    let topics = Topics::create("eos-zombie", 4).await;
    // Enough that the SIGTERM comes mid-flow on an idle machine too (10,000 were all written
    // before it in one run).
    let total = 30_000;
    crate::produce_round_robin(&topics, 100, 300).await;
    let yaml = topics.stage_yaml("{latencyMs: 20, seed: 7}", "delivery: exactlyOnce");

    let mut frozen = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(120), || topics.output_count() >= 1_500)
        .await
        .expect("the first worker made progress");
    frozen.pause();
    let at_freeze = topics.output_count();

    let mut next = WorkerProcess::spawn(&yaml);
    // The group gives the frozen member's partitions away after its session timeout (6 s).
    wait_until(Duration::from_secs(120), || {
        topics.output_count() >= at_freeze + 2_000
    })
    .await
    .expect("the next owner made progress");
    frozen.resume();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let frozen_alive = frozen.running();
    let next_alive = next.running();
    // Whoever is left finishes (a worker a fence stopped exits non-zero; one more replaces it).
    let spare = (!frozen_alive && !next_alive).then(|| WorkerProcess::spawn(&yaml));
    topics.wait_fully_committed(Duration::from_secs(180)).await;
    for w in [Some(frozen), Some(next), spare].into_iter().flatten() {
        let mut w = w;
        if w.running() {
            w.terminate();
        }
    }

    let report = verify_pipeline(&topics);
    eprintln!(
        "exactlyOnce, frozen at {at_freeze} output offsets, resumed (alive after: frozen \
         {frozen_alive}, next {next_alive}):\n{report}"
    );
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.stale_ends, 0, "{report}");
    assert_eq!(report.duplicates, 0, "{report}");
    assert_eq!(
        report.records + report.dlq_records,
        total as u64,
        "{report}"
    );
    topics.delete().await;
}

/// Scale out and in while records flow, in `exactlyOnce`: every revocation commits the
/// partition's transaction (after its drain) and closes its producer before the next owner's
/// init; the read_committed output has every record once, in order per session (an abort
/// rewinds its partition; under KIP-848 a transactional offset commit refused with an outdated
/// member epoch while the assignment changes is such an abort).
async fn scale_out_and_in_exactly_once(strategy: &str) {
    let topics = Topics::create(&format!("eos-scale-{strategy}"), 6).await;
    // Enough that the SIGTERM comes mid-flow on an idle machine too (10,000 were all written
    // before it in one run).
    let total = 30_000;
    crate::produce_round_robin(&topics, 100, 300).await;
    let yaml = topics.stage_yaml(
        "{transientRate: 0.02, latencyMs: 10, seed: 13}",
        &format!(
            "delivery: exactlyOnce\nrebalance: {{strategy: {strategy}, drainTimeoutMs: 4000}}"
        ),
    );
    let first = WorkerProcess::spawn(&yaml);
    wait_until(Duration::from_secs(120), || topics.output_count() >= 1_500)
        .await
        .expect("the first worker made progress");
    let second = WorkerProcess::spawn(&yaml);
    let third = WorkerProcess::spawn(&yaml);
    let at_three = topics.output_count();
    wait_until(Duration::from_secs(120), || {
        topics.output_count() >= at_three + 3_000
    })
    .await
    .expect("three workers made progress");
    second.terminate();
    third.terminate();
    // A worker that stops on its own is replaced, as its Deployment would, and counted.
    let mut workers = vec![first];
    let mut restarted = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    while topics.committed() != topics.end_offsets(&topics.input) {
        assert!(
            std::time::Instant::now() < deadline,
            "committed {:?} never reached the end",
            topics.committed()
        );
        if !workers.iter_mut().any(|w| w.running()) {
            workers.push(WorkerProcess::spawn(&yaml));
            restarted += 1;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for mut w in workers {
        if w.running() {
            w.terminate();
        }
    }

    let report = verify_pipeline(&topics);
    eprintln!(
        "exactlyOnce, scale 1→3→1 ({strategy}) from {at_three} output offsets (workers started \
         again: {restarted}):\n{report}"
    );
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.duplicates, 0, "{report}");
    assert_eq!(
        report.records + report.dlq_records,
        total as u64,
        "{report}"
    );
    // Not asserted to be 0: before branch `fenced`, a producer fenced by the partition's next
    // owner stopped a worker (seen once in a CI rehearsal of the cooperative run, the first
    // worker, as the other two left); it now gives up only that partition, but other causes
    // (a rewind's committed-offset read refused) still stop one. Exactness is asserted above
    // either way.
    if restarted > 0 {
        eprintln!("workers stopped on their own and were started again: {restarted}");
    }
    topics.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_scale_out_and_in_consumer() {
    scale_out_and_in_exactly_once("consumer").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_scale_out_and_in_cooperative() {
    scale_out_and_in_exactly_once("cooperative").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_scale_out_and_in_eager() {
    scale_out_and_in_exactly_once("eager").await;
}

/// Output topic limit for the abort tests: a normal output fits, the big record's does not.
const OUTPUT_MAX_BYTES: usize = 50_000;
/// The big record's value size.
const BIG_BYTES: usize = 200_000;
const SESSIONS: usize = 10;
const PER_SESSION: usize = 30;
/// The big record: session 3's 11th.
const BIG: (usize, usize) = (3, 10);

fn value(session: usize, i: usize) -> String {
    let v = format!("s{session}-{i:03}");
    if (session, i) == BIG {
        format!("{v}-{}", "x".repeat(BIG_BYTES))
    } else {
        v
    }
}

/// Sets `topic`'s `max.message.bytes`.
async fn set_max_message_bytes(topic: &str, bytes: usize) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin");
    let bytes = bytes.to_string();
    let change = AlterConfig::new(ResourceSpecifier::Topic(topic)).set("max.message.bytes", &bytes);
    let results = admin
        .alter_configs(&[change], &AdminOptions::new())
        .await
        .expect("alter_configs");
    for r in results {
        r.expect("max.message.bytes set");
    }
}

/// The abort tests' input: `SESSIONS` sessions of `PER_SESSION` records each, interleaved,
/// keyed by session, with one big record (`BIG`).
fn produce_sessions(topic: &str) {
    let p: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("message.max.bytes", "1000000")
        .create()
        .expect("producer");
    for i in 0..PER_SESSION {
        for s in 0..SESSIONS {
            let key = format!("s{s}");
            let v = value(s, i);
            p.send(BaseRecord::to(topic).key(&key).payload(&v))
                .map_err(|(e, _)| e)
                .expect("send");
            p.poll(Duration::ZERO);
        }
    }
    p.flush(T).expect("flush");
}

/// Everything a read_committed consumer reads of `topic` (all `partitions`) from the start:
/// until `want` records, then two seconds more for extras, or `within`. Values with the
/// `sessionflow-dlq-reason` header if any.
fn read_all(
    topic: &str,
    partitions: i32,
    want: usize,
    within: Duration,
) -> Vec<(String, Option<String>)> {
    let extra = Duration::from_secs(2);
    consume(topic, "read_committed", partitions, want, within, extra)
}

/// What a consumer with `isolation` reads of `topic`'s first `partitions` from the start: until
/// `want` records, then `extra` more time, or `within`. Values with their
/// `sessionflow-dlq-reason` header if any.
fn consume(
    topic: &str,
    isolation: &str,
    partitions: i32,
    want: usize,
    within: Duration,
    extra: Duration,
) -> Vec<(String, Option<String>)> {
    use rdkafka::message::Headers;
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", "unused")
        .set("isolation.level", isolation)
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    c.assign(&tpl).expect("assign");
    let mut got = Vec::new();
    let deadline = Instant::now() + within;
    let mut extra_until: Option<Instant> = None;
    while Instant::now() < extra_until.unwrap_or(deadline) {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(100)) {
            let reason = m.headers().and_then(|hs| {
                hs.iter()
                    .find(|h| h.key == sessionflow_worker::record::header::DLQ_REASON)
                    .and_then(|h| h.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            });
            let v = String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned();
            got.push((v, reason));
        }
        if got.len() >= want && extra_until.is_none() {
            extra_until = Some(Instant::now() + extra);
        }
    }
    got
}

/// What the abort tests check of the read_committed output and DLQ: each non-big record
/// exactly once in the output, in order per session; the big one exactly once, in the DLQ (with
/// `dlq_reason`) or in the output (when `dlq_reason` is `None` and it went there). Returns
/// whether the big record went to the DLQ.
fn check_exactly_once(topics: &Topics, partitions: i32) -> bool {
    let total = SESSIONS * PER_SESSION;
    let output = read_all(
        &topics.output,
        partitions,
        total - 1,
        Duration::from_secs(60),
    );
    let dlq = read_all(&topics.dlq, 1, 0, Duration::from_secs(5));
    let short = |v: &str| v.chars().take(12).collect::<String>();
    let big = value(BIG.0, BIG.1);
    let big_in_output = output.iter().filter(|(v, _)| *v == big).count();
    let big_in_dlq: Vec<&Option<String>> = dlq
        .iter()
        .filter(|(v, _)| *v == big)
        .map(|(_, r)| r)
        .collect();
    assert_eq!(
        dlq.len(),
        big_in_dlq.len(),
        "only the big record may be dead-lettered: {:?}",
        dlq.iter().map(|(v, r)| (short(v), r)).collect::<Vec<_>>()
    );
    assert_eq!(
        big_in_output + big_in_dlq.len(),
        1,
        "the big record exactly once (output {big_in_output}, DLQ {})",
        big_in_dlq.len()
    );
    let to_dlq = big_in_dlq.len() == 1;
    for s in 0..SESSIONS {
        let prefix = format!("s{s}-");
        let got: Vec<String> = output
            .iter()
            .filter(|(v, _)| v.starts_with(&prefix))
            .map(|(v, _)| v.clone())
            .collect();
        let want: Vec<String> = (0..PER_SESSION)
            .filter(|i| !(to_dlq && (s, *i) == BIG))
            .map(|i| value(s, i))
            .collect();
        assert_eq!(
            got.iter().map(|v| short(v)).collect::<Vec<_>>(),
            want.iter().map(|v| short(v)).collect::<Vec<_>>(),
            "session s{s}: every record exactly once, in order"
        );
    }
    to_dlq
}

/// The sum of the worker's counter `name` over the series with all of `labels` (Prometheus
/// text, e.g. `reason="write"`), 0 if none.
async fn counter(port: u16, name: &str, labels: &[&str]) -> u64 {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let (status, body) = sessionflow_tests::http_get(addr, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    let prefix = format!("sessionflow_{name}{{");
    body.lines()
        .filter(|l| l.starts_with(&prefix) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// An exactly-once stage over 2 partitions whose output topic takes at most
/// `OUTPUT_MAX_BYTES`; metrics on `port`, logs (warn) to a file of its own.
async fn abort_stage(name: &str, port: u16) -> (Topics, WorkerProcess, std::path::PathBuf) {
    let topics = Topics::create(name, 2).await;
    set_max_message_bytes(&topics.output, OUTPUT_MAX_BYTES).await;
    produce_sessions(&topics.input);
    let yaml = topics
        .stage_yaml("{latencyMs: 200, seed: 3}", "delivery: exactlyOnce")
        .replace(
            "metricsAddr: null",
            &format!("metricsAddr: 127.0.0.1:{port}"),
        );
    // Small output batches: the topic's limit applies to a batch of records.
    let yaml = format!("{yaml}  batch.size: '8192'\n");
    let log = std::env::temp_dir().join(sessionflow_tests::unique(name) + ".log");
    let worker = WorkerProcess::spawn_logging_at(
        &yaml,
        &[],
        std::fs::File::create(&log).expect("log file").into(),
        "sessionflow_worker=warn",
    );
    (topics, worker, log)
}

/// An exactly-once transaction aborts (the big record's output is refused by the output
/// topic, which makes the transaction abortable): the worker aborts it and rewinds the
/// partition instead of stopping; once the topic takes the record (its limit raised), the
/// replay commits. The worker never stops, and the read_committed output has every record
/// exactly once, in order per session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_exactly_once_transaction_rewinds_its_partition_and_the_worker_goes_on() {
    let port = 19490;
    let (topics, mut worker, log) = abort_stage("eos-abort", port).await;
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    worker
        .wait_for_log(
            &log,
            "transaction aborted",
            "abort",
            Duration::from_secs(120),
        )
        .await;
    set_max_message_bytes(&topics.output, 1_000_000).await;
    topics.wait_fully_committed(Duration::from_secs(120)).await;
    assert!(
        worker.running(),
        "the worker stopped after the abort:\n{}",
        read_log()
    );
    let aborts = counter(
        port,
        "transactions_total",
        &["result=\"aborted\"", "reason=\"write\""],
    )
    .await;
    assert!(aborts >= 1, "aborts counted: {aborts}");
    let to_dlq = check_exactly_once(&topics, 2);
    eprintln!("aborts (write): {aborts}; the big record went to the DLQ: {to_dlq}");
    worker.terminate();
    topics.delete().await;
}

/// A poison transaction: the big record's output is refused every time (the output topic never
/// takes it), so every transaction of its partition that writes it aborts. After
/// `POISON_ABORTS` aborts in a row naming it, its replay writes it to the DLQ (reason
/// `transaction-abort`) in the transaction instead, which commits: the worker never stops, the
/// big record is exactly once in the read_committed DLQ, every other record exactly once in the
/// output, in order per session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_aborts_every_transaction_goes_to_the_dlq_once() {
    let port = 19491;
    let (topics, mut worker, log) = abort_stage("eos-poison", port).await;
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let input = topics.input.clone();
    let done = wait_until(Duration::from_secs(180), || {
        !worker.running() || topics.committed() == sessionflow_tests::end_offsets(&input)
    })
    .await;
    assert!(worker.running(), "the worker stopped:\n{}", read_log());
    assert!(
        done.is_ok(),
        "committed {:?} never reached the end:\n{}",
        topics.committed(),
        read_log()
    );
    let aborts = counter(
        port,
        "transactions_total",
        &["result=\"aborted\"", "reason=\"write\""],
    )
    .await;
    let dlq = counter(port, "dlq_total", &["reason=\"transaction-abort\""]).await;
    let to_dlq = check_exactly_once(&topics, 2);
    eprintln!("aborts (write): {aborts}; dead letters (transaction-abort): {dlq}");
    assert!(to_dlq, "the big record is in the DLQ");
    assert!(
        aborts >= u64::from(sessionflow_worker::output::transactions::POISON_ABORTS),
        "aborts counted: {aborts}"
    );
    let dlq_reason = read_all(&topics.dlq, 1, 1, Duration::from_secs(10));
    assert_eq!(
        dlq_reason[0].1.as_deref(),
        Some("transaction-abort"),
        "the DLQ record's reason"
    );
    worker.terminate();
    topics.delete().await;
}

/// The relayed node of [`a_rewind_asks_again_for_an_offset_the_coordinator_cannot_serve`]
/// (all the relayed nodes' ports are listed at `sessionflow_tests::relay::broker_behind_relay`).
const REWIND_READ_PORT: u16 = 19652;

/// A rewind needs its partition's committed offset, and the group coordinator cannot serve it
/// for a while (a coordinator moving or restarting: in a chaos run, a worker stopped here after
/// one timed-out read). On an Apache Kafka node of its own behind the relay, one output write
/// is refused (the transaction must abort and its partition rewind) while every `OffsetFetch`
/// is answered "request timed out" for longer than one read may wait (librdkafka asks again
/// within the read; the read times out). The worker must ask again until the coordinator
/// answers, rewind, and go on: it keeps running, and the read_committed output has every record
/// once, in order per session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_asks_again_for_an_offset_the_coordinator_cannot_serve() {
    use rdkafka::types::RDKafkaRespErr::*;
    use sessionflow_tests::relay::{RelayedNode, OFFSET_FETCH};
    use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};
    const RECORDS: u64 = 4_000;
    /// Longer than one read's 10 s (`intake::transactional`), shorter than the rewind's budget.
    const UNSERVED: Duration = Duration::from_secs(16);

    let node = RelayedNode::start(REWIND_READ_PORT, "eos-rewind-read", 2).await;
    let (brokers, topics) = (node.brokers.clone(), &node.topics);
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        rate: Some(200.0),
        ..LoadgenOptions::new(&brokers, &topics.input, RECORDS, 40)
    };
    let load = tokio::spawn(async move { loadgen::run(&opts).await });
    let yaml = topics.stage_yaml_on(&brokers, "{latencyMs: 2, seed: 9}", "delivery: exactlyOnce");
    let log = std::env::temp_dir().join(sessionflow_tests::unique("eos-rewind-read") + ".log");
    let mut worker = WorkerProcess::spawn_logging_at(
        &yaml,
        &[],
        std::fs::File::create(&log).expect("log file").into(),
        "sessionflow_worker=info",
    );
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let outputs = || {
        sessionflow_tests::end_offsets_on(&brokers, &topics.output)
            .iter()
            .sum::<i64>()
    };
    wait_until(Duration::from_secs(90), || outputs() >= 300)
        .await
        .unwrap_or_else(|_| panic!("no progress before the fault:\n{}", read_log()));

    node.relay.refuse(
        OFFSET_FETCH,
        RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT as i16,
        usize::MAX,
    );
    node.relay.refuse_produce(
        &topics.output,
        &[RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE as i16],
    );
    tokio::time::sleep(UNSERVED).await;
    node.relay.accept(OFFSET_FETCH);
    let fetches_refused = node.relay.refused(OFFSET_FETCH);

    load.await.unwrap().expect("loadgen");
    let committed =
        sessionflow_tests::wait_committed_to_end_on(&brokers, topics, Duration::from_secs(120))
            .await;
    let log_text = read_log();
    assert!(
        worker.running(),
        "the worker stopped (fetches refused: {fetches_refused}):\n{log_text}"
    );
    committed.unwrap_or_else(|(committed, end)| {
        panic!("committed {committed:?} never reached {end:?}:\n{log_text}")
    });
    assert!(
        log_text.contains("transaction aborted"),
        "the refused write aborted no transaction:\n{log_text}"
    );
    assert!(
        log_text.contains("could not be read; asking again"),
        "the rewind's read was never refused (fetches refused: {fetches_refused}):\n{log_text}"
    );
    assert!(worker.terminate().success(), "{}", read_log());
    let report = sessionflow_tests::verify_on(&brokers, topics);
    eprintln!("a rewind's read refused for {UNSERVED:?} ({fetches_refused} fetches):\n{report}");
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.duplicates, 0, "{report}");
    assert_eq!(report.records + report.dlq_records, RECORDS, "{report}");
}
