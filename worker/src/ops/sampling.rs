//! Head sampling of records: which records get spans, decided before any span is built.
//!
//! An exported record costs ~22,400 instructions in spans (BENCHMARKS.md, issue 37 step 4),
//! more than the rest of its path, so tracing that can stay on must leave most records without
//! spans — and the decision has to come before `tracing::Span` is made, since building,
//! entering and closing the span is the cost. The OpenTelemetry SDK's own sampler decides only
//! when the span is already there, so the worker reads the standard variables itself:
//!
//! - `OTEL_TRACES_SAMPLER`: `parentbased_traceidratio` (the default), `parentbased_always_on`,
//!   `parentbased_always_off`, `traceidratio`, `always_on`, `always_off`;
//! - `OTEL_TRACES_SAMPLER_ARG`: the ratio for the two `traceidratio` samplers, in [0, 1];
//!   [`DEFAULT_RATIO`] when `OTEL_TRACES_SAMPLER` is unset, 1 when it is set without an
//!   argument (as the specification says).
//!
//! Parent-based: a record whose `traceparent` has the sampled flag gets spans, one whose flag is
//! clear gets none (its `traceparent` is passed on unchanged); a record without a (valid)
//! `traceparent` is a root, sampled at the ratio. The other samplers apply the ratio to roots
//! and sampled parents alike; a parent flagged not sampled gets no spans with any of them (the
//! SDK's sampler is parent-based and would drop them). The ratio is compared with the trace id's low
//! 64 bits when the record has one (every hop of a trace decides alike), else with a hash of the
//! record's partition and offset (a redelivered record decides as it did the first time).

use crate::config::ConfigError;

/// The root ratio when `OTEL_TRACES_SAMPLER` is unset: one record in a hundred.
pub const DEFAULT_RATIO: f64 = 0.01;

/// What a record's `traceparent` says about its trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parent {
    /// No `traceparent`, or one that does not parse.
    None,
    /// A parent span; `sampled` is the flag, `trace_low` the trace id's low 64 bits.
    Span { sampled: bool, trace_low: u64 },
}

impl Parent {
    /// Reads a W3C `traceparent` value (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`)
    /// without allocating.
    pub fn of(traceparent: Option<&[u8]>) -> Parent {
        let Some(v) = traceparent else {
            return Parent::None;
        };
        if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
            return Parent::None;
        }
        let (Some(trace_high), Some(trace_low), Some(span), Some(flags)) = (
            hex(&v[3..19]),
            hex(&v[19..35]),
            hex(&v[36..52]),
            hex(&v[53..55]),
        ) else {
            return Parent::None;
        };
        if (trace_high == 0 && trace_low == 0) || span == 0 || &v[0..2] == b"ff" {
            return Parent::None;
        }
        Parent::Span {
            sampled: flags & 1 == 1,
            trace_low,
        }
    }
}

fn hex(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |n, d| {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            _ => return None,
        };
        Some(n << 4 | u64::from(v))
    })
}

/// A head sampler: parent-based or not, and the ratio for records it decides itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub parent_based: bool,
    /// In [0, 1].
    pub ratio: f64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            parent_based: true,
            ratio: DEFAULT_RATIO,
        }
    }
}

impl Sampling {
    /// The sampler the standard variables name (`var` reads one); an error names the variable.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Sampling, ConfigError> {
        const SAMPLER: &str = "OTEL_TRACES_SAMPLER";
        const ARG: &str = "OTEL_TRACES_SAMPLER_ARG";
        let Some(name) = var(SAMPLER).filter(|s| !s.trim().is_empty()) else {
            return Ok(Sampling::default());
        };
        let ratio = || -> Result<f64, ConfigError> {
            let Some(arg) = var(ARG).filter(|s| !s.trim().is_empty()) else {
                return Ok(1.0);
            };
            match arg.trim().parse::<f64>() {
                Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
                _ => Err(ConfigError::new(
                    ARG,
                    format!("must be a ratio in [0, 1], got {arg:?}"),
                )),
            }
        };
        let (parent_based, ratio) = match name.trim() {
            "always_on" => (false, 1.0),
            "always_off" => (false, 0.0),
            "traceidratio" => (false, ratio()?),
            "parentbased_always_on" => (true, 1.0),
            "parentbased_always_off" => (true, 0.0),
            "parentbased_traceidratio" => (true, ratio()?),
            other => {
                return Err(ConfigError::new(
                    SAMPLER,
                    format!(
                        "must be one of always_on, always_off, traceidratio, \
                         parentbased_always_on, parentbased_always_off, \
                         parentbased_traceidratio; got {other:?}"
                    ),
                ))
            }
        };
        Ok(Sampling {
            parent_based,
            ratio,
        })
    }

    /// The ratio as a threshold on a uniform 64-bit draw: sampled when `draw < threshold`,
    /// except that [`u64::MAX`] samples every draw.
    pub fn threshold(&self) -> u64 {
        if self.ratio >= 1.0 {
            u64::MAX
        } else if self.ratio > 0.0 {
            // Exact below 1.0: the float rounds, the cast saturates.
            (self.ratio * 18_446_744_073_709_551_616.0) as u64
        } else {
            0
        }
    }
}

