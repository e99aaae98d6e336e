//! Logs and traces: structured logs on stderr, W3C trace context across every hop.
//!
//! Logs are human-readable text by default and JSON lines with `--log-format json`; `RUST_LOG`
//! filters (default `info`). The log lines about a record name its session, partition, offset
//! and event id; at `debug`, every line inside a record also carries the record's span.
//!
//! Tracing follows OpenTelemetry: the `traceparent` of an input record becomes the parent of the
//! record's span (one per record, one child per attempt), and the current span's context is
//! injected into the output and DLQ records and into HTTP handler calls, so a trace follows a
//! message across stages. Spans are exported over OTLP/HTTP only when an endpoint is
//! configured (`otlpEndpoint`, or `OTEL_EXPORTER_OTLP_ENDPOINT`).
//!
//! Spans are the largest cost on the record path (two per record, entered and left at every
//! poll), so a record gets them only when something wants them, decided before the span is
//! built ([`super::sampling`]): when its `traceparent` says sampled (its trace goes on with this
//! hop's span id), when spans are exported and the head sampler picks it as a root
//! (`OTEL_TRACES_SAMPLER`, by default `parentbased_traceidratio` at 1 %), or when logging at
//! `debug` shows them. A record with none of these has no span: its results carry its own
//! `traceparent` unchanged, or none — the first stage that exports starts the trace, rather
//! than every record pointing at a parent span no collector ever received.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub use super::sampling::Sampling;
use super::sampling::{self, Parent};
use crate::record::{header, InputRecord};

/// The target of the per-record spans (at `debug`, so logging at `info` does not record them;
/// the OpenTelemetry layer takes them at any level).
pub const RECORD_SPANS: &str = "sessionflow::record";

/// Whether a record without a `traceparent` gets spans: spans are exported, or logged. True
/// until [`init`] decides, so a program with a subscriber of its own gets every span.
static EVERY_RECORD_SPAN: AtomicBool = AtomicBool::new(true);

/// Sets whether records without a `traceparent` get spans ([`init`] does it; for tests and
/// programs that install their own subscriber).
pub fn set_every_record_span(on: bool) {
    EVERY_RECORD_SPAN.store(on, Ordering::Relaxed);
}

/// The head sampler of records when not every record gets spans: parent-based, and the root
/// ratio as a threshold ([`Sampling::threshold`]; 0 until [`init`] decides: no roots).
static PARENT_BASED: AtomicBool = AtomicBool::new(true);
static ROOT_THRESHOLD: AtomicU64 = AtomicU64::new(0);

