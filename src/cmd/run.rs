//! `rootrank run`: the supervisor of one rank process (rootrank-node does the work).

use std::time::Duration;

use rootrank_node::SuperviseConfig;

use super::EtcdArgs;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The rank's reduction group (passed to the process as ROOTRANK_GROUP).
    #[arg(long)]
    pub group: String,
    /// The rank, 0 <= rank < group size (ROOTRANK_RANK).
    #[arg(long)]
    pub rank: u64,
    /// The group's size (ROOTRANK_GROUP_SIZE).
    #[arg(long)]
    pub group_size: u64,
    /// Liveness lease TTL in milliseconds, when the supervisor registers for a process that
    /// has no agent of its own (whole seconds, at least 1000).
    #[arg(long, default_value_t = 5_000)]
    pub lease_ttl_ms: u64,
    /// How long to wait for the process's own agent to register before registering on its
    /// behalf.
    #[arg(long, default_value_t = 3_000)]
    pub agent_grace_ms: u64,
    /// Lines of the process's stderr kept for its down certificate.
    #[arg(long, default_value_t = 50)]
    pub tail_lines: usize,
    /// Serve Prometheus metrics (rootrank_unverified_pids_total) at http://ADDR/metrics,
    /// e.g. 0.0.0.0:9752. Off by default. The process is not started when ADDR is taken.
    #[arg(long, env = "ROOTRANK_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The rank process and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

pub fn run(a: RunArgs) -> anyhow::Result<u8> {
    let mut config = SuperviseConfig::new(a.etcd.etcd_endpoints.clone(), &a.group, a.rank, a.group_size, a.command)?;
    config.etcd = a.etcd.access()?;
    config.prefix = a.etcd.prefix;
    config.lease_ttl = Duration::from_millis(a.lease_ttl_ms);
    config.agent_grace = Duration::from_millis(a.agent_grace_ms);
    config.tail_lines = a.tail_lines.max(1);
    config.metrics_listen = a.metrics_listen;
    let done = super::runtime()?.block_on(rootrank_node::supervise(config))?;
    // The child's status, as if it had been run directly (128 + signal for a signal).
    Ok(done.code)
}
