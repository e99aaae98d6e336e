//! `sessionflow-chaos`: the randomized nemesis run (`make chaos`).
//!
//! The fault-injection tests each prove one hole closed under one fault. Real incidents are
//! several faults at once, in an order nobody wrote a test for: a worker is killed while
//! commits fail and a broker is down, a rolling restart lands during a coordinator move. This
//! run draws such a schedule from a seed, plays it against real worker processes and a
//! cluster — three nodes of Apache Kafka behind toxiproxy (`CHAOS_CLUSTER=kafka`, the
//! default) or librdkafka's mock cluster hosted in this process (`CHAOS_CLUSTER=mock`) —
//! while a load generator writes numbered sessions, heals everything, waits for the group to
//! commit the whole input, and judges the result with `verify`: nothing lost, nothing out of
//! order, committed == end, and on the mock no session ending on an older record. The seed is printed first and reproduces the schedule, the load
//! and the handler's faults, so a failure can be replayed (`CHAOS_SEED=… make chaos`); the
//! interleaving with real processes and timers is not reproduced exactly.

mod cluster;
mod input;
mod kafka_cluster;
mod load;
mod mock_cluster;
mod offsets;
mod schedule;
mod settings;
mod toxiproxy;
mod verdict;
mod workers;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use sessionflow_tools::verify::{self, VerifyOptions};
use sessionflow_worker::config::Delivery;
use sessionflow_worker::StageConfig;

use cluster::{ChaosCluster, RunTopics};
use input::InputAudit;
use load::{Load, LoadEnd};
use offsets::{GroupLag, Lag};
use schedule::{Action, Schedule, Step};
use settings::Settings;
use verdict::Verdict;
use workers::WorkerPool;

/// Partitions of the input and output topics.
const PARTITIONS: i32 = 8;
/// Share of the fault phase during which the load generator writes.
const LOAD_SHARE: f64 = 0.8;
/// How long the end of the run waits for the load generator's last acknowledgements.
const LOAD_GRACE: Duration = Duration::from_secs(60);
/// Workers kept for the end of the run: they must finish what the others left.
const FINAL_WORKERS: usize = 2;

fn main() -> ExitCode {
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!(
            "sessionflow-chaos: the randomized nemesis run (make chaos)\n\n{}",
            settings::HELP
        );
        return ExitCode::SUCCESS;
    }
    let settings = match Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("chaos: {e:#}\n\n{}", settings::HELP);
            return ExitCode::from(2);
        }
    };
    match run(&settings) {
        Ok(verdict) => {
            println!("{verdict}");
            if verdict.is_ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            println!(
                "chaos: seed={} seconds={} could not be judged: {e:#} → FAILED",
                settings.seed, settings.seconds
            );
            ExitCode::FAILURE
        }
    }
}

/// Time since the start of the run, for every line printed.
struct Clock(Instant);

impl Clock {
    fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }

    fn say(&self, what: impl std::fmt::Display) {
        println!("[{:>6.1}s] {what}", self.elapsed().as_secs_f64());
    }
}

