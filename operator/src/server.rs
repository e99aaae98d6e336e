//! The operator's HTTP endpoints: `/metrics` (Prometheus), `/healthz` (the process serves and
//! its autoscaler loop completed a pass recently, see [`crate::liveness`]) and `/readyz` (the
//! SessionPipeline cache has synced, so reconciles see the cluster).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;

use crate::liveness::PassClock;
use crate::metrics::Metrics;

#[derive(Clone)]
struct AppState {
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    passes: Arc<PassClock>,
}

/// Serves until the task is dropped; returns the bound address once listening.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    passes: Arc<PassClock>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState {
            metrics,
            ready,
            passes,
        });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "metrics server stopped");
        }
    });
    Ok((bound, task))
}

async fn render_metrics(State(s): State<AppState>) -> String {
    s.metrics.render()
}

async fn healthz(State(s): State<AppState>) -> (StatusCode, String) {
    if s.passes.healthy() {
        (StatusCode::OK, "ok".into())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the autoscaler loop has not completed a pass for more than {} s",
                s.passes.allowed().as_secs()
            ),
        )
    }
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "cache not synced")
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;
    use crate::fixtures::stalled_pass_clock;

    /// The status line of `GET path` (plain HTTP/1.1 over a blocking socket).
    async fn get_status(addr: SocketAddr, path: &str) -> String {
        let path = path.to_string();
        tokio::task::spawn_blocking(move || {
            let mut stream = std::net::TcpStream::connect(addr).unwrap();
            let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            stream.write_all(request.as_bytes()).unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).unwrap();
            response.lines().next().unwrap_or_default().to_string()
        })
        .await
        .unwrap()
    }

    /// `/healthz` over HTTP: 200 while passes complete, 503 once the last one is older than
    /// the allowance (a clock that started long enough ago stands in for a wedged loop).
    #[tokio::test]
    async fn healthz_fails_when_the_autoscaler_loop_stops_completing_passes() {
        let passes = stalled_pass_clock();
        let (addr, _task) = serve(
            "127.0.0.1:0".parse().unwrap(),
            Metrics::new(),
            Arc::new(AtomicBool::new(true)),
            passes.clone(),
        )
        .await
        .unwrap();
        assert_eq!(
            get_status(addr, "/healthz").await,
            "HTTP/1.1 503 Service Unavailable"
        );
        passes.completed();
        assert_eq!(get_status(addr, "/healthz").await, "HTTP/1.1 200 OK");
        assert_eq!(get_status(addr, "/readyz").await, "HTTP/1.1 200 OK");
    }
}
