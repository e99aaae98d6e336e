//! The Kafka cluster of a chaos run: three nodes of Apache Kafka, each behind a toxiproxy proxy.
//!
//! The mock cluster breaks requests; it cannot break a process or a network. Here a broker is
//! a JVM started by `scripts/kafka.sh` on ports of the run's own (`CHAOS_KAFKA_PORT`), so a
//! fault is what an operator sees: a node killed with -9 and started again, a node frozen with
//! SIGSTOP (a hung broker: its sockets stay open, nothing answers), a node stopped with SIGTERM
//! (its controlled shutdown moves its partition leaderships and groups to the others), and the
//! clients' network to a node slowed or cut through toxiproxy. Every client (the workers, the
//! load generator, `verify`) reaches the nodes through the proxies, since the nodes advertise
//! the proxies' addresses (`--proxied`). The cluster counts the faults in force per node, so
//! overlapping faults heal when the last ends, and [`KafkaChaos::heal`] undoes all of them.
//! Dropping it stops the nodes (their logs copied to the run's directory first) and toxiproxy,
//! however the run ends.

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use serde_json::json;
use sessionflow_worker::kafka::topics::{create_missing, TopicRequest};

use crate::cluster::RunTopics;
use crate::schedule::BROKERS;
use crate::toxiproxy::Toxiproxy;

/// The project's scripts (`kafka.sh`, `toxiproxy.sh`), found from this crate's sources.
const SCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts");
/// How long a healed cluster may take to serve every partition of the run's topics again.
const HEAL_WITHIN: Duration = Duration::from_secs(120);

/// What is done to one node now.
#[derive(Debug, Default, Clone)]
struct Node {
    /// Kill and graceful-stop faults in force (started again when the last ends).
    down: u32,
    /// Freezes in force (SIGCONT when the last ends).
    frozen: u32,
    /// Disabled-proxy cuts in force.
    cut: u32,
}

/// The cluster, its proxies and the faults in force.
pub struct KafkaChaos {
    // Declared first: dropped (stopped) before the proxies.
    nodes: KafkaNodes,
    proxy: Toxiproxy,
    state: BTreeMap<i32, Node>,
    /// Which broker each graceful stop (a leader move) stopped, by the fault's token.
    stopped: BTreeMap<usize, i32>,
    topics: Vec<(String, i32)>,
}

/// The nodes of `scripts/kafka.sh` on one port; stopped when dropped.
struct KafkaNodes {
    port: u16,
    /// Where their logs are copied before `kafka.sh stop` deletes them.
    dir: PathBuf,
    /// The clients' bootstrap list (the proxies' addresses).
    bootstrap: String,
}

impl KafkaChaos {
    /// Starts toxiproxy (API on `port` + 12) with a proxy per node, the three nodes on `port`
    /// … `port` + 11, and creates the run's topics (replication factor 3).
    pub fn start(
        port: u16,
        topics: &RunTopics,
        partitions: i32,
        dir: &Path,
    ) -> anyhow::Result<Self> {
        // A cluster a dead run left on this port (its nodes were in sessions of their own).
        let _ = kafka_sh(&["stop", "--port", &port.to_string()], dir);
        let server = script_output(&format!("{SCRIPTS}/toxiproxy.sh"), &["bin"], dir)?;
        let proxy = Toxiproxy::start(
            Path::new(server.trim()),
            port + 12,
            &dir.join("toxiproxy.log"),
            &toxiproxy_pid_file(dir, port),
        )?;
        for i in 0..BROKERS as u16 {
            let client = port + 4 * i;
            proxy.create(
                &proxy_name(i as i32 + 1),
                &format!("127.0.0.1:{}", client + 3),
                &format!("127.0.0.1:{client}"),
            )?;
        }
        let mut nodes = KafkaNodes {
            port,
            dir: dir.to_path_buf(),
            bootstrap: String::new(),
        };
        let out = kafka_sh(
            &[
                "start",
                "--port",
                &port.to_string(),
                "--nodes",
                &BROKERS.to_string(),
                "--proxied",
            ],
            dir,
        )?;
        nodes.bootstrap = out
            .lines()
            .last()
            .ok_or_else(|| anyhow::anyhow!("kafka.sh start printed no bootstrap list"))?
            .trim()
            .to_string();
        let cluster = Self {
            nodes,
            proxy,
            state: (1..=BROKERS).map(|b| (b, Node::default())).collect(),
            stopped: BTreeMap::new(),
            topics: vec![
                (topics.input.clone(), partitions),
                (topics.output.clone(), partitions),
                (topics.dlq.clone(), 1),
            ],
        };
        cluster.create_topics()?;
        cluster.wait_for_leaders(Duration::from_secs(60))?;
        Ok(cluster)
    }

