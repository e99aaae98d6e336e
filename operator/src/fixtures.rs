//! Test fixtures: sample pipelines, a scripted stand-in for the Kubernetes API server
//! (kube-rs's ApiServerVerifier pattern, as in controller-rs), and the harnesses built on it
//! that more than one test file uses: a reconciler [`context`], a [`scaler_of`] a store of
//! pipelines, a Kafka cluster with lag ([`cluster_with_lag`]), the Deployment the scaler reads.
//!
//! The client under test talks to a `tower_test` mock service; the test answers each request
//! in turn, checking method and path, and sees the request body. A request the script does not
//! expect fails the test with its method and path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Method, Request, Response};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::client::Body;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher;
use kube::Client;
use rdkafka::config::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, Producer};
use serde_json::{json, Value};
use sessionflow_worker::config::{
    BuiltinHandlerConfig, HandlerConfig, RebalanceConfig, StageSettings,
};
use tokio::sync::Notify;

use crate::crd::{
    AutoscalingSpec, KafkaSpec, ReplicasSpec, SessionPipeline, SessionPipelineSpec, StageSpec,
    TopicSpec, TopicsSpec,
};
use crate::liveness::PassClock;
use crate::metrics::Metrics;
use crate::reconciler::Context;
use crate::render::Defaults;
use crate::scaler::Scaler;

pub const NAMESPACE: &str = "shop";
pub const PIPELINE: &str = "chat";
pub const UID: &str = "6f1c2a40-0000-4000-8000-000000000001";

/// A pipeline `chat` in namespace `shop` whose stages are chained: stage i reads `t{i}` and
/// writes `t{i+1}`.
pub fn pipeline(stages: &[&str]) -> SessionPipeline {
    let mut declared: Vec<TopicSpec> = (0..=stages.len())
        .map(|i| TopicSpec {
            name: format!("t{i}"),
            partitions: 8,
            replication_factor: None,
        })
        .collect();
    declared.push(TopicSpec {
        name: "dlq".into(),
        partitions: 1,
        replication_factor: None,
    });
    let stages = stages
        .iter()
        .enumerate()
        .map(|(i, name)| stage(name, &format!("t{i}"), Some(&format!("t{}", i + 1))))
        .collect();
    let mut sp = SessionPipeline::new(
        PIPELINE,
        SessionPipelineSpec {
            kafka: KafkaSpec {
                bootstrap_servers: "kafka:9092".into(),
                properties: Default::default(),
                sasl: None,
                tls: None,
            },
            topics: TopicsSpec {
                create: false,
                dlq: "dlq".into(),
                declared,
            },
            stages,
            worker_image: None,
            defaults: StageSettings::default(),
            worker_template: None,
            disruption_budget: None,
        },
    );
    sp.metadata = ObjectMeta {
        name: Some(PIPELINE.into()),
        namespace: Some(NAMESPACE.into()),
        uid: Some(UID.into()),
        generation: Some(1),
        ..ObjectMeta::default()
    };
    sp
}

pub fn stage(name: &str, input: &str, output: Option<&str>) -> StageSpec {
    StageSpec {
        name: name.into(),
        input: input.into(),
        output: output.map(Into::into),
        handler: HandlerConfig::Builtin(BuiltinHandlerConfig::default()),
        image: None,
        resources: None,
        replicas: ReplicasSpec::default(),
        autoscaling: AutoscalingSpec::default(),
        settings: StageSettings::default(),
        rebalance: None,
        dispatchers: None,
        dispatcher_capacity: None,
        session_idle_ms: None,
        max_in_flight_per_partition: None,
        prefetch_kbytes: None,
        prefetch_records: None,
        lag_interval_ms: None,
        otlp_endpoint: None,
        template: None,
        disruption_budget: None,
    }
}

/// A stage's `rebalance` with this drain timeout (default strategy).
pub fn rebalance(drain_timeout_ms: u64) -> RebalanceConfig {
    RebalanceConfig {
        drain_timeout_ms,
        ..RebalanceConfig::default()
    }
}

/// Sets a librdkafka property of the pipeline (e.g. `max.poll.interval.ms`).
pub fn kafka_property(sp: &mut SessionPipeline, key: &str, value: &str) {
    sp.spec.kafka.properties.insert(key.into(), value.into());
}

/// One request as the API server saw it.
#[derive(Debug)]
pub struct Seen {
    pub method: Method,
    /// Path and query, e.g. `/api/v1/namespaces/shop/configmaps?&labelSelector=…`.
    pub uri: String,
    pub body: Value,
}

impl Seen {
    pub fn query_has(&self, part: &str) -> bool {
        self.uri
            .split_once('?')
            .is_some_and(|(_, q)| q.contains(part))
    }
}

/// The test's side of the mock API server.
pub struct ApiServer {
    handle: tower_test::mock::Handle<Request<Body>, Response<Body>>,
}

/// A client wired to a scripted API server.
pub fn mock_client() -> (Client, ApiServer) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, NAMESPACE), ApiServer { handle })
}

impl ApiServer {
    /// Waits (≤ 5 s) for the next request, checks its method and that its path (before `?`)
    /// is `path`, and answers `reply` (JSON, status 200); returns the request.
    pub async fn expect(
        &mut self,
        method: Method,
        path: &str,
        reply: impl FnOnce(&Seen) -> Value,
    ) -> Seen {
        let (request, respond) = self.next().await.unwrap_or_else(|| {
            panic!("expected {method} {path}, but the client sent nothing more")
        });
        let seen_req = seen_parts(request).await;
        assert_eq!(
            (&seen_req.method, seen_req.uri.split('?').next().unwrap()),
            (&method, path),
            "unexpected request (body {})",
            seen_req.body
        );
        let body = serde_json::to_vec(&reply(&seen_req)).unwrap();
        respond.send_response(
            Response::builder()
                .status(200)
                .body(Body::from(body))
                .unwrap(),
        );
        seen_req
    }

