//! Is a stage running? Judged from its Deployment and its pods, for the pipeline's `Ready`
//! and `Degraded` conditions.
//!
//! Two mistakes this module exists to avoid. A stage whose pods cannot start (an image that
//! cannot be pulled, a crash loop, a missing Secret key) must show as `Degraded`, with the pod
//! and the kubelet's message, not as a rollout that never ends. And a stage must not stop being
//! `Ready` because the autoscaler asked for more replicas: readiness is judged on the pods of
//! the current revision that are available, not on the new target count. Pure: the reconciler
//! lists, this decides.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;

/// Waiting reasons of a container that will not get better by itself.
const FAILING_REASONS: [&str; 6] = [
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
];

/// What one stage looks like now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageHealth {
    /// Every pod is of the current revision and at least one is available (or the stage is
    /// scaled to zero).
    Ready,
    /// A rollout or the first start is under way.
    Progressing,
    /// The stage cannot run as it is: `reason` is the kubelet's or the Deployment's.
    Failing {
        reason: String,
        /// `pod <name> container <name>` or `Deployment <name>`.
        subject: String,
        message: String,
    },
}

/// The health of a stage from its Deployment (none yet: progressing), the pods its selector
/// matches, and the Deployment generation that carries the operator's latest pod template
/// (`None` when unknown: then the Deployment's own generation must have been observed).
pub fn stage_health(
    deployment: Option<&Deployment>,
    pods: &[&Pod],
    template_generation: Option<i64>,
) -> StageHealth {
    if let Some(failing) = failing_pod(pods) {
        return failing;
    }
    let Some(d) = deployment else {
        return StageHealth::Progressing;
    };
    let Some(status) = d.status.as_ref() else {
        return StageHealth::Progressing;
    };
    for c in status.conditions.iter().flatten() {
        if c.type_ == "Progressing"
            && c.status == "False"
            && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
        {
            return StageHealth::Failing {
                reason: "ProgressDeadlineExceeded".into(),
                subject: format!(
                    "Deployment {}",
                    d.metadata.name.as_deref().unwrap_or_default()
                ),
                message: c.message.clone().unwrap_or_default(),
            };
        }
    }
    // The controller must have seen the latest template; a newer generation that only
    // changed `replicas` (the autoscaler) does not matter.
    let needed = template_generation.or(d.metadata.generation).unwrap_or(0);
    if status.observed_generation.unwrap_or(0) < needed {
        return StageHealth::Progressing;
    }
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let replicas = status.replicas.unwrap_or(0);
    let updated = status.updated_replicas.unwrap_or(0);
    let available = status.available_replicas.unwrap_or(0);
    if want == 0 {
        return if replicas == 0 {
            StageHealth::Ready
        } else {
            StageHealth::Progressing
        };
    }
    // No pod of an older revision left, and the current revision serves.
    if updated >= replicas && available >= 1 {
        StageHealth::Ready
    } else {
        StageHealth::Progressing
    }
}

