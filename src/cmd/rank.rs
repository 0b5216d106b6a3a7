//! `rootrank rank`: a rank process with an embedded agent, driven by commands on stdin.
//! Tests use it as a real rank; operators can use it to see rootrank work by hand.

use std::time::Duration;

use anyhow::Context;
use rootrank_agent::{Agent, AgentConfig};

use super::EtcdArgs;

#[derive(clap::Args, Debug)]
pub struct RankArgs {
    #[arg(long, env = "ROOTRANK_GROUP")]
    pub group: String,
    #[arg(long, env = "ROOTRANK_RANK")]
    pub rank: u64,
    #[arg(long, env = "ROOTRANK_GROUP_SIZE")]
    pub group_size: u64,
    #[arg(long)]
    pub role: Option<String>,
    /// Liveness lease TTL in milliseconds (whole seconds, at least 1000).
    #[arg(long, default_value_t = 5_000)]
    pub lease_ttl_ms: u64,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

pub fn run(a: RankArgs) -> anyhow::Result<u8> {
    let mut config = AgentConfig::new(a.etcd.etcd_endpoints.clone(), &a.group, a.rank, a.group_size)?;
    config.etcd = a.etcd.access()?;
    config.prefix = a.etcd.prefix.clone();
    config.role = a.role.clone();
    config.lease_ttl = Duration::from_millis(a.lease_ttl_ms);
    let agent = Agent::start(config)?;
    rootrank_agent::script::drive(&agent, std::io::stdin().lock(), std::io::stdout().lock())
        .context("driving the rank")?;
    Ok(0)
}
