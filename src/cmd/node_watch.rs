//! `rootrank node-watch`: the node watchdog, one per host (rootrank-node does the work).

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
    /// Serve Prometheus metrics (rootrank_unverified_pids_total, rootrank_node_watch_events_total) at http://ADDR/metrics,
    /// e.g. 0.0.0.0:9751. Off by default.
    #[arg(long, env = "ROOTRANK_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// py-spy, to read a stalled rank's Python stack into its stall record (default: `py-spy`
    /// on PATH, when there is one; `pip install py-spy`). `none` turns it off.
    #[arg(long, env = "ROOTRANK_PY_SPY", value_name = "PATH")]
    pub py_spy: Option<std::path::PathBuf>,
    /// What to watch: `host`, only this host's ranks (the copies their agents keep under
    /// `PREFIX/groups/_hosts/HOST/`: watch traffic independent of the fleet's size), or
    /// `fleet`, all of `PREFIX/groups/` (for agents older than the host copies).
    #[arg(long, value_enum, default_value_t = Scope::Host)]
    pub watch_scope: Scope,
    /// Hold one liveness lease for this host, with this TTL (ms, whole seconds, at least
    /// 1000), and move each rank this watchdog watches onto it: one keepalive per host instead
    /// of one per rank (docs/fleet.md). A rank's death is still certified here in
    /// milliseconds; a host that dies takes its lease and all its ranks; if this watchdog
    /// stops, its ranks register again on their own leases (`lease_lost`, no death).
    /// Off by default: each rank keeps its own lease.
    #[arg(long, value_name = "MS")]
    pub host_lease_ttl_ms: Option<u64>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Scope {
    Host,
    Fleet,
}

pub fn run(a: NodeWatchArgs) -> anyhow::Result<u8> {
    let mut config = NodeWatchConfig::new(a.etcd.etcd_endpoints.clone());
    config.etcd = a.etcd.access()?;
    config.prefix = a.etcd.prefix;
    config.retention = Duration::from_secs(a.retention_s.max(1));
    config.supervisor_grace = Duration::from_millis(a.supervisor_grace_ms);
    config.kernel_log = a.kernel_log;
    config.metrics_listen = a.metrics_listen;
    config.watch_scope = match a.watch_scope {
        Scope::Host => rootrank_node::WatchScope::Host,
        Scope::Fleet => rootrank_node::WatchScope::Fleet,
    };
    config.host_lease_ttl = match a.host_lease_ttl_ms {
        None => None,
        Some(ms) if ms < 1_000 || ms % 1_000 != 0 => anyhow::bail!(
            "--host-lease-ttl-ms {ms}: etcd leases have whole seconds; give at least 1000 and a multiple of 1000 (e.g. 5000)"
        ),
        Some(ms) => Some(Duration::from_millis(ms)),
    };
    config.py_spy = match a.py_spy {
        Some(p) if p.as_os_str() == "none" => None,
        Some(p) => Some(p),
        None => find_on_path("py-spy"),
    };
    match &config.py_spy {
        Some(p) => tracing::info!(py_spy = %p.display(), "stalled ranks' stacks will be read with py-spy"),
        None => {
            tracing::info!("no py-spy (pip install py-spy, or --py-spy PATH): stalled ranks' stacks are not captured")
        }
    }
    super::runtime()?.block_on(async {
        rootrank_node::node_watch(config, super::shutdown_signal()).await?;
        Ok(0)
    })
}

fn find_on_path(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(name))
        .find(|p| p.is_file())
}
