//! System 1, the ceiling: librdkafka consuming the records with no processing at all.
//!
//! One `BaseConsumer` on one thread, handing each record to the measurements only. It reads
//! the records the way the engine does: each partition split into its own queue (the engine's
//! `partition_queues`, detached before the assignment so no record goes through the main
//! queue), taken in bursts from every partition in turn (a burst in one call, as the engine's
//! `fetched`), with a wait on the queues' doorbell when all are empty. Polling the consumer's single queue instead made this "ceiling" swing
//! between runs (librdkafka hands a backlog out through it one partition at a time) and fall
//! below the designs it bounds. Whatever a real design adds (routing, a handler, retries,
//! offset bookkeeping) can only cost, so this is the rate the others are held against.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::Message;
use sessionflow_worker::intake::partition_queues::{detach_before_assign, PartitionQueues};

use super::{baseline_consumer, Running, SystemSettings};
use crate::handler::Core;
use crate::workload::{decode, seq_header};

/// Records taken from one partition's queue before the next partition's (as the engine).
const BURST: usize = 256;
/// Longest wait for records while every queue is empty (also how often `stop` is checked).
const IDLE_WAIT: Duration = Duration::from_millis(50);

/// Hands a record to the measurements.
fn observe(core: &Core, m: &impl Message) {
    if let Some(v) = decode(m.payload(), seq_header(m.headers())) {
        core.observe(v, m.partition());
    }
}

pub fn start(settings: &SystemSettings, core: Arc<Core>) -> anyhow::Result<Running> {
    let consumer: Arc<BaseConsumer> = Arc::new(baseline_consumer(settings, false).create()?);
    for p in 0..settings.partitions {
        detach_before_assign(&consumer, &settings.topic, p);
    }
    consumer.assign(&settings.assignment()?)?;
    let mut queues = PartitionQueues::new(consumer.clone(), &settings.topic, Default::default());
    queues.sync(&(0..settings.partitions).collect::<Vec<_>>());
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = stop.clone();
    let thread = std::thread::Builder::new()
        .name("ceiling".into())
        .spawn(move || {
            let partitions: Vec<_> = queues.partitions().collect();
            while !stop.load(Ordering::Acquire) {
                let mut took = false;
                // Events, and any record that reached the main queue after all.
                while let Some(polled) = consumer.poll(Duration::ZERO) {
                    match polled {
                        Ok(m) => {
                            observe(&core, &m);
                            took = true;
                        }
                        Err(e) => eprintln!("ceiling: consume error: {e}"),
                    }
                }
                for &p in &partitions {
                    let taken = queues.take(p, BURST, |m| match m {
                        Ok(m) => observe(&core, m),
                        Err(e) => eprintln!("ceiling: consume error: {e}"),
                    });
                    took |= taken > 0;
                }
                if !took {
                    queues.wait(IDLE_WAIT);
                }
            }
        })?;
    Ok(Running {
        stop: Box::new(move || {
            async move {
                stopping.store(true, Ordering::Release);
                let _ = tokio::task::spawn_blocking(move || thread.join()).await;
            }
            .boxed()
        }),
        sessions: None,
        pid: None,
        go: None,
    })
}
