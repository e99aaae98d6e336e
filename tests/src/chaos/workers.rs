//! The worker processes of a chaos run: started, killed, stopped and watched.
//!
//! Every worker is the real `sessionflow-worker run` binary on the same config file, so it
//! dies the way a pod dies (SIGKILL: nothing runs after; SIGTERM: its own graceful stop).
//! The pool is the run's supervisor: a worker that exits without being told to is reported
//! and replaced, as Kubernetes would, and one that ignores SIGTERM for too long is killed and
//! reported. A worker can also be frozen (SIGSTOP) and thawed (SIGCONT): a zombie member,
//! as a long GC pause, a starved container or a suspended VM makes one.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a SIGTERMed worker may take to stop before it is killed (and reported).
const STOP_GRACE: Duration = Duration::from_secs(60);

/// One worker process.
struct Worker {
    id: u32,
    child: Child,
    /// When it was sent SIGTERM.
    terminated_at: Option<Instant>,
    /// Stopped with SIGSTOP (and not continued yet).
    frozen: bool,
}

impl Worker {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Something the pool saw that the run's report should mention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incident {
    /// A worker exited without being told to (it was replaced).
    ExitedOnItsOwn { id: u32, status: String },
    /// A worker stopped after SIGTERM with a non-zero status.
    StoppedBadly { id: u32, status: String },
    /// A worker had not stopped `STOP_GRACE` after SIGTERM and was killed.
    IgnoredSigterm { id: u32 },
}

impl std::fmt::Display for Incident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ExitedOnItsOwn { id, status } => {
                write!(f, "worker {id} exited on its own ({status}); replaced")
            }
            Self::StoppedBadly { id, status } => {
                write!(f, "worker {id} stopped after SIGTERM with {status}")
            }
            Self::IgnoredSigterm { id } => write!(
                f,
                "worker {id} had not stopped {}s after SIGTERM; killed",
                STOP_GRACE.as_secs()
            ),
        }
    }
}

/// The running workers, the ones stopping, and what happened to them.
pub struct WorkerPool {
    exe: PathBuf,
    config: PathBuf,
    dir: PathBuf,
    next_id: u32,
    live: Vec<Worker>,
    stopping: Vec<Worker>,
    /// The worker each freeze stopped, by the fault's token.
    freezes: BTreeMap<usize, u32>,
    pub incidents: Vec<Incident>,
    /// Workers started, killed and terminated over the run.
    pub started: u32,
    pub killed: u32,
    pub terminated: u32,
    pub frozen: u32,
}

impl WorkerPool {
    /// A pool of `exe run --config <config>` processes logging to `<dir>/worker-<id>.log`.
    pub fn new(exe: &Path, config: &Path, dir: &Path) -> Self {
        Self {
            exe: exe.to_path_buf(),
            config: config.to_path_buf(),
            dir: dir.to_path_buf(),
            next_id: 1,
            live: Vec::new(),
            stopping: Vec::new(),
            freezes: BTreeMap::new(),
            incidents: Vec::new(),
            started: 0,
            killed: 0,
            terminated: 0,
            frozen: 0,
        }
    }

    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Starts one more worker; returns a description for the log.
    pub fn spawn(&mut self) -> anyhow::Result<String> {
        let id = self.next_id;
        self.next_id += 1;
        let log = File::create(self.dir.join(format!("worker-{id}.log")))?;
        let child = Command::new(&self.exe)
            .args(["run", "--config"])
            .arg(&self.config)
            .env(
                "RUST_LOG",
                std::env::var("CHAOS_WORKER_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {}: {e}", self.exe.display()))?;
        let w = Worker {
            id,
            child,
            terminated_at: None,
            frozen: false,
        };
        let said = format!("worker {id} started (pid {})", w.pid());
        self.live.push(w);
        self.started += 1;
        Ok(said)
    }

    /// SIGKILL the `pick`-th live worker (modulo how many run).
    pub fn kill(&mut self, pick: usize) -> anyhow::Result<String> {
        let Some(mut w) = self.take(pick) else {
            return Ok("no worker to kill".into());
        };
        w.child.kill()?;
        w.child.wait()?;
        self.killed += 1;
        Ok(format!("worker {} killed (kill -9, pid {})", w.id, w.pid()))
    }

    /// SIGTERM the `pick`-th live worker; it stops in the background (see [`Self::reap`]).
    pub fn terminate(&mut self, pick: usize) -> anyhow::Result<String> {
        let Some(mut w) = self.take(pick) else {
            return Ok("no worker to stop".into());
        };
        sigterm(w.pid())?;
        w.terminated_at = Some(Instant::now());
        let said = format!("worker {} sent SIGTERM (pid {})", w.id, w.pid());
        self.stopping.push(w);
        self.terminated += 1;
        Ok(said)
    }

