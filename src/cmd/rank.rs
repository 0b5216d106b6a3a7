//! `rootrank rank`: a rank process with an embedded agent, driven by commands on stdin.
//! Tests use it as a real rank; operators can use it to see rootrank work by hand.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use rootrank_agent::{Agent, AgentConfig};
use rootrank_core::Origin;

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

const HELP: &str =
    "commands: fail ROOM local|propagated REASON [DETAIL...] | down REASON [DETAIL...] | flush | stats | exit";

pub fn run(a: RankArgs) -> anyhow::Result<ExitCode> {
    let mut config = AgentConfig::new(a.etcd.etcd_endpoints.clone(), &a.group, a.rank, a.group_size)?;
    config.prefix = a.etcd.prefix.clone();
    config.role = a.role.clone();
    config.lease_ttl = Duration::from_millis(a.lease_ttl_ms);
    let agent = Agent::start(config)?;
    let inc = agent
        .wait_registered(Duration::from_secs(30))
        .context("the agent did not register within 30 s: is etcd reachable?")?;
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(out, "registered incarnation={inc} pid={}", std::process::id())?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            [] => continue,
            ["exit"] => break,
            ["help"] => HELP.to_string(),
            ["flush"] => {
                if agent.flush(Duration::from_secs(30)) {
                    "flushed".into()
                } else {
                    "error: flush timed out".into()
                }
            }
            ["stats"] => {
                let s = agent.stats();
                use std::sync::atomic::Ordering::Relaxed;
                format!(
                    "published={} dropped={} retries={} registrations={}",
                    s.published.load(Relaxed),
                    s.dropped.load(Relaxed),
                    s.retries.load(Relaxed),
                    s.registrations.load(Relaxed)
                )
            }
            ["fail", room, origin, reason, detail @ ..] => match parse_fail(room, origin) {
                Ok((room, origin)) => match agent.record_failure(room, origin, reason, &detail.join(" "), None) {
                    Ok(()) => "ok".into(),
                    Err(e) => format!("error: {e}"),
                },
                Err(e) => format!("error: {e}"),
            },
            ["down", reason, detail @ ..] => match agent.record_down(reason, &detail.join(" "), None) {
                Ok(()) => "ok".into(),
                Err(e) => format!("error: {e}"),
            },
            _ => format!("error: unknown command; {HELP}"),
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    let clean = agent.shutdown(Duration::from_secs(10));
    writeln!(
        out,
        "{}",
        if clean {
            "bye"
        } else {
            "bye (shutdown incomplete: etcd unreachable)"
        }
    )?;
    Ok(ExitCode::SUCCESS)
}

fn parse_fail(room: &str, origin: &str) -> anyhow::Result<(u64, Origin)> {
    let room: u64 = room
        .parse()
        .with_context(|| format!("room {room:?} is not a decimal integer"))?;
    let origin = match origin {
        "local" => Origin::Local,
        "propagated" => Origin::Propagated,
        other => bail!("origin {other:?}: local or propagated"),
    };
    Ok((room, origin))
}