fn run(settings: &Settings) -> anyhow::Result<Verdict> {
    let seed = settings.seed;
    let schedule = Schedule::draw(seed, settings.seconds, settings.cluster);
    let delivery = match settings.delivery {
        Delivery::AtLeastOnce => "atLeastOnce",
        Delivery::ExactlyOnce => "exactlyOnce",
    };
    println!(
        "chaos: seed={seed} seconds={} cluster={} delivery={delivery} (CHAOS_CLUSTER={} \
         CHAOS_DELIVERY={delivery} CHAOS_SEED={seed} CHAOS_SECONDS={} make chaos repeats this \
         schedule)",
        settings.seconds, settings.cluster, settings.cluster, settings.seconds
    );
    println!("schedule:\n{schedule}");

    std::fs::create_dir_all(&settings.dir)?;
    let topics = RunTopics {
        input: format!("chaos-{seed}-in"),
        output: format!("chaos-{seed}-out"),
        dlq: format!("chaos-{seed}-dlq"),
        group: format!("chaos-{seed}"),
    };
    let started = Instant::now();
    let mut cluster = ChaosCluster::start(
        settings.cluster,
        &topics,
        PARTITIONS,
        settings.kafka_port,
        &settings.dir,
    )?;
    let brokers = cluster.bootstrap();
    println!(
        "cluster: {} (ready in {:.1}s); logs in {}",
        cluster.describe(PARTITIONS),
        started.elapsed().as_secs_f64(),
        settings.dir.display()
    );
    let config = settings.dir.join("worker.yaml");
    let handler = Handler {
        seed,
        slow_ms: settings.slow_ms,
    };
    let producer = cluster.producer_properties();
    let stage =
        |rebalance: &str| stage_yaml(&brokers, &topics, &handler, rebalance, delivery, &producer);
    let yaml = match stage(schedule.rebalance) {
        // A worker that does not know KIP-848's protocol yet: the run goes on with the classic
        // protocol, and says so.
        Err(e) if schedule.rebalance == "consumer" => {
            println!(
                "workers: the worker refuses `rebalance: {{strategy: consumer}}` ({e:#}); \
                 this run uses cooperative instead"
            );
            stage("cooperative")?
        }
        other => other?,
    };
    std::fs::write(&config, yaml)?;
    let mut pool = WorkerPool::new(&settings.worker, &config, &settings.dir);
    println!(
        "workers: {} run --config {}",
        settings.worker.display(),
        config.display()
    );

    let clock = Clock(Instant::now());
    for _ in 0..schedule.initial_workers {
        clock.say(pool.spawn()?);
    }
    let records = (settings.rate * settings.seconds as f64 * LOAD_SHARE) as u64;
    let load = Load::start(
        &brokers,
        producer.clone(),
        &topics.input,
        records,
        settings.sessions,
        settings.rate,
        seed,
    )?;
    clock.say(format!(
        "load: {records} records over {} sessions at {}/s",
        settings.sessions, settings.rate
    ));

    play(
        &clock,
        &schedule.steps(),
        settings.seconds,
        &mut cluster,
        &mut pool,
        &topics,
    )?;

    clock.say("end of the fault phase: waiting for the load generator");
    let acknowledged = match load.finish(LOAD_GRACE) {
        LoadEnd::Acknowledged(r) => {
            clock.say(format!(
                "load: {} records acknowledged in {:.1}s",
                r.records,
                r.elapsed.as_secs_f64()
            ));
            Some(r.records)
        }
        LoadEnd::Unfinished(why) => {
            clock.say(format!("load: {why}; the input topic is the truth"));
            None
        }
    };
    for healed in pool.thaw_all()? {
        clock.say(format!("heal: {healed}"));
    }
    for healed in cluster.heal()? {
        clock.say(format!("heal: {healed}"));
    }
    keep_final_workers(&clock, &mut pool)?;

    let lag = GroupLag::new(&brokers, &topics.group, &topics.input, PARTITIONS)?;
    let settled = settle(&clock, &lag, &mut pool, settings.settle)?;
    for said in pool.stop_all()? {
        clock.say(said);
    }
    let after_stop = lag.read()?;
    if after_stop != settled {
        clock.say(format!("after the workers stopped: {after_stop}"));
    }
    clock.say(format!(
        "workers: {} started, {} killed, {} sent SIGTERM, {} frozen, {} incidents",
        pool.started,
        pool.killed,
        pool.terminated,
        pool.frozen,
        pool.incidents.len()
    ));
    for incident in &pool.incidents {
        clock.say(format!("incident: {incident}"));
    }

    clock.say("verify: reading output, DLQ and input back");
    let report = verify::run(&VerifyOptions {
        kafka: brokers.as_str().into(),
        topic: topics.output.clone(),
        dlq: Some(topics.dlq.clone()),
        input: Some(topics.input.clone()),
        session_header: None,
        timeout: Duration::from_secs(300),
    })?;
    println!("{report}");
    let input = InputAudit::read(&brokers, &topics.input, acknowledged)?;
    println!("{input}");
    Ok(Verdict {
        delivery: settings.delivery,
        seed,
        seconds: settings.seconds,
        input,
        report,
        committed_equals_end: settled.is_zero() && after_stop.is_zero(),
    })
}

/// Leaves one or two workers to finish what the others left: SIGTERM the rest, or start one.
fn keep_final_workers(clock: &Clock, pool: &mut WorkerPool) -> anyhow::Result<()> {
    while pool.live() > FINAL_WORKERS {
        clock.say(pool.terminate(pool.live() - 1)?);
    }
    if pool.live() == 0 {
        clock.say(pool.spawn()?);
    }
    Ok(())
}

