//! Charts: the report's pictures, as SVG files drawn with plotters.
//!
//! Tables give the numbers; the charts show what a reader should see at a glance: how each
//! design's throughput compares scenario by scenario (log scale: the designs differ by orders
//! of magnitude in P2), in P4 how much of the healthy sessions' latency distribution one
//! failing session drags out, and in the growth sweeps how throughput and CPU per record move
//! with sessions, partitions and record size, and latency with the offered load. Only plotters'
//! SVG backend is used — no bitmap encoder and no font loading (SVG text is laid out with
//! plotters' built-in estimate and drawn by the viewer).

use std::path::Path;

use plotters::prelude::*;

use crate::scenarios::{Measured, Outcome};
use crate::systems::SystemKind;

pub fn colour(kind: SystemKind) -> RGBColor {
    match kind {
        SystemKind::Ceiling => RGBColor(120, 120, 120),
        SystemKind::Sessionflow => RGBColor(31, 119, 180),
        SystemKind::SessionflowOutput => RGBColor(44, 160, 44),
        SystemKind::SessionflowEos => RGBColor(23, 190, 207),
        SystemKind::SessionflowAlo100 => RGBColor(140, 86, 75),
        SystemKind::Sequential => RGBColor(214, 39, 40),
        SystemKind::Pool => RGBColor(255, 127, 14),
        SystemKind::ParallelConsumer => RGBColor(148, 103, 189),
        SystemKind::ParallelConsumerTx => RGBColor(227, 119, 194),
    }
}

fn throughput(m: Option<&Measured>) -> Option<f64> {
    m.and_then(|m| m.result.throughput())
}

/// Grouped bars: one group per scenario that compares systems, one bar per system that ran.
pub fn throughput_chart(outcomes: &[Outcome], path: &Path) -> anyhow::Result<()> {
    let groups: Vec<&Outcome> = outcomes.iter().filter(|o| o.systems.len() > 1).collect();
    let kinds: Vec<SystemKind> = SystemKind::EVERY
        .into_iter()
        .filter(|k| groups.iter().any(|o| o.system(*k).is_some()))
        .collect();
    let values: Vec<Vec<(SystemKind, f64)>> = groups
        .iter()
        .map(|o| {
            o.systems
                .iter()
                .filter_map(|s| {
                    throughput(s.backlog.as_ref().or(s.paced.as_ref())).map(|t| (s.system, t))
                })
                .collect()
        })
        .collect();
    let max = values
        .iter()
        .flatten()
        .map(|(_, v)| *v)
        .fold(1_000.0f64, f64::max);
    let top = 10f64.powf(max.log10().ceil());
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let n = groups.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Throughput by scenario and system (msg/s, log scale)",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..(n - 0.5), (100f64..top).log_scale())?;
    let labels: Vec<String> = groups
        .iter()
        .map(|o| format!("{:?}", o.scenario.id))
        .collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len().max(1))
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| crate::report::fmt_int(*y))
        .y_desc("msg/s")
        .draw()?;
    let width = 0.8 / kinds.len().max(1) as f64;
    for (slot, &kind) in kinds.iter().enumerate() {
        let bars: Vec<Rectangle<(f64, f64)>> = values
            .iter()
            .enumerate()
            .filter_map(|(g, vs)| {
                let v = vs.iter().find(|(k, _)| *k == kind)?.1;
                let x0 = g as f64 - 0.4 + slot as f64 * width;
                Some(Rectangle::new(
                    [(x0, 100.0), (x0 + width * 0.9, v.max(100.0))],
                    colour(kind).filled(),
                ))
            })
            .collect();
        chart
            .draw_series(bars)?
            .label(kind.label())
            .legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour(kind).filled())
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// P4: for each system, the fraction of healthy records slower than x (log–log), with the
/// fault (solid) and without (dashed).
pub fn p4_latency_chart(p4: &Outcome, path: &Path) -> anyhow::Result<()> {
    // (system, with the fault, (latency ms, fraction slower) points)
    type Curve = (SystemKind, bool, Vec<(f64, f64)>);
    let mut curves: Vec<Curve> = Vec::new();
    for s in &p4.systems {
        for (fault, m) in [(true, s.paced.as_ref()), (false, s.fault_free.as_ref())] {
            let Some(m) = m else { continue };
            let total = (m.result.healthy.count() + m.censored_healthy()).max(1) as f64;
            let floor = 0.5 / total;
            let points: Vec<(f64, f64)> = m
                .result
                .healthy
                .cdf(m.censored_healthy())
                .into_iter()
                .map(|(us, f)| (us / 1e3, (1.0 - f).max(floor)))
                .collect();
            curves.push((s.system, fault, points));
        }
    }
    let xmax = curves
        .iter()
        .flat_map(|(_, _, p)| p.iter().map(|(x, _)| *x))
        .fold(10.0f64, f64::max);
    let ymin = curves
        .iter()
        .flat_map(|(_, _, p)| p.iter().map(|(_, y)| *y))
        .fold(1.0f64, f64::min)
        .max(1e-7);
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "P4: latency of the 999 healthy sessions, one session failing for 10 s",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (0.1f64..xmax * 1.5).log_scale(),
            (ymin * 0.5..1.0f64).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("latency, ms (produce stamp → handler done)")
        .y_desc("fraction of records slower")
        .x_label_formatter(&|x| format!("{x}"))
        .y_label_formatter(&|y| format!("{y:e}"))
        .draw()?;
    for (kind, fault, points) in curves {
        let style = colour(kind).stroke_width(2);
        let label = format!(
            "{}{}",
            kind.label(),
            if fault {
                ", with fault"
            } else {
                ", fault-free"
            }
        );
        let steps = points.clone();
        if fault {
            chart
                .draw_series(LineSeries::new(steps, style))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour(kind).stroke_width(2))
                });
        } else {
            chart
                .draw_series(DashedLineSeries::new(steps, 6, 4, style))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 8, y)], colour(kind).stroke_width(2))
                });
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// A log-scale axis range around `values` (a factor of `pad` either side; `1..10` when empty).
fn log_range(values: impl Iterator<Item = f64>, pad: f64) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| *v > 0.0 && v.is_finite())
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return 1.0..10.0;
    }
    lo / pad..hi * pad
}

