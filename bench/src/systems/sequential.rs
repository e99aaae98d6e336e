//! System 3: the per-partition sequential consumer.
//!
//! The design Kafka's ordering suggests first: each partition is a queue, so process each
//! partition's records one at a time, in offset order, retrying a failing record in place
//! before moving on. Per-session order holds trivially (a session lives in one partition), but
//! parallelism is capped at the partition count, and a slow or failing record delays every
//! session that shares its partition. Each partition gets its own librdkafka queue
//! (`split_partition_queue`) and its own task; a record's offset is stored for the periodic
//! auto-commit once it is done.

use std::sync::Arc;

use futures::FutureExt;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::Message;
use tokio_util::sync::CancellationToken;

use super::{baseline_consumer, Running, SystemSettings};
use crate::handler::Core;
use crate::workload::{decode, seq_header};

pub fn start(settings: &SystemSettings, core: Arc<Core>) -> anyhow::Result<Running> {
    let mut config = baseline_consumer(settings, true);
    config.set("auto.commit.interval.ms", "1000");
    let consumer: Arc<StreamConsumer> = Arc::new(config.create()?);
    consumer.assign(&settings.assignment()?)?;
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for p in 0..settings.partitions {
        let queue = consumer
            .split_partition_queue(&settings.topic, p)
            .ok_or_else(|| anyhow::anyhow!("no queue for partition {p}"))?;
        let (core, stop, consumer) = (core.clone(), stop.clone(), consumer.clone());
        let (topic, retry) = (settings.topic.clone(), settings.retry());
        tasks.push(tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    m = queue.recv() => m,
                    _ = stop.cancelled() => return,
                };
                let (view, offset) = match next {
                    Ok(m) => (decode(m.payload(), seq_header(m.headers())), m.offset()),
                    Err(e) => {
                        eprintln!("sequential: partition {p}: {e}");
                        continue;
                    }
                };
                if let Some(v) = view {
                    core.call_until_done(v, p, &retry).await;
                }
                let _ = consumer.store_offset(&topic, p, offset);
            }
        }));
    }
    // The main queue must be served for events; with every partition split off it carries no
    // records (one arriving here would have been fetched before its queue was split).
    let (main_stop, main) = (stop.clone(), consumer.clone());
    tasks.push(tokio::spawn(async move {
        loop {
            tokio::select! {
                m = main.recv() => if let Ok(m) = m {
                    eprintln!("sequential: record of partition {} on the main queue", m.partition());
                },
                _ = main_stop.cancelled() => return,
            }
        }
    }));
    Ok(Running {
        stop: Box::new(move || {
            async move {
                stop.cancel();
                for t in tasks {
                    let _ = t.await;
                }
            }
            .boxed()
        }),
        sessions: None,
        pid: None,
        go: None,
    })
}