    fn create_topics(&self) -> anyhow::Result<()> {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &self.nodes.bootstrap)
            .create()?;
        let requests: Vec<TopicRequest> = self
            .topics
            .iter()
            .map(|(name, partitions)| TopicRequest {
                name: name.clone(),
                partitions: *partitions,
                replication: BROKERS,
            })
            .collect();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(create_missing(&admin, &requests))?;
        Ok(())
    }

    pub fn bootstrap(&self) -> String {
        self.nodes.bootstrap.clone()
    }

    pub fn port(&self) -> u16 {
        self.nodes.port
    }

    /// kill -9 a node (one more "down" fault of it).
    pub fn kill_broker(&mut self, broker: i32) -> anyhow::Result<Vec<String>> {
        self.node(broker).down += 1;
        let Some(pid) = self.pid(broker)? else {
            return Ok(vec![format!("broker {broker} is down already")]);
        };
        signal("KILL", pid)?;
        wait_gone(pid, Duration::from_secs(10));
        Ok(vec![format!("broker {broker} killed (pid {pid})")])
    }

    /// Ends one "down" fault of a node; it starts again when none is left.
    pub fn restart_broker(&mut self, broker: i32) -> anyhow::Result<Vec<String>> {
        let node = self.node(broker);
        node.down = node.down.saturating_sub(1);
        if node.down > 0 {
            return Ok(vec![format!("broker {broker} stays down (another fault)")]);
        }
        self.start_again(broker)
    }

    /// Starts a node that is not running; one still shutting down after SIGTERM is killed first.
    fn start_again(&mut self, broker: i32) -> anyhow::Result<Vec<String>> {
        let mut said = Vec::new();
        if let Some(pid) = self.pid(broker)? {
            if self.node(broker).frozen > 0 {
                return Ok(vec![format!("broker {broker} runs (frozen)")]);
            }
            // Still in its controlled shutdown.
            if !wait_gone(pid, Duration::from_secs(2)) {
                signal("KILL", pid)?;
                wait_gone(pid, Duration::from_secs(10));
                said.push(format!(
                    "broker {broker} had not stopped yet: killed (pid {pid})"
                ));
            }
        }
        // A node that exited but was not reaped yet (a zombie: its parent, `kafka.sh start`,
        // is gone, and this container's init may reap late) still answers `kill -0`, which is
        // how kafka.sh decides that a node runs: its pid file goes, since the JVM is gone.
        if self.pid(broker)?.is_none() {
            let _ = std::fs::remove_file(self.pid_file(broker));
        }
        let node = (broker - 1).to_string();
        // `i` in the environment: kafka.sh's `launch_node` expands `$i` in the same `local`
        // that sets it, so outside `start` (whose loop variable it then is) `restart-node`
        // dies on `set -u` ("i: unbound variable") unless an `i` naming the node exists.
        script_output_env(
            &format!("{SCRIPTS}/kafka.sh"),
            &[
                "restart-node",
                "--port",
                &self.nodes.port.to_string(),
                "--node",
                &node,
            ],
            &[("i", &node)],
            &self.nodes.dir,
        )?;
        // kafka.sh returns once the pid file is not empty, which the old pid already made it.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut pid = self.pid(broker)?;
        while pid.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            pid = self.pid(broker)?;
        }
        said.push(match pid {
            Some(pid) => format!("broker {broker} started again (pid {pid})"),
            None => format!("broker {broker} started again (no pid yet)"),
        });
        Ok(said)
    }

    /// SIGSTOP a node (one more freeze of it).
    pub fn freeze_broker(&mut self, broker: i32) -> anyhow::Result<Vec<String>> {
        self.node(broker).frozen += 1;
        match self.pid(broker)? {
            Some(pid) => {
                signal("STOP", pid)?;
                Ok(vec![format!("broker {broker} frozen (SIGSTOP, pid {pid})")])
            }
            None => Ok(vec![format!("broker {broker} is down: nothing to freeze")]),
        }
    }

    /// Ends one freeze of a node; SIGCONT when none is left.
    pub fn thaw_broker(&mut self, broker: i32) -> anyhow::Result<Vec<String>> {
        let node = self.node(broker);
        node.frozen = node.frozen.saturating_sub(1);
        if node.frozen > 0 {
            return Ok(vec![format!(
                "broker {broker} stays frozen (another fault)"
            )]);
        }
        match self.pid(broker)? {
            Some(pid) => {
                signal("CONT", pid)?;
                Ok(vec![format!("broker {broker} thawed (SIGCONT, pid {pid})")])
            }
            None => Ok(vec![format!("broker {broker} is down: nothing to thaw")]),
        }
    }

    /// SIGTERM the running node that leads the most input partitions: its controlled shutdown
    /// hands its leaderships (and the groups it coordinates) to the others.
    pub fn stop_leader(&mut self, token: usize, input: &str) -> anyhow::Result<Vec<String>> {
        let mut running = Vec::new();
        for b in 1..=BROKERS {
            if self.pid(b)?.is_some() && self.state[&b].down == 0 {
                running.push(b);
            }
        }
        let leaders = self.leaders(input).unwrap_or_default();
        let count = |b: i32| leaders.iter().filter(|l| **l == b).count();
        let Some(&broker) = running.iter().max_by_key(|b| (count(**b), -**b)) else {
            return Ok(vec!["no broker runs: no leader to move".into()]);
        };
        self.stopped.insert(token, broker);
        self.node(broker).down += 1;
        let pid = self.pid(broker)?.expect("it runs");
        if self.state[&broker].frozen > 0 {
            signal("CONT", pid)?;
        }
        signal("TERM", pid)?;
        Ok(vec![format!(
            "broker {broker} sent SIGTERM (pid {pid}): it led {} of the input's partitions \
             (leaders by partition: {leaders:?})",
            count(broker)
        )])
    }

    pub fn restart_leader(&mut self, token: usize) -> anyhow::Result<Vec<String>> {
        match self.stopped.remove(&token) {
            Some(broker) => self.restart_broker(broker),
            None => Ok(vec![]),
        }
    }

    /// A latency toxic on a node's proxy (the broker's answers come late).
    pub fn net_delay(&mut self, broker: i32, delay: Duration, token: usize) -> anyhow::Result<()> {
        let ms = delay.as_millis() as u64;
        self.proxy.add_toxic(
            &proxy_name(broker),
            &format!("delay-{token}"),
            "latency",
            "downstream",
            json!({"latency": ms, "jitter": ms / 10}),
        )
    }

    pub fn end_net_delay(&mut self, broker: i32, token: usize) -> anyhow::Result<()> {
        self.proxy
            .remove_toxic(&proxy_name(broker), &format!("delay-{token}"))
    }

    /// Cuts the clients' path to a node: its proxy disabled, or both directions blackholed.
    pub fn net_cut(&mut self, broker: i32, blackhole: bool, token: usize) -> anyhow::Result<()> {
        let name = proxy_name(broker);
        if blackhole {
            for stream in ["upstream", "downstream"] {
                self.proxy.add_toxic(
                    &name,
                    &format!("cut-{token}-{stream}"),
                    "timeout",
                    stream,
                    json!({"timeout": 0}),
                )?;
            }
            Ok(())
        } else {
            self.node(broker).cut += 1;
            self.proxy.set_enabled(&name, false)
        }
    }

    pub fn end_net_cut(
        &mut self,
        broker: i32,
        blackhole: bool,
        token: usize,
    ) -> anyhow::Result<()> {
        let name = proxy_name(broker);
        if blackhole {
            for stream in ["upstream", "downstream"] {
                self.proxy
                    .remove_toxic(&name, &format!("cut-{token}-{stream}"))?;
            }
            Ok(())
        } else {
            let node = self.node(broker);
            node.cut = node.cut.saturating_sub(1);
            if node.cut == 0 {
                self.proxy.set_enabled(&name, true)?;
            }
            Ok(())
        }
    }

    /// Undoes every fault: no toxic, every proxy enabled, every node thawed and running; then
    /// waits until every partition of the run's topics has a leader. Returns what it healed.
    pub fn heal(&mut self) -> anyhow::Result<Vec<String>> {
        let mut healed = Vec::new();
        self.proxy.reset()?;
        healed.push("toxiproxy reset: every proxy enabled, no toxic".into());
        self.stopped.clear();
        for b in 1..=BROKERS {
            let node = std::mem::take(self.node(b));
            match self.pid(b)? {
                Some(pid) if node.frozen > 0 => {
                    signal("CONT", pid)?;
                    healed.push(format!("broker {b} thawed"));
                }
                Some(_) if node.down > 0 => healed.extend(self.start_again(b)?),
                Some(_) => {}
                None => healed.extend(self.start_again(b)?),
            }
        }
        let t = Instant::now();
        self.wait_for_leaders(HEAL_WITHIN)?;
        healed.push(format!(
            "every partition has a leader ({:.1}s)",
            t.elapsed().as_secs_f64()
        ));
        Ok(healed)
    }

    /// Waits until the nodes listen and every partition of the run's topics has a leader.
    fn wait_for_leaders(&self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        for i in 0..BROKERS as u16 {
            let addr = format!("127.0.0.1:{}", self.nodes.port + 4 * i);
            while TcpStream::connect(&addr).is_err() {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "node {i} does not listen on {addr}"
                );
                std::thread::sleep(Duration::from_millis(250));
            }
        }
        loop {
            let mut missing = Vec::new();
            for (topic, partitions) in &self.topics {
                match self.leaders(topic) {
                    Ok(l) if l.len() == *partitions as usize && l.iter().all(|b| *b > 0) => {}
                    Ok(l) => missing.push(format!("{topic}: leaders {l:?}")),
                    Err(e) => missing.push(format!("{topic}: {e:#}")),
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "partitions without a leader after {}s: {}",
                within.as_secs(),
                missing.join("; ")
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The leader (broker id, -1 for none) of each partition of `topic`, in partition order.
    fn leaders(&self, topic: &str) -> anyhow::Result<Vec<i32>> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.nodes.bootstrap)
            .create()?;
        let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(5))?;
        let t = metadata
            .topics()
            .first()
            .ok_or_else(|| anyhow::anyhow!("no metadata for {topic}"))?;
        if let Some(e) = t.error() {
            anyhow::bail!("metadata of {topic}: {e:?}");
        }
        let mut parts: Vec<(i32, i32)> = t
            .partitions()
            .iter()
            .map(|p| (p.id(), p.leader()))
            .collect();
        parts.sort();
        Ok(parts.into_iter().map(|(_, l)| l).collect())
    }

    /// `scripts/kafka.sh`'s pid file of a node.
    fn pid_file(&self, broker: i32) -> PathBuf {
        self.nodes
            .state_dir()
            .join(format!("node-{}", broker - 1))
            .join("pid")
    }

    fn node(&mut self, broker: i32) -> &mut Node {
        self.state.entry(broker).or_default()
    }

    /// The pid of a node's JVM while it runs (frozen or not).
    fn pid(&self, broker: i32) -> anyhow::Result<Option<u32>> {
        let file = self.pid_file(broker);
        // kafka.sh truncates and rewrites the file when it starts a node: an empty file is a
        // node being started, read again shortly.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let Ok(text) = std::fs::read_to_string(&file) else {
                return Ok(None);
            };
            match text.trim().parse::<u32>() {
                Ok(pid) => return Ok(alive(pid).then_some(pid)),
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => anyhow::bail!("{}: {text:?}: {e}", file.display()),
            }
        }
    }
}

