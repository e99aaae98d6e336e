//! Reconcile scenarios against a scripted API server: every request the reconciler makes is
//! checked in order, and a request the scenario does not expect fails the test.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use kube::runtime::events::Reporter;
use serde_json::{json, Value};

use super::*;
use crate::crd::SessionPipeline;
use crate::fixtures::{
    kafka_property, list, mock_client, pipeline, rebalance, ApiServer, Seen, UID,
};
use crate::metrics::Metrics;
use crate::render::Defaults;

const CM: &str = "/api/v1/namespaces/shop/configmaps";
const DEP: &str = "/apis/apps/v1/namespaces/shop/deployments";
const SVC: &str = "/api/v1/namespaces/shop/services";
const STATUS: &str = "/apis/sessionflow.io/v1alpha1/namespaces/shop/sessionpipelines/chat/status";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/shop/events";

fn context(client: kube::Client) -> Arc<Context> {
    Arc::new(Context::new(
        client,
        Defaults {
            worker_image: "sessionflow-worker:test".into(),
            log_format: "json".into(),
        },
        Metrics::new(),
        Reporter {
            controller: "sessionflow-operator".into(),
            instance: None,
        },
    ))
}

/// What a pass applied, as the API server would now return it.
#[derive(Default, Clone)]
struct Cluster {
    config_maps: Vec<Value>,
    deployments: Vec<Value>,
    services: Vec<Value>,
}

fn echo(seen: &Seen) -> Value {
    seen.body.clone()
}

/// The status the pipeline shows after a status patch, as a resource.
fn with_status(sp: &SessionPipeline, patch: &Value) -> SessionPipeline {
    let mut sp = sp.clone();
    let mut status = serde_json::to_value(sp.status.clone().unwrap_or_default()).unwrap();
    for (k, v) in patch["status"].as_object().unwrap() {
        status[k] = v.clone();
    }
    sp.status = Some(serde_json::from_value(status).unwrap());
    sp
}

fn status_reply(sp: &SessionPipeline) -> impl FnOnce(&Seen) -> Value + '_ {
    move |seen| serde_json::to_value(with_status(sp, &seen.body)).unwrap()
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {status}"))
}

/// Answers the three owned-object lists from `cluster`.
async fn lists(server: &mut ApiServer, cluster: &Cluster) {
    for (path, kind, version, items) in [
        (CM, "ConfigMap", "v1", &cluster.config_maps),
        (DEP, "Deployment", "apps/v1", &cluster.deployments),
        (SVC, "Service", "v1", &cluster.services),
    ] {
        let seen = server
            .expect(Method::GET, path, |_| list(kind, version, items))
            .await;
        assert!(
            seen.query_has("labelSelector=sessionflow.io%2Fpipeline%3Dchat"),
            "list not scoped to the pipeline: {}",
            seen.uri
        );
    }
}

/// Runs `reconcile` while `script` plays the API server; returns the reconcile result after
/// checking that nothing else was requested.
async fn scenario<F>(
    sp: SessionPipeline,
    script: impl FnOnce(ApiServer) -> F,
) -> Result<kube::runtime::controller::Action, Error>
where
    F: std::future::Future<Output = ApiServer>,
{
    let (client, server) = mock_client();
    let ctx = context(client);
    let task = tokio::spawn(reconcile(Arc::new(sp), ctx));
    let mut server = tokio::time::timeout(Duration::from_secs(10), script(server))
        .await
        .expect("scenario finished in time");
    server.expect_silence(Duration::from_millis(200)).await;
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("reconcile finished")
        .expect("reconcile did not panic")
}

/// First pass on an empty cluster: applies everything, returns what it applied and the
/// status patch.
async fn first_pass(sp: &SessionPipeline) -> (Cluster, Value) {
    let stages: Vec<String> = sp.spec.stages.iter().map(|s| s.name.clone()).collect();
    let applied = Arc::new(std::sync::Mutex::new((Cluster::default(), Value::Null)));
    let out = applied.clone();
    let sp2 = sp.clone();
    let result = scenario(sp.clone(), |mut server| async move {
        lists(&mut server, &Cluster::default()).await;
        for stage in &stages {
            let cm = server
                .expect(Method::PATCH, &format!("{CM}/chat-{stage}"), echo)
                .await;
            let dep = server
                .expect(Method::PATCH, &format!("{DEP}/chat-{stage}"), echo)
                .await;
            let svc = server
                .expect(Method::PATCH, &format!("{SVC}/chat-{stage}-metrics"), echo)
                .await;
            for seen in [&cm, &dep, &svc] {
                assert!(
                    seen.query_has("fieldManager=sessionflow-operator"),
                    "{}",
                    seen.uri
                );
                assert!(seen.query_has("force=true"), "{}", seen.uri);
                let owner = &seen.body["metadata"]["ownerReferences"][0];
                assert_eq!(owner["uid"], UID);
                assert_eq!(owner["kind"], "SessionPipeline");
                assert_eq!(owner["controller"], true);
                assert_eq!(
                    seen.body["metadata"]["labels"]["sessionflow.io/stage"],
                    stage.as_str()
                );
            }
            let mut guard = out.lock().unwrap();
            guard.0.config_maps.push(cm.body);
            guard.0.deployments.push(dep.body);
            guard.0.services.push(svc.body);
        }
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        out.lock().unwrap().1 = status.body;
        server
    })
    .await;
    assert!(result.is_ok(), "{result:?}");
    let guard = applied.lock().unwrap();
    guard.clone()
}

