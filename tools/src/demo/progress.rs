//! Progress while the demo runs, and knowing when the pipeline is done.
//!
//! Each stage's progress comes from its `/metrics` (records finished, retries, dead letters)
//! and its group's lag, read from the broker. The pipeline is done when, after the load has
//! been fully acknowledged, each stage in turn has committed all of its input: a stage is
//! checked only after the one before it was seen done, so nothing more can reach it. The lag
//! comes through the engine's [`lag::LagReaders`], the operator's autoscaler's too.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use sessionflow_worker::kafka::client_settings::ClientSettings;
use tokio_util::task::AbortOnDropHandle;

use super::pipeline::Pipeline;
use super::scrape::{Scraper, StageSnapshot};
use super::stages::StageProcesses;
use super::TICK;
use crate::loadgen;
use sessionflow_worker::commit::lag;

/// How often a progress line is printed when stderr is not a terminal.
const PLAIN_PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Every stage group's lag on its input topic, read from the broker: one reader per group, kept
/// from tick to tick.
pub(super) struct StageLags {
    kafka: ClientSettings,
    /// Each stage's group and input topic, in pipeline order.
    stages: Vec<(String, String)>,
    readers: lag::LagReaders,
}

/// Lag of one stage's group, and how many records its input topic holds.
#[derive(Debug, Clone, Copy, Default)]
struct StageLag {
    lag: i64,
    high: i64,
}

impl StageLags {
    pub(super) fn new(kafka: ClientSettings, pipeline: &Pipeline) -> anyhow::Result<Self> {
        let stages = pipeline
            .stages
            .iter()
            .map(|s| (s.group_id(), s.input.clone()))
            .collect();
        let mut lags = Self {
            kafka,
            stages,
            readers: lag::LagReaders::default(),
        };
        // Every client made now: a bad setting fails the demo before the stages start.
        for (group, _) in &lags.stages {
            lags.readers.get(&lags.kafka, group)?;
        }
        Ok(lags)
    }

    /// Reads every stage's lag, in stage order (blocking). `done[k]` is true when stage k has
    /// committed all of its input and, before that was read, every stage before it was done
    /// too (`upstream_done` for the first stage): then nothing more can arrive.
    fn read(&mut self, upstream_done: bool) -> (Vec<Option<StageLag>>, Vec<bool>) {
        let mut lags = Vec::new();
        let mut done = Vec::new();
        let mut before = upstream_done;
        for (group, topic) in &self.stages {
            let read = self
                .readers
                .get(&self.kafka, group)
                .and_then(|reader| reader.read_blocking(topic))
                .ok()
                .map(|l| StageLag {
                    lag: lag::total(&l),
                    high: l.iter().map(|p| p.high - p.low).sum(),
                });
            before = before && read.is_some_and(|l| l.lag == 0);
            lags.push(read);
            done.push(before);
        }
        (lags, done)
    }
}

/// Shows progress until every stage is done; returns the stages' final snapshots.
pub(super) async fn watch(
    stages: &mut StageProcesses,
    scraper: &Scraper,
    mut lags: StageLags,
    load: &AbortOnDropHandle<anyhow::Result<loadgen::LoadgenReport>>,
    records: u64,
    deadline: Instant,
) -> anyhow::Result<Vec<StageSnapshot>> {
    let names: Vec<String> = stages.procs.iter().map(|p| p.stage.clone()).collect();
    let mut view = ProgressView::new(&names, records);
    let mut now = Figures {
        produced: 0,
        snaps: vec![StageSnapshot::default(); names.len()],
        lags: vec![None; names.len()],
        done: vec![false; names.len()],
    };
    loop {
        stages.check_running()?;
        let loaded = load.is_finished();
        // The readers go to the blocking pool for the read and come back with the figures.
        let read;
        (lags, read) = tokio::task::spawn_blocking(move || {
            let read = lags.read(loaded);
            (lags, read)
        })
        .await?;
        (now.lags, now.done) = read;
        now.produced = now.lags[0].map_or(0, |l| l.high.max(0) as u64);
        // Read after the lags: once the last stage is done, the counters include everything.
        now.refresh(scraper.scrape_all(stages).await);
        let finished = now.done.last() == Some(&true);
        view.update(&now, finished);
        if finished {
            view.finish();
            return Ok(now.snaps);
        }
        if Instant::now() >= deadline {
            view.finish();
            let behind: Vec<String> = names
                .iter()
                .zip(&now.lags)
                .map(|(n, l)| format!("{n} lag {}", l.map_or("?".into(), |l| l.lag.to_string())))
                .collect();
            anyhow::bail!(
                "the pipeline did not finish in time ({})",
                behind.join(", ")
            );
        }
        tokio::time::sleep(TICK).await;
    }
}

