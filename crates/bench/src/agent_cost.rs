//! Part 5: what `Agent::record_failure` costs the caller's thread (it must only validate and
//! enqueue), with room in the queue and with the queue full (dropping), next to one NIXL
//! transfer of a 64 KiB block.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rootrank_agent::{Agent, AgentConfig};
use rootrank_core::Origin;
use serde_json::{json, Value};

use crate::procs::{self, Env};
use crate::util::Dist;

#[derive(Clone, Debug)]
pub struct AgentCfg {
    pub calls: usize,
    /// Run the transfer crate's nixl_bench example (needs it built, and NIXL fetched).
    pub nixl: bool,
    pub nixl_scale: f64,
}

impl AgentCfg {
    pub fn full() -> Self {
        AgentCfg {
            calls: 100_000,
            nixl: true,
            nixl_scale: 1.0,
        }
    }
    pub fn smoke() -> Self {
        AgentCfg {
            calls: 1_000,
            nixl: false,
            nixl_scale: 0.1,
        }
    }
}

/// A typical detail: an error line from the transfer layer.
const DETAIL: &str = "NIXL_ERR_BACKEND: UCX transport error on WRITE to decode-0 rank 3 (10.0.0.7:5555): Connection reset by remote peer";

pub async fn run(env: &Env, cfg: &AgentCfg) -> anyhow::Result<Value> {
    let dir = env.subdir("agent")?;
    let etcd = procs::start_etcd(&dir, &[])?;
    let endpoint = etcd.endpoint();
    let calls = cfg.calls.max(10);
    let (with_room, full) = tokio::task::spawn_blocking(move || -> anyhow::Result<(Value, Value)> {
        // With room: a queue bigger than the calls, a registered agent draining into etcd.
        let mut c = AgentConfig::new(vec![endpoint], "agentcost-0", 0, 8)?;
        c.queue_capacity = calls + 1_000;
        let agent = Agent::start(c)?;
        agent.wait_registered(Duration::from_secs(30));
        let with_room = measure(&agent, calls, 1)?;
        drop(agent);
        // Full: an agent whose etcd never answers (a closed loopback port) never drains; after
        // one record its queue of one is full and every call is a drop.
        let mut c = AgentConfig::new(vec!["http://127.0.0.1:9".into()], "agentcost-1", 0, 8)?;
        c.queue_capacity = 1;
        let agent = Agent::start(c)?;
        let _ = agent.record_failure(1, Origin::Local, "nixl_error", DETAIL, None);
        let full = measure(&agent, calls, 2)?;
        let dropped = agent.stats().dropped.load(std::sync::atomic::Ordering::Relaxed);
        drop(agent);
        let mut full = full;
        full["dropped"] = json!(dropped);
        Ok((with_room, full))
    })
    .await??;
    let nixl = if cfg.nixl {
        nixl_64k(env, cfg.nixl_scale).await
    } else {
        json!({"available": false, "reason": "skipped (smoke mode or --no-nixl)"})
    };
    let ratio = match nixl["p50_us"].as_f64() {
        Some(p50) if p50 > 0.0 => json!(with_room["mean_ns"].as_f64().unwrap_or(0.0) / (p50 * 1e3)),
        _ => Value::Null,
    };
    Ok(json!({
        "setup": {"calls": calls, "detail_bytes": DETAIL.len(), "how": "mean = one Instant pair around all calls / calls; the distribution times each call (adds ~20-40 ns of clock reads)"},
        "queue_with_room": with_room,
        "queue_full_dropping": full,
        "nixl_write_64k": nixl,
        "record_failure_over_nixl_64k_p50": ratio,
    }))
}

fn measure(agent: &Agent, calls: usize, salt: u64) -> anyhow::Result<Value> {
    let mut ok = 0u64;
    let mut err = 0u64;
    // Mean over the batch first (no per-call clock reads), then per-call timings.
    let half = calls / 2;
    let t = Instant::now();
    for i in 0..half {
        let room = crate::state::room_id(salt, i as u64);
        match agent.record_failure(room, Origin::Local, "nixl_error", DETAIL, None) {
            Ok(()) => ok += 1,
            Err(_) => err += 1,
        }
    }
    let mean_ns = t.elapsed().as_secs_f64() * 1e9 / half.max(1) as f64;
    let mut each = Vec::with_capacity(calls - half);
    for i in half..calls {
        let room = crate::state::room_id(salt, i as u64);
        let s = Instant::now();
        let r = agent.record_failure(room, Origin::Local, "nixl_error", DETAIL, None);
        each.push(s.elapsed());
        match r {
            Ok(()) => ok += 1,
            Err(_) => err += 1,
        }
    }
    let d = Dist::from_durations(&each);
    Ok(json!({
        "calls": calls, "enqueued": ok, "rejected": err,
        "mean_ns": mean_ns,
        "per_call": d,
        "p50_ns": d.p50_us * 1e3, "p99_ns": d.p99_us * 1e3, "p999_ns": d.p999_us * 1e3,
    }))
}

/// Runs the transfer crate's `nixl_bench` example and reads its 64 KiB row.
async fn nixl_64k(env: &Env, scale: f64) -> Value {
    let bin: Option<PathBuf> = env.exe.parent().map(|d| d.join("examples").join("nixl_bench"));
    let Some(bin) = bin.filter(|b| b.is_file()) else {
        return json!({"available": false, "reason": "nixl_bench example not built (make bench builds it: cargo build --release -p rootrank-transfer --example nixl_bench)"});
    };
    let repo = env.repo.clone();
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(["--scale", &scale.to_string()]).current_dir(&repo);
        if std::env::var_os("ROOTRANK_NIXL_DIR").is_none() {
            cmd.env("ROOTRANK_NIXL_DIR", repo.join(".cache/nixl"));
        }
        cmd.output()
    })
    .await;
    let out = match out {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => return json!({"available": false, "reason": format!("running nixl_bench: {e}")}),
        Err(e) => return json!({"available": false, "reason": format!("running nixl_bench: {e}")}),
    };
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() {
        return json!({"available": false, "reason": format!("nixl_bench failed ({}): {} {}", out.status, stdout, String::from_utf8_lossy(&out.stderr)), "hint": "run scripts/fetch-nixl.sh"});
    }
    // Row: "  64 KiB    2000       p50       p99      mean       MiB/s"
    let row = stdout.lines().find(|l| l.trim_start().starts_with("64 KiB"));
    let nums: Vec<f64> = row
        .map(|r| r.split_whitespace().skip(2).filter_map(|w| w.parse().ok()).collect())
        .unwrap_or_default();
    match nums.as_slice() {
        [iters, p50, p99, mean, mibs, ..] => json!({
            "available": true, "iters": iters, "p50_us": p50, "p99_us": p99, "mean_us": mean, "mib_per_s": mibs,
            "tool": "crates/transfer/examples/nixl_bench (UCX, DRAM to DRAM, two processes, notification per WRITE)",
            "output": stdout,
        }),
        _ => json!({"available": false, "reason": "no 64 KiB row in nixl_bench output", "output": stdout}),
    }
}
