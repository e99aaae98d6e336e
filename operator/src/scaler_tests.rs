//! Autoscaling passes against a scripted API server and a real Kafka-protocol broker
//! (librdkafka's mock cluster): a pass that scales and reports, who may write `spec.replicas`
//! (external mode, the pause annotation) and what the `Autoscaling` condition says. The
//! harness (scaler, cluster, Deployment) is in [`crate::fixtures`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use kube::runtime::watcher;
use serde_json::{json, Value};

use super::*;
use crate::crd::{AutoscalingMode, SaslMechanism, SaslSpec};
use crate::fixtures::{
    cluster_with_lag, deployment, pipeline, scaler_of, stalled_pass_clock, Seen,
};

const DEP: &str = "/apis/apps/v1/namespaces/shop/deployments/chat-nlu-bb263a2d";
const STATUS: &str = "/apis/sessionflow.io/v1alpha1/namespaces/shop/sessionpipelines/chat/status";

/// One pass of `scaler` in a task that gives the scaler back for the next pass.
fn spawn_pass(mut scaler: Scaler) -> tokio::task::JoinHandle<Scaler> {
    tokio::spawn(async move {
        scaler.tick().await;
        scaler
    })
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

/// One autoscaling pass with lag read from a real Kafka-protocol broker (librdkafka's mock
/// cluster, in process) and a scripted API server: 2,500 records of lag at 1,000 per
/// replica on 4 partitions → 3 replicas, applied under the autoscaler's own field manager,
/// announced, and reported in the status. A second pass with nothing new writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_reads_lag_scales_the_deployment_and_reports_it() {
    let cluster = cluster_with_lag("t0", 4, 2_500);
    let mut sp = pipeline(&["nlu"]);
    sp.spec.kafka.bootstrap_servers = cluster.bootstrap_servers();
    sp.spec.stages[0].replicas.max = 10;
    let (scaler, mut server, mut writer, metrics) = scaler_of(std::slice::from_ref(&sp));
    let pass = spawn_pass(scaler);
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu-bb263a2d", 1, 1))
        .await;
    let scale = server
        .expect(Method::PATCH, DEP, |_| {
            deployment("chat-nlu-bb263a2d", 3, 1)
        })
        .await;
    assert!(
        scale.query_has("fieldManager=sessionflow-autoscaler"),
        "{}",
        scale.uri
    );
    assert_eq!(
        scale.body["spec"],
        json!({ "replicas": 3 }),
        "only replicas are applied"
    );
    let event = server
        .expect(
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/shop/events",
            |s: &Seen| s.body.clone(),
        )
        .await;
    assert_eq!(event.body["reason"], "ScaledUp");
    assert!(event.body["note"].as_str().unwrap().contains("1 → 3"));
    let status = server.expect(Method::PATCH, STATUS, status_echo(&sp)).await;
    let stage = &status.body["status"]["stages"][0];
    assert_eq!(stage["name"], "nlu");
    assert_eq!(stage["lag"], 2_500);
    assert_eq!(stage["effectiveLag"], 2_500);
    assert_eq!(stage["partitions"], 4);
    assert_eq!(stage["desiredReplicas"], 3);
    assert_eq!(stage["readyReplicas"], 1);
    assert!(stage["lastScaleReason"]
        .as_str()
        .unwrap()
        .contains("above 1000 per replica"));
    assert_eq!(status.body["status"]["lag"], 2_500);
    server.expect_silence(Duration::from_millis(200)).await;
    let scaler = pass.await.unwrap();
    let rendered = metrics.render();
    assert!(rendered.contains(
        r#"sessionflow_stage_replicas_desired{namespace="shop",pipeline="chat",stage="nlu"} 3"#
    ));
    assert!(rendered.contains(
        r#"sessionflow_stage_effective_lag{namespace="shop",pipeline="chat",stage="nlu"} 2500"#
    ));

    // The status is now what the pipeline shows; the next pass only reads.
    writer.apply_watcher_event(&watcher::Event::Apply(shown(&sp, &status)));
    let pass = spawn_pass(scaler);
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu-bb263a2d", 3, 1))
        .await;
    server.expect_silence(Duration::from_millis(300)).await;
    let scaler = pass.await.unwrap();
    assert_eq!(
        scaler.lag_readers.lock().unwrap().created(),
        1,
        "the second pass reads with the first pass's client"
    );
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
    let (scaler, mut server, mut writer, metrics) = scaler_of(std::slice::from_ref(&sp));

    let pass = spawn_pass(scaler);
    server
        .expect(Method::GET, DEP, |_| {
            deployment("chat-nlu-bb263a2d", 20, 20)
        })
        .await;
    let status = server.expect(Method::PATCH, STATUS, status_echo(&sp)).await;
    server.expect_silence(Duration::from_millis(300)).await;
    let scaler = pass.await.unwrap();
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
    let pass = spawn_pass(scaler);
    server
        .expect(Method::GET, DEP, |_| {
            deployment("chat-nlu-bb263a2d", 20, 20)
        })
        .await;
    let scale = server
        .expect(Method::PATCH, DEP, |_| {
            deployment("chat-nlu-bb263a2d", 10, 10)
        })
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
    let (scaler, mut server, mut writer, _) = scaler_of(std::slice::from_ref(&sp));

    let pass = spawn_pass(scaler);
    server
        .expect(Method::GET, DEP, |_| {
            deployment("chat-nlu-bb263a2d", 20, 20)
        })
        .await;
    let status = server.expect(Method::PATCH, STATUS, status_echo(&sp)).await;
    server.expect_silence(Duration::from_millis(300)).await;
    let scaler = pass.await.unwrap();
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
    let pass = spawn_pass(scaler);
    server
        .expect(Method::GET, DEP, |_| {
            deployment("chat-nlu-bb263a2d", 20, 20)
        })
        .await;
    server.expect_silence(Duration::from_millis(300)).await;
    let scaler = pass.await.unwrap();

    // Resumed: scaled within bounds, and the condition turns Active.
    let mut resumed = again;
    resumed.metadata.annotations = None;
    writer.apply_watcher_event(&watcher::Event::Apply(resumed.clone()));
    let pass = spawn_pass(scaler);
    server
        .expect(Method::GET, DEP, |_| {
            deployment("chat-nlu-bb263a2d", 20, 20)
        })
        .await;
    let scale = server
        .expect(Method::PATCH, DEP, |_| {
            deployment("chat-nlu-bb263a2d", 10, 10)
        })
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
    let (scaler, mut server, _writer, _) = scaler_of(std::slice::from_ref(&sp));
    let pass = spawn_pass(scaler);
    server
        .fail(
            Method::GET,
            "/api/v1/namespaces/shop/secrets/kafka-user",
            404,
        )
        .await;
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu-bb263a2d", 1, 1))
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
    let scaler = scaler.with_lag_deadline(Duration::from_secs(5));
    let passes = scaler.passes.clone();
    let pass = spawn_pass(scaler);

    tokio::time::timeout(Duration::from_secs(5), async {
        while accepted.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the edge pipeline's lag read reached its broker");
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu-bb263a2d", 1, 1))
        .await;
    let scale = server
        .expect(Method::PATCH, DEP, |_| {
            deployment("chat-nlu-bb263a2d", 3, 3)
        })
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
            "/apis/apps/v1/namespaces/edge/deployments/chat-nlu-bb263a2d",
            |_| deployment("chat-nlu-bb263a2d", 2, 2),
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
    let passes = stalled_pass_clock();
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
    let pass = spawn_pass(scaler);
    // Leading: the pipeline's lag is read and its Deployment too.
    server
        .expect(Method::GET, DEP, |_| deployment("chat-nlu-bb263a2d", 1, 1))
        .await;
    pass.abort();
}