impl KafkaNodes {
    /// `scripts/kafka.sh`'s state of this port (`.local/kafka-P/` of the checkout).
    fn state_dir(&self) -> PathBuf {
        Path::new(SCRIPTS)
            .join("../.local")
            .join(format!("kafka-{}", self.port))
    }
}

impl Drop for KafkaNodes {
    /// Keeps the nodes' logs with the run's (`kafka-node-<i>.log`), then stops the nodes and
    /// deletes their data.
    fn drop(&mut self) {
        for i in 0..BROKERS {
            let log = self.state_dir().join(format!("node-{i}")).join("kafka.log");
            let _ = std::fs::copy(&log, self.dir.join(format!("kafka-node-{i}.log")));
        }
        let _ = kafka_sh(&["stop", "--port", &self.port.to_string()], &self.dir);
    }
}

/// Where the toxiproxy of a run on `port` writes its pid: `.local/chaos/toxiproxy-P.pid`
/// (`make chaos` kills it from there when the harness died without its destructors).
pub fn toxiproxy_pid_file(dir: &Path, port: u16) -> PathBuf {
    dir.parent()
        .unwrap_or(dir)
        .join(format!("toxiproxy-{port}.pid"))
}

fn proxy_name(broker: i32) -> String {
    format!("broker-{broker}")
}

