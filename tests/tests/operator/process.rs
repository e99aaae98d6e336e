//! The operator binary against a real API server (apiextensions-apiserver, see `crd.rs`): it
//! starts, syncs its cache (`/readyz`), reconciles, and reports in the resource's status what
//! it could not do. That server serves custom resources only, so the valid pipeline's
//! reconcile must fail on ConfigMaps and say so in `Degraded`, and the invalid one must be
//! `Degraded` with the field named: both are written by the operator process itself.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kube::api::{Api, PostParams};
use sessionflow_operator::crd::SessionPipeline;
use sessionflow_tests::{http_get, unique, workspace_binary};

use crate::crd::{cluster, valid};

struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn degraded(sp: &SessionPipeline) -> Option<(String, String, String)> {
    let c = sp
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_process_reconciles_and_reports_in_conditions() {
    let Some(client) = cluster().await else {
        return;
    };
    let namespace = unique("operator-run");
    let port = free_port();
    let operator = Operator(
        Command::new(workspace_binary("sessionflow-operator"))
            .args(["run", "--namespace", &namespace, "--metrics-addr"])
            .arg(format!("127.0.0.1:{port}"))
            .env(
                "KUBECONFIG",
                std::env::var("SESSIONFLOW_KUBECONFIG").unwrap(),
            )
            .env("RUST_LOG", "info")
            // Its log (on stdout) goes to the test's output: shown when the test fails.
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("operator starts"),
    );
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut ready = false;
    // Up to 120 s, as the cluster tests wait: on a loaded 2-core machine (after a 3-node Kafka
    // test) the operator's start and first sync once took longer than 30 s.
    for _ in 0..600 {
        // http_get panics on a refused connection: wait for the port first.
        if std::net::TcpStream::connect(addr).is_ok() && http_get(addr, "/readyz").await.0 == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ready, "/readyz never answered 200");

    let api: Api<SessionPipeline> = Api::namespaced(client.clone(), &namespace);
    let mut good: SessionPipeline = serde_json::from_value(valid()).unwrap();
    good.metadata.name = Some("good".into());
    let mut bad = good.clone();
    bad.metadata.name = Some("bad".into());
    bad.spec.stages[1].handler = sessionflow_worker::config::HandlerConfig::Http(
        sessionflow_worker::config::HttpHandlerConfig {
            url: "ftp://b/".into(),
            timeout_ms: 500,
        },
    );
    api.create(&PostParams::default(), &good).await.unwrap();
    api.create(&PostParams::default(), &bad).await.unwrap();

    let mut last = (None, None);
    // Up to 4 minutes: the CRD's schema (pod templates carry the whole Kubernetes pod schema)
    // makes this API server slow to list and patch on a loaded 2-core machine.
    for _ in 0..1200 {
        let read = |name: &'static str| {
            let api = api.clone();
            async move { api.get(name).await.ok().as_ref().and_then(degraded) }
        };
        last = (read("good").await, read("bad").await);
        if matches!(&last, (Some((g, _, _)), Some((b, _, _))) if g == "True" && b == "True") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        last.0.is_some() && last.1.is_some(),
        "conditions never settled: {last:?}"
    );
    let (good, bad) = (last.0.unwrap(), last.1.unwrap());
    assert_eq!(bad.1, "InvalidSpec");
    assert!(
        bad.2.starts_with("spec.stages[1].handler.http.url:"),
        "{}",
        bad.2
    );
    assert_eq!(good.1, "ReconcileFailed");
    assert!(good.2.starts_with("listing ConfigMaps in "), "{}", good.2);

    let (status, metrics) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("sessionflow_operator_reconciles_total{result=\"error\"}"),
        "{metrics}"
    );
    drop(operator);
}
