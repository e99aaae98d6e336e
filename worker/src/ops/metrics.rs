//! The worker's Prometheus metrics.
//!
//! Each worker owns its own registry (several workers can share a test process), with the stage
//! as a constant label and `sessionflow_` as the prefix, so the names here are the names users
//! query: `sessionflow_records_in_total`, `sessionflow_dlq_total{reason}`, ….

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus::core::Collector;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<MetricsRegistry>,
    pub records_in: IntCounter,
    pub records_out: IntCounter,
    pub retries: IntCounter,
    pub dlq: IntCounterVec,
    pub in_flight: IntGauge,
    pub active_sessions: IntGauge,
    pub sessions: IntGauge,
    pub handler_seconds: HistogramVec,
    /// `handler_seconds` of each outcome, resolved once: looking a label up hashes it and
    /// takes a lock, on every record.
    pub handler_outcome: HandlerOutcomes,
    pub committed_offset: IntGaugeVec,
    pub paused_partitions: IntGauge,
    pub prefetched_records: IntGauge,
    pub map_overflow_partitions: IntGauge,
    pub pending_records: IntGauge,
    pub produce_errors: IntCounter,
    pub commit_errors: IntCounter,
    pub stuck_records: IntCounter,
    pub stuck_now: IntGauge,
    pub order_violations: IntCounterVec,
    pub replay_skipped: IntCounter,
    pub partition_lag: IntGaugeVec,
    pub handler_panics: IntCounter,
    pub dlq_write_errors: IntCounter,
    pub blocked_writes: IntGauge,
    pub late_writes: IntCounter,
    pub writes_taken_back: IntCounter,
    pub producers_replaced: IntCounter,
    pub commit_failing_partitions: IntGauge,
    pub offset_maps_ignored: IntCounter,
    pub lost_partitions: IntCounter,
    pub log_truncations: IntCounter,
    pub membership_doubts: IntCounter,
    pub write_gate_closed: IntGauge,
    pub final_commit_failures: IntCounter,
    pub fatal_errors: IntCounter,
    /// `exactlyOnce`: partition transactions by result (`committed`, `aborted`) and, for an
    /// abort, reason (`write`, `commit`, `fence`, `fenced`; empty for a commit).
    pub transactions: IntCounterVec,
    /// `exactlyOnce`: barrier + offsets + commit of one partition's transaction.
    pub transaction_commit_seconds: Histogram,
    /// `exactlyOnce`: input records one committed partition transaction marks done.
    pub transaction_records: Histogram,
    /// 1 when the stage runs `delivery: exactlyOnce`.
    pub eos_enabled: IntGauge,
}

/// The series of `handler_duration_seconds`, one per outcome of an attempt.
#[derive(Clone)]
pub struct HandlerOutcomes {
    pub ok: Histogram,
    pub transient: Histogram,
    pub poison: Histogram,
}

impl HandlerOutcomes {
    fn of(seconds: &HistogramVec) -> Self {
        Self {
            ok: seconds.with_label_values(&["ok"]),
            transient: seconds.with_label_values(&["transient"]),
            poison: seconds.with_label_values(&["poison"]),
        }
    }
}

