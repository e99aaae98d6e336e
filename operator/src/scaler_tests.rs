//! Autoscaling passes against a scripted API server and a real Kafka-protocol broker
//! (librdkafka's mock cluster): who may write `spec.replicas` (external mode, the pause
//! annotation) and what the `Autoscaling` condition says.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher;
use rdkafka::config::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use serde_json::{json, Value};
use tokio::sync::Notify;

use super::*;
use crate::crd::{AutoscalingMode, SaslMechanism, SaslSpec};
use crate::fixtures::{mock_client, pipeline, ApiServer, Seen};
use crate::liveness::PassClock;

const DEP: &str = "/apis/apps/v1/namespaces/shop/deployments/chat-nlu";
const STATUS: &str = "/apis/sessionflow.io/v1alpha1/namespaces/shop/sessionpipelines/chat/status";

pub(super) fn deployment(name: &str, replicas: i32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": { "name": name, "namespace": "shop" },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": "x" } },
            "template": { "spec": { "containers": [{ "name": "worker" }] } },
        },
        "status": { "replicas": replicas, "readyReplicas": replicas },
    })
}

/// A mock cluster whose topic `topic` holds `records` records nobody consumed.
pub(super) fn cluster_with_lag(
    topic: &str,
    partitions: i32,
    records: usize,
) -> MockCluster<'static, rdkafka::producer::DefaultProducerContext> {
    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic(topic, partitions, 1).unwrap();
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .create()
        .unwrap();
    for i in 0..records {
        let key = format!("s{}", i % 50);
        producer
            .send(BaseRecord::<str, str>::to(topic).key(&key).payload("x"))
            .unwrap();
    }
    producer.flush(Duration::from_secs(10)).unwrap();
    cluster
}

/// A scaler over a store holding `pipelines`, and the API server it talks to.
pub(super) fn scaler_of(
    pipelines: &[SessionPipeline],
) -> (Scaler, ApiServer, Writer<SessionPipeline>, Metrics) {
    let (store, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Init);
    for sp in pipelines {
        writer.apply_watcher_event(&watcher::Event::InitApply(sp.clone()));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    let (client, server) = mock_client();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "sessionflow-operator".into(),
            instance: None,
        },
    );
    let metrics = Metrics::new();
    let scaler = Scaler::new(
        client,
        store,
        metrics.clone(),
        recorder,
        Duration::from_secs(15),
        Arc::new(Notify::new()),
    );
    (scaler, server, writer, metrics)
}

fn autoscaling(status_patch: &Seen) -> Value {
    status_patch.body["status"]["conditions"]
        .as_array()
        .unwrap_or_else(|| panic!("no conditions in {}", status_patch.body))
        .iter()
        .find(|c| c["type"] == "Autoscaling")
        .cloned()
        .unwrap_or_else(|| panic!("no Autoscaling condition in {}", status_patch.body))
}

fn status_echo(sp: &SessionPipeline) -> impl FnOnce(&Seen) -> Value {
    let mut value = serde_json::to_value(sp).unwrap();
    move |s| {
        value["status"] = s.body["status"].clone();
        value
    }
}

fn paused(mut sp: SessionPipeline) -> SessionPipeline {
    sp.metadata.annotations = Some(BTreeMap::from([(
        AUTOSCALING_PAUSED_ANNOTATION.to_string(),
        "true".to_string(),
    )]));
    sp
}

/// The pipeline as the next pass sees it: with the status the last pass wrote.
fn shown(sp: &SessionPipeline, status_patch: &Seen) -> SessionPipeline {
    let mut sp = sp.clone();
    sp.status = Some(serde_json::from_value(status_patch.body["status"].clone()).unwrap());
    sp
}

