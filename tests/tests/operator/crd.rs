//! The CRD against a real Kubernetes API server: apiextensions-apiserver over etcd, started by
//! `scripts/apiserver.sh` (`make test` and `.ci/run` do it and export
//! `SESSIONFLOW_KUBECONFIG`). It enforces the OpenAPI schema, the CEL rules, defaults and the
//! status subresource exactly as a cluster would. Where that server could not be built, these
//! tests print SKIPPED and pass, unless `SESSIONFLOW_REQUIRE_APISERVER=1` (CI sets it when the
//! build succeeded).
//!
//! That server has no namespaces API (and no admission for them), so each test works in a
//! namespace of its own without creating it.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config};
use serde_json::{json, Value};
use sessionflow_operator::crd::{SessionPipeline, CRD_NAME};
use sessionflow_tests::unique;
use tokio::sync::OnceCell;

const MANAGER: &str = "sessionflow-tests";

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

fn yaml(text: &str) -> Value {
    serde_saphyr::from_str(text).expect("valid YAML")
}

/// A client of the test API server with the CRD installed, or `None` (SKIPPED). Each test
/// gets a client of its own: a client lives on the runtime that made it, and every test has
/// its own runtime.
pub async fn cluster() -> Option<Client> {
    static INSTALLED: OnceCell<()> = OnceCell::const_new();
    let Ok(path) = std::env::var("SESSIONFLOW_KUBECONFIG") else {
        assert!(
            std::env::var("SESSIONFLOW_REQUIRE_APISERVER").as_deref() != Ok("1"),
            "SESSIONFLOW_REQUIRE_APISERVER=1 but SESSIONFLOW_KUBECONFIG is not set"
        );
        eprintln!(
            "\n*** SKIPPED: CRD tests need a Kubernetes API server: run \
             `scripts/apiserver.sh install && scripts/apiserver.sh start` and export \
             SESSIONFLOW_KUBECONFIG=$(scripts/apiserver.sh kubeconfig) ***\n"
        );
        return None;
    };
    let kubeconfig = Kubeconfig::read_from(&path).expect("kubeconfig");
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig usable");
    let client = Client::try_from(config).expect("client");
    INSTALLED.get_or_init(|| install_crd(&client)).await;
    Some(client)
}