/// Runs `scripts/kafka.sh ARGS`; returns its stdout.
fn kafka_sh(args: &[&str], dir: &Path) -> anyhow::Result<String> {
    script_output(&format!("{SCRIPTS}/kafka.sh"), args, dir)
}

/// Runs a script, its stderr appended to `dir/scripts.log`; returns its stdout.
fn script_output(script: &str, args: &[&str], dir: &Path) -> anyhow::Result<String> {
    script_output_env(script, args, &[], dir)
}

fn script_output_env(
    script: &str,
    args: &[&str],
    env: &[(&str, &str)],
    dir: &Path,
) -> anyhow::Result<String> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("scripts.log"))?;
    let out = Command::new(script)
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stderr(log)
        .output()
        .map_err(|e| anyhow::anyhow!("running {script}: {e}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{script} {} failed ({}); see {}",
        args.join(" "),
        out.status,
        dir.join("scripts.log").display()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn signal(name: &str, pid: u32) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()?;
    anyhow::ensure!(status.success(), "kill -{name} {pid} failed: {status}");
    Ok(())
}

/// Whether `pid` runs (a zombie, killed and not reaped yet, counts as gone).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
        Err(_) => false,
    }
}

/// Waits up to `within` for `pid` to be gone; whether it is.
fn wait_gone(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while alive(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}
