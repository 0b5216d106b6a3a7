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
        let ep = vec![etcd.endpoint()];
        _private = Some(etcd);
        ep
    } else {
        a.etcd.etcd_endpoints.clone()
    };
    let config = CoordinatorConfig {
        endpoints,
        listen: a.listen,
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
        "rootrank: coordinator on http://{} (etcd {})",
        a.listen,
        config.endpoints.join(",")
    );
    let rt = super::runtime()?;
    rt.block_on(rootrank_coordinator::run(config, super::shutdown_signal()))?;
    eprintln!("rootrank: coordinator stopped");
    Ok(0)
}