/// External mode: 2,500 records of lag would ask the built-in autoscaler for 3 replicas, and
/// the Deployment's 20 replicas are above `replicas.max` (which the built-in one would enforce
/// at once) — yet nothing is written to the Deployment. The lag is still read and exported
/// (what the HPA or KEDA scales on), the status shows the count the external owner set, and the
/// condition says who scales. The same stage back in mode `lag` is scaled at once: the script
/// does see replica writes when there are any.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_stage_never_gets_its_replicas_written() {
    let cluster = cluster_with_lag("t0", 4, 2_500);
    let mut sp = pipeline(&["nlu"]);
    sp.spec.kafka.bootstrap_servers = cluster.bootstrap_servers();
    sp.spec.stages[0].replicas.max = 10;
    sp.spec.stages[0].autoscaling.mode = AutoscalingMode::External;
    let (mut scaler, mut server, mut writer, metrics) = scaler_of(std::slice::from_ref(&sp));

    let pass = tokio::spawn(async move {
        scaler.tick().await;
        scaler
    });
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu", 20))
        .await;
    let status = server.expect(Method::PATCH, STATUS, status_echo(&sp)).await;
    server.expect_silence(Duration::from_millis(300)).await;
    let mut scaler = pass.await.unwrap();
    let stage = &status.body["status"]["stages"][0];
    assert_eq!(stage["effectiveLag"], 2_500);
    assert_eq!(stage["desiredReplicas"], 20, "what the external owner set");
    let condition = autoscaling(&status);
    assert_eq!(condition["status"], "True");
    assert_eq!(condition["reason"], "Active");
    assert!(
        condition["message"]
            .as_str()
            .unwrap()
            .contains("0 scaled by lag, 1 by an external autoscaler"),
        "{condition}"
    );
    assert!(metrics.render().contains(
        r#"sessionflow_stage_effective_lag{namespace="shop",pipeline="chat",stage="nlu"} 2500"#
    ));

    // Back to mode lag: the built-in autoscaler brings the count within bounds at once.
    let mut lag_mode = shown(&sp, &status);
    lag_mode.spec.stages[0].autoscaling.mode = AutoscalingMode::Lag;
    writer.apply_watcher_event(&watcher::Event::Apply(lag_mode.clone()));
    let pass = tokio::spawn(async move { scaler.tick().await });
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu", 20))
        .await;
    let scale = server
        .expect(Method::PATCH, DEP, |_| deployment("chat-nlu", 10))
        .await;
    assert_eq!(scale.body["spec"], json!({ "replicas": 10 }));
    server
        .answer_all(Duration::from_millis(300), |s| s.body.clone())
        .await;
    pass.await.unwrap();
}

/// The pause annotation: the same out-of-bounds count and lag, and no write to the
/// Deployment; the condition is `Paused`. Removing the annotation resumes scaling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_pipeline_is_left_as_it_is_until_resumed() {
    let cluster = cluster_with_lag("t0", 4, 2_500);
    let mut sp = pipeline(&["nlu"]);
    sp.spec.kafka.bootstrap_servers = cluster.bootstrap_servers();
    sp.spec.stages[0].replicas.max = 10;
    let sp = paused(sp);
    let (mut scaler, mut server, mut writer, _) = scaler_of(std::slice::from_ref(&sp));

    let pass = tokio::spawn(async move {
        scaler.tick().await;
        scaler
    });
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu", 20))
        .await;
    let status = server.expect(Method::PATCH, STATUS, status_echo(&sp)).await;
    server.expect_silence(Duration::from_millis(300)).await;
    let mut scaler = pass.await.unwrap();
    let condition = autoscaling(&status);
    assert_eq!(
        (&condition["status"], &condition["reason"]),
        (&json!("False"), &json!("Paused"))
    );
    assert!(condition["message"]
        .as_str()
        .unwrap()
        .contains("sessionflow.io/autoscaling-paused"));
    assert_eq!(status.body["status"]["stages"][0]["effectiveLag"], 2_500);

    // A second paused pass changes nothing and writes nothing.
    let again = shown(&sp, &status);
    writer.apply_watcher_event(&watcher::Event::Apply(again.clone()));
    let pass = tokio::spawn(async move {
        scaler.tick().await;
        scaler
    });
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu", 20))
        .await;
    server.expect_silence(Duration::from_millis(300)).await;
    let mut scaler = pass.await.unwrap();

    // Resumed: scaled within bounds, and the condition turns Active.
    let mut resumed = again;
    resumed.metadata.annotations = None;
    writer.apply_watcher_event(&watcher::Event::Apply(resumed.clone()));
    let pass = tokio::spawn(async move { scaler.tick().await });
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu", 20))
        .await;
    let scale = server
        .expect(Method::PATCH, DEP, |_| deployment("chat-nlu", 10))
        .await;
    assert_eq!(scale.body["spec"], json!({ "replicas": 10 }));
    let seen = server
        .answer_all(Duration::from_millis(300), |s| {
            match s.uri.contains("/status") {
                true => status_echo(&resumed)(s),
                false => s.body.clone(),
            }
        })
        .await;
    pass.await.unwrap();
    let status = seen
        .iter()
        .find(|s| s.uri.starts_with(STATUS))
        .expect("a status patch");
    let condition = autoscaling(status);
    assert_eq!(
        (&condition["status"], &condition["reason"]),
        (&json!("True"), &json!("Active"))
    );
}