/// Sets the head sampler of records ([`init`] does it, with the ratio only when exporting).
pub fn set_sampling(sampling: Sampling) {
    PARENT_BASED.store(sampling.parent_based, Ordering::Relaxed);
    ROOT_THRESHOLD.store(sampling.threshold(), Ordering::Relaxed);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Keeps the tracer provider alive; flushes exported spans when dropped.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// Installs the global subscriber (logs + OpenTelemetry layer). A second call installs nothing
/// but still returns a guard. The sampler is read from `OTEL_TRACES_SAMPLER(_ARG)`, the default
/// one when they are invalid (the worker binary checks them first and exits 2).
pub fn init(format: LogFormat) -> Telemetry {
    let sampling = Sampling::from_env(|n| std::env::var(n).ok()).unwrap_or_default();
    init_with_otlp(format, None, sampling)
}

/// Like [`init`], exporting spans over OTLP/HTTP to `endpoint` (e.g.
/// `http://collector:4318/v1/traces`) when given, of the records `sampling` picks.
pub fn init_with_otlp(format: LogFormat, endpoint: Option<&str>, sampling: Sampling) -> Telemetry {
    // The records are sampled before their spans exist (`record_span`): the SDK keeps every
    // root and sampled parent it is given, rather than sampling a second time (and reading
    // OTEL_TRACES_SAMPLER itself). ParentBased(AlwaysOn), not AlwaysOn: with AlwaysOn, the
    // otlp e2e test run alone got ~4 of its 200 spans (8 runs of 8; cause not found).
    let mut builder =
        SdkTracerProvider::builder().with_sampler(opentelemetry_sdk::trace::Sampler::ParentBased(
            Box::new(opentelemetry_sdk::trace::Sampler::AlwaysOn),
        ));
    let endpoint = endpoint
        .map(str::to_owned)
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok());
    let mut exporter_error = None;
    let mut exporting = false;
    if let Some(endpoint) = &endpoint {
        use opentelemetry_otlp::WithExportConfig;
        match opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(endpoint)
            .build()
        {
            Ok(exporter) => {
                builder = builder.with_batch_exporter(exporter);
                exporting = true;
            }
            Err(e) => exporter_error = Some(e.to_string()),
        }
    }
    let provider = builder.build();
    let tracer = provider.tracer("sessionflow-worker");
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs_spans = filter
        .max_level_hint()
        .is_none_or(|max| max >= tracing::level_filters::LevelFilter::DEBUG);
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().boxed(),
    };
    let otel = tracing_opentelemetry::layer().with_tracer(tracer);
    // Not exported, a span only gives its hop a span id for the traceparent passed on: skip
    // what only an exported span shows (code location, thread, target, busy and idle time,
    // which costs two clock reads per poll of a record's future).
    let otel = if exporting {
        otel
    } else {
        otel.with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
    };
    // RUST_LOG filters what is logged, not which spans exist: trace context must flow even
    // when logging is quiet.
    let installed = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(
            otel.with_filter(
                tracing_subscriber::filter::filter_fn(|m| {
                    *m.level() <= tracing::Level::INFO || m.target() == RECORD_SPANS
                })
                .with_max_level_hint(tracing::Level::DEBUG),
            ),
        )
        .try_init()
        .is_ok();
    if installed {
        set_every_record_span(logs_spans);
        set_sampling(if exporting {
            sampling
        } else {
            // Not exported: only a sampled parent's trace goes on through this hop.
            Sampling {
                parent_based: true,
                ratio: 0.0,
            }
        });
        if let Some(e) = exporter_error {
            tracing::error!(error = %e, "OTLP exporter not started; spans are not exported");
        } else if let Some(endpoint) = endpoint {
            tracing::info!(%endpoint, parent_based = sampling.parent_based, ratio = sampling.ratio,
                "exporting spans over OTLP/HTTP");
        }
    }
    Telemetry { provider }
}

/// Reads a record's headers for the W3C propagator.
struct RecordHeaders<'a>(&'a InputRecord);

impl Extractor for RecordHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.header(key).and_then(|v| std::str::from_utf8(v).ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.headers().map(|(k, _)| k).collect()
    }
}

/// The span of one record, a child of the trace its `traceparent` names (if any); none when
/// nothing wants it (see the module's introduction): an unsampled record costs a header scan.
pub fn record_span(record: &InputRecord) -> tracing::Span {
    if !EVERY_RECORD_SPAN.load(Ordering::Relaxed)
        && !sampling::sampled(
            PARENT_BASED.load(Ordering::Relaxed),
            ROOT_THRESHOLD.load(Ordering::Relaxed),
            Parent::of(record.header(header::TRACEPARENT)),
            sampling::draw(record.partition, record.offset),
        )
    {
        return tracing::Span::none();
    }
    let span = tracing::debug_span!(target: RECORD_SPANS, "record",
        session = %record.session_str(),
        partition = record.partition,
        offset = record.offset,
        event_id = %record.event_id(),
    );
    // No subscriber takes the span (telemetry not installed): no parent to read, no header
    // scanned for one.
    if !span.is_disabled() && record.header(header::TRACEPARENT).is_some() {
        let parent = TraceContextPropagator::new().extract(&RecordHeaders(record));
        let _ = span.set_parent(parent);
    }
    span
}

/// The span of one handler attempt, a child of the current (the record's) span; none when
/// the record has no span (`in_record_span` false).
pub fn attempt_span(in_record_span: bool, attempt: u32) -> tracing::Span {
    if !in_record_span {
        return tracing::Span::none();
    }
    tracing::debug_span!(target: RECORD_SPANS, "attempt", attempt)
}