async fn install_crd(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd: CustomResourceDefinition =
        serde_json::from_value(yaml(&repo_file("crds/sessionpipeline.yaml"))).unwrap();
    crds.patch(
        CRD_NAME,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("the API server accepts the CRD");
    tokio::time::timeout(
        Duration::from_secs(30),
        await_condition(crds, CRD_NAME, conditions::is_crd_established()),
    )
    .await
    .expect("CRD established in time")
    .expect("watch");
}

fn pipelines(client: &Client, namespace: &str) -> Api<SessionPipeline> {
    Api::namespaced(client.clone(), namespace)
}

/// Creates `resource` as raw JSON (so the API server, not the Rust types, judges it) and
/// returns the server's verdict.
async fn create(
    client: &Client,
    namespace: &str,
    resource: &Value,
) -> Result<SessionPipeline, kube::Error> {
    let mut resource = resource.clone();
    resource["metadata"]["namespace"] = json!(namespace);
    let raw: DynamicObject = serde_json::from_value(resource).expect("an object with metadata");
    let kind = ApiResource::erase::<SessionPipeline>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &kind);
    let created = api.create(&PostParams::default(), &raw).await?;
    Ok(created
        .try_parse()
        .expect("what the server stores matches the Rust types"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_pipeline_is_accepted_and_defaulted() {
    let Some(client) = cluster().await else {
        return;
    };
    let namespace = unique("crd-examples");
    let mut names = Vec::new();
    for file in [
        "one-stage.yaml",
        "conversational.yaml",
        "secure.yaml",
        "sidecar.yaml",
    ] {
        let example = yaml(&repo_file(&format!("examples/k8s/{file}")));
        let created = create(&client, &namespace, &example)
            .await
            .unwrap_or_else(|e| panic!("examples/k8s/{file} rejected: {e}"));
        names.push(created.metadata.name.clone().unwrap());
        // Defaults come from the schema: an example that sets no replicas gets 1..1.
        for stage in &created.spec.stages {
            assert!(stage.replicas.min <= stage.replicas.max);
            assert!(stage.autoscaling.lag_per_replica >= 1);
        }
    }
    let minimal = pipelines(&client, &namespace).get("minimal").await.unwrap();
    let stage = &minimal.spec.stages[0];
    assert_eq!((stage.replicas.min, stage.replicas.max), (1, 1));
    assert_eq!(stage.autoscaling.scale_down_stabilization_secs, 300);
    assert_eq!(names, ["minimal", "assistant", "secure", "helpdesk"]);
    // The pod template survives the schema (nothing pruned): sidecars, probes, budgets.
    let helpdesk = pipelines(&client, &namespace)
        .get("helpdesk")
        .await
        .unwrap();
    let stage = &helpdesk.spec.stages[0];
    let template = stage.template.as_ref().expect("template kept");
    assert_eq!(template.sidecars[0].name, "handler");
    assert!(template.sidecars[0].startup_probe.is_some());
    assert_eq!(
        template.service_account_name.as_deref(),
        Some("helpdesk-reply")
    );
    let budget = stage.disruption_budget.as_ref().unwrap();
    assert!(budget.enabled, "defaulted");
    let pipeline_wide = helpdesk.spec.worker_template.as_ref().unwrap();
    assert_eq!(pipeline_wide.tolerations.len(), 1);
    assert_eq!(pipeline_wide.topology_spread_constraints.len(), 1);
}

/// One valid pipeline to break one field at a time.
pub fn valid() -> Value {
    yaml(
        r#"
apiVersion: sessionflow.io/v1alpha1
kind: SessionPipeline
metadata: { name: p }
spec:
  kafka: { bootstrapServers: "kafka:9092" }
  topics:
    dlq: dead
    declared:
      - { name: in, partitions: 4 }
      - { name: mid, partitions: 4 }
      - { name: out, partitions: 4 }
      - { name: dead, partitions: 1 }
  stages:
    - { name: a, input: in, output: mid, handler: { builtin: {} } }
    - { name: b, input: mid, output: out, handler: { http: { url: "http://b:8080/", timeoutMs: 500 } } }
"#,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_pipelines_are_rejected_with_a_message_naming_the_field() {
    let Some(client) = cluster().await else {
        return;
    };
    let namespace = unique("crd-invalid");
    assert!(
        create(&client, &namespace, &valid()).await.is_ok(),
        "the base case is valid"
    );

    type Break = fn(&mut Value);
    let cases: &[(&str, Break, &[&str])] = &[
        (
            "duplicate stage",
            |v| v["spec"]["stages"][1]["name"] = json!("a"),
            &["spec.stages", "stage names must be unique"],
        ),
        (
            "output is input",
            |v| v["spec"]["stages"][0]["output"] = json!("in"),
            &["spec.stages[0].output", "must not be its own input"],
        ),
        (
            "min > max",
            |v| v["spec"]["stages"][0]["replicas"] = json!({"min": 3, "max": 2}),
            &[
                "spec.stages[0].replicas",
                "replicas.min must not exceed replicas.max",
            ],
        ),
        (
            "undeclared topic",
            |v| v["spec"]["stages"][1]["output"] = json!("elsewhere"),
            &["spec.stages", "must be listed in topics.declared"],
        ),
        (
            "dlq as input",
            |v| v["spec"]["stages"][0]["input"] = json!("dead"),
            &["spec.topics.dlq", "cannot be a stage's input or output"],
        ),
        (
            "undeclared dlq",
            |v| v["spec"]["topics"]["dlq"] = json!("nowhere"),
            &["spec.topics.dlq", "topics.dlq must be listed"],
        ),
        (
            "inline password",
            |v| v["spec"]["kafka"]["properties"] = json!({"sasl.password": "hunter2"}),
            &["spec.kafka.properties", "credentials must not be inline"],
        ),
        (
            "owned property",
            |v| v["spec"]["kafka"]["properties"] = json!({"group.id": "mine"}),
            &["spec.kafka.properties", "set by sessionflow"],
        ),
        (
            "bad stage name",
            |v| v["spec"]["stages"][0]["name"] = json!("Stage_A"),
            &["spec.stages[0].name", "should match"],
        ),
        (
            "zero timeout",
            |v| v["spec"]["stages"][1]["handler"]["http"]["timeoutMs"] = json!(0),
            &[
                "spec.stages[1].handler.http.timeoutMs",
                "greater than or equal to 1",
            ],
        ),
        (
            "zero partitions",
            |v| v["spec"]["topics"]["declared"][0]["partitions"] = json!(0),
            &[
                "spec.topics.declared[0].partitions",
                "greater than or equal to 1",
            ],
        ),
        (
            "half mTLS",
            |v| v["spec"]["kafka"]["tls"] = json!({"secretName": "t", "certKey": "tls.crt"}),
            &["spec.kafka.tls", "tls.certKey and tls.keyKey go together"],
        ),
        (
            "header without name",
            |v| v["spec"]["session"] = json!({"from": "header"}),
            &["spec.session", "session.name is required"],
        ),
        (
            "no stages",
            |v| v["spec"]["stages"] = json!([]),
            &["spec.stages", "at least 1"],
        ),
        (
            "worker as root",
            |v| v["spec"]["workerTemplate"] = json!({"securityContext": {"runAsNonRoot": false}}),
            &[
                "spec.workerTemplate.securityContext",
                "workers run as non-root",
            ],
        ),
        (
            "stage runs as uid 0",
            |v| v["spec"]["stages"][0]["template"] = json!({"securityContext": {"runAsUser": 0}}),
            &[
                "spec.stages[0].template.securityContext",
                "runAsUser cannot be 0",
            ],
        ),
        (
            "privileged",
            |v| {
                v["spec"]["stages"][1]["template"] =
                    json!({"securityContext": {"privileged": true}})
            },
            &[
                "spec.stages[1].template.securityContext",
                "privileged containers and privilege escalation are not allowed",
            ],
        ),
        (
            "negative budget",
            |v| v["spec"]["stages"][0]["disruptionBudget"] = json!({"maxUnavailable": -1}),
            &[
                "spec.stages[0].disruptionBudget.maxUnavailable",
                "a number ≥ 0 or a percentage",
            ],
        ),
        (
            "budget not a percentage",
            |v| v["spec"]["disruptionBudget"] = json!({"maxUnavailable": "most"}),
            &[
                "spec.disruptionBudget.maxUnavailable",
                "a number ≥ 0 or a percentage",
            ],
        ),
        (
            "name too long",
            |v| v["metadata"]["name"] = json!("p".repeat(64)),
            &["metadata.name must not exceed 63 characters"],
        ),
    ];
    let mut failures = Vec::new();
    for (i, (what, break_it, expected)) in cases.iter().enumerate() {
        let mut v = valid();
        if v["metadata"]["name"] == "p" {
            v["metadata"]["name"] = json!(format!("p{i}"));
        }
        break_it(&mut v);
        match create(&client, &namespace, &v).await {
            Ok(_) => failures.push(format!("{what}: accepted")),
            Err(kube::Error::Api(e)) => {
                let missing: Vec<&&str> = expected
                    .iter()
                    .filter(|s| !e.message.contains(**s))
                    .collect();
                if e.code != 422 || !missing.is_empty() {
                    failures.push(format!(
                        "{what}: {} {:?} lacks {missing:?}",
                        e.code, e.message
                    ));
                }
            }
            Err(e) => failures.push(format!("{what}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_is_a_subresource() {
    let Some(client) = cluster().await else {
        return;
    };
    let namespace = unique("crd-status");
    let api = pipelines(&client, &namespace);
    let created = create(&client, &namespace, &valid()).await.unwrap();
    let generation = created.metadata.generation;

    let status = json!({ "status": {
        "observedGeneration": generation,
        "stagesReady": "1/2",
        "lag": 1234,
        "conditions": [{
            "type": "Ready", "status": "False", "reason": "StagesNotReady",
            "message": "1/2 stages ready", "lastTransitionTime": "2026-11-29T12:00:00Z",
        }],
        "stages": [{ "name": "a", "desiredReplicas": 3, "readyReplicas": 1, "lag": 2000,
                     "effectiveLag": 1234, "partitions": 4 }],
    }});
    api.patch_status("p", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("status patch accepted");
    let read = api.get("p").await.unwrap();
    let s = read.status.expect("status stored");
    assert_eq!(s.stages_ready.as_deref(), Some("1/2"));
    assert_eq!(s.lag, Some(1234));
    assert_eq!(s.stages[0].desired_replicas, Some(3));
    assert_eq!(s.conditions[0].reason, "StagesNotReady");
    assert_eq!(
        read.metadata.generation, generation,
        "status writes do not bump the generation"
    );

    // Through the main resource, status is ignored; a spec change bumps the generation.
    let spec_and_status = json!({
        "spec": { "stages": [
            { "name": "a", "input": "in", "output": "mid", "handler": { "builtin": {} },
              "replicas": { "min": 1, "max": 4 } },
            { "name": "b", "input": "mid", "output": "out", "handler": { "builtin": {} } },
        ]},
        "status": { "lag": 0 },
    });
    api.patch(
        "p",
        &PatchParams::default(),
        &Patch::Merge(&spec_and_status),
    )
    .await
    .unwrap();
    let read = api.get("p").await.unwrap();
    assert_eq!(read.status.unwrap().lag, Some(1234));
    assert_eq!(read.spec.stages[0].replicas.max, 4);
    assert!(read.metadata.generation > generation);
}

/// `autoscaling.mode` (default `lag`, or `external`) and `scaleUpMaxStep`, on the real API
/// server: the server fills the mode in, refuses an unknown mode and a zero step, and refuses a
/// step in external mode (where it would do nothing) with the field named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autoscaling_modes_are_defaulted_and_checked() {
    let Some(client) = cluster().await else {
        return;
    };
    let namespace = unique("crd-autoscaling");
    let mut v = valid();
    v["metadata"]["name"] = json!("modes");
    v["spec"]["stages"][0]["autoscaling"] = json!({ "mode": "external" });
    v["spec"]["stages"][1]["autoscaling"] = json!({ "lagPerReplica": 500, "scaleUpMaxStep": 2 });
    create(&client, &namespace, &v)
        .await
        .expect("external mode, and a step in lag mode, are accepted");
    let kind = ApiResource::erase::<SessionPipeline>(&());
    let raw: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &kind);
    let stored = raw.get("modes").await.unwrap().data;
    assert_eq!(
        stored["spec"]["stages"][0]["autoscaling"]["mode"],
        "external"
    );
    assert_eq!(
        stored["spec"]["stages"][1]["autoscaling"]["mode"], "lag",
        "the server defaults the mode"
    );
    assert_eq!(
        stored["spec"]["stages"][1]["autoscaling"]["scaleUpMaxStep"],
        2
    );

    type Break = fn(&mut Value);
    let cases: &[(&str, Break, &[&str])] = &[
        (
            "unknown mode",
            |v| v["spec"]["stages"][0]["autoscaling"] = json!({ "mode": "hpa" }),
            &["spec.stages[0].autoscaling.mode", "Unsupported value"],
        ),
        (
            "zero step",
            |v| v["spec"]["stages"][0]["autoscaling"] = json!({ "scaleUpMaxStep": 0 }),
            &[
                "spec.stages[0].autoscaling.scaleUpMaxStep",
                "greater than or equal to 1",
            ],
        ),
        (
            "step in external mode",
            |v| {
                v["spec"]["stages"][1]["autoscaling"] =
                    json!({ "mode": "external", "scaleUpMaxStep": 3 })
            },
            &[
                "spec.stages[1].autoscaling.scaleUpMaxStep",
                "applies to mode lag only",
            ],
        ),
    ];
    let mut failures = Vec::new();
    for (i, (what, break_it, expected)) in cases.iter().enumerate() {
        let mut v = valid();
        v["metadata"]["name"] = json!(format!("modes{i}"));
        break_it(&mut v);
        match create(&client, &namespace, &v).await {
            Ok(_) => failures.push(format!("{what}: accepted")),
            Err(kube::Error::Api(e)) => {
                let missing: Vec<&&str> = expected
                    .iter()
                    .filter(|s| !e.message.contains(**s))
                    .collect();
                if e.code != 422 || !missing.is_empty() {
                    failures.push(format!(
                        "{what}: {} {:?} lacks {missing:?}",
                        e.code, e.message
                    ));
                }
            }
            Err(e) => failures.push(format!("{what}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
