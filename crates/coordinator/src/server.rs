//! The HTTP server loop, with the bounds a shared service needs: at most `max_connections`
//! connections (more are closed on arrival and counted), and a deadline for each request's
//! head that also ends idle kept-alive connections. Long polls are bounded separately
//! ([`crate::http::MAX_LONG_POLLS`]) and every handler either answers at once or waits at
//! most `wait_ms` (<= 30 s).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tracing::{debug, warn};

use crate::{CoordinatorConfig, Shared};

/// Default bound on open connections: far below a default 1,048,576 fd limit and far above
/// what a fleet's schedulers keep open to one replica.
pub const MAX_CONNECTIONS: usize = 16_384;

/// Default time a client gets to send a request head (and a kept-alive connection to stay idle).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long shutdown waits for open requests (long polls included) to finish.
const DRAIN: Duration = Duration::from_secs(5);

/// Serves `app` on `listener` until `shutdown` resolves, then drains for at most [`DRAIN`].
pub async fn serve(
    listener: TcpListener,
    app: Router,
    config: &CoordinatorConfig,
    shared: &Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    // Semaphore::new panics past MAX_PERMITS, and the drain below counts in u32: any larger
    // bound is far beyond the file descriptors a process gets anyway.
    let max = config.max_connections.clamp(1, u32::MAX as usize);
    let slots = Arc::new(Semaphore::new(max));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_timeout)
        .keep_alive(true);
    let tls = config.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors or similar: pause instead of spinning.
                    warn!(error = %e, "accept failed; pausing 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            shared.metrics.http_connections_refused.inc();
            debug!(%peer, max, "connection refused: --max-connections are open");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (stop, shared) = (stop_rx.clone(), shared.clone());
        let (app, http1, tls) = (app.clone(), http1.clone(), tls.clone());
        let handshake_within = config.header_timeout;
        shared.metrics.http_connections.inc();
        tokio::spawn(async move {
            match tls {
                None => serve_connection(TokioIo::new(stream), &http1, app, stop, peer).await,
                // The handshake is bounded like a request head: a client that opens TLS and
                // says nothing holds its slot no longer than a slow plain one.
                Some(acceptor) => match tokio::time::timeout(handshake_within, handshake(acceptor, stream)).await {
                    Ok(Ok(Some(tls_stream))) => {
                        serve_connection(TokioIo::new(tls_stream), &http1, app, stop, peer).await
                    }
                    Ok(Ok(None)) => debug!(%peer, "plain HTTP on the HTTPS port: answered 400"),
                    Ok(Err(e)) => debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => debug!(%peer, "TLS handshake timed out"),
                },
            }
            shared.metrics.http_connections.dec();
            drop(slot);
        });
    }
    let _ = stop_tx.send(true);
    // Every connection gives its slot back when it ends; wait (bounded) for all of them.
    let _ = tokio::time::timeout(DRAIN + Duration::from_secs(1), slots.acquire_many(max as u32)).await;
}

/// The answer to a plain HTTP request on the HTTPS port: without it the client sees a closed
/// connection and no reason (curl: "Empty reply from server").
const USE_HTTPS: &str =
    r#"{"error":{"code":"use_https","message":"this port speaks HTTPS: use https:// instead of http://"}}"#;

/// The TLS handshake, or `None` when the client spoke plain HTTP (answered [`USE_HTTPS`]). A
/// TLS client's first byte is a handshake record (0x16); an HTTP request starts with a method
/// in capitals.
async fn handshake(
    acceptor: tokio_rustls::TlsAcceptor,
    mut stream: tokio::net::TcpStream,
) -> std::io::Result<Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut first = [0u8; 1];
    if stream.peek(&mut first).await? == 1 && first[0].is_ascii_uppercase() {
        // Read the request head first: closing with unread bytes resets the connection, and
        // the client would see the reset instead of the answer.
        let mut head = Vec::new();
        let mut buf = [0u8; 2048];
        while head.len() < 16 * 1024 && !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await? {
                0 => break,
                n => head.extend_from_slice(&buf[..n]),
            }
        }
        let answer = format!(
            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{USE_HTTPS}",
            USE_HTTPS.len()
        );
        stream.write_all(answer.as_bytes()).await?;
        let _ = stream.shutdown().await;
        return Ok(None);
    }
    acceptor.accept(stream).await.map(Some)
}

/// One connection until it ends, or until shutdown asks it to finish its requests (bounded by
/// [`DRAIN`]).
async fn serve_connection<I>(
    io: TokioIo<I>,
    http1: &hyper::server::conn::http1::Builder,
    app: Router,
    mut stop: watch::Receiver<bool>,
    peer: std::net::SocketAddr,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let conn = http1.serve_connection(io, TowerToHyperService::new(app));
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                debug!(%peer, error = %e, "connection ended with an error");
            }
        }
        _ = stop.changed() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(DRAIN, conn).await;
        }
    }
}
