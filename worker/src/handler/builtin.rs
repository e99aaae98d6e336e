//! A pass-through handler with deterministic fault injection.
//!
//! Demos, tests and benchmarks need a stage that fails *reproducibly*: the same seed and the
//! same records give the same poison records and the same failing attempts, whichever worker
//! processes them and however often they are replayed. So every draw is a hash of
//! (seed, event id[, attempt]) rather than a random number.

use std::time::Duration;

use crate::config::BuiltinHandlerConfig;
use crate::record::session_id::stable_hash;
use crate::record::InputRecord;

use super::{HandlerError, HandlerResult};

pub struct BuiltinHandler {
    config: BuiltinHandlerConfig,
}

impl BuiltinHandler {
    pub fn new(config: BuiltinHandlerConfig) -> Self {
        Self { config }
    }

    /// A uniform draw in [0, 1) determined by the seed and `parts`.
    fn draw(&self, parts: &[&[u8]]) -> f64 {
        let mut bytes = self.config.seed.to_le_bytes().to_vec();
        for p in parts {
            bytes.extend_from_slice(p);
            bytes.push(0xff);
        }
        // Finalise FNV's weak low bits with a multiply-shift before taking the top 53 bits.
        let h = stable_hash(&bytes).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (h >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Whether this record is poison, whatever the attempt.
    pub fn is_poison(&self, record: &InputRecord) -> bool {
        self.draw(&[b"poison", record.event_id().as_bytes()]) < self.config.poison_rate
    }

    /// Whether this attempt of this record fails transiently.
    pub fn is_transient_failure(&self, record: &InputRecord, attempt: u32) -> bool {
        self.draw(&[
            b"transient",
            record.event_id().as_bytes(),
            &attempt.to_le_bytes(),
        ]) < self.config.transient_rate
    }

    /// Whether the first attempt of this record is a slow one. Unlike the fault draws, this
    /// one also depends on the worker process: a call that was slow on one worker (an LLM call
    /// that outlived a rebalance) is usually quick when the partition's next owner redoes it.
    pub fn is_slow(&self, record: &InputRecord) -> bool {
        let process = std::process::id().to_le_bytes();
        self.draw(&[b"slow", record.event_id().as_bytes(), &process]) < self.config.slow_rate
    }

    pub async fn handle(&self, record: &InputRecord, attempt: u32) -> HandlerResult {
        let mut work = Duration::from_millis(self.config.latency_ms);
        if attempt == 1 && self.config.slow_ms > 0 && self.is_slow(record) {
            work += Duration::from_millis(self.config.slow_ms);
        }
        if !work.is_zero() {
            tokio::time::sleep(work).await;
        }
        if self.is_poison(record) {
            return Err(HandlerError::Poison(format!(
                "injected poison (seed {})",
                self.config.seed
            )));
        }
        if self.is_transient_failure(record, attempt) {
            return Err(HandlerError::Transient(format!(
                "injected transient fault on attempt {attempt}"
            )));
        }
        Ok(Some(record.value().unwrap_or_default().to_vec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Lease;
    use std::sync::Arc;

    fn record(i: usize) -> InputRecord {
        let value = format!("v{i}");
        let parts = crate::record::Parts {
            key: Some(b"s"),
            value: Some(value.as_bytes()),
            headers: &[],
        };
        let source = crate::record::SessionSource::Key;
        InputRecord::new(
            "t".into(),
            0,
            i as i64,
            parts,
            &source,
            Arc::new(Lease::new(0, 0)),
        )
    }

    fn handler(transient_rate: f64, poison_rate: f64, seed: u64) -> BuiltinHandler {
        BuiltinHandler::new(BuiltinHandlerConfig {
            transient_rate,
            poison_rate,
            latency_ms: 0,
            seed,
            ..Default::default()
        })
    }

    #[test]
    fn fault_rates_are_close_to_the_configured_ones() {
        let h = handler(0.1, 0.01, 7);
        let n = 100_000;
        let transient = (0..n)
            .filter(|i| h.is_transient_failure(&record(*i), 1))
            .count();
        let poison = (0..n).filter(|i| h.is_poison(&record(*i))).count();
        assert!((9_000..11_000).contains(&transient), "{transient}");
        assert!((800..1_200).contains(&poison), "{poison}");
    }

    #[test]
    fn draws_are_deterministic_and_depend_on_seed_and_attempt() {
        let (a, b, c) = (
            handler(0.5, 0.5, 1),
            handler(0.5, 0.5, 1),
            handler(0.5, 0.5, 2),
        );
        let pattern = |h: &BuiltinHandler, attempt| -> Vec<bool> {
            (0..256)
                .map(|i| h.is_transient_failure(&record(i), attempt))
                .collect()
        };
        assert_eq!(pattern(&a, 1), pattern(&b, 1));
        assert_ne!(pattern(&a, 1), pattern(&c, 1));
        assert_ne!(pattern(&a, 1), pattern(&a, 2));
    }

    #[tokio::test]
    async fn passes_the_value_through() {
        let h = handler(0.0, 0.0, 0);
        assert_eq!(h.handle(&record(5), 1).await, Ok(Some(b"v5".to_vec())));
        let all_poison = handler(0.0, 1.0, 0);
        assert!(matches!(
            all_poison.handle(&record(5), 1).await,
            Err(HandlerError::Poison(_))
        ));
    }
}
