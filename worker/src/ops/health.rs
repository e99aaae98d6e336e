//! `/metrics`, `/healthz` and `/readyz` over HTTP.
//!
//! Liveness and readiness are different questions. *Alive* means the consumer loop is still
//! turning (a wedged loop should get the pod restarted). *Ready* means the worker reaches the
//! broker and holds a subscription; a missing broker makes the worker not-ready while it keeps
//! retrying — never a crash loop.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;

use crate::ops::metrics::Metrics;

/// Shared liveness/readiness flags, written by the consumer loop (reachability, turns) and by
/// the write path (results the broker keeps refusing, fatal client errors).
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    /// Unix millis of the consumer loop's last turn.
    heartbeat_ms: AtomicU64,
    /// Records whose dead letter the broker keeps refusing: nothing behind them can commit.
    blocked_writes: AtomicUsize,
    /// A fatal client error: not ready for good, the worker is stopping.
    failed: AtomicBool,
}

/// The consumer loop is considered wedged when it has not turned for this long.
pub const LIVENESS_LIMIT: Duration = Duration::from_secs(60);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
            && self.blocked_writes.load(Ordering::Relaxed) == 0
            && !self.failed.load(Ordering::Relaxed)
            && self.is_alive()
    }

    /// A write started being refused (`true`) or finally landed (`false`).
    pub fn write_blocked(&self, blocked: bool) {
        if blocked {
            self.blocked_writes.fetch_add(1, Ordering::Relaxed);
        } else {
            self.blocked_writes.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Not ready from now on (a fatal error; the worker is stopping).
    pub fn fail(&self) {
        self.failed.store(true, Ordering::Relaxed);
    }

    pub fn beat(&self) {
        self.heartbeat_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub fn is_alive(&self) -> bool {
        let last = self.heartbeat_ms.load(Ordering::Relaxed);
        last == 0 || now_ms().saturating_sub(last) < LIVENESS_LIMIT.as_millis() as u64
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Metrics,
    health: Arc<Health>,
}

/// Binds `addr` and serves until `shutdown` is cancelled. Returns the bound address (useful
/// with port 0).
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { metrics, health });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok(bound)
}

async fn render_metrics(State(s): State<AppState>) -> String {
    s.metrics.render()
}

async fn healthz(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.health.is_alive() {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "consumer loop stalled\n")
    }
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.health.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