/// What the progress view shows: the latest figures of the load and of every stage.
struct Figures {
    /// Records in the pipeline's input topic.
    produced: u64,
    snaps: Vec<StageSnapshot>,
    lags: Vec<Option<StageLag>>,
    done: Vec<bool>,
}

impl Figures {
    /// Keeps a stage's previous snapshot when it did not answer this time.
    fn refresh(&mut self, scraped: Vec<Option<StageSnapshot>>) {
        for (slot, snap) in self.snaps.iter_mut().zip(scraped) {
            if let Some(snap) = snap {
                *slot = snap;
            }
        }
    }
}

/// Progress bars on a terminal; a line every few seconds otherwise.
struct ProgressView {
    bars: Option<(indicatif::MultiProgress, Vec<indicatif::ProgressBar>)>,
    names: Vec<String>,
    records: u64,
    started: Instant,
    last_line: Option<Instant>,
}

impl ProgressView {
    fn new(names: &[String], records: u64) -> Self {
        let bars = std::io::stderr().is_terminal().then(|| {
            let multi = indicatif::MultiProgress::new();
            let style = indicatif::ProgressStyle::with_template(
                "{prefix:>9} [{bar:24}] {pos:>7}/{len:<7} {msg}",
            )
            .expect("valid template")
            .progress_chars("=> ");
            let bars = std::iter::once("loadgen")
                .chain(names.iter().map(String::as_str))
                .map(|n| {
                    let bar = multi.add(indicatif::ProgressBar::new(records));
                    bar.set_style(style.clone());
                    bar.set_prefix(n.to_string());
                    bar
                })
                .collect();
            (multi, bars)
        });
        Self {
            bars,
            names: names.to_vec(),
            records,
            started: Instant::now(),
            last_line: None,
        }
    }

    /// Shows the latest figures; `force` prints a plain line even if one was printed lately.
    fn update(&mut self, now: &Figures, force: bool) {
        // A record dead-lettered upstream never reaches a later stage.
        let mut reaching = self.records;
        let rows: Vec<(u64, u64, String)> = now
            .snaps
            .iter()
            .zip(&now.lags)
            .map(|(snap, lag)| {
                let row = (
                    snap.done(),
                    reaching,
                    lag.map_or("?".into(), |l| l.lag.to_string()),
                );
                reaching = reaching.saturating_sub(snap.dlq);
                row
            })
            .collect();
        let elapsed = self.started.elapsed().as_secs_f64();
        if let Some((_, bars)) = &self.bars {
            bars[0].set_position(now.produced);
            bars[0].set_message(format!("produced  {elapsed:.0}s"));
            for (i, (done, reaching, lag)) in rows.into_iter().enumerate() {
                let bar = &bars[i + 1];
                let snap = &now.snaps[i];
                bar.set_length(reaching);
                bar.set_position(done);
                let state = if now.done[i] { "  ✓" } else { "" };
                bar.set_message(format!(
                    "lag {lag}  retries {}  dlq {}{state}",
                    snap.retries, snap.dlq
                ));
            }
            return;
        }
        if !force
            && self
                .last_line
                .is_some_and(|t| t.elapsed() < PLAIN_PROGRESS_EVERY)
        {
            return;
        }
        self.last_line = Some(Instant::now());
        let mut line = format!(
            "  {elapsed:>4.0}s  loadgen {}/{}",
            now.produced, self.records
        );
        for (name, (done, reaching, lag)) in self.names.iter().zip(rows) {
            let _ = write!(line, " | {name} {done}/{reaching} lag {lag}");
        }
        eprintln!("{line}");
    }

    fn finish(&mut self) {
        if let Some((_, bars)) = &self.bars {
            for b in bars {
                b.finish();
            }
        }
    }
}
