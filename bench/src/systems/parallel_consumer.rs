//! System 5 (on request): the Confluent Parallel Consumer, the design users would pick instead.
//!
//! PC is a Java library, so it runs in a JVM of its own: `bench/parallel-consumer/` (a Maven
//! project: `parallel-consumer-core` 0.5.3.3 with the kafka-clients 3.9.1 it is built with, and
//! a small main, `ParallelConsumerBench.java`) packaged as one jar, started by this child with
//! the machine's `java` and a small heap ([`JAVA_HEAP`]). It consumes the run's topic in KEY
//! ordering with PC's default commit mode (periodic asynchronous consumer commits, the offset
//! map in the commit metadata), committing every second like every system here, and runs the
//! bench handler's Java twin on each record: the same order check, the same fault draws and
//! failing-session window, the same histogram buckets, the handler's I/O as a blocking 5 ms
//! wait on PC's worker thread (PC's natural model: its poll function runs on a thread pool of
//! `maxConcurrency` threads). Failed attempts are retried by PC after the engine's retry
//! policy's delay.
//!
//! PC's `maxConcurrency` is the in-flight budget sessionflow gets in the same scenario: one
//! record in the handler per session, up to `maxInFlightPerPartition` records per partition
//! ([`max_concurrency`]): 1,000 in P1, P2 and P4 (the sessions), 10 in P3.
//!
//! The JVM reports on its stdout (`W <partition>` for warm-ups, and every 5 ms an `S` line of
//! counters and histogram deltas, see [`parse_status`]); this child feeds the lines to its
//! [`Core`], so the run loop, the cap and the result are the same code as for every other
//! system. The run's CPU seconds and peak RSS are the JVM's (`/proc/<pid>`, from its start:
//! JVM start-up and JIT compilation are part of them). The jar is built on first use, and again
//! when the pom or the Java source is newer than it (`mvn -q -B package`, Maven's cache in
//! `~/.m2`); `make bench-pc-jar` does the same.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

use super::{Running, SystemSettings};
use crate::handler::{Core, RemoteStatus};

const STOP: &str = "STOP\n";

/// What `bench/parallel-consumer/pom.xml` names (the report prints them).
pub const PC_VERSION: &str = "0.5.3.3";
pub const PC_KAFKA_CLIENTS: &str = "3.9.1";

/// The JVM's heap: PC's buffers of fetched records (its load factor × concurrency) live there.
pub const JAVA_HEAP: &str = "-Xmx512m";

/// The Maven project of the Java main.
pub fn project_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("parallel-consumer")
}

/// The jar `mvn package` makes (every dependency inside).
pub fn jar_path() -> PathBuf {
    project_dir().join("target/sessionflow-bench-pc.jar")
}

/// PC's `maxConcurrency` for a scenario: sessionflow's budget, one record in the handler per
/// session and at most `max_in_flight_per_partition` records per partition, unless the run caps
/// PC's threads (`--pc-max-concurrency`: one thread per record in flight, so sessionflow's
/// budget at 100,000 sessions would be 80,000 threads in one JVM).
pub fn max_concurrency(
    sessions: usize,
    partitions: i32,
    max_in_flight_per_partition: usize,
    cap: Option<usize>,
) -> usize {
    let per_partitions = usize::try_from(partitions.max(1))
        .unwrap_or(1)
        .saturating_mul(max_in_flight_per_partition);
    sessions
        .min(per_partitions)
        .min(cap.unwrap_or(usize::MAX))
        .max(1)
}

/// Builds the jar unless it is newer than the pom and the Java sources.
pub fn ensure_jar() -> anyhow::Result<PathBuf> {
    let jar = jar_path();
    let dir = project_dir();
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let newest_source = [
        dir.join("pom.xml"),
        dir.join("src/main/java/sessionflow/bench/ParallelConsumerBench.java"),
    ]
    .iter()
    .filter_map(|p| modified(p))
    .max();
    let fresh = matches!((modified(&jar), newest_source), (Some(j), Some(s)) if j >= s);
    if !fresh {
        eprintln!(
            "parallel-consumer: building {} (mvn -q -B package)",
            jar.display()
        );
        let status = std::process::Command::new("mvn")
            .args(["-q", "-B", "package"])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| anyhow::anyhow!("mvn (Maven is needed for the Parallel Consumer): {e}"))?;
        anyhow::ensure!(status.success(), "mvn package in {} failed", dir.display());
    }
    anyhow::ensure!(jar.exists(), "{} was not built", jar.display());
    Ok(jar)
}

