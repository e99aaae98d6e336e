//! The "How cost grows" section of BENCHMARKS.md and its charts, from the sweeps' outcomes.
//!
//! The sweeps ([`crate::sweeps`]) can run alone (`make bench-sweeps`), so their section must be
//! able to replace itself inside a BENCHMARKS.md written by an earlier full run without
//! touching P1–P5: it is written between two HTML comments, and [`splice`] swaps what lies
//! between them (or, the first time, puts it before the hand-written notes). Each sweep gets a
//! table and a chart; the numbers are the same definitions as P1–P5's (the report's own cell
//! formatting is reused), plus CPU per record: the system process's CPU seconds over the run ÷
//! the records it handled.

use std::fmt::Write as _;
use std::path::Path;

use crate::charts::{self, GrowthSeries, LoadSeries};
use crate::report::{fmt_int, fmt_ms, healthy_quantile, mib, rate_cell, Environment};
use crate::scenarios::{Measured, ScenarioId};
use crate::sweeps::{self, Axis, Sweeps};

pub const BEGIN: &str =
    "<!-- how-cost-grows:begin (written by sessionflow-bench; make bench-sweeps replaces it) -->";
pub const END: &str = "<!-- how-cost-grows:end -->";
const LATENCY_CHART: &str = "sweep-latency.svg";

/// µs of the system's CPU per record handled.
pub fn cpu_per_record_us(m: &Measured) -> Option<f64> {
    (m.result.handled > 0).then(|| m.result.cpu_s * 1e6 / m.result.handled as f64)
}

fn fmt_us(v: Option<f64>) -> String {
    match v {
        None => "—".into(),
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) if v >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

fn axis_title(axis: Axis) -> &'static str {
    match axis {
        Axis::Sessions => "Sessions (8 partitions, 100-byte values)",
        Axis::Partitions => "Partitions (1,000 sessions, 100-byte values)",
        Axis::ValueSize => "Record size (1,000 sessions, 8 partitions)",
    }
}

fn backlog_table(sweeps: &Sweeps, axis: Axis, md: &mut String) {
    let _ = writeln!(
        md,
        "| {} | records | system | throughput, msg/s | CPU µs/record | CPU s | broker CPU s | \
         peak RSS MiB | order violations |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        axis.name()
    );
    for p in sweeps.axis(axis) {
        for s in &p.outcome.systems {
            let Some(m) = s.backlog.as_ref() else {
                continue;
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {:.1} | {} | {} | {} |",
                fmt_int(axis.x(&p.shape)),
                fmt_int(m.expected as f64),
                s.system.label(),
                rate_cell(Some(m)),
                fmt_us(cpu_per_record_us(m)),
                m.result.cpu_s,
                m.broker_cpu_s.map_or("—".into(), |c| format!("{c:.1}")),
                mib(m.result.peak_rss),
                m.result.order_violations,
            );
        }
    }
    md.push('\n');
}

fn latency_table(sweeps: &Sweeps, md: &mut String) {
    let _ = writeln!(
        md,
        "| handler | system | capacity, msg/s | offered | offered, msg/s | produced, msg/s \
         (% of capacity) | handled, msg/s | p50 ms | p99 ms | p99.9 ms | CPU µs/record | order \
         violations |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for c in &sweeps.latency {
        for p in &c.points {
            let Some(m) = p.outcome.system(c.system).and_then(|s| s.paced.as_ref()) else {
                continue;
            };
            let q = |q| fmt_ms(healthy_quantile(Some(m), q), m.cap_secs);
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.0} % | {} | {} | {} | {} | {} | {} | {} | {} |",
                base_label(c.base),
                c.system.label(),
                c.capacity.map_or("—".into(), fmt_int),
                p.fraction * 100.0,
                m.offered_rate.map_or("—".into(), fmt_int),
                m.produced_rate.map_or("—".into(), |r| format!(
                    "{} ({:.0} %)",
                    fmt_int(r),
                    achieved_pct(p.fraction, m, c.capacity)
                )),
                rate_cell(Some(m)),
                q(0.5),
                q(0.99),
                q(0.999),
                fmt_us(cpu_per_record_us(m)),
                m.result.order_violations,
            );
        }
    }
    md.push('\n');
}

fn base_label(id: ScenarioId) -> &'static str {
    match id {
        ScenarioId::P1 => "P1 no-op",
        ScenarioId::P2 => "P2 5 ms I/O",
        _ => "other",
    }
}

