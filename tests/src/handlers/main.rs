//! `sessionflow-demo-handlers`: the conversational example's services (ingest, nlu, the LLM
//! gateway, delivery) as one local HTTP server, for `make demo-k8s`: the workers' HTTP handlers
//! POST each record to it and get the output back.
//!
//! ```text
//! sessionflow-demo-handlers --listen 127.0.0.1:PORT [--latency PATH=MS]...
//! ```
//! Every path answers a POST with the body it got (200: the record goes on unchanged, so the
//! per-session numbering `verify` checks survives every stage), after the path's latency (the
//! LLM's is the long one: the stage that scales). A path given latency 0 answers at once. A
//! path ending in `/send` (delivery, the last stage, which has no output topic) answers 204.
//! It serves until SIGTERM/SIGINT.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::IntoResponse;
use axum::Router;

fn usage() -> ! {
    eprintln!("usage: sessionflow-demo-handlers --listen ADDR [--latency PATH=MS]...");
    std::process::exit(2)
}

#[tokio::main]
async fn main() {
    let mut listen = None;
    let mut latency: HashMap<String, Duration> = HashMap::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--listen" => listen = Some(value),
            "--latency" => {
                let (path, ms) = value.split_once('=').unwrap_or_else(|| usage());
                let ms: u64 = ms.parse().unwrap_or_else(|_| usage());
                latency.insert(path.to_string(), Duration::from_millis(ms));
            }
            _ => usage(),
        }
    }
    let listen = listen.unwrap_or_else(|| usage());
    let app = Router::new().fallback(handle).with_state(Arc::new(latency));
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .unwrap_or_else(|e| panic!("binding {listen}: {e}"));
    eprintln!("sessionflow-demo-handlers: listening on {listen}");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        })
        .await
        .expect("serving");
}

async fn handle(
    State(latency): State<Arc<HashMap<String, Duration>>>,
    uri: Uri,
    body: Bytes,
) -> impl IntoResponse {
    if let Some(wait) = latency.get(uri.path()) {
        tokio::time::sleep(*wait).await;
    }
    if uri.path().ends_with("/send") {
        (StatusCode::NO_CONTENT, Bytes::new())
    } else {
        (StatusCode::OK, body)
    }
}
