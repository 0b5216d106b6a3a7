//! The coordinator: etcd → index → verdicts over HTTP and metrics.
//!
//! - [`sync`]: loads the prefix at a revision, watches from revision + 1, re-creates the
//!   watch after errors and reloads after compaction; applies every event to the index and
//!   acts on its outputs (metrics, persisting vanished live keys as certificates).
//! - [`lease_doubt`]: after etcd was silent, a vanished live key is certified only once it is
//!   known whether its process lived on (`lease_lost`) or died (`lease_expired`).
//! - [`http`]: the API of SPEC section 6, including long-poll verdicts.
//! - [`metrics`]: the metrics of SPEC section 8.
//! - [`events`]: `GET /v1/events`, a bounded ring of rank changes and resolved rooms.
//! - [`waiters`]: long polls wait on their room, woken by what concerns it.
//!
//! Nothing lives only in memory: a restarted coordinator rebuilds the same index from etcd.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
pub mod alarms;
pub mod events;
pub mod http;
pub mod lease_doubt;
pub mod metrics;
pub mod presence;
pub mod series;
pub mod server;
pub mod sync;
pub mod waiters;

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rootrank_core::{Index, IndexConfig};
pub use rootrank_store::{EtcdAccess, EtcdCredentialFiles};
pub use rootrank_tls::AuthToken;
use tokio::sync::watch;

/// How a coordinator runs.
#[derive(Clone, Debug)]
pub struct CoordinatorConfig {
    /// etcd's endpoints and credentials ([`CoordinatorConfig::new`]: plain).
    pub etcd: EtcdAccess,
    pub listen: SocketAddr,
    /// HTTPS (`--tls-cert/--tls-key`); plain HTTP when `None`.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// The bearer token every data route wants (`--auth-token-file`); open when `None`.
    pub auth_token: Option<AuthToken>,
    /// Whether `/metrics` wants the token too (`--auth-metrics`).
    pub auth_metrics: bool,
    pub index: IndexConfig,
    /// How long the certificates it writes are kept (default 600 s).
    pub retention: Duration,
    /// Long polls allowed to wait at once (default [`http::MAX_LONG_POLLS`]).
    pub max_long_polls: usize,
    /// HTTP connections open at once (default [`server::MAX_CONNECTIONS`]); more are closed
    /// on arrival, so a client tries another replica instead of waiting in a queue.
    pub max_connections: usize,
    /// How long a client may take to send a request's head, and how long a kept-alive
    /// connection may sit idle (default [`server::HEADER_TIMEOUT`]): slow clients
    /// (slowloris) cannot hold connections for ever.
    pub header_timeout: Duration,
    /// Concurrent range readers for the start-up snapshot (default
    /// [`rootrank_store::DEFAULT_READERS`]): start-up time is failover time.
    pub snapshot_readers: usize,
}

impl CoordinatorConfig {
    /// The defaults of `rootrank serve` for everything but where etcd is and where to listen.
    pub fn new(endpoints: Vec<String>, listen: SocketAddr) -> Self {
        CoordinatorConfig {
            etcd: EtcdAccess::plain(endpoints),
            listen,
            tls: None,
            auth_token: None,
            auth_metrics: false,
            index: IndexConfig::default(),
            retention: Duration::from_secs(600),
            max_long_polls: http::MAX_LONG_POLLS,
            max_connections: server::MAX_CONNECTIONS,
            header_timeout: server::HEADER_TIMEOUT,
            snapshot_readers: rootrank_store::DEFAULT_READERS,
        }
    }
}