/// An `S` line: `S handled healthy attempts first_us last_us violations [i:n]… ; [i:n]…`
/// (first_us / last_us 0: none yet).
pub fn parse_status(line: &str) -> Option<RemoteStatus> {
    let rest = line.strip_prefix("S ")?;
    let (counters_and_all, healthy) = rest.split_once(';')?;
    let mut words = counters_and_all.split_whitespace();
    let mut next = || -> Option<u64> { words.next()?.parse().ok() };
    let (handled, healthy_handled, attempts) = (next()?, next()?, next()?);
    let (first, last, order_violations) = (next()?, next()?, next()?);
    let pairs = |text: &str| -> Option<Vec<(usize, u64)>> {
        text.split_whitespace()
            .map(|p| {
                let (i, n) = p.split_once(':')?;
                Some((i.parse().ok()?, n.parse().ok()?))
            })
            .collect()
    };
    let all_text: String = counters_and_all
        .split_whitespace()
        .skip(6)
        .collect::<Vec<_>>()
        .join(" ");
    Some(RemoteStatus {
        handled,
        healthy_handled,
        attempts,
        first_us: (first > 0).then_some(first),
        last_us: (last > 0).then_some(last),
        order_violations,
        all: pairs(&all_text)?,
        healthy: pairs(healthy)?,
    })
}

/// One line of the JVM's stdout into `core`.
fn relay(line: &str, core: &Core) {
    if let Some(p) = line.strip_prefix("W ") {
        if let Ok(p) = p.trim().parse() {
            core.warm_up(p);
        }
    } else if let Some(status) = parse_status(line) {
        core.absorb(&status);
    } else {
        eprintln!("parallel-consumer: {line}");
    }
}

