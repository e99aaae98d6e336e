//! System 1, the ceiling: librdkafka consuming the records with no processing at all.
//!
//! One `BaseConsumer` on one thread, polling and handing each record to the measurements only.
//! Whatever a real design adds (routing, a handler, retries, offset bookkeeping) can only cost,
//! so this is the rate the others are held against.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::Message;

use super::{baseline_consumer, Running, SystemSettings};
use crate::handler::Core;
use crate::workload::{decode, seq_header};

pub fn start(settings: &SystemSettings, core: Arc<Core>) -> anyhow::Result<Running> {
    let consumer: BaseConsumer = baseline_consumer(settings, false).create()?;
    consumer.assign(&settings.assignment()?)?;
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = stop.clone();
    let thread = std::thread::Builder::new()
        .name("ceiling".into())
        .spawn(move || {
            while !stop.load(Ordering::Acquire) {
                match consumer.poll(Duration::from_millis(50)) {
                    Some(Ok(m)) => {
                        if let Some(v) = decode(m.payload(), seq_header(m.headers())) {
                            core.observe(v, m.partition());
                        }
                    }
                    Some(Err(e)) => eprintln!("ceiling: consume error: {e}"),
                    None => {}
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
        active_sessions: None,
    })
}