/// The `traceparent` of the current span, to send downstream; falls back to the record's own
/// when no span context exists (no OpenTelemetry layer installed).
pub fn traceparent(record: &InputRecord) -> Option<String> {
    let cx = tracing::Span::current().context();
    let mut carrier: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove(header::TRACEPARENT).or_else(|| {
        record
            .header(header::TRACEPARENT)
            .and_then(|v| std::str::from_utf8(v).ok())
            .map(str::to_owned)
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage, Timestamp};
    use tracing::Instrument;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;
    use crate::record::Lease;
    use crate::record::SessionSource;

    fn record(traceparent: Option<&str>) -> InputRecord {
        let mut hs = OwnedHeaders::new();
        if let Some(tp) = traceparent {
            hs = hs.insert(Header {
                key: header::TRACEPARENT,
                value: Some(tp.as_bytes()),
            });
        }
        let m = OwnedMessage::new(
            Some(b"v".to_vec()),
            Some(b"s1".to_vec()),
            "in".into(),
            Timestamp::NotAvailable,
            0,
            7,
            Some(hs),
        );
        InputRecord::from_message(
            &m,
            "in".into(),
            &SessionSource::Key,
            Arc::new(Lease::new(0, 1)),
        )
    }

    /// (traceparent in the record's span, traceparent in its attempt's span)
    fn traceparents(record: &InputRecord) -> (Option<String>, Option<String>) {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry().with(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("test"))
                .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                    m.target() == RECORD_SPANS
                })),
        );
        tracing::subscriber::with_default(subscriber, || {
            let span = record_span(record);
            let attempt = span.in_scope(|| attempt_span(!span.is_none(), 1));
            let in_record = span.in_scope(|| traceparent(record));
            let in_attempt =
                futures::executor::block_on(async { traceparent(record) }.instrument(attempt));
            (in_record, in_attempt)
        })
    }

    fn parts(tp: &str) -> (String, String) {
        let p: Vec<&str> = tp.split('-').collect();
        (p[1].to_string(), p[2].to_string())
    }

    // One test for both settings of the process-wide switch, so no other test races it.
    #[test]
    fn records_get_spans_only_when_something_wants_them() {
        let input = "00-0000000000000000000000000000abcd-00000000000012ab-01";
        set_every_record_span(false);
        set_sampling(Sampling {
            parent_based: true,
            ratio: 0.0,
        });
        // Not exported, not logged: no span, and nothing made up downstream.
        assert_eq!(traceparents(&record(None)), (None, None));
        // A parent that is not sampled: no span, its traceparent passed on unchanged.
        let unsampled = "00-0000000000000000000000000000abcd-00000000000012ab-00";
        let passed = Some(unsampled.to_string());
        assert_eq!(
            traceparents(&record(Some(unsampled))),
            (passed.clone(), passed)
        );
        // A traced record continues its trace with spans of this hop.
        let (in_record, in_attempt) = traceparents(&record(Some(input)));
        let (in_record, in_attempt) = (in_record.unwrap(), in_attempt.unwrap());
        assert_eq!(parts(&in_record).0, parts(input).0, "same trace");
        assert_eq!(parts(&in_attempt).0, parts(input).0, "same trace");
        assert_ne!(parts(&in_record).1, parts(input).1, "this hop's own span");
        assert_ne!(
            parts(&in_attempt).1,
            parts(&in_record).1,
            "the attempt is a child span"
        );
        // Exported at ratio 1: a root gets its span, a new trace.
        set_sampling(Sampling {
            parent_based: true,
            ratio: 1.0,
        });
        let (in_record, in_attempt) = traceparents(&record(None));
        assert!(in_record.is_some() && in_attempt.is_some());
        assert_ne!(in_record, in_attempt);
        // Logged at debug: every record has its span, whatever its parent says.
        set_sampling(Sampling {
            parent_based: true,
            ratio: 0.0,
        });
        set_every_record_span(true);
        let (in_record, _) = traceparents(&record(Some(unsampled)));
        assert_ne!(in_record.as_deref(), Some(unsampled), "this hop's own span");
        let (in_record, in_attempt) = traceparents(&record(None));
        assert!(in_record.is_some() && in_attempt.is_some());
        assert_ne!(in_record, in_attempt);
    }
}
