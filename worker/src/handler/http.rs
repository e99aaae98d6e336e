//! The HTTP handler: each record is POSTed to the stage's service.
//!
//! This is how the worker image is useful without writing Rust: the stage's logic lives in any
//! HTTP service. The status code decides what happens to the record — 2xx succeeds (the body is
//! the output record, 204 means no output), 408/429/5xx and connection failures or timeouts are
//! transient (retried in place), any other status is poison (DLQ).

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::StatusCode;

use crate::config::HttpHandlerConfig;
use crate::record::{header, InputRecord};

use super::{HandlerError, HandlerResult};

pub struct HttpHandler {
    client: reqwest::Client,
    url: reqwest::Url,
}

/// What a response status means for the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusClass {
    Success { output: bool },
    Transient,
    Poison,
}

/// Classifies a response status (pure, for tests and for the handler).
pub fn classify(status: StatusCode) -> StatusClass {
    match status.as_u16() {
        204 => StatusClass::Success { output: false },
        200..=299 => StatusClass::Success { output: true },
        408 | 429 | 500..=599 => StatusClass::Transient,
        _ => StatusClass::Poison,
    }
}

impl HttpHandler {
    pub fn new(config: &HttpHandlerConfig) -> anyhow::Result<Self> {
        let url = reqwest::Url::parse(&config.url)
            .map_err(|e| anyhow::anyhow!("handler.http.url {:?}: {e}", config.url))?;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(config.timeout_ms))
            .connect_timeout(Duration::from_millis(config.timeout_ms.min(5_000)))
            .pool_max_idle_per_host(256)
            .build()?;
        Ok(Self { client, url })
    }

    fn headers(record: &InputRecord, attempt: u32) -> HeaderMap {
        let mut map = HeaderMap::new();
        // The record's own headers first; the ones sessionflow sets win over them.
        for (k, v) in record.headers() {
            let (Ok(name), Some(Ok(value))) = (
                HeaderName::from_bytes(k.as_bytes()),
                v.map(HeaderValue::from_bytes),
            ) else {
                continue; // not representable in HTTP; the body is what the service needs
            };
            map.append(name, value);
        }
        let mut set = |name: &'static str, value: &str| {
            if let Ok(v) = HeaderValue::from_str(value) {
                map.insert(HeaderName::from_static(name), v);
            }
        };
        set(header::SESSION, &record.session_str());
        set(header::EVENT_ID, &record.event_id());
        set(header::ATTEMPT, &attempt.to_string());
        if let Some(tp) = crate::ops::telemetry::traceparent(record) {
            set(header::TRACEPARENT, &tp);
        }
        map
    }

    pub async fn handle(&self, record: &InputRecord, attempt: u32) -> HandlerResult {
        let response = self
            .client
            .post(self.url.clone())
            .headers(Self::headers(record, attempt))
            .body(record.value().unwrap_or_default().to_vec())
            .send()
            .await
            .map_err(|e| HandlerError::Transient(format!("POST {}: {e}", self.url)))?;
        let status = response.status();
        match classify(status) {
            StatusClass::Success { output: false } => Ok(None),
            StatusClass::Success { output: true } => {
                let body = response
                    .bytes()
                    .await
                    .map_err(|e| HandlerError::Transient(format!("reading response body: {e}")))?;
                Ok(Some(body.to_vec()))
            }
            class => {
                let body = response.text().await.unwrap_or_default();
                let message = format!("{status}: {}", body.chars().take(512).collect::<String>());
                Err(if class == StatusClass::Transient {
                    HandlerError::Transient(message)
                } else {
                    HandlerError::Poison(message)
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_classes() {
        let c = |s: u16| classify(StatusCode::from_u16(s).unwrap());
        assert_eq!(c(200), StatusClass::Success { output: true });
        assert_eq!(c(201), StatusClass::Success { output: true });
        assert_eq!(c(204), StatusClass::Success { output: false });
        for s in [408, 429, 500, 502, 503, 504, 599] {
            assert_eq!(c(s), StatusClass::Transient, "{s}");
        }
        for s in [300, 301, 400, 401, 403, 404, 409, 422] {
            assert_eq!(c(s), StatusClass::Poison, "{s}");
        }
    }
}
