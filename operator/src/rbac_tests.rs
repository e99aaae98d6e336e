//! The chart grants every API call the operator makes: the operator's API sessions (reconciles
//! that create, update and remove, report errors and invalid specs; an autoscaling pass with
//! credentials from a Secret) are replayed against an answer-everything API server, and each
//! request is mapped to an RBAC (group, resource, verb) and looked up in
//! `charts/sessionflow/files/operator-rules.yaml`, the file the chart renders its
//! (Cluster)Role from. A new call the chart does not grant fails here, and so does a grant no
//! call uses (the rules stay exact).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::crd::{SaslMechanism, SaslSpec, SessionPipeline};
use crate::fixtures::{
    cluster_with_lag, context, list, mock_client, pipeline, scaler_of, Seen, UID,
};
use crate::reconciler::reconcile;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Rule {
    api_groups: Vec<String>,
    resources: Vec<String>,
    verbs: Vec<String>,
}

/// (API group, resource[/subresource], verb) of one request.
fn rbac_call(seen: &Seen) -> (String, String, String) {
    let path = seen.uri.split('?').next().unwrap();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (group, rest) = match parts[0] {
        "api" => (String::new(), &parts[2..]),
        "apis" => (parts[1].to_string(), &parts[3..]),
        other => panic!("unexpected path root {other} in {path}"),
    };
    let rest = if rest.first() == Some(&"namespaces") {
        &rest[2..]
    } else {
        rest
    };
    let resource = match rest {
        [resource] | [resource, _] => resource.to_string(),
        [resource, _, sub] => format!("{resource}/{sub}"),
        _ => panic!("unexpected path {path}"),
    };
    let named = rest.len() >= 2;
    let verb = match (&seen.method, named) {
        (&Method::GET, _) if seen.query_has("watch=true") => "watch",
        (&Method::GET, true) => "get",
        (&Method::GET, false) => "list",
        (&Method::POST, _) => "create",
        (&Method::PATCH, _) => "patch",
        (&Method::PUT, _) => "update",
        (&Method::DELETE, _) => "delete",
        (m, _) => panic!("unexpected method {m}"),
    };
    (group, resource, verb.to_string())
}

/// What an API server would answer, closely enough for the operator to go on.
fn answer(seen: &Seen, lists: &Value) -> Value {
    let path = seen.uri.split('?').next().unwrap();
    match seen.method {
        Method::GET if path.ends_with("/configmaps") => lists["configmaps"].clone(),
        Method::GET if path.ends_with("/deployments") => lists["deployments"].clone(),
        Method::GET if path.ends_with("/services") => lists["services"].clone(),
        Method::GET if path.ends_with("/poddisruptionbudgets") => lists["budgets"].clone(),
        Method::GET if path.ends_with("/pods") => list("Pod", "v1", &[]),
        Method::GET if path.contains("/deployments/") => json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": { "name": path.rsplit('/').next().unwrap(), "namespace": "shop",
                          "ownerReferences": [owner()] },
            "spec": { "replicas": 1, "selector": {}, "template": {} },
            "status": { "readyReplicas": 1 },
        }),
        // A name not in the pipeline's lists, looked up: the pipeline's own, without its label.
        Method::GET if path.contains("/configmaps/") => json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": path.rsplit('/').next().unwrap(), "namespace": "shop",
                          "ownerReferences": [owner()] },
        }),
        Method::GET if path.contains("/services/") => json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": { "name": path.rsplit('/').next().unwrap(), "namespace": "shop",
                          "ownerReferences": [owner()] },
        }),
        Method::GET if path.contains("/poddisruptionbudgets/") => json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": { "name": path.rsplit('/').next().unwrap(), "namespace": "shop",
                          "ownerReferences": [owner()] },
        }),
        Method::GET if path.contains("/secrets/") => json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": { "name": "kafka-user", "namespace": "shop",
                          "labels": { "sessionflow.io/credentials": "true" } },
            "data": { "username": "dXNlcg==", "password": "cGFzcw==" },
        }),
        Method::PATCH if path.ends_with("/status") => {
            let mut sp = serde_json::to_value(pipeline(&["a"])).unwrap();
            sp["status"] = seen.body["status"].clone();
            sp
        }
        Method::DELETE => {
            json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success"})
        }
        _ => seen.body.clone(),
    }
}

