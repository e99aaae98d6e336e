//! The readiness probe: an HTTP GET on 127.0.0.1, as the kubelet's `httpGet` probe does.
//!
//! Written on a bare TCP stream (one request, `Connection: close`, the status line read back)
//! so that the test kubelet needs no HTTP client; a 2xx or 3xx answer is success, anything else
//! (refused, timed out, 4xx, 5xx) is failure — the kubelet's rule.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long one probe may take (the kubelet's default `timeoutSeconds` is 1).
const TIMEOUT: Duration = Duration::from_secs(1);

/// GET `path` on 127.0.0.1:`port`: `true` on a 2xx or 3xx status.
pub async fn http_get(port: u16, path: &str) -> bool {
    tokio::time::timeout(TIMEOUT, status(port, path))
        .await
        .ok()
        .flatten()
        .is_some_and(|code| (200..400).contains(&code))
}

async fn status(port: u16, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut head = Vec::with_capacity(64);
    let mut buf = [0u8; 64];
    // The status line is all that is needed: "HTTP/1.1 200 OK\r\n".
    while !head.contains(&b'\n') && head.len() < 1024 {
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    line.split_whitespace().nth(1)?.parse().ok()
}