/// `(x, throughput msg/s, CPU µs per record)`.
type GrowthPoint = (f64, f64, f64);

/// One line of a growth chart.
pub struct GrowthSeries {
    pub system: SystemKind,
    pub points: Vec<GrowthPoint>,
}

/// One panel of a growth chart: `y` of every series' points against their x (log scale), on
/// `area` with the y axis `y_spec` (a log or a linear range: two coordinate types, hence a
/// macro rather than a function).
macro_rules! growth_panel {
    ($area:expr, $x_desc:expr, $x_range:expr, $y_spec:expr, $y_desc:expr, $y:expr, $series:expr, $legend:expr) => {{
        let mut chart = ChartBuilder::on($area)
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d($x_range.log_scale(), $y_spec)?;
        chart
            .configure_mesh()
            .x_desc($x_desc)
            .y_desc($y_desc)
            .x_label_formatter(&|x| crate::report::fmt_int(*x))
            .y_label_formatter(&|v| {
                if *v >= 1_000.0 {
                    crate::report::fmt_int(*v)
                } else {
                    format!("{v}")
                }
            })
            .draw()?;
        for s in $series {
            let c = colour(s.system);
            let points: Vec<(f64, f64)> = s.points.iter().map(|p| (p.0, $y(p))).collect();
            chart
                .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))?
                .label(s.system.label())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            chart.draw_series(points.into_iter().map(|p| Circle::new(p, 4, c.filled())))?;
        }
        if $legend {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerLeft)
                .background_style(WHITE.mix(0.9))
                .border_style(BLACK)
                .draw()?;
        }
    }};
}

/// A growth sweep: throughput (left) and CPU per record (right) against `x_desc`, one line per
/// system, log–log.
pub fn growth_chart(
    title: &str,
    x_desc: &str,
    series: &[GrowthSeries],
    path: &Path,
) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (1000, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 20))?;
    let (left, right) = root.split_horizontally(500);
    let xs = || series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let x_range = log_range(xs(), 1.5);
    let throughput = |p: &GrowthPoint| p.1;
    let cpu = |p: &GrowthPoint| p.2;
    let t_range = log_range(
        series.iter().flat_map(|s| s.points.iter().map(throughput)),
        2.0,
    );
    let cpu_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(cpu))
        .fold(1.0f64, f64::max);
    // Throughput on a log scale (the systems differ by multiples), CPU per record on a linear
    // one from zero (a few µs to a few tens: log ticks would leave it unlabelled).
    growth_panel!(
        &left,
        x_desc,
        x_range.clone(),
        t_range.log_scale(),
        "backlog throughput, msg/s",
        throughput,
        series,
        true
    );
    growth_panel!(
        &right,
        x_desc,
        x_range,
        0f64..cpu_max * 1.15,
        "CPU per record, µs",
        cpu,
        series,
        false
    );
    root.present()?;
    Ok(())
}

/// `(offered % of capacity, p50 ms, p99 ms)`; a percentile beyond the run's cap is `None` (not
/// drawn).
type LoadPoint = (f64, Option<f64>, Option<f64>);

/// One curve of the latency chart.
pub struct LoadSeries {
    pub label: String,
    pub colour: RGBColor,
    pub points: Vec<LoadPoint>,
}

/// Latency against offered load: p50 (solid) and p99 (dashed) per curve, log latency.
pub fn load_latency_chart(series: &[LoadSeries], path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let values = series
        .iter()
        .flat_map(|s| s.points.iter().flat_map(|p| [p.1, p.2]).flatten());
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Latency against offered load (achieved, % of the capacity measured in the same run)",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..100f64, log_range(values, 2.0).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("offered load achieved by the producer, % of capacity")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("latency, ms (produce stamp → handler done)")
        .y_label_formatter(&|v| format!("{v}"))
        .draw()?;
    for s in series {
        let c = s.colour;
        let line = |pick: fn(&LoadPoint) -> Option<f64>| -> Vec<(f64, f64)> {
            s.points
                .iter()
                .filter_map(|p| pick(p).map(|v| (p.0, v)))
                .collect()
        };
        let (p50, p99) = (line(|p| p.1), line(|p| p.2));
        chart
            .draw_series(LineSeries::new(p50.clone(), c.stroke_width(2)))?
            .label(format!("{}, p50", s.label))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(DashedLineSeries::new(p99.clone(), 6, 4, c.stroke_width(2)))?
            .label(format!("{}, p99", s.label))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 8, y)], c.stroke_width(2)));
        chart.draw_series(
            p50.into_iter()
                .chain(p99)
                .map(|p| Circle::new(p, 3, c.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_ranges_pad_the_values_and_survive_no_values() {
        assert_eq!(log_range([2.0, 50.0].into_iter(), 2.0), 1.0..100.0);
        assert_eq!(log_range([0.0, f64::NAN].into_iter(), 2.0), 1.0..10.0);
    }
}
