//! toxiproxy between the clients and each Kafka node: the network faults of a chaos run.
//!
//! A delay or a cut between a worker and a broker has to be one of the TCP connection itself
//! (librdkafka's timeouts, reconnects and half-open sockets are what is tested), so every
//! client reaches broker i through a toxiproxy proxy on the address the node advertises
//! (`scripts/kafka.sh start --proxied`). The server is a child of the chaos process, driven
//! through its HTTP API with a few lines of HTTP/1.1 over a `TcpStream` (one request per
//! connection), so the tests crate needs no HTTP client for it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

/// A toxiproxy server this process started, killed when dropped.
pub struct Toxiproxy {
    child: Child,
    api: String,
    pid_file: PathBuf,
}

impl Toxiproxy {
    /// Starts `server` with its API on 127.0.0.1:`port` (logging to `log`) and waits until the
    /// API answers. Its pid goes to `pid_file`, so `make chaos` can kill it when this process
    /// dies without running its destructors.
    pub fn start(server: &Path, port: u16, log: &Path, pid_file: &Path) -> anyhow::Result<Self> {
        let api = format!("127.0.0.1:{port}");
        anyhow::ensure!(
            TcpStream::connect(&api).is_err(),
            "something already listens on toxiproxy's API port {api} (a run that died? \
             `make chaos` kills its toxiproxy; otherwise set CHAOS_KAFKA_PORT)"
        );
        let log = std::fs::File::create(log)?;
        let child = Command::new(server)
            .args(["-host", "127.0.0.1", "-port", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {}: {e}", server.display()))?;
        std::fs::write(pid_file, child.id().to_string())?;
        let proxy = Self {
            child,
            api,
            pid_file: pid_file.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while proxy.call("GET", "/version", None).is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "toxiproxy's API did not answer within 20 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(proxy)
    }

    /// A proxy `name` listening on `listen`, forwarding to `upstream`.
    pub fn create(&self, name: &str, listen: &str, upstream: &str) -> anyhow::Result<()> {
        let body = json!({"name": name, "listen": listen, "upstream": upstream, "enabled": true});
        self.call("POST", "/proxies", Some(body)).map(drop)
    }

    /// Enables or disables a proxy (disabled: its connections are closed, new ones refused).
    pub fn set_enabled(&self, name: &str, enabled: bool) -> anyhow::Result<()> {
        let body = json!({ "enabled": enabled });
        self.call("POST", &format!("/proxies/{name}"), Some(body))
            .map(drop)
    }

    /// Adds a toxic `toxic` of `kind` with `attributes` on one `stream` of the proxy
    /// (`downstream`: the broker's answers; `upstream`: the clients' requests).
    pub fn add_toxic(
        &self,
        proxy: &str,
        toxic: &str,
        kind: &str,
        stream: &str,
        attributes: serde_json::Value,
    ) -> anyhow::Result<()> {
        let body = json!({
            "name": toxic,
            "type": kind,
            "stream": stream,
            "toxicity": 1.0,
            "attributes": attributes,
        });
        self.call("POST", &format!("/proxies/{proxy}/toxics"), Some(body))
            .map(drop)
    }

    pub fn remove_toxic(&self, proxy: &str, toxic: &str) -> anyhow::Result<()> {
        self.call("DELETE", &format!("/proxies/{proxy}/toxics/{toxic}"), None)
            .map(drop)
    }

    /// Every proxy enabled, every toxic removed (toxiproxy's `/reset`).
    pub fn reset(&self) -> anyhow::Result<()> {
        self.call("POST", "/reset", None).map(drop)
    }

    /// One request; the body of a 2xx answer, an error naming the answer otherwise.
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> anyhow::Result<String> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut stream = TcpStream::connect(&self.api)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.set_write_timeout(Some(Duration::from_secs(10)))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: {api}\r\nContent-Type: application/json\r\n\
             Content-Length: {len}\r\nConnection: close\r\n\r\n{body}",
            api = self.api,
            len = body.len()
        )?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        let status: u16 = answer
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("toxiproxy: no HTTP status in {answer:?}"))?;
        let body = answer
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        anyhow::ensure!(
            (200..300).contains(&status),
            "toxiproxy: {method} {path} → {status} {}",
            body.trim()
        );
        Ok(body)
    }
}

impl Drop for Toxiproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.pid_file);
    }
}
