//! One run: one system on one topic, in a child process of its own.
//!
//! CPU seconds and peak RSS are per process, and a system leaves things behind (librdkafka
//! threads and buffers, allocator arenas, a million reaped session tasks' freed memory), so
//! every run gets a fresh process: `sessionflow-bench child SPEC`, where SPEC is the JSON of a
//! [`RunSpec`]. The parent produces (its CPU is not the system's) and talks to the child over
//! its standard streams: for a paced run the child prints `READY` once it is fetching (it has
//! seen a warm-up record on every partition) and waits for `GO <µs>`, the moment the load
//! starts; at the end it prints `RESULT <json>` (a [`RunResult`]). A run ends when every
//! expected record is done or its time cap passes; records not done by then are counted as
//! censored, not dropped from the statistics.

use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::handler::{Core, HandlerSpec};
use crate::measurement::{cpu_seconds, now_us, process_cpu_seconds, process_rss, rss, Hist};
use crate::systems::{self, SystemKind, SystemSettings};

/// How long a child waits for its first record or its warm-ups before giving up.
const START_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSpec {
    pub system: SystemKind,
    pub settings: SystemSettings,
    pub handler: HandlerSpec,
    pub sessions: u64,
    /// Records (warm-ups aside) the run waits for.
    pub expected: u64,
    /// Paced: the load is produced while the system runs (READY / GO handshake).
    pub paced: bool,
    /// Longest run: from the first record (backlog runs) or from GO (paced runs).
    pub cap_secs: f64,
    /// P5: measure RSS at rest before the load, and after the sessions are reaped.
    pub memory: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunResult {
    pub handled: u64,
    pub healthy_handled: u64,
    pub attempts: u64,
    /// First handler call and last completion, µs since the epoch.
    pub first_us: Option<u64>,
    pub last_us: Option<u64>,
    /// The time cap ended the run before every expected record was done.
    pub capped: bool,
    pub all: Hist,
    pub healthy: Hist,
    pub order_violations: u64,
    /// CPU seconds of the child from just before the system started to the last record.
    pub cpu_s: f64,
    /// Peak RSS of the child (VmHWM) at the end of the measured part, bytes.
    pub peak_rss: u64,
    pub memory: Option<Memory>,
}

impl RunResult {
    /// Records per second between the first handler call and the last completion.
    pub fn throughput(&self) -> Option<f64> {
        let (first, last) = (self.first_us?, self.last_us?);
        (last > first && self.handled > 0)
            .then(|| self.handled as f64 / ((last - first) as f64 / 1e6))
    }
}

/// P5's readings, bytes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Memory {
    /// Engine running and idle, warm-up sessions reaped, before the load.
    pub baseline_rss: u64,
    pub peak_rss: u64,
    /// Every session reaped after the load.
    pub after_reap_rss: u64,
    /// Diagnostic: heap bytes still allocated after the reap (the allocator's own count,
    /// `memory::allocated_bytes`), to tell memory the engine keeps from pages the allocator
    /// keeps; `None` when the allocator does not report it.
    #[serde(default)]
    pub live_heap: Option<u64>,
    /// Diagnostic: the same count at rest before the load, to tell what the reap left allocated
    /// from what was allocated before.
    #[serde(default)]
    pub baseline_heap: Option<u64>,
    /// Diagnostic: the allocator's own books (`memory::metadata_bytes`) at rest before the
    /// load and after the reap; what they grew by is RSS no trim gives back.
    #[serde(default)]
    pub baseline_metadata: Option<u64>,
    #[serde(default)]
    pub after_reap_metadata: Option<u64>,
    /// The harness's own per-session memory in this process (the order check, 8 bytes a
    /// session), allocated and written before the baseline, so resident in both readings: the
    /// growth ratio leaves it out ([`Memory::growth`]). 0 in results older than 6 Dec.
    #[serde(default)]
    pub harness_bytes: u64,
    pub peak_sessions: i64,
    /// From the last record to the last session reaped.
    pub reap_secs: f64,
}

