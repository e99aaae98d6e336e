//! Reconcile scenarios against a scripted API server: every request the reconciler makes is
//! checked in order, and a request the scenario does not expect fails the test.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use serde_json::{json, Value};

use super::*;
use crate::crd::SessionPipeline;
use crate::fixtures::{
    context, kafka_property, list, mock_client, pipeline, plain_context, rebalance, ApiServer,
    Seen, UID,
};

const CM: &str = "/api/v1/namespaces/shop/configmaps";
const DEP: &str = "/apis/apps/v1/namespaces/shop/deployments";
const SVC: &str = "/api/v1/namespaces/shop/services";
const PDB: &str = "/apis/policy/v1/namespaces/shop/poddisruptionbudgets";
const PODS: &str = "/api/v1/namespaces/shop/pods";
const STATUS: &str = "/apis/sessionflow.io/v1alpha1/namespaces/shop/sessionpipelines/chat/status";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/shop/events";

/// What a pass applied, as the API server would now return it.
#[derive(Default, Clone)]
struct Cluster {
    config_maps: Vec<Value>,
    deployments: Vec<Value>,
    services: Vec<Value>,
    budgets: Vec<Value>,
    pods: Vec<Value>,
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

/// Answers the owned-object lists (and the pods') from `cluster`.
async fn lists(server: &mut ApiServer, cluster: &Cluster) {
    for (path, kind, version, items) in [
        (CM, "ConfigMap", "v1", &cluster.config_maps),
        (DEP, "Deployment", "apps/v1", &cluster.deployments),
        (SVC, "Service", "v1", &cluster.services),
        (PDB, "PodDisruptionBudget", "policy/v1", &cluster.budgets),
        (PODS, "Pod", "v1", &cluster.pods),
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
    scenario_with(context(client), server, sp, script).await
}

/// [`scenario`] with a context kept across passes (what the reconciler remembers).
async fn scenario_with<F>(
    ctx: Arc<Context>,
    server: ApiServer,
    sp: SessionPipeline,
    script: impl FnOnce(ApiServer) -> F,
) -> Result<kube::runtime::controller::Action, Error>
where
    F: std::future::Future<Output = ApiServer>,
{
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
            // Names not in the pipeline's lists are looked up first: none is taken.
            for path in [
                format!("{CM}/{}", crate::render::stage_object_name("chat", stage)),
                format!("{DEP}/{}", crate::render::stage_object_name("chat", stage)),
                format!("{SVC}/{}", crate::render::service_name("chat", stage)),
                format!("{PDB}/{}", crate::render::stage_object_name("chat", stage)),
            ] {
                server.fail(Method::GET, &path, 404).await;
            }
            let cm = server
                .expect(
                    Method::PATCH,
                    &format!("{CM}/{}", crate::render::stage_object_name("chat", stage)),
                    echo,
                )
                .await;
            let dep = server
                .expect(
                    Method::PATCH,
                    &format!("{DEP}/{}", crate::render::stage_object_name("chat", stage)),
                    echo,
                )
                .await;
            let svc = server
                .expect(
                    Method::PATCH,
                    &format!("{SVC}/{}", crate::render::service_name("chat", stage)),
                    echo,
                )
                .await;
            let pdb = server
                .expect(
                    Method::PATCH,
                    &format!("{PDB}/{}", crate::render::stage_object_name("chat", stage)),
                    echo,
                )
                .await;
            for seen in [&cm, &dep, &svc, &pdb] {
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
            guard.0.budgets.push(pdb.body);
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
    assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 100);
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
        "availableReplicas": 2,
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

    // Third pass: the cluster and the status are as desired: five reads, no write.
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
            .expect(
                Method::DELETE,
                &format!("{CM}/chat-llm-8dcd942b"),
                echo_deleted,
            )
            .await;
        server
            .expect(
                Method::DELETE,
                &format!("{DEP}/chat-llm-8dcd942b"),
                echo_deleted,
            )
            .await;
        server
            .expect(
                Method::DELETE,
                &format!("{SVC}/chat-llm-8dcd942b-metrics"),
                echo_deleted,
            )
            .await;
        server
            .expect(
                Method::DELETE,
                &format!("{PDB}/chat-llm-8dcd942b"),
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
    sp.spec.defaults.shutdown_timeout_ms = Some(u64::MAX);
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
            .expect(Method::PATCH, &format!("{CM}/chat-nlu-bb263a2d"), echo)
            .await;
        let config = cm.body["data"]["stage.yaml"].as_str().unwrap();
        let parsed = sessionflow_worker::config::StageConfig::from_yaml(config).unwrap();
        assert_eq!(parsed.rebalance.drain_timeout_ms, 27_499);
        assert_eq!(parsed.kafka["max.poll.interval.ms"], "60000");
        let dep = server
            .expect(Method::PATCH, &format!("{DEP}/chat-nlu-bb263a2d"), echo)
            .await;
        // ⌈(3 × 27 499 + 20 000) / 1000⌉ + 10 s fence + 10 s commits + 20 s close + 10 s slack.
        assert_eq!(
            dep.body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
            103 + 50
        );
        // The llm stage's ConfigMap changes too (the pipeline-wide property), nothing else.
        server
            .expect(Method::PATCH, &format!("{CM}/chat-llm-8dcd942b"), echo)
            .await;
        server
            .expect(Method::PATCH, &format!("{DEP}/chat-llm-8dcd942b"), echo)
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

/// The status patch of a pass over `cluster` that turns the pipeline `Degraded` and writes
/// nothing else but the Warning event with the same reason.
async fn degraded_pass(sp: &SessionPipeline, cluster: &Cluster) -> Value {
    let seen = Arc::new(std::sync::Mutex::new(Value::Null));
    let (out, c, sp2) = (seen.clone(), cluster.clone(), sp.clone());
    scenario(sp.clone(), |mut server| async move {
        lists(&mut server, &c).await;
        let s = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        let event = server.expect(Method::POST, EVENTS, echo).await;
        assert_eq!(event.body["type"], "Warning");
        assert_eq!(
            event.body["reason"],
            condition(&s.body, "Degraded")["reason"]
        );
        assert_eq!(
            event.body["note"],
            condition(&s.body, "Degraded")["message"]
        );
        *out.lock().unwrap() = s.body;
        server
    })
    .await
    .unwrap();
    let status = seen.lock().unwrap().clone();
    status
}

fn pod(stage: &str, containers: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": format!("chat-{stage}-5c7d9-x2x4q"), "namespace": "shop",
                      "labels": { "sessionflow.io/pipeline": "chat", "sessionflow.io/stage": stage } },
        "spec": { "containers": [] },
        "status": { "containerStatuses": containers },
    })
}

#[tokio::test]
async fn pods_that_cannot_run_make_the_pipeline_degraded_with_the_pod_named() {
    let sp = pipeline(&["nlu", "llm"]);
    let (mut cluster, status) = first_pass(&sp).await;
    cluster.deployments = cluster.deployments.into_iter().map(ready).collect();
    let sp = with_status(&sp, &status);
    for (reason, message) in [
        (
            "ImagePullBackOff",
            "Back-off pulling image \"sessionflow-worker:tset\"",
        ),
        (
            "CrashLoopBackOff",
            "back-off 5m0s restarting failed container=worker",
        ),
        (
            "CreateContainerConfigError",
            "secret \"kafka-user\" not found",
        ),
    ] {
        let mut cluster = cluster.clone();
        cluster.pods = vec![pod(
            "llm",
            json!([{ "name": "worker", "image": "w", "imageID": "", "ready": false, "restartCount": 4,
                     "state": { "waiting": { "reason": reason, "message": message } } }]),
        )];
        let status = degraded_pass(&sp, &cluster).await;
        let degraded = condition(&status, "Degraded");
        assert_eq!(degraded["status"], "True", "{reason}");
        assert_eq!(degraded["reason"], reason);
        assert_eq!(
            degraded["message"],
            format!("stage llm: pod chat-llm-5c7d9-x2x4q container worker: {message}")
        );
        assert_eq!(condition(&status, "Ready")["status"], "False");
        assert_eq!(status["status"]["stagesReady"], "1/2");
    }
    // The Deployment's own verdict on a rollout that stopped progressing.
    let mut stuck = cluster.clone();
    stuck.deployments[0]["status"]["conditions"] = json!([{
        "type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
        "message": "ReplicaSet \"chat-nlu-5c7d9\" has timed out progressing."
    }]);
    let status = degraded_pass(&sp, &stuck).await;
    let degraded = condition(&status, "Degraded");
    assert_eq!(degraded["reason"], "ProgressDeadlineExceeded");
    assert_eq!(
        degraded["message"],
        "stage nlu: Deployment chat-nlu-bb263a2d: ReplicaSet \"chat-nlu-5c7d9\" has timed out progressing."
    );
}

#[tokio::test]
async fn ready_holds_while_the_autoscaler_adds_replicas() {
    let sp = pipeline(&["nlu"]);
    let (client, mut server) = mock_client();
    let ctx = context(client);
    let within = |f| tokio::time::timeout(Duration::from_secs(1), f);

    // Pass 1 applies; the API server answers the Deployment's apply with generation 1.
    let task = tokio::spawn(reconcile(Arc::new(sp.clone()), ctx.clone()));
    lists(&mut server, &Cluster::default()).await;
    for path in [
        format!("{CM}/chat-nlu-bb263a2d"),
        format!("{DEP}/chat-nlu-bb263a2d"),
        format!("{SVC}/chat-nlu-bb263a2d-metrics"),
        format!("{PDB}/chat-nlu-bb263a2d"),
    ] {
        server.fail(Method::GET, &path, 404).await;
    }
    let mut cluster = Cluster::default();
    cluster.config_maps.push(
        server
            .expect(Method::PATCH, &format!("{CM}/chat-nlu-bb263a2d"), echo)
            .await
            .body,
    );
    let dep = server
        .expect(Method::PATCH, &format!("{DEP}/chat-nlu-bb263a2d"), |seen| {
            let mut d = seen.body.clone();
            d["metadata"]["generation"] = json!(1);
            d
        })
        .await;
    cluster.deployments.push(dep.body);
    cluster.services.push(
        server
            .expect(
                Method::PATCH,
                &format!("{SVC}/chat-nlu-bb263a2d-metrics"),
                echo,
            )
            .await
            .body,
    );
    cluster.budgets.push(
        server
            .expect(Method::PATCH, &format!("{PDB}/chat-nlu-bb263a2d"), echo)
            .await
            .body,
    );
    let status = server
        .expect(Method::PATCH, STATUS, status_reply(&sp))
        .await
        .body;
    within(task).await.unwrap().unwrap().unwrap();
    let sp = with_status(&sp, &status);

    // Generation 1 rolled out with 2 replicas; then the autoscaler asked for 4 (generation 2),
    // which the Deployment controller has not even observed yet: the stage stays Ready.
    let mut d = ready(cluster.deployments[0].clone());
    d["metadata"]["generation"] = json!(2);
    d["spec"]["replicas"] = json!(4);
    cluster.deployments = vec![d];
    let task = tokio::spawn(reconcile(Arc::new(sp.clone()), ctx.clone()));
    lists(&mut server, &cluster).await;
    let status = server
        .expect(Method::PATCH, STATUS, status_reply(&sp))
        .await
        .body;
    within(task).await.unwrap().unwrap().unwrap();
    assert_eq!(condition(&status, "Ready")["status"], "True", "{status}");
    assert_eq!(status["status"]["stagesReady"], "1/1");

    // Observed, 2 of 4 available: still Ready (the new pods are of the same revision).
    let sp = with_status(&sp, &status);
    cluster.deployments[0]["status"] = json!({
        "observedGeneration": 2, "replicas": 4, "updatedReplicas": 4, "readyReplicas": 2,
        "availableReplicas": 2,
    });
    let task = tokio::spawn(reconcile(Arc::new(sp.clone()), ctx.clone()));
    lists(&mut server, &cluster).await;
    server.expect_silence(Duration::from_millis(200)).await;
    within(task).await.unwrap().unwrap().unwrap();
}

#[tokio::test]
async fn an_edited_or_deleted_child_is_repaired_on_the_next_pass() {
    let sp = pipeline(&["nlu"]);
    let (cluster, status) = first_pass(&sp).await;
    let sp = with_status(&sp, &status);
    let rendered_image =
        cluster.deployments[0]["spec"]["template"]["spec"]["containers"][0]["image"].clone();
    let mut drifted = cluster.clone();
    // Someone edits the worker image in place (the applied-hash annotation survives) and
    // deletes the metrics Service.
    drifted.deployments[0]["spec"]["template"]["spec"]["containers"][0]["image"] = json!("evil:1");
    drifted.services.clear();
    let sp2 = sp.clone();
    scenario(sp, |mut server| async move {
        lists(&mut server, &drifted).await;
        server
            .fail(
                Method::GET,
                &format!("{SVC}/chat-nlu-bb263a2d-metrics"),
                404,
            )
            .await;
        let dep = server
            .expect(Method::PATCH, &format!("{DEP}/chat-nlu-bb263a2d"), echo)
            .await;
        assert_eq!(
            dep.body["spec"]["template"]["spec"]["containers"][0]["image"],
            rendered_image
        );
        assert!(dep.query_has("force=true"));
        server
            .expect(
                Method::PATCH,
                &format!("{SVC}/chat-nlu-bb263a2d-metrics"),
                echo,
            )
            .await;
        // The repaired stage rolls again: the status still says Progressing, as before.
        let _ = sp2;
        server
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_name_held_by_another_object_is_a_conflict_and_never_taken_over() {
    let sp = pipeline(&["nlu", "llm"]);
    let sp2 = sp.clone();
    scenario(sp, |mut server| async move {
        lists(&mut server, &Cluster::default()).await;
        // chat-nlu-bb263a2d's ConfigMap exists without the pipeline's label or owner (another
        // pipeline `chat-nlu-bb263a2d`'s, or a hand-made one).
        server
            .expect(Method::GET, &format!("{CM}/chat-nlu-bb263a2d"), |_| {
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "chat-nlu-bb263a2d", "namespace": "shop"}, "data": {"x": "y"}})
            })
            .await;
        for path in [
            format!("{DEP}/chat-nlu-bb263a2d"),
            format!("{SVC}/chat-nlu-bb263a2d-metrics"),
            format!("{PDB}/chat-nlu-bb263a2d"),
        ] {
            server.fail(Method::GET, &path, 404).await;
        }
        // Nothing of stage nlu is written; stage llm is.
        for path in [
            format!("{CM}/chat-llm-8dcd942b"),
            format!("{DEP}/chat-llm-8dcd942b"),
            format!("{SVC}/chat-llm-8dcd942b-metrics"),
            format!("{PDB}/chat-llm-8dcd942b"),
        ] {
            server.fail(Method::GET, &path, 404).await;
        }
        for path in [
            format!("{CM}/chat-llm-8dcd942b"),
            format!("{DEP}/chat-llm-8dcd942b"),
            format!("{SVC}/chat-llm-8dcd942b-metrics"),
            format!("{PDB}/chat-llm-8dcd942b"),
        ] {
            server.expect(Method::PATCH, &path, echo).await;
        }
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        let degraded = condition(&status.body, "Degraded");
        assert_eq!(degraded["status"], "True");
        assert_eq!(degraded["reason"], "NameConflict");
        let message = degraded["message"].as_str().unwrap();
        assert!(
            message.starts_with("ConfigMap chat-nlu-bb263a2d not created by this SessionPipeline"),
            "{message}"
        );
        assert!(
            status.body["status"]["observedGeneration"].is_null(),
            "not a successful reconcile: {}",
            status.body
        );
        let event = server.expect(Method::POST, EVENTS, echo).await;
        assert_eq!(event.body["reason"], "NameConflict");
        server
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_topic_failure_still_writes_the_stages_status_and_keeps_the_observed_generation() {
    let mut sp = pipeline(&["nlu"]);
    let (mut cluster, status) = first_pass(&sp).await;
    cluster.deployments = cluster.deployments.into_iter().map(ready).collect();
    sp = with_status(&sp, &status);
    sp.metadata.generation = Some(2);
    sp.spec.topics.create = true;
    // librdkafka refuses the client at once: the topic step fails without a broker timeout.
    kafka_property(&mut sp, "no.such.property", "1");
    let sp2 = sp.clone();
    let result = scenario(sp, |mut server| async move {
        lists(&mut server, &cluster).await;
        // The new property is in the worker config: ConfigMap and Deployment change.
        server
            .expect(Method::PATCH, &format!("{CM}/chat-nlu-bb263a2d"), echo)
            .await;
        server
            .expect(Method::PATCH, &format!("{DEP}/chat-nlu-bb263a2d"), echo)
            .await;
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        let degraded = condition(&status.body, "Degraded");
        assert_eq!(degraded["reason"], "TopicsFailed");
        assert!(
            degraded["message"]
                .as_str()
                .unwrap()
                .starts_with("creating topics:"),
            "{degraded}"
        );
        assert_eq!(
            status.body["status"]["stagesReady"], "0/1",
            "rolled: not ready"
        );
        assert_eq!(
            status.body["status"]["observedGeneration"], 1,
            "not advanced"
        );
        let event = server.expect(Method::POST, EVENTS, echo).await;
        assert_eq!(event.body["reason"], "TopicsFailed");
        server
    })
    .await;
    assert!(matches!(result, Err(Error::Reported(_))), "{result:?}");
}

const SECRET: &str = "/api/v1/namespaces/shop/secrets/kafka-user";

fn with_sasl(mut sp: SessionPipeline) -> SessionPipeline {
    sp.spec.kafka.sasl = Some(crate::crd::SaslSpec {
        mechanism: crate::crd::SaslMechanism::ScramSha512,
        secret_name: "kafka-user".into(),
        username_key: "username".into(),
        password_key: "password".into(),
        allow_plain_without_tls: false,
    });
    sp
}

fn secret(resource_version: &str, labelled: bool) -> Value {
    let labels = if labelled {
        json!({ "sessionflow.io/credentials": "true" })
    } else {
        json!({})
    };
    json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": { "name": "kafka-user", "namespace": "shop",
                      "resourceVersion": resource_version, "labels": labels },
        "data": { "username": "dXNlcg==", "password": "cGFzcw==" },
    })
}

#[tokio::test]
async fn a_rotated_secret_rolls_the_stage_and_nothing_else() {
    let sp = with_sasl(pipeline(&["nlu"]));
    let applied = Arc::new(std::sync::Mutex::new((Cluster::default(), Value::Null)));
    let (out, sp1) = (applied.clone(), sp.clone());
    scenario(sp.clone(), |mut server| async move {
        server
            .expect(Method::GET, SECRET, |_| secret("41", true))
            .await;
        lists(&mut server, &Cluster::default()).await;
        for path in [
            format!("{CM}/chat-nlu-bb263a2d"),
            format!("{DEP}/chat-nlu-bb263a2d"),
            format!("{SVC}/chat-nlu-bb263a2d-metrics"),
            format!("{PDB}/chat-nlu-bb263a2d"),
        ] {
            server.fail(Method::GET, &path, 404).await;
        }
        let mut c = Cluster::default();
        c.config_maps.push(
            server
                .expect(Method::PATCH, &format!("{CM}/chat-nlu-bb263a2d"), echo)
                .await
                .body,
        );
        c.deployments.push(
            server
                .expect(Method::PATCH, &format!("{DEP}/chat-nlu-bb263a2d"), echo)
                .await
                .body,
        );
        c.services.push(
            server
                .expect(
                    Method::PATCH,
                    &format!("{SVC}/chat-nlu-bb263a2d-metrics"),
                    echo,
                )
                .await
                .body,
        );
        c.budgets.push(
            server
                .expect(Method::PATCH, &format!("{PDB}/chat-nlu-bb263a2d"), echo)
                .await
                .body,
        );
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&sp1))
            .await
            .body;
        *out.lock().unwrap() = (c, status);
        server
    })
    .await
    .unwrap();
    let (cluster, status) = applied.lock().unwrap().clone();
    let sp = with_status(&sp, &status);
    let annotation =
        |d: &Value| d["spec"]["template"]["metadata"]["annotations"][render::SECRETS_HASH].clone();
    let before = annotation(&cluster.deployments[0]);
    assert!(
        before.is_string(),
        "the pod template carries the Secrets' hash"
    );

    // The same version: nothing to write.
    let c = cluster.clone();
    scenario(sp.clone(), |mut server| async move {
        server
            .expect(Method::GET, SECRET, |_| secret("41", true))
            .await;
        lists(&mut server, &c).await;
        server
    })
    .await
    .unwrap();

    // Rotated: the Deployment's pod template changes (the pods roll); the config does not.
    scenario(sp, |mut server| async move {
        server
            .expect(Method::GET, SECRET, |_| secret("97", true))
            .await;
        lists(&mut server, &cluster).await;
        let dep = server
            .expect(Method::PATCH, &format!("{DEP}/chat-nlu-bb263a2d"), echo)
            .await;
        let after = annotation(&dep.body);
        assert!(after.is_string() && after != before, "{before} → {after}");
        server
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_secret_that_did_not_opt_in_is_not_used() {
    let sp = with_sasl(pipeline(&["nlu"]));
    let sp2 = sp.clone();
    let result = scenario(sp, |mut server| async move {
        server
            .expect(Method::GET, SECRET, |_| secret("41", false))
            .await;
        let status = server
            .expect(Method::PATCH, STATUS, status_reply(&sp2))
            .await;
        let degraded = condition(&status.body, "Degraded");
        assert_eq!(degraded["reason"], "ReconcileFailed");
        let message = degraded["message"].as_str().unwrap();
        assert!(
            message
                .contains("secret kafka-user is not labelled sessionflow.io/credentials: \"true\""),
            "{message}"
        );
        server.expect(Method::POST, EVENTS, echo).await;
        server
    })
    .await;
    assert!(matches!(result, Err(Error::Credentials(_))), "{result:?}");
}

/// Leader election: a standby's reconcile makes no API call at all (and waits for a change,
/// which gaining the lease supplies); the same reconcile on the leader does its work.
#[tokio::test]
async fn only_the_leader_reconciles() {
    let (switch, leadership) = crate::leader::Leadership::channel(false);
    let (client, mut server) = mock_client();
    let ctx = Arc::new(plain_context(client).with_leadership(leadership));
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

/// Objects under the names an older operator rendered (`<pipeline>-<stage>`, no hash) belong
/// to a stage still in the spec: the pass applies the new names and deletes the old objects,
/// without a StageRemoved event.
#[tokio::test]
async fn objects_under_the_names_of_an_older_operator_are_replaced() {
    let (mut cluster, status) = first_pass(&pipeline(&["nlu"])).await;
    let rename = |items: &mut Vec<Value>, old: &str| {
        for item in items.iter_mut() {
            item["metadata"]["name"] = json!(old);
        }
    };
    rename(&mut cluster.config_maps, "chat-nlu");
    rename(&mut cluster.deployments, "chat-nlu");
    rename(&mut cluster.services, "chat-nlu-metrics");
    rename(&mut cluster.budgets, "chat-nlu");
    let sp = with_status(&pipeline(&["nlu"]), &status);
    scenario(sp, |mut server| async move {
        lists(&mut server, &cluster).await;
        let new = crate::render::stage_object_name("chat", "nlu");
        let new_svc = crate::render::service_name("chat", "nlu");
        for path in [
            format!("{CM}/{new}"),
            format!("{DEP}/{new}"),
            format!("{SVC}/{new_svc}"),
            format!("{PDB}/{new}"),
        ] {
            server.fail(Method::GET, &path, 404).await;
        }
        for path in [
            format!("{CM}/{new}"),
            format!("{DEP}/{new}"),
            format!("{SVC}/{new_svc}"),
            format!("{PDB}/{new}"),
        ] {
            server.expect(Method::PATCH, &path, echo).await;
        }
        for path in [
            format!("{CM}/chat-nlu"),
            format!("{DEP}/chat-nlu"),
            format!("{SVC}/chat-nlu-metrics"),
            format!("{PDB}/chat-nlu"),
        ] {
            server.expect(Method::DELETE, &path, echo_deleted).await;
        }
        // No StageRemoved event, and the status did not change: nothing more is sent.
        server
    })
    .await
    .unwrap();
}
