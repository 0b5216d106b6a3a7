//! `--metrics-listen` (SPEC section 8): `rootrank node-watch` and `rootrank run` serve
//! `GET /metrics` with the family they own, `rootrank_unverified_pids_total` (and node-watch
//! `rootrank_node_watch_events_total`).
//!
//! The server is a task of its own, bounded (a few connections at once, a deadline for each
//! request head), so a slow or hostile scraper can neither hold up node-watch's watch loop
//! nor take the file descriptors and time the supervisor needs for its child and its
//! certificate. Its sockets are close-on-exec: the supervised child inherits none of them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus::{Encoder, IntCounter, Registry, TextEncoder};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::NodeError;

/// Connections open at once; more are closed on arrival. One or two Prometheus servers
/// scrape a node's processes.
const MAX_CONNECTIONS: usize = 16;

/// Time a client gets to send a request head; also how long an idle kept-alive connection
/// stays open.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// The metrics of one node-watch or supervisor process. Counting works whether or not they
/// are served.
#[derive(Clone)]
pub(crate) struct NodeMetrics {
    registry: Registry,
    /// `rootrank_unverified_pids_total`: live records whose process could not be verified,
    /// so nothing was done to it (counted once per incarnation).
    pub(crate) unverified_pids: IntCounter,
}

impl NodeMetrics {
    pub(crate) fn new() -> Result<Self, NodeError> {
        let registry = Registry::new();
        let unverified_pids = IntCounter::new(
            "rootrank_unverified_pids_total",
            "Rank pids this process refused to act on: the live record's process could not be verified (another pid namespace without a mapping, or a reused pid).",
        )?;
        registry.register(Box::new(unverified_pids.clone()))?;
        Ok(NodeMetrics {
            registry,
            unverified_pids,
        })
    }

    /// node-watch's own family, `rootrank_node_watch_events_total`: etcd keys its snapshots
    /// and watch delivered (with `--watch-scope host`, its host's ranks only, whatever the
    /// fleet's size).
    pub(crate) fn watch_events(&self) -> Result<IntCounter, NodeError> {
        let c = IntCounter::new(
            "rootrank_node_watch_events_total",
            "etcd keys node-watch's snapshots and watch delivered (with --watch-scope host, its own host's ranks only).",
        )?;
        self.registry.register(Box::new(c.clone()))?;
        Ok(c)
    }

    /// The text exposition.
    fn render(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        String::from_utf8(buf).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }
}

/// The metrics server, listening; it stops, with its connections, when dropped.
pub(crate) struct MetricsServer {
    task: JoinHandle<()>,
}

impl MetricsServer {
    /// Binds `addr` (an error naming it when that fails) and serves `metrics` there from a
    /// task of its own.
    pub(crate) async fn start(addr: SocketAddr, metrics: NodeMetrics) -> Result<MetricsServer, NodeError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| NodeError::MetricsListen { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| NodeError::MetricsListen { addr, source })?;
        info!(addr = %local, "serving metrics at http://{local}/metrics");
        let app = Router::new()
            .route("/metrics", get(scrape))
            .fallback(|| async { (StatusCode::NOT_FOUND, "not found; metrics are at GET /metrics\n") })
            .with_state(Arc::new(metrics));
        Ok(MetricsServer {
            task: tokio::spawn(accept_loop(listener, app)),
        })
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts the server when an address is configured.
pub(crate) async fn serve_if(
    addr: Option<SocketAddr>,
    metrics: &NodeMetrics,
) -> Result<Option<MetricsServer>, NodeError> {
    match addr {
        Some(a) => Ok(Some(MetricsServer::start(a, metrics.clone()).await?)),
        None => Ok(None),
    }
}

async fn scrape(State(metrics): State<Arc<NodeMetrics>>) -> Response {
    match metrics.render() {
        Ok(text) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], text).into_response(),
        // Never an empty 200, which a scraper would read as "no series".
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot render metrics: {e}\n"),
        )
            .into_response(),
    }
}

/// Accepts until aborted. Each connection is a task that ends when this loop does (its
/// `stop` sender is dropped then).
async fn accept_loop(listener: TcpListener, app: Router) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let (_stop_tx, stop_rx) = watch::channel(());
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(true);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors or similar: pause instead of spinning.
                warn!(error = %e, "metrics: accept failed; pausing 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            debug!(%peer, max = MAX_CONNECTIONS, "metrics: connection refused, too many open");
            drop(stream);
            continue;
        };
        let conn = http1.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            tokio::select! {
                r = conn => {
                    if let Err(e) = r {
                        debug!(%peer, error = %e, "metrics: connection ended with an error");
                    }
                }
                // The server is stopping (the sender is gone): drop the connection.
                _ = stop.changed() => {}
            }
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_counter_family_starting_at_zero() -> Result<(), Box<dyn std::error::Error>> {
        let m = NodeMetrics::new()?;
        let text = m.render()?;
        assert!(
            text.contains("# TYPE rootrank_unverified_pids_total counter\n"),
            "{text}"
        );
        assert!(text.contains("\nrootrank_unverified_pids_total 0\n"), "{text}");
        m.unverified_pids.inc();
        let text = m.render()?;
        assert!(text.contains("\nrootrank_unverified_pids_total 1\n"), "{text}");
        let samples = text.lines().filter(|l| !l.starts_with('#')).count();
        assert_eq!(samples, 1, "exactly one series: {text}");
        Ok(())
    }

    #[tokio::test]
    async fn a_taken_address_is_an_error_naming_it() -> Result<(), Box<dyn std::error::Error>> {
        let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = taken.local_addr()?;
        let Err(e) = MetricsServer::start(addr, NodeMetrics::new()?).await else {
            return Err("bound an address already taken".into());
        };
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
        Ok(())
    }
}