#[tokio::test]
async fn first_reconcile_creates_config_map_deployment_and_service_per_stage() {
    let sp = pipeline(&["nlu", "llm"]);
    let (cluster, status) = first_pass(&sp).await;

    let config = cluster.config_maps[0]["data"]["stage.yaml"]
        .as_str()
        .unwrap();
    let parsed = sessionflow_worker::config::StageConfig::from_yaml(config).unwrap();
    assert_eq!(parsed.input, "t0");
    assert_eq!(parsed.output.as_deref(), Some("t1"));
    assert_eq!(parsed.group_id(), "sessionflow.shop.chat.nlu");

    let dep = &cluster.deployments[1];
    assert!(
        dep["spec"].get("replicas").is_none(),
        "the autoscaler owns replicas"
    );
    let pod = &dep["spec"]["template"];
    assert!(pod["metadata"]["annotations"]["sessionflow.io/config-hash"].is_string());
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["image"], "sessionflow-worker:test");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["livenessProbe"]["periodSeconds"], 10);
    assert_eq!(container["livenessProbe"]["failureThreshold"], 3);
    // Worker defaults: a 25 s revocation + 20 s shutdown + 10 s writes + 5 s final commit
    // + 20 s close + 10 s slack.
    assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 90);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(pod["spec"]["securityContext"]["runAsNonRoot"], true);

    assert_eq!(status["status"]["observedGeneration"], 1);
    assert_eq!(status["status"]["stagesReady"], "0/2");
    assert_eq!(condition(&status, "Ready")["status"], "False");
    assert_eq!(condition(&status, "Progressing")["status"], "True");
    assert_eq!(condition(&status, "Degraded")["status"], "False");
}

fn ready(mut deployment: Value) -> Value {
    deployment["metadata"]["generation"] = json!(1);
    deployment["spec"]["replicas"] = json!(2);
    deployment["status"] = json!({
        "observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2,
    });
    deployment
}

