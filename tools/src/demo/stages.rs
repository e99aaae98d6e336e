//! The demo's stage processes: one `sessionflow-worker run --config …` per stage.
//!
//! Each stage runs as its own process, as it would in a deployment, from a config written for
//! this run (the broker's address and a free metrics port filled in) next to its log. The demo
//! stops them as an orchestrator would, with SIGTERM (they drain, commit and leave their
//! groups), and kills whatever is left if the demo itself ends early.

use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::pipeline::Pipeline;
use super::scrape::Scraper;
use super::TICK;

/// How long the stages get to join their groups before the load starts anyway.
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a stage gets to drain and exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

pub(super) struct StageProcess {
    pub(super) stage: String,
    child: Child,
    pub(super) metrics_url: String,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

/// The worker processes, one per stage; any still running when dropped are killed.
pub(super) struct StageProcesses {
    pub(super) procs: Vec<StageProcess>,
}

impl StageProcesses {
    /// Writes each stage's config (brokers and a free metrics port filled in) into `dir` and
    /// starts `exe run --config` on it, its output going to `<stage>.log`.
    pub(super) fn start(
        exe: &Path,
        pipeline: &Pipeline,
        brokers: &str,
        dir: &Path,
    ) -> anyhow::Result<Self> {
        let mut procs = StageProcesses { procs: Vec::new() };
        for s in &pipeline.stages {
            let mut config = s.clone();
            config.brokers = brokers.to_string();
            let addr = free_metrics_addr(config.metrics_addr)?;
            config.metrics_addr = Some(addr);
            config.validate()?;
            let path = dir.join(format!("{}.yaml", s.stage));
            std::fs::write(&path, serde_saphyr::to_string(&config)?)?;
            let log = dir.join(format!("{}.log", s.stage));
            let out = File::create(&log)?;
            let child = Command::new(exe)
                .arg("run")
                .arg("--config")
                .arg(&path)
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .map_err(|e| anyhow::anyhow!("starting {}: {e}", exe.display()))?;
            procs.procs.push(StageProcess {
                stage: s.stage.clone(),
                child,
                metrics_url: format!("http://{}/metrics", reachable(addr)),
                log,
                exited: None,
            });
        }
        Ok(procs)
    }

    /// Fails when a stage process has exited on its own.
    pub(super) fn check_running(&mut self) -> anyhow::Result<()> {
        for p in &mut self.procs {
            if let Some(status) = p.child.try_wait()? {
                p.exited = Some(status);
                anyhow::bail!(
                    "stage {} exited ({status}); the end of its log ({}):\n{}",
                    p.stage,
                    p.log.display(),
                    tail(&p.log, 20)
                );
            }
        }
        Ok(())
    }

    /// Waits until every stage holds all partitions of its input (its lag gauge covers them),
    /// so the load does not start while the groups are still forming.
    pub(super) async fn wait_assigned(
        &mut self,
        scraper: &Scraper,
        partitions: usize,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + JOIN_TIMEOUT;
        let started = Instant::now();
        loop {
            self.check_running()?;
            let snaps = scraper.scrape_all(self).await;
            let joined = snaps
                .iter()
                .filter(|s| s.as_ref().is_some_and(|s| s.assigned >= partitions))
                .count();
            if joined == self.procs.len() {
                println!(
                    "== stages joined their groups in {:.1}s",
                    started.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            if Instant::now() >= deadline {
                println!(
                    "== only {joined} of {} stages hold their partitions after {}s; starting anyway",
                    self.procs.len(),
                    JOIN_TIMEOUT.as_secs()
                );
                return Ok(());
            }
            tokio::time::sleep(TICK).await;
        }
    }

    /// SIGTERM to every stage (they drain, commit and leave their groups), then waits.
    pub(super) async fn stop(&mut self) {
        for p in &mut self.procs {
            if p.exited.is_none() {
                terminate(&mut p.child);
            }
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        for p in &mut self.procs {
            while p.exited.is_none() {
                match p.child.try_wait() {
                    Ok(Some(status)) => p.exited = Some(status),
                    Ok(None) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    _ => {
                        eprintln!("   stage {} did not stop in time; killing it", p.stage);
                        let _ = p.child.kill();
                        p.exited = p.child.wait().ok();
                    }
                }
            }
        }
    }
}

impl Drop for StageProcesses {
    fn drop(&mut self) {
        for p in &mut self.procs {
            if p.exited.is_none() {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }
}

/// Sends SIGTERM: the worker's graceful stop.
#[cfg(unix)]
fn terminate(child: &mut Child) {
    // SAFETY: kill(2) on a child we spawned and have not reaped (its pid cannot have been
    // reused), with a valid signal number; it has no memory-safety preconditions.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
}

/// Without signals, the stage is killed (it replays its uncommitted records next time).
#[cfg(not(unix))]
fn terminate(child: &mut Child) {
    let _ = child.kill();
}

/// The configured metrics address when it is free, else a free port on 127.0.0.1.
fn free_metrics_addr(wanted: Option<SocketAddr>) -> std::io::Result<SocketAddr> {
    if let Some(addr) = wanted {
        if TcpListener::bind(addr).is_ok() {
            return Ok(addr);
        }
    }
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

/// An address to connect to for one a server listens on (`0.0.0.0` → `127.0.0.1`).
fn reachable(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], addr.port()))
    } else {
        addr
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
