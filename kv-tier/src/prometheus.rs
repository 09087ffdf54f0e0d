//! A Prometheus endpoint for a manager's metrics (feature `prometheus`).
//!
//! kv-tier records through the [`metrics`](https://docs.rs/metrics) facade (see
//! [`kv_tier_core::metrics`] for the names). This module installs the Prometheus recorder as
//! the process's recorder and serves the text format over HTTP; an engine that already
//! installs its own recorder (or exports through OpenTelemetry) skips it and calls
//! [`TieringManager::publish_metrics`] itself.
//!
//! ```no_run
//! # async fn demo(manager: std::sync::Arc<kv_tier::TieringManager>) -> std::io::Result<()> {
//! let endpoint = kv_tier::prometheus::serve("127.0.0.1:9464".parse().unwrap(), &manager).await?;
//! println!("metrics at http://{}/metrics", endpoint.addr());
//! # Ok(()) }
//! ```

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::TieringManager;

/// Histogram buckets, in seconds: 50 µs to a minute.
const BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder as the process's `metrics` recorder, once: later calls
/// return the same handle. Fails when another recorder was installed first.
pub fn install_recorder() -> io::Result<PrometheusHandle> {
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .and_then(|b| b.install_recorder())
        .map_err(|e| io::Error::other(format!("installing the Prometheus recorder: {e}")))?;
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// What a scrape renders: the manager's statistics published now, then every metric of the
/// recorder in the Prometheus text format.
pub fn render(handle: &PrometheusHandle, manager: &TieringManager) -> String {
    manager.publish_metrics();
    handle.run_upkeep();
    handle.render()
}

/// A running endpoint. Dropping it stops serving.
#[derive(Debug)]
pub struct MetricsEndpoint {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsEndpoint {
    /// The address it listens on (the port the OS chose when asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Installs the recorder (see [`install_recorder`]) and serves `GET /metrics` on `addr`, on
/// the current tokio runtime: each scrape publishes `manager`'s statistics first, so every
/// value is as of the scrape (counters are the process's, summed over every manager it had:
/// see [`kv_tier_core::metrics`]). Other paths answer 404. The endpoint does not keep the
/// manager alive: once it is dropped, scrapes render what was recorded last.
pub async fn serve(addr: SocketAddr, manager: &Arc<TieringManager>) -> io::Result<MetricsEndpoint> {
    let handle = install_recorder()?;
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("binding the metrics endpoint {addr}: {e}"),
        )
    })?;
    let addr = listener.local_addr()?;
    let manager = Arc::downgrade(manager);
    let task = tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                // out of descriptors, most likely: do not spin
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let (handle, manager) = (handle.clone(), manager.clone());
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_secs(10), answer(conn, &handle, &manager))
                        .await;
            });
        }
    });
    Ok(MetricsEndpoint { addr, task })
}

/// Reads one request's head and answers it; the connection closes after.
async fn answer(
    mut conn: TcpStream,
    handle: &PrometheusHandle,
    manager: &Weak<TieringManager>,
) -> io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, kind, body) = if method == "GET" && (path == "/metrics" || path == "/") {
        let body = match manager.upgrade() {
            Some(m) => render(handle, &m),
            None => handle.render(),
        };
        ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body)
    } else {
        (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "kv-tier serves GET /metrics\n".to_string(),
        )
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(reply.as_bytes()).await?;
    conn.shutdown().await
}