/// The first container (init containers, sidecars among them, first) waiting for a reason
/// that will not clear by itself.
fn failing_pod(pods: &[&Pod]) -> Option<StageHealth> {
    for pod in pods {
        let Some(status) = &pod.status else { continue };
        let statuses = status
            .init_container_statuses
            .iter()
            .flatten()
            .chain(status.container_statuses.iter().flatten());
        for c in statuses {
            let Some(waiting) = c.state.as_ref().and_then(|s| s.waiting.as_ref()) else {
                continue;
            };
            let Some(reason) = waiting.reason.as_deref() else {
                continue;
            };
            if FAILING_REASONS.contains(&reason) {
                return Some(StageHealth::Failing {
                    reason: reason.to_string(),
                    subject: format!(
                        "pod {} container {}",
                        pod.metadata.name.as_deref().unwrap_or_default(),
                        c.name
                    ),
                    message: waiting.message.clone().unwrap_or_default(),
                });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn deployment(generation: i64, replicas: i32, status: Value) -> Deployment {
        serde_json::from_value(json!({
            "metadata": { "name": "chat-nlu-bb263a2d", "generation": generation },
            "spec": { "replicas": replicas, "selector": {}, "template": {} },
            "status": status,
        }))
        .unwrap()
    }

    fn pod(containers: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": "chat-nlu-7d9f-abcde" },
            "status": { "containerStatuses": containers },
        }))
        .unwrap()
    }

    fn waiting(reason: &str, message: &str) -> Value {
        json!([{ "name": "worker", "image": "w", "imageID": "", "ready": false,
                 "restartCount": 3, "state": { "waiting": { "reason": reason, "message": message } } }])
    }

    #[test]
    fn pods_that_cannot_run_make_the_stage_failing_with_the_pod_named() {
        let d = deployment(
            1,
            1,
            json!({"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1}),
        );
        for reason in [
            "ImagePullBackOff",
            "CrashLoopBackOff",
            "CreateContainerConfigError",
        ] {
            let p = pod(waiting(reason, "it went wrong"));
            assert_eq!(
                stage_health(Some(&d), &[&p], Some(1)),
                StageHealth::Failing {
                    reason: reason.into(),
                    subject: "pod chat-nlu-7d9f-abcde container worker".into(),
                    message: "it went wrong".into(),
                }
            );
        }
        // Waiting for a reason that clears by itself is progress, not failure.
        let p = pod(waiting("ContainerCreating", ""));
        assert_eq!(
            stage_health(Some(&d), &[&p], Some(1)),
            StageHealth::Progressing
        );
    }

    #[test]
    fn a_rollout_past_its_deadline_is_failing() {
        let d = deployment(
            2,
            2,
            json!({
                "observedGeneration": 2, "replicas": 3, "updatedReplicas": 1, "availableReplicas": 2,
                "conditions": [{ "type": "Progressing", "status": "False",
                                 "reason": "ProgressDeadlineExceeded",
                                 "message": "ReplicaSet \"chat-nlu-7d9f\" has timed out progressing." }],
            }),
        );
        let StageHealth::Failing {
            reason,
            subject,
            message,
        } = stage_health(Some(&d), &[], Some(2))
        else {
            panic!("not failing");
        };
        assert_eq!(
            (reason.as_str(), subject.as_str()),
            ("ProgressDeadlineExceeded", "Deployment chat-nlu-bb263a2d")
        );
        assert!(message.contains("timed out"), "{message}");
    }

    #[test]
    fn more_replicas_asked_for_do_not_make_a_ready_stage_unready() {
        // Generation 3 only raised replicas from 2 to 4; the template is generation 2's.
        let growing = deployment(
            3,
            4,
            json!({
                "observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2,
                "availableReplicas": 2,
            }),
        );
        assert_eq!(
            stage_health(Some(&growing), &[], Some(2)),
            StageHealth::Ready
        );
        let observed = deployment(
            3,
            4,
            json!({
                "observedGeneration": 3, "replicas": 4, "updatedReplicas": 4, "readyReplicas": 2,
                "availableReplicas": 2,
            }),
        );
        assert_eq!(
            stage_health(Some(&observed), &[], Some(2)),
            StageHealth::Ready
        );
        // A new template not yet rolled out is not ready: old pods remain.
        let rolling = deployment(
            4,
            4,
            json!({
                "observedGeneration": 4, "replicas": 5, "updatedReplicas": 1, "availableReplicas": 4,
            }),
        );
        assert_eq!(
            stage_health(Some(&rolling), &[], Some(4)),
            StageHealth::Progressing
        );
        // The template's generation not yet seen by the Deployment controller.
        assert_eq!(
            stage_health(Some(&growing), &[], Some(3)),
            StageHealth::Progressing
        );
        // Unknown template generation (operator restart): the Deployment's own must be seen.
        assert_eq!(
            stage_health(Some(&growing), &[], None),
            StageHealth::Progressing
        );
        assert_eq!(stage_health(Some(&observed), &[], None), StageHealth::Ready);
        // Nothing available yet.
        let starting = deployment(
            1,
            2,
            json!({"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2}),
        );
        assert_eq!(
            stage_health(Some(&starting), &[], Some(1)),
            StageHealth::Progressing
        );
        // Scaled to zero and drained.
        let idle = deployment(5, 0, json!({"observedGeneration": 5}));
        assert_eq!(stage_health(Some(&idle), &[], Some(2)), StageHealth::Ready);
        assert_eq!(stage_health(None, &[], None), StageHealth::Progressing);
    }
}
