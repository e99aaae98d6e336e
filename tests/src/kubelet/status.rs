//! What the test kubelet reports of a pod: phase, conditions, container statuses, IPs. Pure:
//! the runner ([`super::pod`]) keeps a [`PodView`] and writes [`PodView::status`] whenever it
//! changes.
//!
//! The Deployment controller counts a pod available from its `Ready` condition; `kubectl get`
//! shows `READY` from the containers' `ready` and `RESTARTS` from their `restartCount`; all
//! pods run on the host, so `podIP` is 127.0.0.1.

use serde_json::{json, Value};

/// One container as last seen.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerView {
    pub name: String,
    pub image: String,
    pub ready: bool,
    pub restarts: i32,
    pub state: State,
    /// The last run that ended: (exit code, started, finished).
    pub last_exit: Option<(i32, String, String)>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Running {
        pid: u32,
        started_at: String,
    },
    /// Not running: waiting to be (re)started, or could not be started.
    Waiting {
        reason: String,
        message: String,
    },
    Terminated {
        code: i32,
        started_at: String,
        finished_at: String,
    },
}

/// A pod as last seen.
#[derive(Debug, Clone, PartialEq)]
pub struct PodView {
    pub start_time: String,
    pub containers: Vec<ContainerView>,
    /// All containers ready, and since when (the conditions' lastTransitionTime).
    pub ready: bool,
    pub ready_since: String,
}

impl PodView {
    /// Pending until a container has started; Succeeded/Failed once every container has
    /// terminated for good; Running otherwise.
    pub fn phase(&self) -> &'static str {
        let terminated: Vec<i32> = self
            .containers
            .iter()
            .filter_map(|c| match c.state {
                State::Terminated { code, .. } => Some(code),
                _ => None,
            })
            .collect();
        if !self.containers.is_empty() && terminated.len() == self.containers.len() {
            if terminated.iter().all(|c| *c == 0) {
                "Succeeded"
            } else {
                "Failed"
            }
        } else if self
            .containers
            .iter()
            .any(|c| matches!(c.state, State::Running { .. }) || c.restarts > 0)
        {
            "Running"
        } else {
            "Pending"
        }
    }

    /// The pod's `status`, for a merge patch of the status subresource.
    pub fn status(&self) -> Value {
        let ready = if self.ready { "True" } else { "False" };
        let condition = |type_: &str, status: &str, since: &str| json!({ "type": type_, "status": status, "lastTransitionTime": since });
        let containers: Vec<Value> = self.containers.iter().map(container_status).collect();
        json!({
            "phase": self.phase(),
            "conditions": [
                condition("PodScheduled", "True", &self.start_time),
                condition("Initialized", "True", &self.start_time),
                condition("ContainersReady", ready, &self.ready_since),
                condition("Ready", ready, &self.ready_since),
            ],
            "hostIP": "127.0.0.1",
            "hostIPs": [{ "ip": "127.0.0.1" }],
            "podIP": "127.0.0.1",
            "podIPs": [{ "ip": "127.0.0.1" }],
            "startTime": self.start_time,
            "containerStatuses": containers,
        })
    }
}

fn container_status(c: &ContainerView) -> Value {
    let (state, started, id) = match &c.state {
        State::Running { pid, started_at } => (
            json!({ "running": { "startedAt": started_at } }),
            true,
            Some(format!("local-process://{pid}")),
        ),
        State::Waiting { reason, message } => (
            json!({ "waiting": { "reason": reason, "message": message } }),
            false,
            None,
        ),
        State::Terminated {
            code,
            started_at,
            finished_at,
        } => (
            json!({ "terminated": { "exitCode": code, "reason": exit_reason(*code),
                                     "startedAt": started_at, "finishedAt": finished_at } }),
            false,
            None,
        ),
    };
    let last = match &c.last_exit {
        Some((code, started, finished)) => json!({ "terminated": {
            "exitCode": code, "reason": exit_reason(*code),
            "startedAt": started, "finishedAt": finished } }),
        None => json!({}),
    };
    let mut status = json!({
        "name": c.name,
        "image": c.image,
        "imageID": "",
        "ready": c.ready,
        "started": started,
        "restartCount": c.restarts,
        "state": state,
        "lastState": last,
    });
    if let Some(id) = id {
        status["containerID"] = json!(id);
    }
    status
}

fn exit_reason(code: i32) -> &'static str {
    if code == 0 {
        "Completed"
    } else {
        "Error"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(states: Vec<State>, restarts: i32) -> PodView {
        PodView {
            start_time: "t0".into(),
            containers: states
                .into_iter()
                .map(|state| ContainerView {
                    name: "worker".into(),
                    image: "img".into(),
                    ready: false,
                    restarts,
                    state,
                    last_exit: None,
                })
                .collect(),
            ready: false,
            ready_since: "t0".into(),
        }
    }

    #[test]
    fn phases() {
        let waiting = State::Waiting {
            reason: "ContainerCreating".into(),
            message: String::new(),
        };
        let running = State::Running {
            pid: 1,
            started_at: "t1".into(),
        };
        let done = |code| State::Terminated {
            code,
            started_at: "t1".into(),
            finished_at: "t2".into(),
        };
        assert_eq!(view(vec![waiting.clone()], 0).phase(), "Pending");
        // Restarting after a crash is still Running (kubectl shows CrashLoopBackOff).
        assert_eq!(view(vec![waiting], 1).phase(), "Running");
        assert_eq!(view(vec![running.clone(), done(0)], 0).phase(), "Running");
        assert_eq!(view(vec![done(0), done(0)], 0).phase(), "Succeeded");
        assert_eq!(view(vec![done(0), done(1)], 0).phase(), "Failed");
        let status = view(vec![running], 2).status();
        assert_eq!(status["podIP"], "127.0.0.1");
        assert_eq!(status["containerStatuses"][0]["restartCount"], 2);
        assert_eq!(
            status["containerStatuses"][0]["containerID"],
            "local-process://1"
        );
        assert_eq!(status["conditions"][3]["type"], "Ready");
    }
}