/// Whether a record gets spans: the parent's flag when parent-based and there is a parent,
/// else the ratio (`threshold`, see [`Sampling::threshold`]) against the trace id or `draw`.
/// A parent flagged not sampled gets no spans in any mode: the SDK (parent-based, see
/// `telemetry`) would not export them.
pub fn sampled(parent_based: bool, threshold: u64, parent: Parent, draw: u64) -> bool {
    let draw = match parent {
        Parent::Span { sampled, .. } if parent_based || !sampled => return sampled,
        Parent::Span { trace_low, .. } => trace_low,
        Parent::None => draw,
    };
    threshold == u64::MAX || draw < threshold
}

/// A uniform 64-bit draw for a record without a trace id (splitmix64's finaliser).
pub fn draw(partition: i32, offset: i64) -> u64 {
    let mut z = ((partition as u64) << 48 ^ offset as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLED: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const NOT_SAMPLED: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn reads_the_traceparent_flag_and_trace_id() {
        assert_eq!(
            Parent::of(Some(SAMPLED)),
            Parent::Span {
                sampled: true,
                trace_low: 0xa3ce929d0e0e4736
            }
        );
        assert!(matches!(
            Parent::of(Some(NOT_SAMPLED)),
            Parent::Span { sampled: false, .. }
        ));
        for bad in [
            &b""[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(Parent::of(Some(bad)), Parent::None, "{bad:?}");
        }
        assert_eq!(Parent::of(None), Parent::None);
    }

    #[test]
    fn parent_based_follows_the_parent_whatever_the_ratio() {
        let yes = Parent::of(Some(SAMPLED));
        let no = Parent::of(Some(NOT_SAMPLED));
        for ratio in [0.0, 0.01, 1.0] {
            let t = Sampling {
                parent_based: true,
                ratio,
            }
            .threshold();
            for draw in [0, u64::MAX / 2, u64::MAX] {
                assert!(sampled(true, t, yes, draw), "ratio {ratio}");
                assert!(!sampled(true, t, no, draw), "ratio {ratio}");
            }
        }
    }

    #[test]
    fn without_a_parent_the_ratio_decides_with_exact_edges() {
        let never = Sampling {
            parent_based: true,
            ratio: 0.0,
        }
        .threshold();
        let always = Sampling {
            parent_based: true,
            ratio: 1.0,
        }
        .threshold();
        for draw in [0, 1, u64::MAX / 2, u64::MAX - 1, u64::MAX] {
            assert!(!sampled(true, never, Parent::None, draw));
            assert!(sampled(true, always, Parent::None, draw));
        }
        // 1 %: about one record in a hundred, over the draws records really get.
        let t = Sampling::default().threshold();
        let n = (0..100_000)
            .filter(|o| sampled(true, t, Parent::None, draw(o % 8, i64::from(*o))))
            .count();
        assert!((800..1200).contains(&n), "{n} of 100000 at 1 %");
        // Not parent-based: the ratio applies to a sampled parent's trace id; a parent flagged
        // not sampled stays unsampled (the SDK would drop its spans).
        let half = Sampling {
            parent_based: false,
            ratio: 0.5,
        }
        .threshold();
        // trace_low 0xa3ce… is above half of u64: not sampled although the flag is set.
        assert!(!sampled(false, half, Parent::of(Some(SAMPLED)), 0));
        assert!(sampled(false, always, Parent::of(Some(SAMPLED)), 0));
        assert!(!sampled(false, always, Parent::of(Some(NOT_SAMPLED)), 0));
    }

    #[test]
    fn reads_the_standard_variables_and_names_the_bad_one() {
        assert_eq!(Sampling::from_env(env(&[])), Ok(Sampling::default()));
        assert_eq!(
            Sampling::from_env(env(&[
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25")
            ])),
            Ok(Sampling {
                parent_based: true,
                ratio: 0.25
            })
        );
        assert_eq!(
            Sampling::from_env(env(&[("OTEL_TRACES_SAMPLER", "traceidratio")])),
            Ok(Sampling {
                parent_based: false,
                ratio: 1.0
            })
        );
        assert_eq!(
            Sampling::from_env(env(&[("OTEL_TRACES_SAMPLER", "always_off")])),
            Ok(Sampling {
                parent_based: false,
                ratio: 0.0
            })
        );
        let e = Sampling::from_env(env(&[("OTEL_TRACES_SAMPLER", "sometimes")])).unwrap_err();
        assert_eq!(e.key, "OTEL_TRACES_SAMPLER");
        for arg in ["1.5", "-0.1", "half", "NaN"] {
            let e = Sampling::from_env(env(&[
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", arg),
            ]))
            .unwrap_err();
            assert_eq!(e.key, "OTEL_TRACES_SAMPLER_ARG", "{arg}");
        }
    }
}
