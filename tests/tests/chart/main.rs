//! Checks of the Helm chart (charts/sessionflow) against the code, without a cluster, a network or
//! an external binary: the chart's CRD is the one the operator generates, and the Grafana
//! dashboard queries only metrics the worker and the operator export and covers every topic an
//! operator of a pipeline needs. `scripts/chart-check.sh` does the rest (helm lint, helm template,
//! kubernetes-validate).

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

mod images;

fn repo_file(path: &str) -> String {
    let full = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

fn dashboard() -> Value {
    serde_json::from_str(&repo_file("charts/sessionflow/dashboards/sessionflow.json"))
        .expect("the dashboard is valid JSON")
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for panel in list.as_array().into_iter().flatten() {
            out.push(panel);
            if let Some(nested) = panel.get("panels") {
                walk(nested, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

fn title(panel: &Value) -> String {
    panel["title"].as_str().unwrap_or_default().to_lowercase()
}

fn exprs(panel: &Value) -> Vec<String> {
    panel["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["expr"].as_str().map(str::to_string))
        .collect()
}

/// `sessionflow_[a-z0-9_]+` names in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("sessionflow_") {
        let start = i + at;
        let boundary = start == 0 || {
            let b = bytes[start - 1];
            !(b.is_ascii_alphanumeric() || b == b'_')
        };
        let mut end = start + "sessionflow_".len();
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'_')
        {
            end += 1;
        }
        if boundary && end > start + "sessionflow_".len() {
            names.insert(text[start..end].to_string());
        }
        i = end;
    }
    names
}

/// What the worker and the operator export, and which of those are histograms (a histogram
/// shows its `# TYPE` only once it has a series, so one is observed in each here).
fn exported() -> (BTreeSet<String>, BTreeSet<String>) {
    let worker = sessionflow_worker::ops::metrics::Metrics::new("x");
    let operator = sessionflow_operator::metrics::Metrics::new();
    let names: BTreeSet<String> = worker.names().into_iter().chain(operator.names()).collect();
    worker
        .handler_seconds
        .with_label_values(&["ok"])
        .observe(0.01);
    operator
        .reconcile_seconds
        .with_label_values::<&str>(&[])
        .observe(0.01);
    let histograms = [worker.render(), operator.render()]
        .iter()
        .flat_map(|text| {
            text.lines()
                .filter_map(|l| l.strip_prefix("# TYPE "))
                .filter_map(|l| l.strip_suffix(" histogram"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    (names, histograms)
}

#[test]
fn chart_crd_is_the_generated_one() {
    let chart_crd = repo_file("charts/sessionflow/crds/sessionpipeline.yaml");
    assert!(
        chart_crd == sessionflow_operator::crd::crd_yaml(),
        "charts/sessionflow/crds/sessionpipeline.yaml is stale: regenerate it with `make crd`"
    );
    assert_eq!(
        chart_crd,
        repo_file("crds/sessionpipeline.yaml"),
        "the chart's CRD must be a byte copy of crds/sessionpipeline.yaml"
    );
}

#[test]
fn dashboard_queries_only_exported_metrics() {
    let (exported, histograms) = exported();
    assert!(
        exported.contains("sessionflow_records_in_total")
            && exported.contains("sessionflow_stage_lag"),
        "names() of the worker and operator: {exported:?}"
    );
    assert!(
        histograms.contains("sessionflow_handler_duration_seconds"),
        "histograms: {histograms:?}"
    );
    let text = repo_file("charts/sessionflow/dashboards/sessionflow.json");
    let used = metric_names(&text);
    assert!(
        used.len() >= 10,
        "too few metrics in the dashboard: {used:?}"
    );
    let unknown: Vec<&String> = used
        .iter()
        .filter(|name| {
            if exported.contains(*name) {
                return false;
            }
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix));
            !base.is_some_and(|b| histograms.contains(b))
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "the dashboard queries metrics neither the worker nor the operator exports: {unknown:?}\n\
         exported: {exported:?}"
    );
}

#[test]
fn dashboard_has_a_panel_for_every_topic() {
    let d = dashboard();
    let panels = panels(&d);
    let find = |topic: &str, pred: &dyn Fn(&str, &[String]) -> bool| {
        let found = panels.iter().any(|p| pred(&title(p), &exprs(p)));
        assert!(found, "no dashboard panel for {topic}");
    };
    let any = |exprs: &[String], needle: &str| exprs.iter().any(|e| e.contains(needle));
    find("throughput in/out", &|t, e| {
        t.contains("throughput")
            && any(e, "rate(sessionflow_records_in_total")
            && any(e, "rate(sessionflow_records_out_total")
    });
    find("lag", &|t, e| {
        t.contains("lag") && !t.contains("effective") && any(e, "sessionflow_stage_lag{")
    });
    find("effective lag", &|t, e| {
        t.contains("effective lag") && any(e, "sessionflow_stage_effective_lag{")
    });
    find("replicas desired/ready", &|t, e| {
        t.contains("replicas")
            && any(e, "sessionflow_stage_replicas_desired")
            && any(e, "sessionflow_stage_replicas_ready")
    });
    find("retries", &|t, e| {
        t.contains("retries") && any(e, "sessionflow_retries_total")
    });
    find("DLQ by reason", &|t, e| {
        t.contains("dlq")
            && e.iter()
                .any(|e| e.contains("sessionflow_dlq_total") && e.contains("reason)"))
    });
    find("held partitions", &|t, e| {
        t.contains("held") && any(e, "sessionflow_paused_partitions")
    });
    find("stuck records", &|t, e| {
        t.contains("stuck") && any(e, "sessionflow_stuck_records")
    });
    find("handler latency quantiles", &|t, e| {
        t.contains("latency")
            && e.iter().any(|e| {
                e.contains("histogram_quantile(0.5,")
                    && e.contains("sessionflow_handler_duration_seconds_bucket")
            })
            && e.iter().any(|e| {
                e.contains("histogram_quantile(0.99,")
                    && e.contains("sessionflow_handler_duration_seconds_bucket")
            })
    });

    // Order violations: a stat panel, green at 0 and red from 1 on.
    let stat = panels
        .iter()
        .find(|p| {
            p["type"] == "stat"
                && title(p).contains("order violations")
                && any(&exprs(p), "sessionflow_order_violations_total")
        })
        .expect("no stat panel for order violations");
    let steps = stat["fieldConfig"]["defaults"]["thresholds"]["steps"]
        .as_array()
        .expect("order violations: threshold steps");
    assert_eq!(steps[0]["color"], "green", "order violations: base colour");
    assert!(steps[0]["value"].is_null(), "order violations: base step");
    let red = steps
        .iter()
        .find(|s| s["color"] == "red")
        .expect("order violations: a red step");
    assert!(
        red["value"].as_f64().is_some_and(|v| v > 0.0 && v <= 1.0),
        "order violations must turn red at any value above 0: {red}"
    );
}

#[test]
fn dashboard_variables_and_filters() {
    let d = dashboard();
    assert!(
        d["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion {}",
        d["schemaVersion"]
    );
    let vars = d["templating"]["list"].as_array().expect("templating.list");
    for name in ["namespace", "pipeline", "stage"] {
        let var = vars
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no ${name} variable"));
        let query = var["definition"].as_str().unwrap_or_default();
        assert!(
            query.contains("label_values(sessionflow_stage_lag")
                && query.ends_with(&format!("{name})")),
            "${name}: {query}"
        );
    }
    // Every per-stage query filters by the three variables (operator-wide ones have no stage).
    for panel in panels(&d) {
        for expr in exprs(panel) {
            if expr.contains("sessionflow_operator_") {
                continue;
            }
            for filter in [
                r#"namespace=~"$namespace""#,
                r#"pipeline=~"$pipeline""#,
                r#"stage=~"$stage""#,
            ] {
                assert!(
                    expr.contains(filter),
                    "panel {:?}: {expr} does not filter by {filter}",
                    panel["title"]
                );
            }
        }
    }
}