impl Memory {
    /// RSS after the reap ÷ RSS at rest, both without the harness's own bytes: what the engine
    /// grew by, against what it holds at rest.
    pub fn growth(&self) -> Option<f64> {
        let engine = |rss: u64| rss.saturating_sub(self.harness_bytes) as f64;
        let at_rest = engine(self.baseline_rss);
        (at_rest > 0.0).then(|| engine(self.after_reap_rss) / at_rest)
    }
}

/// The child side: runs the system, prints `RESULT`.
pub async fn child(spec: RunSpec) -> anyhow::Result<()> {
    let core = Arc::new(Core::new(
        spec.handler.clone(),
        spec.sessions as usize,
        spec.settings.partitions as usize,
    ));
    let cpu0 = cpu_seconds();
    let system = systems::start(spec.system, &spec.settings, core.clone()).await?;
    let active = Arc::new(AtomicI64::new(0));
    let peak_sessions = Arc::new(AtomicI64::new(0));
    let peak_rss = Arc::new(AtomicU64::new(0));
    let mut memory = None;

    let mut go = None;
    // The parent's `GO` line, read from now on: tokio reads stdin on a thread of its blocking
    // pool, which then waits in `read`. Started here, that thread is in P5's baseline as well
    // as in the reading after the reap; started at `READY`, it was the harness's growth,
    // counted as the engine's.
    let go_line = (spec.paced || spec.memory).then(|| {
        tokio::spawn(async {
            let mut line = String::new();
            BufReader::new(tokio::io::stdin())
                .read_line(&mut line)
                .await
                .map(|_| line)
        })
    });
    if spec.paced || spec.memory {
        wait_for("warm-up records on every partition", || core.all_warm()).await?;
    }
    if spec.memory {
        let sessions = system
            .sessions
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the memory probe needs session counts"))?;
        // At rest: the warm-up sessions reaped, then one more reap interval.
        wait_for("warm-up sessions reaped", || sessions() == 0).await?;
        tokio::time::sleep(Duration::from_millis(spec.settings.session_idle_ms)).await;
        memory = Some(Memory {
            baseline_rss: rss().now,
            baseline_metadata: sessionflow_worker::ops::memory::metadata_bytes(),
            baseline_heap: sessionflow_worker::ops::memory::allocated_bytes(),
            harness_bytes: core.harness_bytes(),
            ..Default::default()
        });
    }
    let sampling = tokio_util::sync::CancellationToken::new();
    if spec.memory {
        // The run loop below keeps `active` current; this samples it and the RSS.
        let (active, peak_sessions, peak_rss, stop) = (
            active.clone(),
            peak_sessions.clone(),
            peak_rss.clone(),
            sampling.clone(),
        );
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                peak_sessions.fetch_max(active.load(Ordering::Acquire), Ordering::AcqRel);
                peak_rss.fetch_max(rss().now, Ordering::AcqRel);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
    }
    if let Some(go_line) = go_line {
        println!("READY");
        let line = go_line.await??;
        let started: u64 = line
            .trim()
            .strip_prefix("GO ")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("expected `GO <µs>`, got {line:?}"))?;
        core.set_load_started(started);
        if let Some(go) = &system.go {
            go(started);
        }
        go = Some(Instant::now());
    }

    let waited = Instant::now();
    let mut capped = false;
    loop {
        if let Some(f) = &system.sessions {
            active.store(f(), Ordering::Release);
        }
        let c = core.counts();
        if c.handled >= spec.expected {
            break;
        }
        let since = match (go, c.first_us) {
            (Some(go), _) => Some(go.elapsed()),
            (None, Some(first)) => Some(Duration::from_micros(now_us().saturating_sub(first))),
            (None, None) => None,
        };
        match since {
            Some(d) if d.as_secs_f64() >= spec.cap_secs => {
                capped = true;
                break;
            }
            None if waited.elapsed() >= START_TIMEOUT => {
                anyhow::bail!("no record reached the handler within {START_TIMEOUT:?}")
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A system in a process of its own (the Parallel Consumer's JVM, started by `systems::start`
    // above) is measured there, from its start; this process only relays its measurements.
    let (cpu_s, peak) = match system.pid {
        Some(pid) => (
            process_cpu_seconds(pid).unwrap_or(0.0),
            process_rss(pid).peak,
        ),
        None => (cpu_seconds() - cpu0, rss().peak),
    };

    if let (Some(m), Some(sessions)) = (memory.as_mut(), system.sessions.as_ref()) {
        let last = Instant::now();
        active.store(sessions(), Ordering::Release);
        wait_for("every session reaped", || {
            let n = sessions();
            active.store(n, Ordering::Release);
            n == 0
        })
        .await?;
        m.reap_secs = last.elapsed().as_secs_f64();
        // One more reap interval: whatever the reaper frees on its next pass is freed.
        tokio::time::sleep(Duration::from_millis(spec.settings.session_idle_ms)).await;
        sampling.cancel();
        m.after_reap_rss = rss().now;
        m.peak_rss = peak.max(peak_rss.load(Ordering::Acquire));
        m.peak_sessions = peak_sessions.load(Ordering::Acquire);
        m.live_heap = sessionflow_worker::ops::memory::allocated_bytes();
        m.after_reap_metadata = sessionflow_worker::ops::memory::metadata_bytes();
    }
    sampling.cancel();

    let c = core.counts();
    let result = RunResult {
        handled: c.handled,
        healthy_handled: c.healthy_handled,
        attempts: c.attempts,
        first_us: c.first_us,
        last_us: c.last_us,
        capped,
        all: core.all.snapshot(),
        healthy: core.healthy.snapshot(),
        order_violations: c.order_violations,
        cpu_s,
        peak_rss: peak,
        memory,
    };
    if tokio::time::timeout(Duration::from_secs(30), system.stop())
        .await
        .is_err()
    {
        eprintln!("child: the system did not stop within 30 s");
    }
    println!("RESULT {}", serde_json::to_string(&result)?);
    Ok(())
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    while !done() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "gave up waiting for {what} after {START_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// The parent's handle on a running child.
pub struct ChildRun {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl ChildRun {
    /// Starts `exe child SPEC`, its stderr appended to `log`.
    pub fn spawn(exe: &Path, spec: &RunSpec, log: &Path) -> anyhow::Result<Self> {
        let log = std::fs::File::create(log)?;
        let mut child = tokio::process::Command::new(exe)
            .arg("child")
            .arg(serde_json::to_string(spec)?)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        Ok(Self {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
        })
    }

    async fn line_starting(&mut self, prefix: &str) -> anyhow::Result<String> {
        while let Some(line) = self.lines.next_line().await? {
            if let Some(rest) = line.strip_prefix(prefix) {
                return Ok(rest.trim().to_string());
            }
        }
        let status = self.child.wait().await?;
        anyhow::bail!("the child ended ({status}) before printing {prefix}")
    }

    /// Waits for `READY`.
    pub async fn ready(&mut self) -> anyhow::Result<()> {
        self.line_starting("READY").await.map(|_| ())
    }

    /// Tells the child the load starts (started) now.
    pub async fn go(&mut self, started_us: u64) -> anyhow::Result<()> {
        self.stdin
            .write_all(format!("GO {started_us}\n").as_bytes())
            .await?;
        self.stdin.flush().await?;
        Ok(())
    }

    /// Waits for the result and the child's exit.
    pub async fn result(mut self) -> anyhow::Result<RunResult> {
        let json = self.line_starting("RESULT").await?;
        let result = serde_json::from_str(&json)?;
        let _ = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// P5 judges what the engine grew by: the harness's own bytes, resident in both readings,
    /// would otherwise pad the baseline and make any growth look smaller.
    #[test]
    fn the_growth_leaves_the_harness_out_of_both_readings() {
        const MIB: u64 = 1 << 20;
        let mut m = Memory {
            baseline_rss: 25 * MIB,
            after_reap_rss: 28 * MIB,
            ..Default::default()
        };
        assert_eq!(
            m.growth(),
            Some(28.0 / 25.0),
            "older results: nothing to leave out"
        );
        m.harness_bytes = 8 * MIB;
        assert_eq!(m.growth(), Some(20.0 / 17.0));
        m.harness_bytes = 25 * MIB;
        assert_eq!(
            m.growth(),
            None,
            "nothing of the engine's at rest: no ratio"
        );
    }
}