    /// SIGSTOP the `pick`-th live worker that is not frozen (modulo how many); `token` names
    /// the freeze for [`Self::thaw`].
    pub fn freeze(&mut self, pick: usize, token: usize) -> anyhow::Result<String> {
        let awake: Vec<usize> = (0..self.live.len())
            .filter(|i| !self.live[*i].frozen)
            .collect();
        if awake.is_empty() {
            return Ok("no worker to freeze".into());
        }
        let w = &mut self.live[awake[pick % awake.len()]];
        signal("STOP", w.pid())?;
        w.frozen = true;
        self.freezes.insert(token, w.id);
        self.frozen += 1;
        Ok(format!("worker {} frozen (SIGSTOP, pid {})", w.id, w.pid()))
    }

    /// SIGCONT the worker the freeze `token` stopped, if it still runs.
    pub fn thaw(&mut self, token: usize) -> anyhow::Result<String> {
        let Some(id) = self.freezes.remove(&token) else {
            return Ok("no frozen worker".into());
        };
        match self
            .live
            .iter_mut()
            .chain(self.stopping.iter_mut())
            .find(|w| w.id == id)
        {
            Some(w) => {
                signal("CONT", w.pid())?;
                w.frozen = false;
                Ok(format!("worker {id} thawed (SIGCONT, pid {})", w.pid()))
            }
            None => Ok(format!("worker {id} is gone: nothing to thaw")),
        }
    }

    /// SIGCONT every frozen worker; returns what it did.
    pub fn thaw_all(&mut self) -> anyhow::Result<Vec<String>> {
        let tokens: Vec<usize> = self.freezes.keys().copied().collect();
        tokens.into_iter().map(|t| self.thaw(t)).collect()
    }

    fn take(&mut self, pick: usize) -> Option<Worker> {
        if self.live.is_empty() {
            return None;
        }
        let i = pick % self.live.len();
        Some(self.live.remove(i))
    }

    /// Collects stopped workers and replaces crashed ones; returns log lines of what changed.
    pub fn reap(&mut self) -> anyhow::Result<Vec<String>> {
        let mut said = Vec::new();
        let mut i = 0;
        while i < self.stopping.len() {
            let w = &mut self.stopping[i];
            let since = w.terminated_at.map(|t| t.elapsed()).unwrap_or_default();
            if let Some(status) = w.child.try_wait()? {
                said.push(format!(
                    "worker {} stopped after {:.1}s: {}",
                    w.id,
                    since.as_secs_f64(),
                    describe(status)
                ));
                if !status.success() {
                    self.incidents.push(Incident::StoppedBadly {
                        id: w.id,
                        status: describe(status),
                    });
                }
                self.stopping.remove(i);
            } else if since > STOP_GRACE {
                w.child.kill()?;
                w.child.wait()?;
                let incident = Incident::IgnoredSigterm { id: w.id };
                said.push(incident.to_string());
                self.incidents.push(incident);
                self.stopping.remove(i);
            } else {
                i += 1;
            }
        }
        let mut crashed = Vec::new();
        let mut i = 0;
        while i < self.live.len() {
            if let Some(status) = self.live[i].child.try_wait()? {
                let w = self.live.remove(i);
                crashed.push(Incident::ExitedOnItsOwn {
                    id: w.id,
                    status: describe(status),
                });
            } else {
                i += 1;
            }
        }
        for incident in crashed {
            said.push(incident.to_string());
            self.incidents.push(incident);
            said.push(self.spawn()?);
        }
        Ok(said)
    }

    /// Workers still stopping after SIGTERM.
    pub fn stopping(&self) -> usize {
        self.stopping.len()
    }

    /// SIGTERM every live worker and wait (bounded) until all have stopped.
    pub fn stop_all(&mut self) -> anyhow::Result<Vec<String>> {
        let mut said = self.thaw_all()?;
        while !self.live.is_empty() {
            said.push(self.terminate(0)?);
        }
        while !self.stopping.is_empty() {
            said.extend(self.reap()?);
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(said)
    }
}

impl Drop for WorkerPool {
    /// No worker outlives the run, however it ends.
    fn drop(&mut self) {
        for w in self.live.iter_mut().chain(self.stopping.iter_mut()) {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}

fn sigterm(pid: u32) -> anyhow::Result<()> {
    signal("TERM", pid)
}

fn signal(name: &str, pid: u32) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()?;
    anyhow::ensure!(status.success(), "kill -{name} {pid} failed: {status}");
    Ok(())
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(signal)) => format!("signal {signal}"),
        _ => status.to_string(),
    }
}