pub async fn start(settings: &SystemSettings, core: Arc<Core>) -> anyhow::Result<Running> {
    let jar = tokio::task::spawn_blocking(ensure_jar).await??;
    let in_flight = super::sessionflow::stage_config(settings).max_in_flight_per_partition;
    let concurrency = max_concurrency(
        core.sessions(),
        settings.partitions,
        in_flight,
        settings.pc_max_concurrency,
    );
    let spec = core.spec().clone();
    let args: Vec<String> = [
        ("brokers", settings.brokers.clone()),
        ("topic", settings.topic.clone()),
        ("group", settings.group.clone()),
        ("partitions", settings.partitions.to_string()),
        ("sessions", core.sessions().to_string()),
        ("max_concurrency", concurrency.to_string()),
        ("fetch_wait_ms", settings.fetch_wait_ms.to_string()),
        (
            "commit_interval_ms",
            settings.commit_interval_ms.to_string(),
        ),
        (
            "commit_mode",
            if settings.exactly_once {
                "transactional"
            } else {
                "async"
            }
            .to_string(),
        ),
        ("io_ms", spec.io_ms.to_string()),
        ("transient_rate", spec.transient_rate.to_string()),
        ("seed", spec.seed.to_string()),
        ("fail_sid", spec.fail_sid.map_or(-1, i64::from).to_string()),
        ("fail_from_ms", spec.fail_from_ms.to_string()),
        ("fail_for_ms", spec.fail_for_ms.to_string()),
        ("retry_initial_ms", settings.retry_initial_ms.to_string()),
        ("retry_max_ms", settings.retry_max_ms.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| format!("{k}={v}"))
    .collect();
    eprintln!("parallel-consumer: java {JAVA_HEAP}, maxConcurrency {concurrency}");
    let mut child = tokio::process::Command::new("java")
        .arg(JAVA_HEAP)
        .arg("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")
        .arg("-jar")
        .arg(&jar)
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow::anyhow!("java (a JDK 17+ is needed): {e}"))?;
    let pid = child.id();
    let mut stdin = child.stdin.take().expect("piped stdin");
    let stdout = child.stdout.take().expect("piped stdout");
    let reader = {
        let core = core.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                relay(&line, &core);
            }
        })
    };
    // GO and STOP go to the JVM's stdin in the order they are said.
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let writer = tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            if stdin.write_all(line.as_bytes()).await.is_err() || stdin.flush().await.is_err() {
                return;
            }
            // The `go` closure keeps a sender for as long as the run: STOP is the last word.
            if line == STOP {
                return;
            }
        }
    });
    let go_tx = tx.clone();
    Ok(Running {
        stop: Box::new(move || {
            async move {
                let _ = tx.send(STOP.into());
                drop(tx);
                let _ = writer.await;
                match tokio::time::timeout(Duration::from_secs(20), child.wait()).await {
                    Ok(_) => {}
                    Err(_) => {
                        eprintln!("parallel-consumer: the JVM did not stop within 20 s; killed");
                        let _ = child.kill().await;
                    }
                }
                let _ = reader.await;
            }
            .boxed()
        }),
        sessions: None,
        pid,
        go: Some(Box::new(move |us| {
            let _ = go_tx.send(format!("GO {us}\n"));
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_carry_counters_and_histogram_deltas() {
        let s = parse_status("S 10 9 12 1700000000000000 1700000000500000 1 3:2 130:8 ; 3:2 130:7")
            .unwrap();
        assert_eq!(
            s,
            RemoteStatus {
                handled: 10,
                healthy_handled: 9,
                attempts: 12,
                first_us: Some(1_700_000_000_000_000),
                last_us: Some(1_700_000_000_500_000),
                order_violations: 1,
                all: vec![(3, 2), (130, 8)],
                healthy: vec![(3, 2), (130, 7)],
            }
        );
        let idle = parse_status("S 0 0 0 0 0 0 ;").unwrap();
        assert_eq!((idle.first_us, idle.last_us), (None, None));
        assert!(idle.all.is_empty() && idle.healthy.is_empty());
        assert_eq!(parse_status("S 1 2 3"), None);
        assert_eq!(parse_status("S 1 1 1 0 0 0 3:x ;"), None);
        assert_eq!(parse_status("W 3"), None);
    }

    #[test]
    fn relayed_lines_become_the_cores_measurements() {
        let core = Core::new(Default::default(), 4, 2);
        relay("W 0", &core);
        assert!(!core.all_warm());
        relay("W 1", &core);
        assert!(core.all_warm());
        relay("S 2 2 3 100 200 0 150:2 ; 150:2", &core);
        relay("S 3 3 4 100 300 0 151:1 ; 151:1", &core);
        let c = core.counts();
        assert_eq!((c.handled, c.healthy_handled, c.attempts), (3, 3, 4));
        assert_eq!((c.first_us, c.last_us), (Some(100), Some(300)));
        assert_eq!(core.all.snapshot().count(), 3);
        assert_eq!(core.healthy.snapshot().buckets, vec![(150, 2), (151, 1)]);
    }

    #[test]
    fn concurrency_is_sessionflows_budget() {
        assert_eq!(max_concurrency(1_000, 8, 10_000, None), 1_000);
        assert_eq!(max_concurrency(10, 8, 10_000, None), 10);
        assert_eq!(max_concurrency(1_000_000, 8, 10_000, None), 80_000);
        assert_eq!(max_concurrency(1_000, 1, 125, None), 125);
    }

    #[test]
    fn a_cap_bounds_only_what_is_above_it() {
        assert_eq!(max_concurrency(1_000_000, 8, 10_000, Some(1_000)), 1_000);
        assert_eq!(max_concurrency(100_000, 8, 10_000, Some(1_000)), 1_000);
        assert_eq!(max_concurrency(10, 8, 10_000, Some(1_000)), 10);
        assert_eq!(max_concurrency(1_000, 8, 10_000, Some(1_000)), 1_000);
    }
}