#[tokio::test]
async fn reconciles_without_changes_write_nothing() {
    let sp = pipeline(&["nlu", "llm"]);
    let (mut cluster, status) = first_pass(&sp).await;
    cluster.deployments = cluster.deployments.into_iter().map(ready).collect();
    let sp = with_status(&sp, &status);

    // Second pass: nothing to apply; the rollout finished, so only the status changes.
    let seen_status = Arc::new(std::sync::Mutex::new(Value::Null));
    let out = seen_status.clone();
    let (c2, sp2) = (cluster.clone(), sp.clone());
    scenario(sp.clone(), |mut server| async move {
        lists(&mut server, &c2).await;
        let s = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        *out.lock().unwrap() = s.body;
        server
    })
    .await
    .unwrap();
    let status = seen_status.lock().unwrap().clone();
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert_eq!(status["status"]["stagesReady"], "2/2");

    // Third pass: the cluster and the status are as desired: three reads, no write.
    let sp = with_status(&sp, &status);
    scenario(sp, |mut server| async move {
        lists(&mut server, &cluster).await;
        server
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_stage_removed_from_the_spec_is_removed_from_the_cluster() {
    let (cluster, status) = first_pass(&pipeline(&["nlu", "llm"])).await;
    let sp = with_status(&pipeline(&["nlu"]), &status);
    let sp2 = sp.clone();
    scenario(sp, |mut server| async move {
        lists(&mut server, &cluster).await;
        server
            .expect(Method::DELETE, &format!("{CM}/chat-llm"), echo_deleted)
            .await;
        server
            .expect(Method::DELETE, &format!("{DEP}/chat-llm"), echo_deleted)
            .await;
        server
            .expect(
                Method::DELETE,
                &format!("{SVC}/chat-llm-metrics"),
                echo_deleted,
            )
            .await;
        let event = server.expect(Method::POST, EVENTS, echo).await;
        assert_eq!(event.body["reason"], "StageRemoved");
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        assert_eq!(status.body["status"]["stagesReady"], "0/1");
        server
    })
    .await
    .unwrap();
}

fn echo_deleted(seen: &Seen) -> Value {
    // The API server answers a background delete with a Status.
    let _ = seen;
    json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success", "code": 200})
}

#[tokio::test]
async fn a_spec_the_worker_would_refuse_sets_degraded_and_applies_nothing() {
    let mut sp = pipeline(&["nlu"]);
    sp.spec.stages[0].handler = sessionflow_worker::config::HandlerConfig::Http(
        sessionflow_worker::config::HttpHandlerConfig {
            url: "ftp://nlu.shop.svc/handle".into(),
            timeout_ms: 1000,
        },
    );
    let sp2 = sp.clone();
    let action = scenario(sp, |mut server| async move {
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        let degraded = condition(&status.body, "Degraded");
        assert_eq!(degraded["status"], "True");
        assert_eq!(degraded["reason"], "InvalidSpec");
        let message = degraded["message"].as_str().unwrap();
        assert!(
            message.starts_with("spec.stages[0].handler.http.url: must be an http://"),
            "{message}"
        );
        assert_eq!(condition(&status.body, "Ready")["status"], "False");
        let event = server.expect(Method::POST, EVENTS, echo).await;
        assert_eq!(event.body["type"], "Warning");
        assert_eq!(event.body["reason"], "InvalidSpec");
        server
    })
    .await
    .unwrap();
    assert_eq!(action, kube::runtime::controller::Action::await_change());
}

/// Plays a pass over an invalid spec: the status patch (checked by `check`) and the Warning
/// event, nothing else — no list, no apply, no delete.
async fn invalid_spec_pass(sp: SessionPipeline, check: impl FnOnce(&Value) + Send + 'static) {
    let sp2 = sp.clone();
    let action = scenario(sp, |mut server| async move {
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        let degraded = condition(&status.body, "Degraded");
        assert_eq!(degraded["status"], "True");
        assert_eq!(degraded["reason"], "InvalidSpec");
        assert_eq!(condition(&status.body, "Ready")["status"], "False");
        assert_eq!(condition(&status.body, "Ready")["reason"], "InvalidSpec");
        assert_eq!(condition(&status.body, "Progressing")["status"], "False");
        check(&status.body);
        let event = server.expect(Method::POST, EVENTS, echo).await;
        assert_eq!(event.body["type"], "Warning");
        assert_eq!(event.body["reason"], "InvalidSpec");
        assert_eq!(event.body["note"], degraded["message"]);
        server
    })
    .await
    .unwrap();
    assert_eq!(action, kube::runtime::controller::Action::await_change());
}

#[tokio::test]
async fn a_drain_that_outlasts_max_poll_interval_is_refused_with_the_field_named() {
    let mut sp = pipeline(&["nlu", "llm"]);
    kafka_property(&mut sp, "max.poll.interval.ms", "60000");
    // 2 × 27 000 + 5000 < 60 000: fine; 2 × 30 000 + 5000 is not.
    sp.spec.stages[0].rebalance = Some(rebalance(27_000));
    sp.spec.stages[1].rebalance = Some(rebalance(30_000));
    invalid_spec_pass(sp, |status| {
        let message = condition(status, "Degraded")["message"].as_str().unwrap();
        assert!(
            message.starts_with(
                "spec.stages[1].rebalance.drainTimeoutMs: 30000 ms cannot finish before \
                 max.poll.interval.ms 60000:"
            ),
            "{message}"
        );
        assert_eq!(status["status"]["observedGeneration"], 1);
    })
    .await;
}

#[tokio::test]
async fn a_poll_interval_below_the_session_timeout_is_refused_with_the_property_named() {
    // The setting: max.poll.interval.ms 10 000, session.timeout.ms left at 45 000.
    let mut sp = pipeline(&["nlu"]);
    kafka_property(&mut sp, "max.poll.interval.ms", "10000");
    invalid_spec_pass(sp, |status| {
        let message = condition(status, "Degraded")["message"].as_str().unwrap();
        assert!(
            message.starts_with(
                "spec.kafka.properties[max.poll.interval.ms]: 10000 ms is below \
                 session.timeout.ms 45000:"
            ),
            "{message}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_shutdown_no_grace_period_can_hold_is_refused_at_the_pipeline_field() {
    let mut sp = pipeline(&["nlu"]);
    sp.spec.shutdown_timeout_ms = Some(u64::MAX);
    invalid_spec_pass(sp, |status| {
        let message = condition(status, "Degraded")["message"].as_str().unwrap();
        assert!(
            message.starts_with("spec.shutdownTimeoutMs: 18446744073709551615 ms cannot finish"),
            "{message}"
        );
    })
    .await;
}

#[tokio::test]
async fn impossible_timeouts_keep_the_running_workers_and_fixing_them_rolls_the_stage() {
    let (cluster, status) = first_pass(&pipeline(&["nlu", "llm"])).await;

    // Generation 2 asks for a drain the group would not wait for: refused, and the workers of
    // generation 1 are left running as they are (no apply, no delete).
    let mut broken = with_status(&pipeline(&["nlu", "llm"]), &status);
    broken.metadata.generation = Some(2);
    kafka_property(&mut broken, "max.poll.interval.ms", "60000");
    broken.spec.stages[0].rebalance = Some(rebalance(30_000));
    let refused = Arc::new(std::sync::Mutex::new(Value::Null));
    let out = refused.clone();
    invalid_spec_pass(broken.clone(), move |status| {
        let message = condition(status, "Degraded")["message"].as_str().unwrap();
        assert!(
            message.starts_with("spec.stages[0].rebalance.drainTimeoutMs: 30000 ms cannot"),
            "{message}"
        );
        assert_eq!(status["status"]["observedGeneration"], 2);
        *out.lock().unwrap() = status.clone();
    })
    .await;

    // Generation 3 fixes it: only the nlu stage's ConfigMap and Deployment change, and its pods
    // get the grace period of the new drain.
    let mut fixed = with_status(&broken, &refused.lock().unwrap().clone());
    fixed.metadata.generation = Some(3);
    fixed.spec.stages[0].rebalance = Some(rebalance(27_499));
    let fixed2 = fixed.clone();
    scenario(fixed, |mut server| async move {
        lists(&mut server, &cluster).await;
        let cm = server
            .expect(Method::PATCH, &format!("{CM}/chat-nlu"), echo)
            .await;
        let config = cm.body["data"]["stage.yaml"].as_str().unwrap();
        let parsed = sessionflow_worker::config::StageConfig::from_yaml(config).unwrap();
        assert_eq!(parsed.rebalance.drain_timeout_ms, 27_499);
        assert_eq!(parsed.kafka["max.poll.interval.ms"], "60000");
        let dep = server
            .expect(Method::PATCH, &format!("{DEP}/chat-nlu"), echo)
            .await;
        // ⌈(3 × 27 499 + 20 000) / 1000⌉ + 10 s commits + 20 s close + 10 s slack.
        assert_eq!(
            dep.body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
            103 + 40
        );
        // The llm stage's ConfigMap changes too (the pipeline-wide property), nothing else.
        server
            .expect(Method::PATCH, &format!("{CM}/chat-llm"), echo)
            .await;
        server
            .expect(Method::PATCH, &format!("{DEP}/chat-llm"), echo)
            .await;
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&fixed2))
            .await;
        let degraded = condition(&status.body, "Degraded");
        assert_eq!(degraded["status"], "False");
        assert_eq!(degraded["reason"], "ReconcileSucceeded");
        assert_eq!(status.body["status"]["observedGeneration"], 3);
        server
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn an_api_failure_is_reported_as_degraded_and_retried() {
    let sp = pipeline(&["nlu"]);
    let sp2 = sp.clone();
    let result = scenario(sp, |mut server| async move {
        server.fail(Method::GET, CM, 500).await;
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        let degraded = condition(&status.body, "Degraded");
        assert_eq!(degraded["status"], "True");
        assert_eq!(degraded["reason"], "ReconcileFailed");
        let message = degraded["message"].as_str().unwrap();
        assert!(
            message.starts_with("listing ConfigMaps in shop:")
                && message.contains("injected failure"),
            "{message}"
        );
        let event = server.expect(Method::POST, EVENTS, echo).await;
        assert_eq!(event.body["reason"], "ReconcileFailed");
        server
    })
    .await;
    assert!(matches!(result, Err(Error::Api { .. })), "{result:?}");
}

/// Leader election: a standby's reconcile makes no API call at all (and waits for a change,
/// which gaining the lease supplies); the same reconcile on the leader does its work.
#[tokio::test]
async fn only_the_leader_reconciles() {
    let (switch, leadership) = crate::leader::Leadership::channel(false);
    let (client, mut server) = mock_client();
    let ctx = Arc::new(
        Context::new(
            client,
            Defaults {
                worker_image: "sessionflow-worker:test".into(),
                log_format: "json".into(),
            },
            Metrics::new(),
            Reporter {
                controller: "sessionflow-operator".into(),
                instance: None,
            },
        )
        .with_leadership(leadership),
    );
    let sp = Arc::new(pipeline(&["nlu"]));
    let action = tokio::time::timeout(Duration::from_secs(1), reconcile(sp.clone(), ctx.clone()))
        .await
        .expect("a standby's reconcile returns at once")
        .unwrap();
    assert_eq!(action, kube::runtime::controller::Action::await_change());
    server.expect_silence(Duration::from_millis(200)).await;

    switch.set(true);
    let task = tokio::spawn(reconcile(sp, ctx));
    let first = server
        .expect(Method::GET, CM, |_| list("ConfigMap", "v1", &[]))
        .await;
    assert!(first.query_has("labelSelector="), "{}", first.uri);
    task.abort();
}