    /// Answers the next request with an API error of `code`.
    pub async fn fail(&mut self, method: Method, path: &str, code: u16) -> Seen {
        let (request, respond) = self.next().await.expect("a request");
        let seen = seen_parts(request).await;
        assert_eq!(
            (&seen.method, seen.uri.split('?').next().unwrap()),
            (&method, path)
        );
        let reason = match code {
            404 => "NotFound",
            409 => "AlreadyExists",
            _ => "InternalError",
        };
        let status = json!({
            "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "message": "injected failure", "reason": reason, "code": code,
        });
        respond.send_response(
            Response::builder()
                .status(code)
                .body(Body::from(serde_json::to_vec(&status).unwrap()))
                .unwrap(),
        );
        seen
    }

    /// The next request, if one comes within a short time.
    async fn next(
        &mut self,
    ) -> Option<(
        Request<Body>,
        tower_test::mock::SendResponse<Response<Body>>,
    )> {
        tokio::time::timeout(Duration::from_secs(5), self.handle.next_request())
            .await
            .ok()
            .flatten()
    }

    /// Answers every request with `respond` (status 200) until none comes for `quiet`;
    /// returns what it saw.
    pub async fn answer_all(
        mut self,
        quiet: Duration,
        respond: impl Fn(&Seen) -> Value,
    ) -> Vec<Seen> {
        let mut seen = Vec::new();
        while let Ok(Some((request, reply))) =
            tokio::time::timeout(quiet, self.handle.next_request()).await
        {
            let s = seen_parts(request).await;
            let body = serde_json::to_vec(&respond(&s)).unwrap();
            reply.send_response(
                Response::builder()
                    .status(200)
                    .body(Body::from(body))
                    .unwrap(),
            );
            seen.push(s);
        }
        seen
    }

    /// Fails the test if the client sends anything else within `wait`.
    pub async fn expect_silence(&mut self, wait: Duration) {
        if let Ok(Some((request, _))) = tokio::time::timeout(wait, self.handle.next_request()).await
        {
            panic!("unexpected request: {} {}", request.method(), request.uri());
        }
    }
}

async fn seen_parts(request: Request<Body>) -> Seen {
    let method = request.method().clone();
    let uri = request.uri().to_string();
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
    };
    Seen { method, uri, body }
}

/// A list reply of `kind` holding `items`.
pub fn list(kind: &str, api_version: &str, items: &[Value]) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": format!("{kind}List"),
        "metadata": { "resourceVersion": "1" },
        "items": items,
    })
}

/// The reporter the operator's events are published under.
pub fn reporter() -> Reporter {
    Reporter {
        controller: "sessionflow-operator".into(),
        instance: None,
    }
}

/// A reconciler context on `client` with the test defaults (worker image
/// `sessionflow-worker:test`, JSON logs, any image allowed).
pub fn context(client: Client) -> Arc<Context> {
    Arc::new(plain_context(client))
}

/// [`context`] before it is shared, for a test to set more (e.g. its leadership).
pub fn plain_context(client: Client) -> Context {
    Context::new(
        client,
        Defaults {
            worker_image: "sessionflow-worker:test".into(),
            log_format: "json".into(),
            allowed_images: Vec::new(),
        },
        Metrics::new(),
        reporter(),
    )
}

/// A scaler (interval 15 s) over a store holding `pipelines`, the API server it talks to, the
/// store's writer (to show the next pass a changed pipeline) and the scaler's metrics.
pub fn scaler_of(
    pipelines: &[SessionPipeline],
) -> (Scaler, ApiServer, Writer<SessionPipeline>, Metrics) {
    let (store, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Init);
    for sp in pipelines {
        writer.apply_watcher_event(&watcher::Event::InitApply(sp.clone()));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    let (client, server) = mock_client();
    let recorder = Recorder::new(client.clone(), reporter());
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

/// A mock Kafka cluster (librdkafka's, in process) whose topic `topic` of `partitions`
/// partitions holds `records` records nobody consumed.
pub fn cluster_with_lag(
    topic: &str,
    partitions: i32,
    records: usize,
) -> MockCluster<'static, DefaultProducerContext> {
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

/// Deployment `name` in namespace `shop` as the API server returns it: `replicas` asked for,
/// `ready` of them ready.
pub fn deployment(name: &str, replicas: i32, ready: i32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": { "name": name, "namespace": NAMESPACE },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": "x" } },
            "template": { "spec": { "containers": [{ "name": "worker" }] } },
        },
        "status": { "replicas": replicas, "readyReplicas": ready },
    })
}

/// A pass clock that stands in for a wedged autoscaler loop: allowed 3 × 2 s + 1 s between
/// passes, and the last pass (the start) was 30 s ago, so it is unhealthy until a pass
/// completes.
pub fn stalled_pass_clock() -> Arc<PassClock> {
    let long_ago = Instant::now()
        .checked_sub(Duration::from_secs(30))
        .expect("the machine is up for more than 30 s");
    Arc::new(PassClock::new(
        Duration::from_secs(2),
        Duration::from_secs(1),
        long_ago,
    ))
}
