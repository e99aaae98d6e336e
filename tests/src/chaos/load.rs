//! The load of a chaos run: `loadgen` writing numbered sessions, rate-limited, on its own
//! runtime in the chaos process, for most of the fault phase.

use std::time::Duration;

use sessionflow_tools::loadgen::{self, LoadgenOptions, LoadgenReport};

use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

/// A load generator under way.
pub struct Load {
    runtime: Runtime,
    task: JoinHandle<anyhow::Result<LoadgenReport>>,
}

/// How a load generator ended.
pub enum LoadEnd {
    /// Every record acknowledged.
    Acknowledged(LoadgenReport),
    /// It failed, or was not done in time: the input topic holds whatever it wrote.
    Unfinished(String),
}

impl Load {
    /// Starts writing `records` records at `rate` per second over `sessions` sessions, with
    /// the cluster's producer properties `kafka`.
    pub fn start(
        brokers: &str,
        kafka: Vec<(String, String)>,
        topic: &str,
        records: u64,
        sessions: u64,
        rate: f64,
        seed: u64,
    ) -> anyhow::Result<Self> {
        let runtime = Runtime::new()?;
        let options = LoadgenOptions {
            seed,
            rate: Some(rate),
            kafka,
            ..LoadgenOptions::new(brokers, topic, records, sessions)
        };
        let task = runtime.spawn(async move { loadgen::run(&options).await });
        Ok(Self { runtime, task })
    }

    /// Waits up to `grace` for the last acknowledgements.
    pub fn finish(self, grace: Duration) -> LoadEnd {
        let Self { runtime, task } = self;
        match runtime.block_on(async { tokio::time::timeout(grace, task).await }) {
            Ok(Ok(Ok(report))) => LoadEnd::Acknowledged(report),
            Ok(Ok(Err(e))) => LoadEnd::Unfinished(format!("failed: {e:#}")),
            Ok(Err(e)) => LoadEnd::Unfinished(format!("task failed: {e}")),
            Err(_) => LoadEnd::Unfinished(format!("not done {}s later", grace.as_secs())),
        }
    }
}