impl Metrics {
    pub fn new(stage: &str) -> Self {
        let labels = [("stage".to_string(), stage.to_string())].into();
        let registry = Arc::new(MetricsRegistry::new(Some(labels)));
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            registry.add(c.clone());
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            registry.add(g.clone());
            g
        };
        let records_in = counter("records_in_total", "Records taken from the input topic.");
        let records_out = counter(
            "records_out_total",
            "Output records acknowledged by the broker.",
        );
        let retries = counter("retries_total", "Transient failures retried in place.");
        let produce_errors = counter(
            "produce_errors_total",
            "Output records the broker did not acknowledge after the producer's own retries.",
        );
        let commit_errors = counter("commit_errors_total", "Offset commits that failed.");
        let stuck_records = counter(
            "stuck_records_total",
            "Records whose handler ran past stuck.timeoutMs (an operational failure).",
        );
        let stuck_now = gauge("stuck_records", "Records currently past stuck.timeoutMs.");
        let replay_skipped = counter(
            "replay_skipped_total",
            "Replayed records skipped because they were already done (commit metadata or the \
             session's recent event ids).",
        );
        let handler_panics = counter(
            "handler_panics_total",
            "Handler attempts that panicked (each one retried in place as a transient failure).",
        );
        let dlq_write_errors = counter(
            "dlq_write_errors_total",
            "Dead letters the broker refused (each one retried with backoff; the record stays \
             uncommitted until one is acknowledged).",
        );
        let blocked_writes = gauge(
            "blocked_writes",
            "Records whose dead letter keeps being refused; the worker is not ready while any is.",
        );
        let late_writes = counter(
            "late_writes_total",
            "Results of a revoked partition still unacknowledged when its revocation stopped \
             waiting for them: they may land after the new owner's. Must stay 0.",
        );
        let writes_taken_back = counter(
            "writes_taken_back_total",
            "Results the worker took back from its producer before they were sent (a purge: \
             the membership fence, a lost partition, a revocation or a shutdown whose fence ran \
             out): written again if the partition is still this worker's, else released to its \
             next owner.",
        );
        let producers_replaced = counter(
            "producers_replaced_total",
            "Times the atLeastOnce producer was replaced by a new one after the broker refused a \
             write: the old one's queued writes are taken back and written again through the \
             new one (librdkafka may reuse a producer's sequence numbers after a refusal).",
        );
        let commit_failing_partitions = gauge(
            "commit_failing_partitions",
            "Partitions whose last offset commit failed; their replay span is measured from the \
             last commit the broker confirmed.",
        );
        let offset_maps_ignored = counter(
            "offset_maps_ignored_total",
            "Completed-offset maps in commit metadata ignored on assignment (another watermark, \
             too large, or corrupt): the partition replays from the plain watermark.",
        );
        let lost_partitions = counter(
            "lost_partitions_total",
            "Partitions lost without a revocation (session timeout, fenced member): dropped \
             without a drain or a commit.",
        );
        let log_truncations = counter(
            "log_truncations_total",
            "Input partitions found rewritten by a new leader (records read again at a newer \
             leader epoch): their records in flight were given up and the partition replayed \
             from its watermark.",
        );
        let membership_doubts = counter(
            "membership_doubts_total",
            "Times the group coordinator went unheard for two thirds of the session timeout: \
             writes stopped (and queued ones were purged) until it answered again.",
        );
        let write_gate_closed = gauge(
            "write_gate_closed",
            "1 while writes wait for the group coordinator to answer (membership fence).",
        );
        let final_commit_failures = counter(
            "final_commit_failures_total",
            "Shutdowns or revocations whose final commit failed: their progress will be replayed.",
        );
        let fatal_errors = counter(
            "fatal_errors_total",
            "Fatal Kafka client errors (e.g. the idempotent producer's); the worker stops.",
        );
        let transactions = IntCounterVec::new(
            Opts::new(
                "transactions_total",
                "exactlyOnce: partition transactions ended, by result (committed, aborted) and \
                 the abort's reason (write: a write refused; commit: the offsets or the end \
                 refused; fence: writes purged; fenced: the partition's producer fenced by \
                 another with its transactional id, the partition given up).",
            ),
            &["result", "reason"],
        )
        .expect("valid metric");
        registry.add(transactions.clone());
        let transaction_commit_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "transaction_commit_seconds",
                "exactlyOnce: duration of one partition's transactional commit (offsets + end).",
            )
            .buckets(prometheus::exponential_buckets(0.001, 2.0, 16).expect("valid buckets")),
        )
        .expect("valid metric");
        registry.add(transaction_commit_seconds.clone());
        let transaction_records = Histogram::with_opts(
            HistogramOpts::new(
                "transaction_records",
                "exactlyOnce: input records a committed partition transaction marks done (their \
                 outputs and dead letters are in it): records settled since the partition's \
                 previous commit, observed at each commit.",
            )
            .buckets(vec![
                1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 2_500.0, 5_000.0,
                10_000.0, 25_000.0,
            ]),
        )
        .expect("valid metric");
        registry.add(transaction_records.clone());
        let eos_enabled = gauge(
            "eos_enabled",
            "1 when the stage runs delivery: exactlyOnce (outputs, dead letters and offsets in \
             transactions), 0 for atLeastOnce.",
        );
        let in_flight = gauge("in_flight", "Records taken in and not finished.");
        let active_sessions = gauge("active_sessions", "Session tasks alive.");
        let sessions = gauge(
            "sessions",
            "Sessions known: with a task, or hibernated (idle, no task) until reaped after \
             sessionIdleMs.",
        );
        let paused_partitions = gauge(
            "paused_partitions",
            "Input partitions held: not taking records in (backpressure, or a completed-offset \
             map too large for commit metadata).",
        );
        let prefetched_records = gauge(
            "prefetched_records",
            "Records librdkafka fetched ahead, waiting in the assigned partitions' queues \
             (bounded by prefetchKbytes and prefetchRecords, totals per worker).",
        );
        let map_overflow_partitions = gauge(
            "offset_map_overflow_partitions",
            "Input partitions whose completed-offset map no longer fits in commit metadata: \
             the plain watermark is committed and intake is held until the map shrinks.",
        );
        let pending_records = gauge(
            "pending_records",
            "Records parked in held partitions' pending buffers.",
        );
        let dlq = IntCounterVec::new(
            Opts::new("dlq_total", "Records written to the DLQ, by reason."),
            &["reason"],
        )
        .expect("valid metric");
        registry.add(dlq.clone());
        let handler_seconds = HistogramVec::new(
            HistogramOpts::new(
                "handler_duration_seconds",
                "Duration of one handler attempt, by outcome.",
            )
            // 0.5 ms to ~93 s, √2 apart: a quantile read from them is within ~20%.
            .buckets(
                prometheus::exponential_buckets(0.0005, std::f64::consts::SQRT_2, 36)
                    .expect("valid buckets"),
            ),
            &["outcome"],
        )
        .expect("valid metric");
        registry.add(handler_seconds.clone());
        let committed_offset = IntGaugeVec::new(
            Opts::new(
                "committed_offset",
                "Last committed contiguous watermark, per partition.",
            ),
            &["topic", "partition"],
        )
        .expect("valid metric");
        registry.add(committed_offset.clone());
        let order_violations = IntCounterVec::new(
            Opts::new(
                "order_violations_total",
                "Per-session sessionflow-seq going backwards within one assignment, seen at \
                 intake or at handler entry. Must stay 0.",
            ),
            &["at"],
        )
        .expect("valid metric");
        registry.add(order_violations.clone());
        for at in ["intake", "handler"] {
            order_violations.with_label_values(&[at]);
        }
        let partition_lag = IntGaugeVec::new(
            Opts::new(
                "partition_lag",
                "High watermark minus committed offset of each assigned partition, read from \
                 the broker.",
            ),
            &["topic", "partition"],
        )
        .expect("valid metric");
        registry.add(partition_lag.clone());
        Self {
            registry,
            stuck_records,
            stuck_now,
            order_violations,
            replay_skipped,
            partition_lag,
            records_in,
            records_out,
            retries,
            dlq,
            in_flight,
            active_sessions,
            sessions,
            handler_outcome: HandlerOutcomes::of(&handler_seconds),
            handler_seconds,
            committed_offset,
            paused_partitions,
            prefetched_records,
            map_overflow_partitions,
            pending_records,
            produce_errors,
            commit_errors,
            handler_panics,
            dlq_write_errors,
            blocked_writes,
            late_writes,
            writes_taken_back,
            producers_replaced,
            commit_failing_partitions,
            offset_maps_ignored,
            lost_partitions,
            log_truncations,
            membership_doubts,
            write_gate_closed,
            final_commit_failures,
            fatal_errors,
            transactions,
            transaction_commit_seconds,
            transaction_records,
            eos_enabled,
        }
    }

    /// Logs the stage's totals (at shutdown).
    pub fn log(&self) {
        let dlq: Vec<String> = crate::record::DlqReason::ALL
            .iter()
            .map(|r| (r.as_str(), self.dlq.with_label_values(&[r.as_str()]).get()))
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| format!("{r}={n}"))
            .collect();
        tracing::info!(
            records_in = self.records_in.get(),
            records_out = self.records_out.get(),
            retries = self.retries.get(),
            dlq = %dlq.join(","),
            "stage stopped"
        );
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        self.registry.render()
    }

    /// Full names of every metric a worker exports (`sessionflow_records_in_total`, …).
    pub fn names(&self) -> Vec<String> {
        self.registry.names()
    }
}

