//! System 4: the flat worker pool — the seed article's first design.
//!
//! A consumer thread hashes each record's session onto one of a fixed number of workers
//! (`--pool-workers`, routed as the engine routes to its dispatchers) and queues it there
//! (bounded; a full queue blocks the consumer thread, which is this design's backpressure).
//! Each worker handles its queue one record at a time, retrying a failing record in place, so
//! per-session order holds and sessions run in parallel up to the pool size — but a retrying
//! session stalls every other session hashed onto its worker, which is why the article replaced
//! it. Completions come back to the consumer thread, which commits the contiguous watermark with
//! the engine's own offset tracker, so the pool commits as safely as sessionflow does.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use sessionflow_worker::commit::offsets::OffsetTracker;
use sessionflow_worker::dispatch::routing::SessionRouter;
use sessionflow_worker::record::session_id::session_hash;
use tokio::sync::mpsc;

use super::{baseline_consumer, Running, SystemSettings};
use crate::handler::Core;
use crate::workload::{decode, seq_header, RecordView};

struct Job {
    view: RecordView,
    partition: i32,
    offset: i64,
}

pub fn start(settings: &SystemSettings, core: Arc<Core>) -> anyhow::Result<Running> {
    let consumer: BaseConsumer = baseline_consumer(settings, false).create()?;
    consumer.assign(&settings.assignment()?)?;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<(i32, i64)>();
    let mut senders = Vec::new();
    let mut workers = Vec::new();
    for _ in 0..settings.pool_workers.max(1) {
        let (tx, mut rx) = mpsc::channel::<Job>(settings.pool_queue.max(1));
        senders.push(tx);
        let (core, done, retry) = (core.clone(), done_tx.clone(), settings.retry());
        workers.push(tokio::spawn(async move {
            while let Some(job) = rx.recv().await {
                core.call_until_done(job.view, job.partition, &retry).await;
                let _ = done.send((job.partition, job.offset));
            }
        }));
    }
    let router = SessionRouter::new(senders.len());
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = stop.clone();
    let topic = settings.topic.clone();
    let partitions = settings.partitions;
    let thread = std::thread::Builder::new()
        .name("pool-consumer".into())
        .spawn(move || {
            let mut tracker = OffsetTracker::new();
            (0..partitions).for_each(|p| tracker.assign(p));
            let mut last_commit = Instant::now();
            while !stop.load(Ordering::Acquire) {
                if let Some(polled) = consumer.poll(Duration::from_millis(20)) {
                    match polled {
                        Ok(m) => {
                            let (p, offset) = (m.partition(), m.offset());
                            let view = decode(m.payload(), seq_header(m.headers()));
                            let key = m.key().unwrap_or_default();
                            let _ = tracker.begin(
                                p,
                                offset,
                                sessionflow_worker::commit::leader_epochs::UNKNOWN,
                            );
                            match view {
                                Some(v) if !v.warmup => {
                                    let job = Job {
                                        view: v,
                                        partition: p,
                                        offset,
                                    };
                                    // Blocks while the worker's queue is full.
                                    if senders[router.route(session_hash(key))]
                                        .blocking_send(job)
                                        .is_err()
                                    {
                                        return;
                                    }
                                }
                                other => {
                                    if let Some(v) = other {
                                        core.observe(v, p);
                                    }
                                    let _ = tracker.complete(p, offset);
                                }
                            }
                        }
                        Err(e) => eprintln!("pool: consume error: {e}"),
                    }
                }
                while let Ok((p, offset)) = done_rx.try_recv() {
                    let _ = tracker.complete(p, offset);
                }
                if last_commit.elapsed() >= Duration::from_secs(1) {
                    let mut tpl = TopicPartitionList::new();
                    for (p, w) in tracker.commit_candidates() {
                        let _ = tpl.add_partition_offset(&topic, p, Offset::Offset(w));
                        if let Some(o) = tracker.partition_mut(p) {
                            // A baseline: taken as confirmed once sent.
                            o.mark_sent(w);
                            o.commit_confirmed(w);
                        }
                    }
                    if tpl.count() > 0 {
                        let _ = consumer.commit(&tpl, CommitMode::Async);
                    }
                    last_commit = Instant::now();
                }
            }
        })?;
    Ok(Running {
        stop: Box::new(move || {
            async move {
                stopping.store(true, Ordering::Release);
                // Aborted workers drop their queues, which unblocks a consumer thread waiting
                // on a full one.
                for w in workers {
                    w.abort();
                }
                let _ = tokio::task::spawn_blocking(move || thread.join()).await;
            }
            .boxed()
        }),
        sessions: None,
        pid: None,
        go: None,
    })
}
