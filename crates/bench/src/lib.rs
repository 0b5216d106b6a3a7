//! rootrank's benchmark suite: rootrank against its alternatives and its limits, side by side.
//!
//! Thirteen parts, each runnable alone (`rootrank-bench verdicts --conns 16 --duration 5s`, ...)
//! or all together (`rootrank-bench all`, which `make bench` runs):
//!
//! 1. [`verdicts`]: verdict lookups over HTTP (wrk) vs the same server's `/healthz` (the HTTP
//!    floor) vs resolving the same verdicts straight from etcd (the scheduler without rootrank).
//! 2. [`ingest`]: records/s from many agents, commit-to-visible lag, CPU per record.
//! 3. [`detection`]: SIGKILL to resolved verdict, lease only (5 s and 1 s TTL), watchdog if any.
//! 4. [`scale`]: 32,000 live leases and a million records: memory, load time, latency, keepalives.
//! 5. [`agent_cost`]: what `record_failure` costs the caller, next to a 64 KiB NIXL WRITE.
//! 6. [`burst`]: a rank fails 500 rooms at once: records batched vs one put each, to verdicts.
//! 7. [`keepalive`]: ranks one etcd core keeps alive at 5 s and 30 s lease TTLs.
//! 8. [`node_memory`]: `rootrank node-watch`'s memory with a million records vs none.
//! 9. [`startup`]: spawn to `/readyz` with a million records, by snapshot reader count, next
//!    to the serial load before.
//! 10. [`events`]: `GET /v1/events` with 1,000 readers at 5,000 records/s: delivery lag at
//!     each reader, the coordinator's CPU and memory with and without them.
//! 11. [`security`]: verdicts over HTTPS with a bearer token next to plain HTTP; an agent's
//!     publish latency over etcd TLS with client certificates next to plain etcd.
//! 12. [`long_polls`]: what parked long polls cost per record, and a probe's poll latency.
//! 13. [`mass_death`]: 1,000 / 10,000 / 100,000 live keys on one lease revoked under read
//!     load: time until all are down on the coordinator, certified in etcd, and applied by
//!     node-watch; `/readyz` meanwhile; the coordinator's RSS.
//! 14. [`fleet`]: 10,000 / 30,000 simulated ranks on a 3-member etcd cluster: etcd CPU per
//!     rank at steady state, the coordinator's start-up and RSS, verdict and long-poll latency,
//!     and a host, a rack and 10 % of the fleet failing.
//!
//! Every figure goes into one JSON file with the machine's facts and the git revision; a
//! Markdown table and an SVG of the latency distributions are made from it ([`report`]).

pub mod agent_cost;
pub mod alloc;
pub mod burst;
pub mod detection;
pub mod events;
pub mod fleet;
pub mod ingest;
pub mod keepalive;
pub mod load;
pub mod long_polls;
pub mod mass_death;
pub mod node_memory;
pub mod procs;
pub mod report;
pub mod scale;
pub mod security;
pub mod startup;
pub mod state;
pub mod util;
pub mod verdicts;

use std::path::Path;

use serde_json::{json, Value};

pub use procs::Env;

/// Which parts run, with what sizes.
#[derive(Clone, Debug, Default)]
pub struct Suite {
    pub verdicts: Option<verdicts::VerdictsCfg>,
    pub ingest: Option<ingest::IngestCfg>,
    pub detection: Option<detection::DetectionCfg>,
    pub scale: Option<scale::ScaleCfg>,
    pub agent: Option<agent_cost::AgentCfg>,
    pub burst: Option<burst::BurstCfg>,
    pub keepalive: Option<keepalive::KeepaliveCfg>,
    pub node_memory: Option<node_memory::NodeMemoryCfg>,
    pub startup: Option<startup::StartupCfg>,
    pub events: Option<events::EventsCfg>,
    pub security: Option<security::SecurityCfg>,
    pub long_polls: Option<long_polls::LongPollsCfg>,
    pub mass_death: Option<mass_death::MassDeathCfg>,
    pub fleet: Option<fleet::FleetCfg>,
}