/// The section, between [`BEGIN`] and [`END`].
pub fn section(env: &Environment, sweeps: &Sweeps) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{BEGIN}\n## How cost grows\n\n\
         The curves to size a stage with (issue 13): backlog throughput and CPU per record \
         against the number of sessions, partitions and the record size, and latency against \
         the offered load. Each backlog sweep varies one number around a middle point \
         ({} sessions, {} partitions, {}-byte values, the no-op handler; records round-robin \
         over the sessions, so each session gets the same share; sessions stay alive for the \
         whole drain, sessionIdleMs 30 s); each point is a backlog drained by sessionflow and, \
         as the reference, by the per-partition sequential consumer. Each point is an \
         ordinary scenario run by the same code as P1–P5, with its own topics and groups: the \
         definitions above hold. **CPU µs/record** is the system process's CPU seconds over the \
         backlog run (from just before it started, so start-up and the group join are in it; \
         at small `--scale` they dominate) ÷ the records it handled.\n",
        fmt_int(sweeps::MIDDLE.sessions as f64),
        sweeps::MIDDLE.partitions,
        sweeps::MIDDLE.value_size
    );
    let _ = writeln!(
        md,
        "- command: `{}`\n\
         - machine: {} CPUs (`nproc`), {}; shared with other work (1-minute load average {} \
         before the sweeps, {} after)\n\
         - date: {}; broker: {} at {}\n\
         - wall time of the sweeps: {:.0} s ({:.1} min){}\n",
        env.command,
        env.nproc,
        env.cpu_model,
        env.load_before,
        env.load_after,
        env.date,
        env.broker,
        env.brokers,
        sweeps.wall_s,
        sweeps.wall_s / 60.0,
        if (sweeps.scale - 1.0).abs() > f64::EPSILON {
            format!(
                "\n- **scaled run** (`--scale {}`): records and paced durations shrunk, not the \
                 full-size sweeps",
                sweeps.scale
            )
        } else {
            String::new()
        }
    );
    for axis in Axis::ALL {
        let _ = writeln!(md, "### {}\n", axis_title(axis));
        if axis == Axis::ValueSize {
            md.push_str(
                "The value is the record's payload (the key, `session-NNNNNNN`, and the \
                 `sessionflow-seq` header come on top). Fewer records at 10 KB (at most 1 GB \
                 of values per backlog): compare rates, not times.\n\n",
            );
        }
        backlog_table(sweeps, axis, &mut md);
        let _ = writeln!(
            md,
            "![{}](bench/results/{})\n",
            axis_title(axis),
            axis.chart_file()
        );
    }
    md.push_str(
        "### Latency against offered load\n\n\
         The capacity is sessionflow's backlog throughput on P1's records (1,000 Zipf \
         sessions, no-op handler) and on P2's (1,000 round-robin sessions, 5 ms simulated \
         I/O), measured in this run; then the same records are offered at 25, 50, 80 and 95 % \
         of it in paced runs of 10 s each (scaled), the system running and fetching before \
         the load starts. With `--systems …,parallel-consumer` the Parallel Consumer gets the \
         same, at fractions of its own capacity (one backlog round, not five). *produced* is the rate the harness's producer achieved (it shares \
         the 2 cores, and tops out near its backlog rate, so at high fractions it may not reach the \
         rate asked: the chart's x is the load it achieved); *handled* the rate the system \
         completed. A run that could not keep up \
         hits its cap (the load's length + 15 s) and its late percentiles read \"> cap\".\n\n",
    );
    latency_table(sweeps, &mut md);
    let _ = writeln!(
        md,
        "![latency against offered load](bench/results/{LATENCY_CHART})\n"
    );
    if !sweeps.failures.is_empty() {
        md.push_str("Sweep points that failed:\n\n");
        for f in &sweeps.failures {
            let _ = writeln!(md, "- {f}");
        }
        md.push('\n');
    }
    md.push_str("The raw results are in `bench/results/results.json` (`sweeps`).\n\n");
    md.push_str(END);
    md.push('\n');
    md
}

/// The load a paced run really offered, as % of `capacity`: what the producer achieved (it
/// shares the cores, and may fall short of the rate asked), else the fraction asked.
pub fn achieved_pct(fraction: f64, m: &Measured, capacity: Option<f64>) -> f64 {
    match (m.produced_rate, capacity) {
        (Some(r), Some(c)) if c > 0.0 => r / c * 100.0,
        _ => fraction * 100.0,
    }
}