/// Plays the steps in time until the fault phase ends, supervising the workers.
fn play(
    clock: &Clock,
    steps: &[Step],
    seconds: u64,
    cluster: &mut ChaosCluster,
    pool: &mut WorkerPool,
    topics: &RunTopics,
) -> anyhow::Result<()> {
    let end = Duration::from_secs(seconds);
    let mut next = steps.iter().peekable();
    let mut last_status = Duration::ZERO;
    while clock.elapsed() < end {
        while let Some(step) = next.next_if(|s| s.at <= clock.elapsed()) {
            clock.say(format!("fault: {}", step.action));
            for said in take(&step.action, cluster, pool, topics)? {
                clock.say(format!("  {said}"));
            }
        }
        for said in pool.reap()? {
            clock.say(said);
        }
        if clock.elapsed() >= last_status + Duration::from_secs(15) {
            last_status = clock.elapsed();
            clock.say(format!(
                "status: {} workers running, {} stopping",
                pool.live(),
                pool.stopping()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Takes one action; returns what the workers' side of it did, for the log.
fn take(
    action: &Action,
    cluster: &mut ChaosCluster,
    pool: &mut WorkerPool,
    topics: &RunTopics,
) -> anyhow::Result<Vec<String>> {
    Ok(match action {
        Action::Kill { pick } => vec![pool.kill(*pick)?],
        Action::Terminate { pick, replace } => {
            let mut said = vec![pool.terminate(*pick)?];
            if *replace {
                said.push(pool.spawn()?);
            }
            said
        }
        Action::Spawn => vec![pool.spawn()?],
        Action::FreezeWorker { pick, token } => vec![pool.freeze(*pick, *token)?],
        Action::ThawWorker { token } => vec![pool.thaw(*token)?],
        cluster_fault => cluster.apply(cluster_fault, topics)?,
    })
}

/// Waits (bounded) until the group has committed the whole input; returns the last reading.
fn settle(
    clock: &Clock,
    lag: &GroupLag,
    pool: &mut WorkerPool,
    within: Duration,
) -> anyhow::Result<Lag> {
    clock.say(format!(
        "settle: waiting up to {}s for committed offsets to reach the end offsets",
        within.as_secs()
    ));
    let deadline = Instant::now() + within;
    let mut last_print = Instant::now();
    loop {
        for said in pool.reap()? {
            clock.say(said);
        }
        let now = match lag.read() {
            Ok(now) => now,
            Err(e) if Instant::now() < deadline => {
                clock.say(format!("settle: offsets unreadable for now: {e:#}"));
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
            Err(e) => return Err(e),
        };
        if now.is_zero() {
            clock.say(format!("settle: committed == end: {now}"));
            return Ok(now);
        }
        if Instant::now() >= deadline {
            clock.say(format!(
                "settle: committed offsets did NOT reach the end in {}s: {now}",
                within.as_secs()
            ));
            return Ok(now);
        }
        if last_print.elapsed() >= Duration::from_secs(10) {
            last_print = Instant::now();
            clock.say(format!("settle: {now}"));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The builtin handler of the workers: transient faults, poison records and (unless
/// `slow_ms` is 0) first attempts several times longer than the rebalance drain, drawn per
/// record from the seed.
struct Handler {
    seed: u64,
    slow_ms: u64,
}

impl Handler {
    fn yaml(&self) -> String {
        let mut yaml = format!(
            "    transientRate: 0.05\n    poisonRate: 0.002\n    latencyMs: 3\n    seed: {}\n",
            self.seed
        );
        if self.slow_ms > 0 {
            yaml += &format!("    slowRate: 0.01\n    slowMs: {}\n", self.slow_ms);
        }
        yaml
    }
}

/// The workers' stage config: the builtin handler, a drain far shorter than the slow calls,
/// Kafka-legal fast group timings (under the classic protocols; with `consumer`, KIP-848, the
/// broker's `group.consumer.*` settings decide them and the worker refuses them), and the
/// cluster's `producer` settings (the mock's workaround, [`mock_cluster::PRODUCER_PROPERTIES`];
/// none on Kafka). Validated here so a config the worker refuses fails the run at once.
fn stage_yaml(
    brokers: &str,
    topics: &RunTopics,
    handler: &Handler,
    rebalance: &str,
    delivery: &str,
    producer: &[(String, String)],
) -> anyhow::Result<String> {
    let group_timings = if rebalance == "consumer" {
        String::new()
    } else {
        format!(
            "  session.timeout.ms: '{}'\n  heartbeat.interval.ms: '500'\n",
            schedule::SESSION_TIMEOUT.as_millis()
        )
    };
    let yaml = format!(
        "brokers: {brokers}
group: {group}
stage: chaos
input: {input}
output: {output}
dlq: {dlq}
handler:
  builtin:
{handler}retry: {{initialBackoffMs: 5, maxBackoffMs: 200}}
rebalance: {{strategy: {rebalance}, drainTimeoutMs: 500}}
commitIntervalMs: 200
delivery: {delivery}
metricsAddr: null
kafka:
{group_timings}  fetch.wait.max.ms: '100'
  linger.ms: '2'
{producer}",
        group = topics.group,
        input = topics.input,
        output = topics.output,
        dlq = topics.dlq,
        handler = handler.yaml(),
        producer = producer
            .iter()
            .map(|(k, v)| format!("  {k}: '{v}'\n"))
            .collect::<String>(),
    );
    let config =
        StageConfig::from_yaml(&yaml).map_err(|e| anyhow::anyhow!("the worker config: {e}"))?;
    // What the worker checks at start.
    sessionflow_worker::commit::exactly_once::check_stage(&config)
        .map_err(|e| anyhow::anyhow!("the worker config: {e}"))?;
    Ok(yaml)
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedule::ClusterKind;

    #[test]
    fn exactly_once_runs_every_protocol_on_kafka() {
        let topics = RunTopics {
            input: "in".into(),
            output: "out".into(),
            dlq: "dlq".into(),
            group: "g".into(),
        };
        let handler = Handler {
            seed: 1,
            slow_ms: 3_000,
        };
        for rebalance in ClusterKind::Kafka.protocols() {
            let yaml = stage_yaml(
                "127.0.0.1:1",
                &topics,
                &handler,
                rebalance,
                "exactlyOnce",
                &[],
            );
            // Every protocol, KIP-848's included: an ILLEGAL_GENERATION aborts and rewinds.
            let config = StageConfig::from_yaml(&yaml.unwrap()).unwrap();
            assert_eq!(config.settings.delivery(), Delivery::ExactlyOnce);
        }
    }

    #[test]
    fn the_worker_config_is_one_the_worker_accepts() {
        let topics = RunTopics {
            input: "in".into(),
            output: "out".into(),
            dlq: "dlq".into(),
            group: "g".into(),
        };
        let mock: Vec<(String, String)> = mock_cluster::PRODUCER_PROPERTIES
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        for (cluster, producer) in [(ClusterKind::Mock, mock), (ClusterKind::Kafka, vec![])] {
            for slow_ms in [0, 3_000] {
                for rebalance in cluster.protocols() {
                    let handler = Handler { seed: 1, slow_ms };
                    let yaml = stage_yaml(
                        "127.0.0.1:1",
                        &topics,
                        &handler,
                        rebalance,
                        "atLeastOnce",
                        &producer,
                    )
                    .unwrap_or_else(|e| panic!("{cluster} {rebalance}: {e:#}"));
                    assert_eq!(yaml.contains("slowMs"), slow_ms > 0);
                    let config = StageConfig::from_yaml(&yaml).unwrap();
                    // Only the mock's producers keep one request in flight.
                    assert_eq!(
                        config
                            .kafka
                            .contains_key("max.in.flight.requests.per.connection"),
                        cluster == ClusterKind::Mock
                    );
                    if *rebalance == "consumer" {
                        // KIP-848: the broker's group.consumer.* settings (6000/500 ms here).
                        assert!(!config.kafka.contains_key("session.timeout.ms"));
                        assert!(!config.kafka.contains_key("heartbeat.interval.ms"));
                    } else {
                        // The session timeout the schedule's rebalance windows are drawn around.
                        let millis = schedule::SESSION_TIMEOUT.as_millis().to_string();
                        assert_eq!(config.kafka.get("session.timeout.ms"), Some(&millis));
                    }
                }
            }
        }
    }
}