fn owner() -> Value {
    json!({ "apiVersion": "sessionflow.io/v1alpha1", "kind": "SessionPipeline",
            "name": "chat", "uid": UID, "controller": true })
}

/// Objects of a stage `old` that the pipeline owns (so a reconcile removes them).
fn stale_objects() -> Value {
    let meta = |name: &str| {
        json!({
            "name": name, "namespace": "shop",
            "labels": { "sessionflow.io/pipeline": "chat", "sessionflow.io/stage": "old" },
            "ownerReferences": [{ "apiVersion": "sessionflow.io/v1alpha1", "kind": "SessionPipeline",
                                  "name": "chat", "uid": UID, "controller": true }],
        })
    };
    json!({
        "configmaps": list("ConfigMap", "v1", &[json!({"metadata": meta("chat-old")})]),
        "deployments": list("Deployment", "apps/v1", &[json!({"metadata": meta("chat-old"),
            "spec": {"selector": {}, "template": {}}})]),
        "services": list("Service", "v1", &[json!({"metadata": meta("chat-old-metrics")})]),
        "budgets": list("PodDisruptionBudget", "policy/v1", &[json!({"metadata": meta("chat-old")})]),
    })
}

async fn reconcile_calls(sp: SessionPipeline, lists: Value) -> Vec<Seen> {
    let (client, server) = mock_client();
    let ctx = context(client);
    let answering =
        tokio::spawn(server.answer_all(Duration::from_millis(300), move |s| answer(s, &lists)));
    let _ = reconcile(Arc::new(sp), ctx).await;
    answering.await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_grants_every_call_the_operator_makes() {
    let rules_file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/sessionflow/files/operator-rules.yaml"
    );
    let rules: Vec<Rule> =
        serde_saphyr::from_str(&std::fs::read_to_string(rules_file).unwrap()).unwrap();

    let mut seen = Vec::new();
    // Create everything; remove a stage; an invalid spec (status + event).
    seen.extend(reconcile_calls(pipeline(&["a", "b"]), stale_objects()).await);
    let mut invalid = pipeline(&["a"]);
    invalid.spec.stages[0].output = Some("t0".into());
    seen.extend(reconcile_calls(invalid, stale_objects()).await);

    // An autoscaling pass that reads a SASL Secret, scales and reports.
    let cluster = cluster_with_lag("t0", 2, 0);
    let mut sp = pipeline(&["a"]);
    sp.spec.kafka.bootstrap_servers = cluster.bootstrap_servers();
    sp.spec.kafka.sasl = Some(SaslSpec {
        mechanism: SaslMechanism::Plain,
        secret_name: "kafka-user".into(),
        username_key: "username".into(),
        password_key: "password".into(),
        allow_plain_without_tls: true,
    });
    sp.spec.stages[0].replicas.min = 2;
    sp.spec.stages[0].replicas.max = 2;
    let (mut scaler, server, _writer, _) = scaler_of(&[sp]);
    let lists = stale_objects();
    let answering =
        tokio::spawn(server.answer_all(Duration::from_secs(3), move |s| answer(s, &lists)));
    scaler.tick().await;
    seen.extend(answering.await.unwrap());

    let mut calls: BTreeSet<(String, String, String)> = seen.iter().map(rbac_call).collect();
    // The controller's watches (main.rs): SessionPipelines and the children it owns.
    for (group, resource) in [
        ("sessionflow.io", "sessionpipelines"),
        ("apps", "deployments"),
        ("", "configmaps"),
        ("", "services"),
        ("policy", "poddisruptionbudgets"),
    ] {
        for verb in ["list", "watch"] {
            calls.insert((group.into(), resource.into(), verb.into()));
        }
    }
    // Server-side apply creates what does not exist: every applied kind needs `create` too.
    let applied: Vec<_> = calls
        .iter()
        .filter(|(_, r, v)| v == "patch" && !r.contains('/') && r != "events")
        .map(|(g, r, _)| (g.clone(), r.clone(), "create".to_string()))
        .collect();
    calls.extend(applied);

    for expected in [
        ("", "secrets", "get"),
        ("apps", "deployments", "patch"),
        ("apps", "deployments", "delete"),
        ("policy", "poddisruptionbudgets", "patch"),
        ("policy", "poddisruptionbudgets", "delete"),
        ("sessionflow.io", "sessionpipelines/status", "patch"),
        ("events.k8s.io", "events", "create"),
    ] {
        let e = (
            expected.0.to_string(),
            expected.1.to_string(),
            expected.2.to_string(),
        );
        assert!(
            calls.contains(&e),
            "the replayed sessions did not exercise {expected:?}: {calls:?}"
        );
    }
    let granted = |(g, r, v): &(String, String, String)| {
        rules.iter().any(|rule| {
            rule.api_groups.contains(g) && rule.resources.contains(r) && rule.verbs.contains(v)
        })
    };
    let missing: Vec<_> = calls.iter().filter(|c| !granted(c)).collect();
    assert!(missing.is_empty(), "the chart does not grant {missing:?}");

    // And nothing more: every grant is a call the operator makes.
    let mut grants = BTreeSet::new();
    for rule in &rules {
        for g in &rule.api_groups {
            for r in &rule.resources {
                for v in &rule.verbs {
                    grants.insert((g.clone(), r.clone(), v.clone()));
                }
            }
        }
    }
    let unused: Vec<_> = grants
        .iter()
        .filter(|(g, r, v)| {
            !calls.contains(&(g.clone(), r.clone(), v.clone()))
                && !NOT_REPLAYED
                    .iter()
                    .any(|(ng, nr, nv, _)| (*ng, *nr, *nv) == (g.as_str(), r.as_str(), v.as_str()))
        })
        .collect();
    assert!(
        unused.is_empty(),
        "the chart grants calls the operator never makes: {unused:?}"
    );
}

