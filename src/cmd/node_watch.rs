//! `rootrank node-watch`: the node watchdog, one per host (rootrank-node does the work).

use std::process::ExitCode;
use std::time::Duration;

use rootrank_node::NodeWatchConfig;

use super::EtcdArgs;

#[derive(clap::Args, Debug)]
pub struct NodeWatchArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// How long the certificates it writes are kept, in seconds.
    #[arg(long, default_value_t = 600)]
    pub retention_s: u64,
    /// How long a rank under `rootrank run` is left to its supervisor (which knows the exit
    /// status and the stderr tail) before the watchdog reports its death itself.
    #[arg(long, default_value_t = 2_000)]
    pub supervisor_grace_ms: u64,
    /// The kernel log device to read OOM kills and GPU Xids from (default /dev/kmsg).
    #[arg(long)]
    pub kernel_log: Option<std::path::PathBuf>,
    /// Serve Prometheus metrics (rootrank_unverified_pids_total) at http://ADDR/metrics,
    /// e.g. 0.0.0.0:9751. Off by default.
    #[arg(long, env = "ROOTRANK_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

pub fn run(a: NodeWatchArgs) -> anyhow::Result<ExitCode> {
    let mut config = NodeWatchConfig::new(a.etcd.etcd_endpoints);
    config.prefix = a.etcd.prefix;
    config.retention = Duration::from_secs(a.retention_s.max(1));
    config.supervisor_grace = Duration::from_millis(a.supervisor_grace_ms);
    config.kernel_log = a.kernel_log;
    config.metrics_listen = a.metrics_listen;
    super::runtime()?.block_on(async {
        rootrank_node::node_watch(config, shutdown_signal()).await?;
        Ok(ExitCode::SUCCESS)
    })
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