/// A lag that cannot be read — here the pipeline's SASL Secret does not exist — holds the
/// count and turns the condition to `Fallback`, with the reason naming the Secret.
#[tokio::test]
async fn a_lag_that_cannot_be_read_is_a_fallback_with_the_reason() {
    let mut sp = pipeline(&["nlu"]);
    sp.spec.kafka.sasl = Some(SaslSpec {
        mechanism: SaslMechanism::ScramSha512,
        secret_name: "kafka-user".into(),
        username_key: "username".into(),
        password_key: "password".into(),
        allow_plain_without_tls: false,
    });
    let (mut scaler, mut server, _writer, _) = scaler_of(std::slice::from_ref(&sp));
    let pass = tokio::spawn(async move { scaler.tick().await });
    server
        .fail(
            Method::GET,
            "/api/v1/namespaces/shop/secrets/kafka-user",
            404,
        )
        .await;
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu", 1))
        .await;
    let status = server.expect(Method::PATCH, STATUS, status_echo(&sp)).await;
    server.expect_silence(Duration::from_millis(300)).await;
    tokio::time::timeout(Duration::from_secs(1), pass)
        .await
        .expect("the pass ends")
        .unwrap();
    let condition = autoscaling(&status);
    assert_eq!(
        (&condition["status"], &condition["reason"]),
        (&json!("False"), &json!("Fallback"))
    );
    let message = condition["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "lag cannot be read, replicas are held: kafka credentials: secret kafka-user"
        ),
        "{message}"
    );
    assert_eq!(status.body["status"]["stages"][0]["desiredReplicas"], 1);
}

/// A "broker" that accepts connections and never answers a byte; counts what it accepted.
fn silent_broker() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(stream);
        }
    });
    (addr, accepted)
}

