//! The demo's report: a row per stage, and `verify` of the last topic against the first.
//!
//! Everything is read back from the topics once the stages have stopped, and measured as
//! follows.
//! - *End-to-end latency* of stage k: its output record's timestamp minus the timestamp of the
//!   loadgen record it came from, joined on `sessionflow-event-id`. Both are create times set by
//!   the producing client (loadgen, and stage k when it enqueues the output) on this machine's
//!   clock, so the figure covers fetching, queueing behind the session's earlier records, every
//!   attempt and backoff, at every stage up to k. Millisecond resolution.
//! - *Handler latency*: one attempt, estimated from the stage's
//!   `sessionflow_handler_duration_seconds` histogram (all outcomes) as Prometheus'
//!   `histogram_quantile` does: linear within a bucket, so as precise as the buckets.
//! - *Throughput*: records the stage finished (outputs and dead letters) over the time from the
//!   first record entering its input topic to its last output.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use super::pipeline::Pipeline;
use super::scrape::StageSnapshot;
use crate::verify::{self, Checker, SeqRecord, VerifyReport};
use sessionflow_worker::record::header;

/// The topics read back after the run.
pub(super) struct ReadBack {
    input: Vec<SeqRecord>,
    /// Each stage's output, in stage order.
    outputs: Vec<Vec<SeqRecord>>,
    dead_letters: Vec<SeqRecord>,
}

/// Reads the input, every output and the DLQs back. One topic at a time: the mock cluster
/// answers a fetch with one batch per partition, found by a scan from the partition's first
/// batch, and several readers at once only make it slower.
pub(super) async fn read_topics(brokers: &str, pipeline: &Pipeline) -> anyhow::Result<ReadBack> {
    let brokers = brokers.to_string();
    let input = pipeline.input().to_string();
    let outputs: Vec<String> = pipeline
        .stages
        .iter()
        .filter_map(|s| s.output.clone())
        .collect();
    let dlqs: Vec<String> = pipeline.dlqs().iter().map(|d| d.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let read = |t: &str| verify::read_topic(&brokers, t, None, Duration::from_secs(300));
        let mut dead_letters = Vec::new();
        for d in &dlqs {
            dead_letters.extend(read(d)?);
        }
        Ok(ReadBack {
            input: read(&input)?,
            outputs: outputs
                .iter()
                .map(|t| read(t))
                .collect::<anyhow::Result<_>>()?,
            dead_letters,
        })
    })
    .await?
}

/// `verify`: the last output against the input, dead letters accounted for.
pub(super) fn check(read: &ReadBack) -> VerifyReport {
    let mut checker = Checker::new();
    for r in read.outputs.last().into_iter().flatten() {
        checker.output(r.session.as_deref(), r.seq);
    }
    for r in &read.dead_letters {
        checker.dead_letter(r.session.as_deref(), r.seq);
    }
    let input: Vec<(&str, u64)> = read
        .input
        .iter()
        .filter_map(|r| Some((r.session.as_deref()?, r.seq?)))
        .collect();
    checker.finish(Some(input))
}

/// The event id a record carries, or the one the first stage gives it.
fn event_id(topic: &str, r: &SeqRecord) -> String {
    r.header(header::EVENT_ID)
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{topic}-{}-{}", r.partition, r.offset))
}

/// One row of the summary table.
#[derive(Debug, Clone, PartialEq)]
pub struct StageRow {
    pub stage: String,
    /// Output records (acknowledged).
    pub records: u64,
    /// Finished records per second.
    pub throughput: Option<f64>,
    /// Handler attempt latency, seconds.
    pub handler_p50: Option<f64>,
    pub handler_p99: Option<f64>,
    /// End-to-end latency, milliseconds.
    pub e2e_p50: Option<i64>,
    pub e2e_p99: Option<i64>,
    pub retries: u64,
    pub dlq: u64,
}

