//! An audit of the input topic itself: did the cluster keep what the load generator was told
//! it had written?
//!
//! `verify` judges the workers against the input topic as it is. When the input itself lacks
//! a sequence number the load generator had an acknowledgement for, the output shows a gap
//! that no worker caused; this audit counts such input gaps so the verdict can tell the two
//! apart (and still report the cluster's).

use std::fmt;
use std::time::Duration;

use sessionflow_tools::verify::{read_topic, Checker};

/// What the input topic holds, checked as a sequence of its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InputAudit {
    pub records: u64,
    /// Sequence numbers below a session's highest that the input does not hold.
    pub gaps: u64,
    /// Records written twice (the producer retried a write that had landed).
    pub duplicates: u64,
    /// Records the load generator had acknowledged, when it finished.
    pub acknowledged: Option<u64>,
}

impl InputAudit {
    pub fn read(brokers: &str, topic: &str, acknowledged: Option<u64>) -> anyhow::Result<Self> {
        let mut checker = Checker::new();
        for r in read_topic(brokers, topic, None, Duration::from_secs(300))? {
            checker.output_record(&r);
        }
        let report = checker.finish(None::<Vec<(&str, u64)>>);
        Ok(Self {
            records: report.records,
            gaps: report.gaps,
            duplicates: report.duplicates,
            acknowledged,
        })
    }
}

impl fmt::Display for InputAudit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "input: {} records, {} gaps, {} duplicates",
            self.records, self.gaps, self.duplicates
        )?;
        if let Some(acked) = self.acknowledged {
            write!(f, "; the load generator had {acked} acknowledged")?;
        }
        if self.gaps > 0 {
            write!(
                f,
                " (the gaps were acknowledged to the producer yet are not in the topic: lost by \
                 the cluster or its client, before any worker)"
            )?;
        }
        Ok(())
    }
}