/// A Prometheus registry with the `sessionflow_` prefix that remembers the full names of the
/// metrics registered in it, so dashboards can be checked against what is really exported
/// (a vector metric with no series yet does not show up in a scrape). The operator uses it too.
pub struct MetricsRegistry {
    registry: Registry,
    names: Mutex<Vec<String>>,
}

impl MetricsRegistry {
    pub const PREFIX: &'static str = "sessionflow";

    pub fn new(const_labels: Option<HashMap<String, String>>) -> Self {
        Self {
            registry: Registry::new_custom(Some(Self::PREFIX.into()), const_labels)
                .expect("static registry settings are valid"),
            names: Mutex::default(),
        }
    }

    /// Registers `collector` and returns it.
    pub fn add<C: Collector + Clone + 'static>(&self, collector: C) -> C {
        let names = collector
            .desc()
            .iter()
            .map(|d| format!("{}_{}", Self::PREFIX, d.fq_name))
            .collect::<Vec<_>>();
        self.registry
            .register(Box::new(collector.clone()))
            .expect("unique metric");
        self.names.lock().expect("not poisoned").extend(names);
        collector
    }

    pub fn names(&self) -> Vec<String> {
        self.names.lock().expect("not poisoned").clone()
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding of gathered metrics");
        String::from_utf8(buf).expect("text exposition is UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_prefix_and_stage() {
        let m = Metrics::new("nlu");
        m.records_in.inc();
        m.dlq.with_label_values(&["poison"]).inc();
        let text = m.render();
        assert!(
            text.contains("sessionflow_records_in_total{stage=\"nlu\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sessionflow_dlq_total{reason=\"poison\",stage=\"nlu\"} 1"),
            "{text}"
        );
    }
}
