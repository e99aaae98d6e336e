//! Stuck records: a handler call that never comes back must not freeze a partition forever.
//!
//! A record whose handler hangs (a downstream call without a timeout, a deadlock) holds the
//! partition's commit watermark in place: nothing after it can be committed. The seed's first
//! detector looked at the partition ("the in-flight set has been non-empty for too long") and
//! so reported every busy partition with steady traffic. This one times each record from the
//! moment its *first attempt starts* — not from intake, so waiting in a session's queue behind
//! another record never counts — across its retries. Past `stuck.timeoutMs` it raises a metric
//! and a log line naming partition, offset and session; with `action: dlq` it also cancels the
//! handler call and dead-letters the record as `stuck`, so the partition moves on. That trades
//! completeness for availability, so it is counted as an operational failure.

use std::time::{Duration, Instant};

use crate::config::{StuckActionConfig, StuckConfig};
use crate::ops::metrics::Metrics;
use crate::record::InputRecord;

/// What to do with a record past the timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StuckAction {
    /// Report it and keep waiting.
    Log,
    /// Report it, cancel the handler, send the record to the DLQ as `stuck`, move on.
    DeadLetter,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StuckPolicy {
    pub timeout: Duration,
    pub action: StuckAction,
}

impl From<StuckConfig> for StuckPolicy {
    fn from(c: StuckConfig) -> Self {
        StuckPolicy {
            timeout: Duration::from_millis(c.timeout_ms),
            action: match c.action {
                StuckActionConfig::Log => StuckAction::Log,
                StuckActionConfig::Dlq => StuckAction::DeadLetter,
            },
        }
    }
}

/// The stuck timer of one record.
pub struct StuckWatch {
    deadline: tokio::time::Instant,
    policy: StuckPolicy,
    reported: bool,
}

/// What the session task should do when the watch fires.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    KeepWaiting,
    DeadLetter,
}

impl StuckWatch {
    /// Starts timing a record whose first attempt starts at `started`.
    pub fn start(policy: StuckPolicy, started: Instant) -> Self {
        Self {
            deadline: tokio::time::Instant::from_std(started + policy.timeout),
            policy,
            reported: false,
        }
    }

    /// Whether the watch can still fire (it fires once per record).
    pub fn armed(&self) -> bool {
        !self.reported
    }

    /// Completes at the deadline.
    pub async fn expired(&self) {
        tokio::time::sleep_until(self.deadline).await
    }

    /// Reports the record as stuck and says what to do with it.
    pub fn fire(&mut self, record: &InputRecord, metrics: &Metrics, started: Instant) -> Verdict {
        self.reported = true;
        metrics.stuck_records.inc();
        metrics.stuck_now.inc();
        tracing::warn!(partition = record.partition, offset = record.offset,
            session = %record.session_str(), event_id = %record.event_id(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            action = ?self.policy.action, "record stuck in its handler");
        match self.policy.action {
            StuckAction::Log => Verdict::KeepWaiting,
            StuckAction::DeadLetter => Verdict::DeadLetter,
        }
    }

    /// The record left the session task (done, DLQ or abandoned).
    pub fn finish(self, metrics: &Metrics) {
        if self.reported {
            metrics.stuck_now.dec();
        }
    }
}
