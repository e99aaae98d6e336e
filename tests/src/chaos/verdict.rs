//! The judgement of a chaos run, on one line a CI log and a human can both read.
//!
//! A run is OK when `verify` finds nothing lost, nothing out of order, no gap the input does
//! not have itself, and the group's committed offsets reached the input's end. Duplicates
//! (at-least-once replays) are reported, not judged; so are gaps of the input topic (see
//! [`crate::input`]), and, in at-least-once mode, stale ends: a zombie member (a frozen
//! worker, a worker cut from a broker, one whose revocation waits on a Produce request stuck
//! in a hung connection) sends the requests librdkafka had queued or retries after the group
//! gave its partitions away, and without transactions nothing fences them; they land after
//! the next owner's writes. That holds on both clusters: the mock, whose coordinator gives a
//! member's partitions away after `session.timeout.ms` even while the member is still inside
//! its revocation callback, reaches it more easily than Kafka does (RELIABILITY.md, footnote
//! 18), but the answer to it is the same on both, `exactlyOnce`.
//!
//! In `exactlyOnce` (`CHAOS_DELIVERY`) the output is read `read_committed` (as `verify` always
//! does) and what the transactions promise is judged too: 0 stale ends (a zombie's late writes
//! are fenced by the broker) and no duplicate the input does not have itself (the load
//! generator's producer is not idempotent: a retried send under the faults writes an input
//! record twice, and the stage rightly handles both), on top of the rest.

use std::fmt;

use sessionflow_tools::verify::VerifyReport;
use sessionflow_worker::config::Delivery;

use crate::input::InputAudit;

pub struct Verdict {
    pub delivery: Delivery,
    pub seed: u64,
    pub seconds: u64,
    pub input: InputAudit,
    pub report: VerifyReport,
    /// The group's committed offsets equalled the input's end offsets, before and after the
    /// workers stopped.
    pub committed_equals_end: bool,
}

impl Verdict {
    pub fn is_ok(&self) -> bool {
        let r = &self.report;
        let exactly_once = self.delivery == Delivery::ExactlyOnce;
        r.lost == 0
            && r.order_violations == 0
            && (r.stale_ends == 0 || !exactly_once)
            && (r.duplicates <= self.input.duplicates || !exactly_once)
            && r.gaps <= self.input.gaps
            && self.committed_equals_end
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.report;
        write!(
            f,
            "chaos: seed={} seconds={}{} records={} lost={} order_violations={} stale_ends={} \
             duplicates={} committed==end: {} → {}",
            self.seed,
            self.seconds,
            match self.delivery {
                Delivery::ExactlyOnce => " delivery=exactlyOnce",
                Delivery::AtLeastOnce => "",
            },
            self.input.records,
            r.lost,
            r.order_violations,
            r.stale_ends,
            r.duplicates,
            if self.committed_equals_end {
                "yes"
            } else {
                "no"
            },
            if self.is_ok() { "OK" } else { "FAILED" }
        )?;
        if r.gaps > 0 || self.input.gaps > 0 {
            write!(
                f,
                " (output gaps={}, input gaps={})",
                r.gaps, self.input.gaps
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(report: VerifyReport, committed_equals_end: bool) -> Verdict {
        Verdict {
            delivery: Delivery::AtLeastOnce,
            seed: 7,
            seconds: 90,
            input: InputAudit {
                records: 100,
                ..Default::default()
            },
            report,
            committed_equals_end,
        }
    }

    #[test]
    fn ok_needs_a_clean_report_and_lag_zero() {
        assert!(verdict(VerifyReport::default(), true).is_ok());
        assert!(!verdict(VerifyReport::default(), false).is_ok());
        let replays = VerifyReport {
            duplicates: 40,
            ..Default::default()
        };
        assert!(verdict(replays, true).is_ok());
    }

    /// The verdict does not ask which cluster ran: the mock and Kafka share the rule.
    #[test]
    fn stale_ends_are_counted_at_least_once_and_judged_exactly_once() {
        let stale = VerifyReport {
            stale_ends: 3,
            duplicates: 9,
            ..Default::default()
        };
        let mut v = verdict(stale.clone(), true);
        assert!(v.is_ok(), "at least once: stale ends are reported only");
        assert!(v.to_string().contains("stale_ends=3 duplicates=9"));
        v.delivery = Delivery::ExactlyOnce;
        v.report.duplicates = 0;
        assert!(!v.is_ok(), "exactlyOnce judges them");
        // What at least once does promise is judged.
        let lost = VerifyReport {
            lost: 1,
            ..stale.clone()
        };
        let disorder = VerifyReport {
            order_violations: 1,
            ..stale
        };
        for (report, committed_equals_end) in [
            (lost, true),
            (disorder, true),
            (VerifyReport::default(), false),
        ] {
            assert!(!verdict(report, committed_equals_end).is_ok());
        }
    }

    #[test]
    fn exactly_once_also_judges_duplicates_and_stale_ends() {
        let mut v = verdict(VerifyReport::default(), true);
        v.delivery = Delivery::ExactlyOnce;
        assert!(v.is_ok());
        assert!(v
            .to_string()
            .starts_with("chaos: seed=7 seconds=90 delivery=exactlyOnce records=100"));
        v.report.duplicates = 1;
        assert!(!v.is_ok());
        v.input.duplicates = 1;
        assert!(v.is_ok(), "a duplicate of the input is handled twice");
        v.input.duplicates = 0;
        v.report.duplicates = 0;
        v.report.stale_ends = 1;
        assert!(!v.is_ok());
        v.delivery = Delivery::AtLeastOnce;
        assert!(
            v.is_ok(),
            "at least once on Kafka: stale ends are reported only"
        );
        v.report.stale_ends = 0;
        v.report.duplicates = 5;
        assert!(v.is_ok(), "at least once: replays are reported only");
    }

    #[test]
    fn only_gaps_the_input_has_too_are_forgiven() {
        let gaps = VerifyReport {
            gaps: 2,
            ..Default::default()
        };
        let mut v = verdict(gaps, true);
        assert!(!v.is_ok());
        v.input.gaps = 2;
        assert!(v.is_ok());
        assert!(v
            .to_string()
            .ends_with("→ OK (output gaps=2, input gaps=2)"));
    }

    #[test]
    fn the_line_names_the_seed_and_the_outcome() {
        let line = verdict(VerifyReport::default(), false).to_string();
        assert!(line.starts_with("chaos: seed=7 seconds=90 records=100 lost=0"));
        assert!(line.ends_with("committed==end: no → FAILED"), "{line}");
    }
}
