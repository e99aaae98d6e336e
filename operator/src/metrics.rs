//! The operator's Prometheus metrics.
//!
//! Per stage (`namespace`, `pipeline`, `stage` labels): the lag the operator measured and the
//! replicas it wants, so HPA or KEDA users can scale on `sessionflow_stage_effective_lag`
//! instead of the built-in autoscaler. Per operator: reconcile outcomes and durations. Series of
//! stages that no longer exist are removed ([`Metrics::forget_stage`]).

use std::sync::Arc;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts};
use sessionflow_worker::ops::metrics::MetricsRegistry;

const STAGE: &[&str] = &["namespace", "pipeline", "stage"];

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<MetricsRegistry>,
    pub stage_lag: IntGaugeVec,
    pub stage_effective_lag: IntGaugeVec,
    pub stage_partitions: IntGaugeVec,
    pub replicas_desired: IntGaugeVec,
    pub replicas_ready: IntGaugeVec,
    pub scale_events: IntCounterVec,
    pub lag_read_errors: IntCounterVec,
    pub reconciles: IntCounterVec,
    pub reconcile_seconds: HistogramVec,
    pub scaler_pass_seconds: HistogramVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Arc::new(MetricsRegistry::new(None));
        let gauges = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), STAGE).expect("valid metric");
            registry.add(g.clone());
            g
        };
        let stage_lag = gauges(
            "stage_lag",
            "Records above the stage group's committed offsets, read from Kafka by the operator.",
        );
        let stage_effective_lag = gauges(
            "stage_effective_lag",
            "Records of the stage not yet done: lag minus those the commit metadata marks done.",
        );
        let stage_partitions = gauges("stage_partitions", "Partitions of the stage's input topic.");
        let replicas_desired = gauges(
            "stage_replicas_desired",
            "Replicas the autoscaler wants for the stage.",
        );
        let replicas_ready = gauges(
            "stage_replicas_ready",
            "Ready replicas of the stage's Deployment.",
        );
        let scale_events = IntCounterVec::new(
            Opts::new(
                "stage_scale_events_total",
                "Replica changes made by the autoscaler.",
            ),
            &["namespace", "pipeline", "stage", "direction"],
        )
        .expect("valid metric");
        registry.add(scale_events.clone());
        let lag_read_errors = IntCounterVec::new(
            Opts::new(
                "stage_lag_read_errors_total",
                "Failed lag reads from Kafka.",
            ),
            STAGE,
        )
        .expect("valid metric");
        registry.add(lag_read_errors.clone());
        let reconciles = IntCounterVec::new(
            Opts::new(
                "operator_reconciles_total",
                "Reconciles by result (ok, error).",
            ),
            &["result"],
        )
        .expect("valid metric");
        registry.add(reconciles.clone());
        let reconcile_seconds = HistogramVec::new(
            HistogramOpts::new("operator_reconcile_seconds", "Time spent in one reconcile.")
                .buckets(vec![0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            &[],
        )
        .expect("valid metric");
        registry.add(reconcile_seconds.clone());
        let scaler_pass_seconds = HistogramVec::new(
            HistogramOpts::new(
                "operator_scaler_pass_seconds",
                "Time one autoscaling pass over every pipeline took (lag reads run concurrently, \
                 each pipeline's under a deadline).",
            )
            .buckets(vec![
                0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0,
            ]),
            &[],
        )
        .expect("valid metric");
        registry.add(scaler_pass_seconds.clone());
        Self {
            registry,
            stage_lag,
            stage_effective_lag,
            stage_partitions,
            replicas_desired,
            replicas_ready,
            scale_events,
            lag_read_errors,
            reconciles,
            reconcile_seconds,
            scaler_pass_seconds,
        }
    }

    /// Drops the series of a stage that was removed.
    pub fn forget_stage(&self, namespace: &str, pipeline: &str, stage: &str) {
        let labels = [namespace, pipeline, stage];
        for g in [
            &self.stage_lag,
            &self.stage_effective_lag,
            &self.stage_partitions,
            &self.replicas_desired,
            &self.replicas_ready,
        ] {
            let _ = g.remove_label_values(&labels);
        }
        let _ = self.lag_read_errors.remove_label_values(&labels);
        for direction in ["up", "down"] {
            let _ = self
                .scale_events
                .remove_label_values(&[namespace, pipeline, stage, direction]);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.registry.render()
    }

    /// Full names of every metric the operator exports.
    pub fn names(&self) -> Vec<String> {
        self.registry.names()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_list_every_metric_even_without_series() {
        let m = Metrics::new();
        let names = m.names();
        for name in [
            "sessionflow_stage_lag",
            "sessionflow_stage_effective_lag",
            "sessionflow_stage_replicas_desired",
            "sessionflow_stage_replicas_ready",
            "sessionflow_operator_reconciles_total",
            "sessionflow_operator_scaler_pass_seconds",
        ] {
            assert!(
                names.iter().any(|n| n == name),
                "{name} missing from {names:?}"
            );
        }
        // Nothing was observed yet, so a scrape shows none of the per-stage series.
        assert!(!m.render().contains("sessionflow_stage_lag"));
        m.stage_lag.with_label_values(&["ns", "p", "s"]).set(5);
        assert!(m
            .render()
            .contains(r#"sessionflow_stage_lag{namespace="ns",pipeline="p",stage="s"} 5"#));
        m.forget_stage("ns", "p", "s");
        assert!(!m.render().contains("sessionflow_stage_lag{"));
    }
}