/// State shared by the sync loop and the HTTP handlers.
pub struct Shared {
    pub index: RwLock<Index>,
    /// Set once the first snapshot is loaded and while the watch is established.
    pub ready: AtomicBool,
    /// Bumped after every applied batch: the event stream, and long polls waiting for a
    /// `min_revision`, wait on it.
    pub revision_tx: watch::Sender<i64>,
    /// Long polls waiting on a room's verdict.
    pub waiters: waiters::RoomWaiters,
    pub metrics: metrics::Metrics,
    /// Slots for long polls (see [`http::MAX_LONG_POLLS`]).
    pub long_polls: Arc<tokio::sync::Semaphore>,
    pub verdicts: http::VerdictCache,
    /// v3: recent rank changes and resolved rooms for `GET /v1/events`.
    pub events: events::EventLog,
    pub auth_token: Option<AuthToken>,
    pub auth_metrics: bool,
    /// v4: the alarms etcd raises now (`NOSPACE`), as [`alarms::run`] last read them.
    pub etcd_alarms: std::sync::Mutex<Vec<&'static str>>,
}

impl Shared {
    pub fn new(config: &CoordinatorConfig) -> Result<Arc<Self>, prometheus::Error> {
        let (revision_tx, _) = watch::channel(0);
        Ok(Arc::new(Shared {
            index: RwLock::new(Index::new(config.index.clone())),
            ready: AtomicBool::new(false),
            revision_tx,
            waiters: waiters::RoomWaiters::default(),
            metrics: metrics::Metrics::new()?,
            long_polls: Arc::new(tokio::sync::Semaphore::new(
                config.max_long_polls.clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
            )),
            verdicts: http::VerdictCache::default(),
            events: events::EventLog::default(),
            auth_token: config.auth_token.clone(),
            auth_metrics: config.auth_metrics,
            etcd_alarms: std::sync::Mutex::new(Vec::new()),
        }))
    }

    /// Marks this replica not current with etcd and wakes every long poll, so each answers
    /// 503 `not_ready` now (a client then asks another replica) instead of a stale `pending`
    /// when its wait ends.
    pub fn set_unready(&self) {
        if self.ready.swap(false, std::sync::atomic::Ordering::SeqCst) {
            self.revision_tx.send_modify(|_| {});
            self.waiters.wake_all();
        }
    }
}

/// Errors that stop a coordinator from starting.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error("cannot listen on {addr}: {source} (is another coordinator running there? pass --listen)")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("HTTP server: {0}")]
    Serve(#[source] std::io::Error),
    #[error(transparent)]
    Etcd(rootrank_store::StoreError),
}

/// Stops start-up when etcd refuses us (TLS, auth, a role that cannot read the prefix or
/// write a certificate): that needs an operator, not a retry. An etcd that is only down is
/// waited for as ever (the replica answers 503 until it is current).
async fn check_etcd_access(config: &CoordinatorConfig) -> Result<(), CoordinatorError> {
    match rootrank_store::connect_checked(&config.etcd, &config.index.prefix).await {
        Err(e) if e.refusal().is_some() => Err(CoordinatorError::Etcd(e)),
        Err(e) => {
            tracing::warn!(error = %e, "etcd is not answering yet; serving 503 until the first snapshot");
            Ok(())
        }
        Ok(_) => Ok(()),
    }
}

/// Runs a coordinator until `shutdown` resolves.
pub async fn run(
    config: CoordinatorConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), CoordinatorError> {
    let shared = Shared::new(&config)?;
    check_etcd_access(&config).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| CoordinatorError::Listen {
            addr: config.listen,
            source: e,
        })?;
    let addr = listener.local_addr().map_err(CoordinatorError::Serve)?;
    tracing::info!(
        %addr,
        endpoints = %config.etcd.endpoints.join(","),
        etcd_identity = %config.etcd.identity(),
        https = config.tls.is_some(),
        token = config.auth_token.is_some(),
        prefix = %config.index.prefix,
        "coordinator listening"
    );
    let sync = tokio::spawn(sync::run(config.clone(), shared.clone()));
    let presence = tokio::spawn(presence::run(config.clone(), addr));
    let alarms = tokio::spawn(alarms::run(config.clone(), shared.clone()));
    let app = http::router(shared.clone());
    server::serve(listener, app, &config, &shared, shutdown).await;
    sync.abort();
    presence.abort();
    alarms.abort();
    Ok(())
}