pub(super) fn summarize(
    pipeline: &Pipeline,
    finals: &[StageSnapshot],
    read: &ReadBack,
) -> Vec<StageRow> {
    let first_input = pipeline.input();
    let born: HashMap<String, i64> = read
        .input
        .iter()
        .filter_map(|r| Some((event_id(first_input, r), r.timestamp_ms?)))
        .collect();
    pipeline
        .stages
        .iter()
        .zip(finals)
        .enumerate()
        .map(|(k, (stage, snap))| {
            let output = read.outputs.get(k).map(Vec::as_slice).unwrap_or_default();
            let stage_input = match k {
                0 => read.input.as_slice(),
                _ => read.outputs[k - 1].as_slice(),
            };
            let mut e2e = end_to_end(&born, first_input, output);
            e2e.sort_unstable();
            let first_in = stage_input.iter().filter_map(|r| r.timestamp_ms).min();
            let last_out = output.iter().filter_map(|r| r.timestamp_ms).max();
            StageRow {
                stage: stage.stage.clone(),
                records: snap.records_out,
                throughput: throughput(snap.done(), first_in, last_out),
                handler_p50: histogram_quantile(0.50, &snap.handler_buckets),
                handler_p99: histogram_quantile(0.99, &snap.handler_buckets),
                e2e_p50: percentile(&e2e, 0.50),
                e2e_p99: percentile(&e2e, 0.99),
                retries: snap.retries,
                dlq: snap.dlq,
            }
        })
        .collect()
}

/// Milliseconds from each record's birth (its first input's timestamp, by event id) to its
/// output's timestamp; a record output twice (a replay) counts once, at its first output.
fn end_to_end(born: &HashMap<String, i64>, first_input: &str, output: &[SeqRecord]) -> Vec<i64> {
    let mut seen = HashSet::new();
    output
        .iter()
        .filter_map(|r| {
            let id = event_id(first_input, r);
            let t0 = *born.get(&id)?;
            let t1 = r.timestamp_ms?;
            seen.insert(id).then_some(t1 - t0)
        })
        .collect()
}

/// Records per second over `[first_in, last_out]`.
pub fn throughput(records: u64, first_in: Option<i64>, last_out: Option<i64>) -> Option<f64> {
    let span_ms = last_out? - first_in?;
    (span_ms > 0).then(|| records as f64 * 1000.0 / span_ms as f64)
}

/// The nearest-rank percentile of sorted values (`q` in (0, 1]).
pub fn percentile(sorted: &[i64], q: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

/// The `q` quantile of a histogram given as (upper bound, cumulative count) sorted by bound,
/// interpolated linearly inside its bucket, as Prometheus' `histogram_quantile` does. A
/// quantile in the `+Inf` bucket is reported as the highest finite bound.
pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(upper, count) in buckets {
        if count >= rank {
            if upper.is_infinite() {
                return Some(lower);
            }
            if count <= below {
                return Some(upper);
            }
            return Some(lower + (upper - lower) * (rank - below) / (count - below));
        }
        (lower, below) = (upper, count);
    }
    Some(lower)
}

