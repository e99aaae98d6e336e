//! `loadgen`: produce sessions of numbered records, for demos, tests and benchmarks.
//!
//! Every record carries its session (as the key) and a per-session sequence number in the
//! `sessionflow-seq` header, starting at 1. That is all `verify` needs to check order, loss and
//! duplicates at the far end of a pipeline. Sessions are chosen uniformly or with a Zipf
//! distribution (a few very chatty sessions, a long tail), from a seeded generator so a run can
//! be repeated exactly.

use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use rand::distr::Distribution;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use sessionflow_worker::kafka::client_settings::ClientSettings;
use sessionflow_worker::record::header;

/// How sessions are picked for each record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SessionChoice {
    /// Record i goes to session i mod S: every session gets the same number of records.
    RoundRobin,
    Uniform,
    /// Zipf with this exponent (1.0 is the classic law).
    Zipf(f64),
}

#[derive(Debug, Clone)]
pub struct LoadgenOptions {
    pub brokers: String,
    pub topic: String,
    pub records: u64,
    pub sessions: u64,
    pub choice: SessionChoice,
    pub seed: u64,
    /// Bytes of padding in each value.
    pub value_size: usize,
    /// Session ids are `<prefix><number>`.
    pub session_prefix: String,
    pub progress: bool,
    /// Records per second; `None` produces as fast as the broker takes them.
    pub rate: Option<f64>,
    pub kafka: Vec<(String, String)>,
}

impl LoadgenOptions {
    pub fn new(brokers: &str, topic: &str, records: u64, sessions: u64) -> Self {
        Self {
            brokers: brokers.into(),
            topic: topic.into(),
            records,
            sessions,
            choice: SessionChoice::Uniform,
            seed: 1,
            value_size: 64,
            session_prefix: "session-".into(),
            progress: false,
            rate: None,
            kafka: vec![],
        }
    }
}

#[derive(Debug, Clone)]
pub struct LoadgenReport {
    pub records: u64,
    pub sessions_used: u64,
    pub elapsed: Duration,
}

impl LoadgenReport {
    pub fn rate(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The session index of each record, in production order (pure; seeded).
pub fn session_sequence(records: u64, sessions: u64, choice: SessionChoice, seed: u64) -> Vec<u64> {
    let sessions = sessions.max(1);
    let mut rng = StdRng::seed_from_u64(seed);
    match choice {
        SessionChoice::RoundRobin => (0..records).map(|i| i % sessions).collect(),
        SessionChoice::Uniform => (0..records)
            .map(|_| rng.random_range(0..sessions))
            .collect(),
        SessionChoice::Zipf(exponent) => {
            let zipf = rand_distr::Zipf::new(sessions as f64, exponent)
                .expect("Zipf parameters are validated by the caller");
            (0..records)
                .map(|_| (zipf.sample(&mut rng) as u64).clamp(1, sessions) - 1)
                .collect()
        }
    }
}

/// Produces the records and waits for every acknowledgement.
pub async fn run(opts: &LoadgenOptions) -> anyhow::Result<LoadgenReport> {
    if let SessionChoice::Zipf(e) = opts.choice {
        anyhow::ensure!(
            e > 0.0 && e.is_finite(),
            "--zipf must be a positive exponent"
        );
    }
    let mut config =
        ClientSettings::with_properties(opts.brokers.clone(), opts.kafka.clone()).base();
    config
        .set("linger.ms", "10")
        .set("partitioner", "murmur2_random")
        .set("enable.idempotence", "true")
        .set("queue.buffering.max.messages", "500000");
    for (k, v) in &opts.kafka {
        config.set(k, v);
    }
    let producer: FutureProducer = config.create()?;
    let order = session_sequence(opts.records, opts.sessions, opts.choice, opts.seed);
    let mut seqs = vec![0u64; opts.sessions.max(1) as usize];
    let bar = progress_bar(opts.progress, opts.records);
    let pad = "x".repeat(opts.value_size);
    let started = Instant::now();
    let mut acks = FuturesUnordered::new();
    let mut failed = 0u64;
    let pace = opts.rate.filter(|r| *r > 0.0 && r.is_finite());
    for (i, s) in order.into_iter().enumerate() {
        if let Some(rate) = pace {
            let due = started + Duration::from_secs_f64(i as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        seqs[s as usize] += 1;
        let seq = seqs[s as usize].to_string();
        let session = format!("{}{s:06}", opts.session_prefix);
        let value = format!("{{\"session\":\"{session}\",\"seq\":{seq},\"pad\":\"{pad}\"}}");
        let headers = OwnedHeaders::new().insert(Header {
            key: header::SEQ,
            value: Some(seq.as_bytes()),
        });
        let mut record = FutureRecord::to(&opts.topic)
            .key(session.as_bytes())
            .payload(value.as_bytes())
            .headers(headers);
        loop {
            match producer.send_result(record) {
                Ok(ack) => {
                    acks.push(ack);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    match acks.next().await {
                        Some(Ok(Ok(_))) => bar.inc(1),
                        Some(_) => failed += 1,
                        None => tokio::time::sleep(Duration::from_millis(5)).await,
                    }
                }
                Err((e, _)) => anyhow::bail!("producing to {}: {e}", opts.topic),
            }
        }
        while acks.len() > 100_000 {
            match acks.next().await {
                Some(Ok(Ok(_))) => bar.inc(1),
                _ => failed += 1,
            }
        }
    }
    while let Some(ack) = acks.next().await {
        match ack {
            Ok(Ok(_)) => bar.inc(1),
            _ => failed += 1,
        }
    }
    bar.finish_and_clear();
    anyhow::ensure!(failed == 0, "{failed} records were not acknowledged");
    Ok(LoadgenReport {
        records: opts.records,
        sessions_used: seqs.iter().filter(|n| **n > 0).count() as u64,
        elapsed: started.elapsed(),
    })
}

fn progress_bar(enabled: bool, total: u64) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} loadgen [{bar:40}] {pos}/{len} records ({per_sec}, eta {eta})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_are_seeded_and_in_range() {
        let a = session_sequence(10_000, 100, SessionChoice::Uniform, 3);
        assert_eq!(a, session_sequence(10_000, 100, SessionChoice::Uniform, 3));
        assert_ne!(a, session_sequence(10_000, 100, SessionChoice::Uniform, 4));
        assert!(a.iter().all(|s| *s < 100));
    }

    #[test]
    fn zipf_favours_low_ranks() {
        let z = session_sequence(100_000, 1_000, SessionChoice::Zipf(1.0), 1);
        assert!(z.iter().all(|s| *s < 1_000));
        let first = z.iter().filter(|s| **s == 0).count();
        let hundredth = z.iter().filter(|s| **s == 99).count();
        assert!(
            first > 20 * hundredth.max(1),
            "rank 1: {first}, rank 100: {hundredth}"
        );
    }
}
