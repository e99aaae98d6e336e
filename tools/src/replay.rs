//! Replaying dead letters: selected DLQ records go back to the topic they came from, so a
//! fixed downstream (or a fixed handler) can process them.
//!
//! A replayed record is a *new* record for its session: it arrives after everything the session
//! did since, which is the operator's decision, made knowingly. So the replay
//! - keeps the original key, value and headers, minus what the DLQ added (`sessionflow-dlq-*`,
//!   source, stage, attempts);
//! - gives it a new event id (`<original>~replay`; the original stays in
//!   `sessionflow-replay-of`): workers skip an event id their session finished recently, and a
//!   dead-lettered record counts as finished;
//! - drops `sessionflow-seq`: the record is deliberately out of its session's sequence, and the
//!   ordering watchdog must not count it as a violation;
//! - produces in DLQ order with an idempotent producer, keyed by the original key, so records
//!   of one session are replayed in the order they were dead-lettered.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::verify::{self, SeqRecord};
use sessionflow_worker::kafka::client_settings::ClientSettings;
use sessionflow_worker::output::dlq;
use sessionflow_worker::record::header;

/// Header naming the event id a replayed record was made from.
pub const REPLAY_OF: &str = "sessionflow-replay-of";

/// Which dead letters to replay.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Only records dead-lettered by this stage.
    pub stage: Option<String>,
    /// Only records with this `sessionflow-dlq-reason`.
    pub reason: Option<String>,
    /// Only this session (the record key).
    pub session: Option<String>,
}

impl Selection {
    pub fn matches(&self, r: &SeqRecord) -> bool {
        let is = |want: &Option<String>, got: Option<&str>| {
            want.as_deref().is_none_or(|w| Some(w) == got)
        };
        is(&self.stage, r.header(header::STAGE))
            && is(&self.reason, r.header(header::DLQ_REASON))
            && is(
                &self.session,
                r.key
                    .as_deref()
                    .map(|k| std::str::from_utf8(k).unwrap_or("")),
            )
    }
}

/// A record to produce again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
    pub headers: Vec<(String, String)>,
}

/// What a dead letter becomes when replayed to `to` (default: its source topic); `None` when
/// it names no source topic and no `to` is given.
pub fn replay_of(dead: &SeqRecord, to: Option<&str>) -> Option<Replay> {
    let topic = to.or(dead.header(header::SOURCE_TOPIC))?.to_string();
    let replaced = [header::SEQ, header::EVENT_ID, REPLAY_OF];
    let mut headers: Vec<(String, String)> = dead
        .headers
        .iter()
        .filter(|(k, _)| {
            !dlq::ADDED_HEADERS.contains(&k.as_str()) && !replaced.contains(&k.as_str())
        })
        .cloned()
        .collect();
    let original = dead
        .header(header::EVENT_ID)
        .map(str::to_string)
        .unwrap_or_else(|| {
            let source = |h| dead.header(h).unwrap_or("?");
            format!(
                "{}-{}-{}",
                source(header::SOURCE_TOPIC),
                source(header::SOURCE_PARTITION),
                source(header::SOURCE_OFFSET)
            )
        });
    headers.push((header::EVENT_ID.to_string(), format!("{original}~replay")));
    headers.push((REPLAY_OF.to_string(), original));
    Some(Replay {
        topic,
        key: dead.key.clone(),
        value: dead.value.clone(),
        headers,
    })
}

/// Counts of one replay run.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReplayReport {
    /// Replayed records per target topic.
    pub replayed: BTreeMap<String, u64>,
    /// Dead letters not selected.
    pub skipped: u64,
    /// Selected dead letters with no source topic (and no `--to`).
    pub no_target: u64,
}