/// The summary table.
pub fn render_table(rows: &[StageRow]) -> String {
    let ms = |s: Option<f64>| s.map_or("-".to_string(), |s| format!("{:.1}", s * 1000.0));
    let int = |v: Option<i64>| v.map_or("-".to_string(), |v| v.to_string());
    let header = [
        "stage",
        "records",
        "rec/s",
        "handler p50 ms",
        "p99 ms",
        "e2e p50 ms",
        "p99 ms",
        "retries",
        "dlq",
    ];
    let cells: Vec<[String; 9]> = rows
        .iter()
        .map(|r| {
            [
                r.stage.clone(),
                r.records.to_string(),
                r.throughput.map_or("-".into(), |t| format!("{t:.0}")),
                ms(r.handler_p50),
                ms(r.handler_p99),
                int(r.e2e_p50),
                int(r.e2e_p99),
                r.retries.to_string(),
                r.dlq.to_string(),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            cells
                .iter()
                .map(|c| c[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cols: &[String]| {
        let mut s = String::new();
        for (i, c) in cols.iter().enumerate() {
            if i == 0 {
                let _ = write!(s, "{c:<w$}", w = widths[i]);
            } else {
                let _ = write!(s, "  {c:>w$}", w = widths[i]);
            }
        }
        s
    };
    let mut out = line(&header.map(String::from));
    out.push('\n');
    out.push_str(&"-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len() - 1)));
    for c in &cells {
        out.push('\n');
        out.push_str(&line(c));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<i64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), Some(50));
        assert_eq!(percentile(&v, 0.99), Some(99));
        assert_eq!(percentile(&v, 1.0), Some(100));
        assert_eq!(percentile(&[7], 0.01), Some(7));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn histogram_quantiles_interpolate_inside_the_bucket() {
        // 10 in (0, 1], 10 in (1, 3], none above.
        let b = [(1.0, 10.0), (3.0, 20.0), (f64::INFINITY, 20.0)];
        assert_eq!(histogram_quantile(0.5, &b), Some(1.0));
        assert_eq!(histogram_quantile(0.25, &b), Some(0.5));
        assert_eq!(histogram_quantile(0.75, &b), Some(2.0));
        // The quantile falls in +Inf: the highest finite bound.
        let b = [(1.0, 1.0), (f64::INFINITY, 10.0)];
        assert_eq!(histogram_quantile(0.99, &b), Some(1.0));
        assert_eq!(histogram_quantile(0.5, &[(1.0, 0.0)]), None);
        assert_eq!(histogram_quantile(0.5, &[]), None);
    }

    #[test]
    fn throughput_needs_a_span() {
        assert_eq!(throughput(1000, Some(0), Some(2000)), Some(500.0));
        assert_eq!(throughput(1000, Some(5), Some(5)), None);
        assert_eq!(throughput(1000, None, Some(5)), None);
    }

    fn record(partition: i32, offset: i64, event: Option<&str>, ts: i64) -> SeqRecord {
        SeqRecord {
            key: None,
            partition,
            offset,
            session: Some("s".into()),
            seq: Some(1),
            headers: event
                .map(|e| vec![(header::EVENT_ID.to_string(), e.to_string())])
                .unwrap_or_default(),
            value: vec![],
            timestamp_ms: Some(ts),
        }
    }

    #[test]
    fn end_to_end_joins_on_event_ids_and_counts_replays_once() {
        let input = [record(0, 0, None, 1_000), record(1, 4, None, 1_010)];
        let born: HashMap<String, i64> = input
            .iter()
            .map(|r| (event_id("in", r), r.timestamp_ms.unwrap()))
            .collect();
        let output = [
            record(3, 0, Some("in-1-4"), 1_050),
            record(2, 0, Some("in-0-0"), 1_020),
            record(2, 1, Some("in-0-0"), 1_500), // replayed
            record(2, 2, Some("elsewhere-0-0"), 1_500),
        ];
        assert_eq!(end_to_end(&born, "in", &output), vec![40, 20]);
    }

    #[test]
    fn the_table_has_a_row_per_stage_and_aligned_columns() {
        let row = |stage: &str| StageRow {
            stage: stage.into(),
            records: 59_940,
            throughput: Some(998.4),
            handler_p50: Some(0.0205),
            handler_p99: None,
            e2e_p50: Some(31),
            e2e_p99: Some(250),
            retries: 6_650,
            dlq: 60,
        };
        let t = render_table(&[row("ingest"), row("delivery")]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].starts_with("stage"));
        assert!(lines[2].starts_with("ingest"), "{t}");
        assert!(lines[3].contains("20.5") && lines[3].contains("998"), "{t}");
        assert!(lines[3].contains(" - "), "{t}");
        let widths: HashSet<usize> = lines.iter().map(|l| l.chars().count()).collect();
        assert_eq!(widths.len(), 1, "{t}");
    }
}
