//! What a stage's `/metrics` says: the counters the demo shows and summarises.
//!
//! The stages are separate processes; their Prometheus endpoint is how the demo (like any
//! monitoring) sees them. This reads the text format's sample lines, and sums what the demo
//! needs over labels: dead letters over reasons, handler durations over outcomes.

use std::time::Duration;

use super::stages::StageProcesses;

/// The figures the demo reads from one stage's `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageSnapshot {
    pub records_in: u64,
    pub records_out: u64,
    pub retries: u64,
    pub dlq: u64,
    pub in_flight: i64,
    /// Partitions the stage reports lag for: the ones it holds.
    pub assigned: usize,
    pub order_violations: u64,
    /// Handler-duration histogram over all outcomes: (upper bound in s, cumulative count).
    pub handler_buckets: Vec<(f64, f64)>,
}

impl StageSnapshot {
    /// Reads the Prometheus text exposition of a worker.
    pub fn parse(text: &str) -> Self {
        let mut s = Self::default();
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for sample in text.lines().filter_map(Sample::parse) {
            let v = sample.value;
            match sample.name {
                "sessionflow_records_in_total" => s.records_in += v as u64,
                "sessionflow_records_out_total" => s.records_out += v as u64,
                "sessionflow_retries_total" => s.retries += v as u64,
                "sessionflow_dlq_total" => s.dlq += v as u64,
                "sessionflow_in_flight" => s.in_flight += v as i64,
                "sessionflow_partition_lag" => s.assigned += 1,
                "sessionflow_order_violations_total" => s.order_violations += v as u64,
                "sessionflow_handler_duration_seconds_bucket" => {
                    let Some(le) = sample.label("le").and_then(parse_bound) else {
                        continue;
                    };
                    match buckets.iter_mut().find(|(b, _)| *b == le) {
                        Some((_, count)) => *count += v,
                        None => buckets.push((le, v)),
                    }
                }
                _ => {}
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        s.handler_buckets = buckets;
        s
    }

    /// Records finished: output or dead-lettered.
    pub fn done(&self) -> u64 {
        self.records_out + self.dlq
    }
}

fn parse_bound(le: &str) -> Option<f64> {
    match le {
        "+Inf" => Some(f64::INFINITY),
        _ => le.parse().ok(),
    }
}

/// One sample line of the Prometheus text format: `name{label="value",…} value`.
#[derive(Debug, PartialEq)]
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

impl<'a> Sample<'a> {
    fn parse(line: &'a str) -> Option<Self> {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
        let name = &line[..name_end];
        let mut rest = &line[name_end..];
        let mut labels = Vec::new();
        if let Some(body) = rest.strip_prefix('{') {
            let mut chars = body.char_indices();
            loop {
                // label name up to '=' (or the closing brace)
                let start = chars.clone().next()?.0;
                let (eq, c) = chars.find(|(_, c)| *c == '=' || *c == '}')?;
                if c == '}' {
                    rest = &body[eq + 1..];
                    break;
                }
                let key = body[start..eq].trim_start_matches(',').trim();
                if chars.next()?.1 != '"' {
                    return None;
                }
                let mut value = String::new();
                loop {
                    match chars.next()?.1 {
                        '\\' => match chars.next()?.1 {
                            'n' => value.push('\n'),
                            other => value.push(other),
                        },
                        '"' => break,
                        c => value.push(c),
                    }
                }
                labels.push((key, value));
            }
        }
        let value = rest.split_whitespace().next()?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().ok()?,
        };
        Some(Self {
            name,
            labels,
            value,
        })
    }

    fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads the stages' `/metrics`.
pub(super) struct Scraper {
    client: reqwest::Client,
}

impl Scraper {
    pub(super) fn new() -> anyhow::Result<Self> {
        Ok(Self {
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()?,
        })
    }

    async fn scrape(&self, url: &str) -> Option<StageSnapshot> {
        let response = self.client.get(url).send().await.ok()?;
        let text = response.text().await.ok()?;
        Some(StageSnapshot::parse(&text))
    }

    /// One snapshot per stage, in stage order; `None` where the stage did not answer.
    pub(super) async fn scrape_all(&self, stages: &StageProcesses) -> Vec<Option<StageSnapshot>> {
        let calls = stages.procs.iter().map(|p| self.scrape(&p.metrics_url));
        futures::future::join_all(calls).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_parsed_with_labels() {
        let s = Sample::parse(r#"m_bucket{le="0.5",outcome="o,k \"x\""} 12"#).unwrap();
        assert_eq!(s.name, "m_bucket");
        assert_eq!(s.label("le"), Some("0.5"));
        assert_eq!(s.label("outcome"), Some(r#"o,k "x""#));
        assert_eq!(s.value, 12.0);
        assert_eq!(Sample::parse("plain 3.5").unwrap().value, 3.5);
        assert_eq!(Sample::parse("m{} 1").unwrap().labels, vec![]);
        assert!(Sample::parse("# HELP m help").is_none());
        assert!(Sample::parse("").is_none());
    }

    #[test]
    fn a_snapshot_sums_labels_and_merges_histogram_outcomes() {
        let text = r#"
# TYPE sessionflow_dlq_total counter
sessionflow_dlq_total{reason="poison",stage="s"} 3
sessionflow_dlq_total{reason="stuck",stage="s"} 1
sessionflow_records_out_total{stage="s"} 90
sessionflow_retries_total{stage="s"} 7
sessionflow_in_flight{stage="s"} 2
sessionflow_partition_lag{partition="0",stage="s",topic="t"} 0
sessionflow_partition_lag{partition="1",stage="s",topic="t"} 5
sessionflow_handler_duration_seconds_bucket{le="0.001",outcome="ok",stage="s"} 1
sessionflow_handler_duration_seconds_bucket{le="+Inf",outcome="ok",stage="s"} 4
sessionflow_handler_duration_seconds_bucket{le="0.001",outcome="transient",stage="s"} 2
sessionflow_handler_duration_seconds_bucket{le="+Inf",outcome="transient",stage="s"} 2
"#;
        let s = StageSnapshot::parse(text);
        assert_eq!((s.dlq, s.records_out, s.retries), (4, 90, 7));
        assert_eq!((s.in_flight, s.assigned, s.done()), (2, 2, 94));
        assert_eq!(s.handler_buckets, vec![(0.001, 3.0), (f64::INFINITY, 6.0)]);
    }
}
