//! Logs and traces: structured logs on stderr, W3C trace context across every hop.
//!
//! Logs are human-readable text by default and JSON lines with `--log-format json`; `RUST_LOG`
//! filters (default `info`). A record's span carries its session, partition, offset and event
//! id, so every log line about the record carries them too.
//!
//! Tracing follows OpenTelemetry: the `traceparent` of an input record becomes the parent of the
//! record's span (one per record, one child per attempt), and the current span's context is
//! injected into the output and DLQ records and into HTTP handler calls, so a trace follows a
//! message across stages. Spans are exported over OTLP/HTTP only when an endpoint is
//! configured (`otlpEndpoint`, or `OTEL_EXPORTER_OTLP_ENDPOINT`); otherwise they exist only to
//! give each hop its own span id.

use std::collections::HashMap;
use std::io::IsTerminal;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::record::{header, InputRecord};

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
/// but still returns a guard.
pub fn init(format: LogFormat) -> Telemetry {
    init_with_otlp(format, None)
}

/// Like [`init`], exporting spans over OTLP/HTTP to `endpoint` (e.g.
/// `http://collector:4318/v1/traces`) when given.
pub fn init_with_otlp(format: LogFormat, endpoint: Option<&str>) -> Telemetry {
    let mut builder = SdkTracerProvider::builder();
    let endpoint = endpoint
        .map(str::to_owned)
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok());
    let mut exporter_error = None;
    if let Some(endpoint) = &endpoint {
        use opentelemetry_otlp::WithExportConfig;
        match opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(endpoint)
            .build()
        {
            Ok(exporter) => builder = builder.with_batch_exporter(exporter),
            Err(e) => exporter_error = Some(e.to_string()),
        }
    }
    let provider = builder.build();
    let tracer = provider.tracer("sessionflow-worker");
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().boxed(),
    };
    // RUST_LOG filters what is logged, not which spans exist: trace context must flow even
    // when logging is quiet.
    let installed = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(tracing_subscriber::filter::LevelFilter::INFO),
        )
        .try_init()
        .is_ok();
    if installed {
        if let Some(e) = exporter_error {
            tracing::error!(error = %e, "OTLP exporter not started; spans are not exported");
        } else if let Some(endpoint) = endpoint {
            tracing::info!(%endpoint, "exporting spans over OTLP/HTTP");
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
        self.0.headers.iter().map(|(k, _)| k.as_str()).collect()
    }
}

/// The span of one record, a child of the trace its `traceparent` names (if any).
pub fn record_span(record: &InputRecord) -> tracing::Span {
    let span = tracing::info_span!("record",
        session = %record.session_str(),
        partition = record.partition,
        offset = record.offset,
        event_id = %record.event_id,
    );
    if record.header(header::TRACEPARENT).is_some() {
        let parent = TraceContextPropagator::new().extract(&RecordHeaders(record));
        let _ = span.set_parent(parent);
    }
    span
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