/// The sweeps' charts, into `dir`.
pub fn write_charts(sweeps: &Sweeps, dir: &Path) -> anyhow::Result<()> {
    for axis in Axis::ALL {
        let mut series: Vec<GrowthSeries> = Vec::new();
        for p in sweeps.axis(axis) {
            for s in &p.outcome.systems {
                let Some(m) = s.backlog.as_ref() else {
                    continue;
                };
                let (Some(t), Some(cpu)) = (m.result.throughput(), cpu_per_record_us(m)) else {
                    continue;
                };
                let point = (axis.x(&p.shape), t, cpu);
                match series.iter_mut().find(|g| g.system == s.system) {
                    Some(g) => g.points.push(point),
                    None => series.push(GrowthSeries {
                        system: s.system,
                        points: vec![point],
                    }),
                }
            }
        }
        charts::growth_chart(
            &format!(
                "Backlog throughput and CPU per record against {}",
                axis.name()
            ),
            axis.name(),
            &series,
            &dir.join(axis.chart_file()),
        )?;
    }
    let series: Vec<LoadSeries> = sweeps
        .latency
        .iter()
        .enumerate()
        .map(|(i, c)| LoadSeries {
            label: format!("{}, {}", base_label(c.base), c.system.label()),
            colour: [
                plotters::style::RGBColor(31, 119, 180),
                plotters::style::RGBColor(148, 103, 189),
                plotters::style::RGBColor(44, 160, 44),
                plotters::style::RGBColor(214, 39, 40),
            ][i % 4],
            points: c
                .points
                .iter()
                .filter_map(|p| {
                    let m = p.outcome.system(c.system)?.paced.as_ref()?;
                    let ms = |q| healthy_quantile(Some(m), q).map(|us| us / 1e3);
                    Some((achieved_pct(p.fraction, m, c.capacity), ms(0.5), ms(0.99)))
                })
                .collect(),
        })
        .collect();
    charts::load_latency_chart(&series, &dir.join(LATENCY_CHART))
}

/// `existing` with its "How cost grows" section replaced by `section`; without one, `section`
/// goes before the line `before` (the notes' first line) or, failing that, at the end.
pub fn splice(existing: &str, section: &str, before: Option<&str>) -> String {
    if let (Some(b), Some(e)) = (existing.find(BEGIN), existing.find(END)) {
        if b < e {
            let rest = existing[e + END.len()..].trim_start_matches('\n');
            return format!("{}{section}\n{rest}", &existing[..b]);
        }
    }
    let at = before.filter(|l| !l.trim().is_empty()).and_then(|l| {
        existing
            .match_indices(l)
            .map(|(i, _)| i)
            .find(|&i| i == 0 || existing.as_bytes()[i - 1] == b'\n')
    });
    match at {
        Some(i) => format!("{}{section}\n{}", &existing[..i], &existing[i..]),
        None => format!("{}\n\n{section}", existing.trim_end()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section_of(body: &str) -> String {
        format!("{BEGIN}\n## How cost grows\n\n{body}\n{END}\n")
    }

    #[test]
    fn splice_replaces_the_section_and_keeps_the_rest() {
        let doc = format!(
            "# B\n\n## P1\n\nx\n\n{}\n## Notes\n\nn\n",
            section_of("old")
        );
        let out = splice(&doc, &section_of("new"), Some("## Notes"));
        assert_eq!(
            out,
            format!(
                "# B\n\n## P1\n\nx\n\n{}\n## Notes\n\nn\n",
                section_of("new")
            )
        );
        // Again: stable.
        assert_eq!(splice(&out, &section_of("new"), Some("## Notes")), out);
    }

    #[test]
    fn without_a_section_it_goes_before_the_notes_or_at_the_end() {
        let doc = "# B\n\n## P1\n\nsee ## Notes below\n\n## Notes\n\nn\n";
        assert_eq!(
            splice(doc, &section_of("s"), Some("## Notes")),
            format!(
                "# B\n\n## P1\n\nsee ## Notes below\n\n{}\n## Notes\n\nn\n",
                section_of("s")
            )
        );
        assert_eq!(
            splice("# B\n", &section_of("s"), None),
            format!("# B\n\n{}", section_of("s"))
        );
    }

    #[test]
    fn an_empty_run_still_renders() {
        let md = section(&Environment::default(), &Sweeps::default());
        assert!(md.starts_with(BEGIN) && md.trim_end().ends_with(END));
        assert!(md.contains("### Latency against offered load"));
    }
}
