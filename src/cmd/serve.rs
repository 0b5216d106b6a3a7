//! `rootrank serve`: the coordinator. With no etcd endpoints it starts a private etcd.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use rootrank_coordinator::CoordinatorConfig;
use rootrank_core::IndexConfig;
use rootrank_store::embedded::{EmbeddedEtcd, EtcdOptions};

use super::EtcdArgs;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Address to serve the HTTP API on.
    #[arg(long, env = "ROOTRANK_LISTEN", default_value = "127.0.0.1:9750")]
    pub listen: SocketAddr,
    /// Where the private etcd keeps its data (only without --etcd-endpoints).
    #[arg(long, env = "ROOTRANK_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// How long before a room's first record a rank death still counts (SPEC rule 2).
    #[arg(long, default_value_t = 360_000)]
    pub death_window_ms: i64,
    /// How long the certificates the coordinator writes are kept.
    #[arg(long, default_value_t = 600)]
    pub retention_s: u64,
    /// Long polls (verdicts with wait_ms) allowed to wait at once; past it, 503 with Retry-After.
    #[arg(long, default_value_t = rootrank_coordinator::http::MAX_LONG_POLLS)]
    pub max_long_polls: usize,
    /// HTTP connections open at once; more are closed on arrival (clients try another replica).
    #[arg(long, default_value_t = rootrank_coordinator::server::MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Milliseconds a client gets to send a request's head; also how long an idle kept-alive
    /// connection stays open.
    #[arg(long, default_value_t = rootrank_coordinator::server::HEADER_TIMEOUT.as_millis() as u64)]
    pub header_timeout_ms: u64,
    /// Concurrent readers of the start-up snapshot (each reads its own key ranges at one
    /// revision; 1 to 64); a replica is ready sooner with more, up to what etcd has cores for.
    #[arg(long, default_value_t = rootrank_store::DEFAULT_READERS)]
    pub snapshot_readers: usize,
    /// Serve HTTPS with this certificate chain (PEM, leaf first), with --tls-key.
    #[arg(long, env = "ROOTRANK_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The HTTPS certificate's private key (PEM).
    #[arg(long, env = "ROOTRANK_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require `Authorization: Bearer TOKEN` (the file's first line) on every route but the
    /// page, /healthz, /readyz and /metrics.
    #[arg(long, env = "ROOTRANK_AUTH_TOKEN_FILE", value_name = "FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// Require the token on /metrics too (the scraper then sends it).
    #[arg(long, requires = "auth_token_file")]
    pub auth_metrics: bool,
}

fn default_data_dir() -> PathBuf {
    let base = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("rootrank")
}

/// Ports of a private etcd are kept with its data so a restart finds it where it was.
fn remembered_ports(dir: &std::path::Path) -> EtcdOptions {
    let mut opts = EtcdOptions::default();
    if let Ok(s) = std::fs::read_to_string(dir.join("ports")) {
        let mut it = s.split_whitespace().filter_map(|p| p.parse::<u16>().ok());
        if let (Some(c), Some(p)) = (it.next(), it.next()) {
            opts.client_port = c;
            opts.peer_port = p;
        }
    }
    opts
}

pub fn run(a: ServeArgs) -> anyhow::Result<u8> {
    // Credentials first: a bad file stops us before a private etcd is started for nothing.
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Some(rootrank_tls::server_config(cert, key)?),
        _ => None,
    };
    let auth_token = a
        .auth_token_file
        .as_deref()
        .map(rootrank_tls::AuthToken::from_file)
        .transpose()?;
    let files = a.etcd.files();
    let mut _private: Option<EmbeddedEtcd> = None;
    let endpoints = if a.etcd.etcd_endpoints.is_empty() {
        let dir = a.data_dir.clone().unwrap_or_else(default_data_dir).join("etcd");
        let opts = remembered_ports(&dir);
        let etcd = match EmbeddedEtcd::start(&dir, &opts) {
            Ok(e) => e,
            // The remembered ports may be taken now: pick new ones.
            Err(_) if opts.client_port != 0 => EmbeddedEtcd::start(&dir, &EtcdOptions::default())?,
            Err(e) => return Err(e).context("starting a private etcd (pass --etcd-endpoints to use yours)"),
        };
        let port = etcd.endpoint().rsplit(':').next().unwrap_or("").to_string();
        let _ = std::fs::write(dir.join("ports"), format!("{port} {}\n", etcd.peer_port()));
        eprintln!(
            "rootrank: no --etcd-endpoints given: started a private etcd (pid {}) at {}, data in {}",
            etcd.pid().unwrap_or(0),
            etcd.endpoint(),
            dir.display()
        );
        if !files.is_empty() {
            anyhow::bail!("--etcd-cacert/--etcd-cert/--etcd-user are for your etcd: pass --etcd-endpoints too (the private etcd is plain, on loopback)");
        }
        let ep = vec![etcd.endpoint()];
        _private = Some(etcd);
        rootrank_store::EtcdAccess::plain(ep)
    } else {
        a.etcd.access()?
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let config = CoordinatorConfig {
        etcd: endpoints,
        listen: a.listen,
        tls,
        auth_token,
        auth_metrics: a.auth_metrics,
        index: IndexConfig {
            prefix: a.etcd.prefix.clone(),
            death_window_ms: a.death_window_ms,
            ..IndexConfig::default()
        },
        retention: Duration::from_secs(a.retention_s.max(1)),
        max_long_polls: a.max_long_polls,
        max_connections: a.max_connections,
        header_timeout: Duration::from_millis(a.header_timeout_ms.max(1)),
        snapshot_readers: a.snapshot_readers,
    };
    eprintln!(
        "rootrank: coordinator on {scheme}://{}{} (etcd {}, {})",
        a.listen,
        if config.auth_token.is_some() {
            ", bearer token required"
        } else {
            ""
        },
        config.etcd.endpoints.join(","),
        config.etcd.identity()
    );
    let rt = super::runtime()?;
    rt.block_on(rootrank_coordinator::run(config, super::shutdown_signal()))?;
    eprintln!("rootrank: coordinator stopped");
    Ok(0)
}