/// Grants the replay cannot show, each with the call that needs it.
const NOT_REPLAYED: &[(&str, &str, &str, &str)] = &[(
    "events.k8s.io",
    "events",
    "patch",
    "kube's Recorder patches an event that recurs into a series; each replayed session publishes an event once",
)];

/// The leader-election Role (`files/leader-election-rules.yaml`) is exactly what an election
/// uses: an election is replayed against the in-memory Lease API — the first replica creates
/// the Lease and takes it, renews it, crashes; the second takes over by force and releases on
/// a clean stop — and the set of (group, resource, verb) it called must equal the rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_grants_the_leader_election_calls_exactly() {
    use crate::leader::{elect, fake, LEASE_NAME};
    use std::sync::Mutex;

    let rules_file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/sessionflow/files/leader-election-rules.yaml"
    );
    let rules: Vec<Rule> =
        serde_saphyr::from_str(&std::fs::read_to_string(rules_file).unwrap()).unwrap();
    let granted: BTreeSet<(String, String, String)> = rules
        .iter()
        .flat_map(|r| {
            r.api_groups.iter().flat_map(move |g| {
                r.resources.iter().flat_map(move |res| {
                    r.verbs
                        .iter()
                        .map(move |v| (g.clone(), res.clone(), v.clone()))
                })
            })
        })
        .collect();

    let store = Arc::new(Mutex::new(fake::LeaseStore::default()));
    let wait = |what: &'static str, l: crate::leader::Leadership| async move {
        tokio::time::timeout(Duration::from_secs(30), async {
            while !l.is_leader() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{what} never led"));
    };
    let (a, a_election) = elect(fake::client(store.clone()), "ops", LEASE_NAME, "a", 2, 1)
        .await
        .unwrap();
    wait("a", a).await;
    let (b, b_election) = elect(fake::client(store.clone()), "ops", LEASE_NAME, "b", 2, 1)
        .await
        .unwrap();
    a_election.abort_without_release();
    wait("b", b).await;
    b_election.release().await;
    assert_eq!(store.lock().unwrap().holder(), None, "b released the lease");

    let calls: BTreeSet<(String, String, String)> = store
        .lock()
        .unwrap()
        .calls
        .iter()
        .map(|(method, uri)| {
            rbac_call(&Seen {
                method: method.clone(),
                uri: uri.clone(),
                body: Value::Null,
            })
        })
        .collect();
    assert_eq!(
        calls, granted,
        "the election's calls and the Role's rules differ"
    );
}
