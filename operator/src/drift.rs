//! Has a child object drifted from what the operator rendered, and is it the operator's to
//! repair at all?
//!
//! Someone may `kubectl edit` a stage's Deployment or delete its Service; the next reconcile
//! must put back what the operator owns without waiting for the spec to change. Comparing the
//! rendered hash alone cannot see an edit (the annotation survives it), so the live object is
//! compared with the rendered one field by field: every field the operator sets must hold the
//! rendered value; fields the API server or others add (defaults, status, `replicas` of the
//! autoscaler) are not the operator's and are ignored. And an object the operator did not
//! create is never taken over: a name held by anything else is a conflict, reported, not
//! overwritten. Pure.

use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde_json::Value;

/// Whether `live` lacks any field `desired` sets, or holds a different value there. Objects
/// are compared key by key (extra live keys are fine), lists item by item (same length),
/// anything else by value.
pub fn drifted<K: Serialize>(desired: &K, live: &K) -> bool {
    let desired = serde_json::to_value(desired).expect("objects serialize");
    let live = serde_json::to_value(live).expect("objects serialize");
    !holds(&live, &desired)
}

fn holds(live: &Value, desired: &Value) -> bool {
    match (live, desired) {
        (Value::Object(l), Value::Object(d)) => d
            .iter()
            .all(|(k, dv)| l.get(k).is_some_and(|lv| holds(lv, dv)) || empty(dv)),
        (Value::Array(l), Value::Array(d)) => {
            l.len() == d.len() && l.iter().zip(d).all(|(lv, dv)| holds(lv, dv))
        }
        (l, d) => l == d,
    }
}

/// An empty map or list the operator renders is absent on the server, and that is no drift.
fn empty(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Null => true,
        _ => false,
    }
}

/// Whether `obj` is controlled by the resource with `owner_uid`.
pub fn owned_by<K: Resource>(obj: &K, owner_uid: &str) -> bool {
    obj.owner_references()
        .iter()
        .any(|o| o.uid == owner_uid && o.controller == Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::Deployment;
    use serde_json::json;

    fn deployment(v: Value) -> Deployment {
        serde_json::from_value(v).unwrap()
    }

    fn desired() -> Deployment {
        deployment(json!({
            "metadata": { "name": "chat-nlu-bb263a2d", "labels": { "a": "1" } },
            "spec": { "selector": { "matchLabels": { "a": "1" } },
                      "template": { "spec": { "containers": [{ "name": "worker", "image": "w:1",
                                                               "env": [] }] } } },
        }))
    }

    #[test]
    fn what_the_server_adds_is_not_drift_but_an_edit_of_an_owned_field_is() {
        let as_served = deployment(json!({
            "metadata": { "name": "chat-nlu-bb263a2d", "labels": { "a": "1" }, "resourceVersion": "7",
                          "generation": 3, "managedFields": [] },
            "spec": { "replicas": 4, "progressDeadlineSeconds": 600,
                      "selector": { "matchLabels": { "a": "1" } },
                      "template": { "spec": { "containers": [{ "name": "worker", "image": "w:1",
                          "imagePullPolicy": "IfNotPresent", "terminationMessagePath": "/dev/termination-log" }],
                          "restartPolicy": "Always" } } },
            "status": { "replicas": 4 },
        }));
        assert!(!drifted(&desired(), &as_served));

        let mut edited = as_served.clone();
        edited
            .spec
            .as_mut()
            .unwrap()
            .template
            .spec
            .as_mut()
            .unwrap()
            .containers[0]
            .image = Some("evil:1".into());
        assert!(drifted(&desired(), &edited));

        let mut relabelled = as_served.clone();
        relabelled.metadata.labels = Some(Default::default());
        assert!(drifted(&desired(), &relabelled));

        let mut extra_container = as_served;
        let pod = extra_container
            .spec
            .as_mut()
            .unwrap()
            .template
            .spec
            .as_mut()
            .unwrap();
        pod.containers.push(pod.containers[0].clone());
        assert!(drifted(&desired(), &extra_container), "lists compare whole");
    }

    #[test]
    fn only_a_controller_reference_to_the_pipeline_makes_it_ours() {
        let mut d = desired();
        assert!(!owned_by(&d, "u1"));
        d.metadata.owner_references = Some(vec![serde_json::from_value(json!({
            "apiVersion": "sessionflow.io/v1alpha1", "kind": "SessionPipeline",
            "name": "chat", "uid": "u1", "controller": true,
        }))
        .unwrap()]);
        assert!(owned_by(&d, "u1"));
        assert!(!owned_by(&d, "u2"));
    }
}