impl Suite {
    pub fn full() -> Self {
        Suite {
            verdicts: Some(verdicts::VerdictsCfg::full()),
            ingest: Some(ingest::IngestCfg::full()),
            detection: Some(detection::DetectionCfg::full()),
            scale: Some(scale::ScaleCfg::full()),
            agent: Some(agent_cost::AgentCfg::full()),
            burst: Some(burst::BurstCfg::full()),
            keepalive: Some(keepalive::KeepaliveCfg::full()),
            node_memory: Some(node_memory::NodeMemoryCfg::full()),
            startup: Some(startup::StartupCfg::full()),
            events: Some(events::EventsCfg::full()),
            security: Some(security::SecurityCfg::full()),
            long_polls: Some(long_polls::LongPollsCfg::full()),
            mass_death: Some(mass_death::MassDeathCfg::full()),
            fleet: Some(fleet::FleetCfg::full()),
        }
    }
    /// Tiny sizes, seconds long: for `cargo test` and `make bench-smoke`.
    pub fn smoke() -> Self {
        Suite {
            verdicts: Some(verdicts::VerdictsCfg::smoke()),
            ingest: Some(ingest::IngestCfg::smoke()),
            detection: Some(detection::DetectionCfg::smoke()),
            scale: Some(scale::ScaleCfg::smoke()),
            agent: Some(agent_cost::AgentCfg::smoke()),
            burst: Some(burst::BurstCfg::smoke()),
            keepalive: Some(keepalive::KeepaliveCfg::smoke()),
            node_memory: Some(node_memory::NodeMemoryCfg::smoke()),
            startup: Some(startup::StartupCfg::smoke()),
            events: Some(events::EventsCfg::smoke()),
            security: Some(security::SecurityCfg::smoke()),
            long_polls: Some(long_polls::LongPollsCfg::smoke()),
            mass_death: Some(mass_death::MassDeathCfg::smoke()),
            fleet: Some(fleet::FleetCfg::smoke()),
        }
    }
}

/// Runs the selected parts. A part that fails is recorded as `{"error": ...}` and the others
/// still run: one broken part must not lose an hour of figures.
pub async fn run(env: &Env, suite: &Suite, mode: &str) -> Value {
    let mut sections = serde_json::Map::new();
    let started = rootrank_store::unix_ms();
    macro_rules! part {
        ($name:literal, $cfg:expr, $f:expr) => {
            if let Some(cfg) = &$cfg {
                eprintln!("rootrank-bench: {} ...", $name);
                let t = std::time::Instant::now();
                let v = match $f(env, cfg).await {
                    Ok(mut v) => {
                        v["elapsed_s"] = json!(t.elapsed().as_secs_f64());
                        v
                    }
                    Err(e) => {
                        // On stderr too: a failed `all --smoke` in CI shows only its output.
                        eprintln!("rootrank-bench: {} FAILED: {e:#}", $name);
                        json!({"error": format!("{e:#}")})
                    }
                };
                eprintln!("rootrank-bench: {} done in {:.1} s", $name, t.elapsed().as_secs_f64());
                sections.insert($name.to_string(), v);
            }
        };
    }
    part!("verdicts", suite.verdicts, verdicts::run);
    part!("ingest", suite.ingest, ingest::run);
    part!("detection", suite.detection, detection::run);
    part!("scale", suite.scale, scale::run);
    part!("agent", suite.agent, agent_cost::run);
    part!("burst", suite.burst, burst::run);
    part!("keepalive", suite.keepalive, keepalive::run);
    part!("node_memory", suite.node_memory, node_memory::run);
    part!("startup", suite.startup, startup::run);
    part!("events", suite.events, events::run);
    part!("security", suite.security, security::run);
    part!("long_polls", suite.long_polls, long_polls::run);
    part!("mass_death", suite.mass_death, mass_death::run);
    part!("fleet", suite.fleet, fleet::run);
    let mut results = json!({
        "schema": "rootrank-bench/1",
        "mode": mode,
        "started_at": rootrank_core::time::format_ms(started),
        "wall_s": (rootrank_store::unix_ms() - started) as f64 / 1e3,
        "machine": util::machine(),
        "git": util::git_rev(&env.repo),
        "sections": Value::Object(sections),
    });
    results["goals"] = Value::Array(report::goals(&results));
    results
}

/// Writes `results.json`, `results.md` and `latency.svg` into `out`.
pub fn write_outputs(out: &Path, results: &Value) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("results.json"), serde_json::to_vec_pretty(results)?)?;
    std::fs::write(out.join("results.md"), report::markdown(results))?;
    std::fs::write(out.join("latency.svg"), report::svg(results))?;
    Ok(())
}