/// Reads `dlq` up to its current end and replays the selected records (nothing is produced
/// when `dry_run`).
pub async fn run(
    kafka: impl Into<ClientSettings>,
    dlq: &str,
    selection: &Selection,
    to: Option<&str>,
    dry_run: bool,
) -> anyhow::Result<ReplayReport> {
    let kafka: ClientSettings = kafka.into();
    let (k, d) = (kafka.clone(), dlq.to_string());
    let dead = tokio::task::spawn_blocking(move || {
        verify::read_topic(&k, &d, None, Duration::from_secs(120))
    })
    .await??;
    let producer: FutureProducer = kafka.base().set("enable.idempotence", "true").create()?;
    let mut report = ReplayReport::default();
    let mut pending = Vec::new();
    for record in &dead {
        if !selection.matches(record) {
            report.skipped += 1;
            continue;
        }
        let Some(replay) = replay_of(record, to) else {
            report.no_target += 1;
            continue;
        };
        *report.replayed.entry(replay.topic.clone()).or_default() += 1;
        if dry_run {
            continue;
        }
        let mut headers = OwnedHeaders::new();
        for (k, v) in &replay.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut out = FutureRecord::to(&replay.topic)
            .payload(&replay.value)
            .headers(headers);
        if let Some(key) = &replay.key {
            out = out.key(key);
        }
        // Enqueue in DLQ order; the idempotent producer keeps that order per partition.
        let delivery = producer
            .send_result(out)
            .map_err(|(e, _)| anyhow::anyhow!("producing to {}: {e}", replay.topic))?;
        pending.push(delivery);
    }
    for delivery in pending {
        delivery
            .await
            .map_err(|_| anyhow::anyhow!("producer dropped a delivery"))?
            .map_err(|(e, _)| anyhow::anyhow!("replay not acknowledged: {e}"))?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dead(headers: &[(&str, &str)]) -> SeqRecord {
        SeqRecord {
            partition: 0,
            offset: 7,
            key: Some(b"s1".to_vec()),
            session: Some("s1".into()),
            seq: Some(4),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            value: b"payload".to_vec(),
            timestamp_ms: None,
        }
    }

    #[test]
    fn a_replay_keeps_the_record_and_drops_what_the_dlq_added() {
        let d = dead(&[
            ("traceparent", "00-abc-def-01"),
            (header::SEQ, "4"),
            (header::EVENT_ID, "e-42"),
            (header::DLQ_REASON, "poison"),
            (header::DLQ_ERROR, "bad input"),
            (header::SOURCE_TOPIC, "chat.in"),
            (header::SOURCE_PARTITION, "3"),
            (header::SOURCE_OFFSET, "7"),
            (header::STAGE, "nlu"),
            (header::ATTEMPTS, "1"),
        ]);
        let r = replay_of(&d, None).unwrap();
        assert_eq!(r.topic, "chat.in");
        assert_eq!(r.key.as_deref(), Some(&b"s1"[..]));
        assert_eq!(r.value, b"payload");
        let h: BTreeMap<&str, &str> = r
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            h,
            BTreeMap::from([
                ("traceparent", "00-abc-def-01"),
                (header::EVENT_ID, "e-42~replay"),
                (REPLAY_OF, "e-42"),
            ])
        );
        assert_eq!(replay_of(&d, Some("elsewhere")).unwrap().topic, "elsewhere");
    }

    #[test]
    fn without_an_event_id_the_source_position_names_the_record() {
        let d = dead(&[
            (header::SOURCE_TOPIC, "in"),
            (header::SOURCE_PARTITION, "1"),
            (header::SOURCE_OFFSET, "9"),
        ]);
        let r = replay_of(&d, None).unwrap();
        assert!(r
            .headers
            .contains(&(header::EVENT_ID.to_string(), "in-1-9~replay".to_string())));
        assert!(
            replay_of(&dead(&[]), None).is_none(),
            "no source topic and no --to"
        );
    }

    #[test]
    fn selection_filters_by_stage_reason_and_session() {
        let d = dead(&[(header::STAGE, "nlu"), (header::DLQ_REASON, "poison")]);
        let sel = |stage: Option<&str>, reason: Option<&str>, session: Option<&str>| Selection {
            stage: stage.map(Into::into),
            reason: reason.map(Into::into),
            session: session.map(Into::into),
        };
        assert!(sel(None, None, None).matches(&d));
        assert!(sel(Some("nlu"), Some("poison"), Some("s1")).matches(&d));
        assert!(!sel(Some("llm"), None, None).matches(&d));
        assert!(!sel(None, Some("stuck"), None).matches(&d));
        assert!(!sel(None, None, Some("s2")).matches(&d));
    }
}