/// Isolation: pipeline `edge/chat` points at a broker that accepts and never answers;
/// pipeline `shop/chat` has 2,500 records of lag on a real (mock) cluster. In one pass, while
/// the edge pipeline's lag read is provably in flight (its broker accepted the connection),
/// the shop pipeline is read, scaled 1 → 3 and reported — before the edge pipeline makes any
/// API call. Then the edge read hits its deadline, its count is held, and its condition says
/// `Fallback` with the reason. (A pass that visits pipelines one after another fails here
/// whichever comes first: shop first, and the edge read has not started when shop is done;
/// edge first, and its calls come before shop's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_cluster_delays_only_its_own_pipeline() {
    let (silent, accepted) = silent_broker();
    let cluster = cluster_with_lag("t0", 4, 2_500);
    let mut shop = pipeline(&["nlu"]);
    shop.spec.kafka.bootstrap_servers = cluster.bootstrap_servers();
    shop.spec.stages[0].replicas.max = 10;
    let mut edge = pipeline(&["nlu"]);
    edge.metadata.namespace = Some("edge".into());
    edge.metadata.uid = Some("6f1c2a40-0000-4000-8000-000000000002".into());
    edge.spec.kafka.bootstrap_servers = silent;
    edge.spec.stages[0].replicas.max = 10;
    let (scaler, mut server, _writer, metrics) = scaler_of(&[edge.clone(), shop.clone()]);
    let mut scaler = scaler.with_lag_deadline(Duration::from_secs(5));
    let passes = scaler.passes.clone();
    let pass = tokio::spawn(async move {
        scaler.tick().await;
        scaler
    });

    tokio::time::timeout(Duration::from_secs(5), async {
        while accepted.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the edge pipeline's lag read reached its broker");
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu", 1))
        .await;
    let scale = server
        .expect(Method::PATCH, DEP, |_| deployment("chat-nlu", 3))
        .await;
    assert_eq!(scale.body["spec"], json!({ "replicas": 3 }));
    server
        .expect(
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/shop/events",
            |s: &Seen| s.body.clone(),
        )
        .await;
    let shop_status = server
        .expect(Method::PATCH, STATUS, status_echo(&shop))
        .await;
    assert_eq!(
        shop_status.body["status"]["stages"][0]["desiredReplicas"],
        3
    );
    assert_eq!(autoscaling(&shop_status)["reason"], "Active");
    assert!(!pass.is_finished(), "the edge pipeline is still being read");

    // The edge pipeline, after its deadline: held, and Fallback with the reason.
    server
        .expect(
            Method::GET,
            "/apis/apps/v1/namespaces/edge/deployments/chat-nlu",
            |_| deployment("chat-nlu", 2),
        )
        .await;
    let edge_status = server
        .expect(
            Method::PATCH,
            "/apis/sessionflow.io/v1alpha1/namespaces/edge/sessionpipelines/chat/status",
            status_echo(&edge),
        )
        .await;
    server.expect_silence(Duration::from_millis(200)).await;
    tokio::time::timeout(Duration::from_secs(1), pass)
        .await
        .expect("the pass ends once the edge pipeline is reported")
        .unwrap();
    let condition = autoscaling(&edge_status);
    assert_eq!(
        (&condition["status"], &condition["reason"]),
        (&json!("False"), &json!("Fallback"))
    );
    let message = condition["message"].as_str().unwrap();
    assert!(
        message.contains("stage nlu: lag read timed out after 5s"),
        "{message}"
    );
    assert_eq!(
        edge_status.body["status"]["stages"][0]["desiredReplicas"],
        2
    );
    assert!(metrics
        .render()
        .contains("sessionflow_operator_scaler_pass_seconds_count 1"));
    assert!(passes.healthy(), "the pass was recorded for /healthz");
}

/// Leader election: a standby's pass reads nothing and writes nothing (yet counts as a
/// completed pass for `/healthz`); on the leader the same pass does its work.
#[tokio::test]
async fn only_the_leader_scales() {
    let mut sp = pipeline(&["nlu"]);
    // Nothing listens there: the leader's lag read fails (fast, under a short deadline).
    sp.spec.kafka.bootstrap_servers = "127.0.0.1:1".into();
    let (switch, leadership) = crate::leader::Leadership::channel(false);
    let (scaler, mut server, _writer, metrics) = scaler_of(std::slice::from_ref(&sp));
    // Allowed: 3 × 2 s + 1 s; the last pass (the start) was 30 s ago.
    let long_ago = std::time::Instant::now()
        .checked_sub(Duration::from_secs(30))
        .expect("the machine is up for more than 30 s");
    let passes = Arc::new(PassClock::new(
        Duration::from_secs(2),
        Duration::from_secs(1),
        long_ago,
    ));
    let mut scaler = scaler
        .with_leadership(leadership)
        .with_pass_clock(passes.clone())
        .with_lag_deadline(Duration::from_millis(500));
    assert!(!passes.healthy());
    tokio::time::timeout(Duration::from_secs(1), scaler.tick())
        .await
        .expect("a standby's pass ends at once");
    server.expect_silence(Duration::from_millis(200)).await;
    assert!(passes.healthy(), "a standby completes its passes");
    assert!(metrics
        .render()
        .contains("sessionflow_operator_scaler_pass_seconds_count 1"));

    switch.set(true);
    let pass = tokio::spawn(async move { scaler.tick().await });
    // Leading: the pipeline's lag is read and its Deployment too.
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu", 1))
        .await;
    pass.abort();
}
