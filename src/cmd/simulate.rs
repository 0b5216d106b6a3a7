//! `rootrank simulate`: a simulated PD deployment with real NIXL transfers (see crates/sim).

use std::path::PathBuf;

use anyhow::{bail, Context};
use rootrank_sim::parent::{Fault, FaultKind, RoomSummary, SimConfig, SimReport};

use super::EtcdArgs;

#[derive(clap::Args, Debug, Clone)]
pub struct SimulateArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The coordinator the survivors ask (without it they only log the generic error).
    #[arg(long, env = "ROOTRANK_COORDINATOR")]
    pub coordinator: Option<String>,
    /// The prefill ranks' group (the ranks that all-reduce together).
    #[arg(long, default_value = "prefill-0")]
    pub prefill_group: String,
    /// The decode ranks' group (prefill rank r writes into decode rank r).
    #[arg(long, default_value = "decode-0")]
    pub decode_group: String,
    /// Ranks in each group.
    #[arg(long, default_value_t = 4)]
    pub ranks: u32,
    /// Rooms to run (0: until SIGINT/SIGTERM).
    #[arg(long, default_value_t = 10)]
    pub rooms: u64,
    /// Rooms issued per second.
    #[arg(long, default_value_t = 10.0)]
    pub room_rate: f64,
    /// Bytes per KV chunk.
    #[arg(long, default_value_t = 1 << 20)]
    pub block_size: usize,
    /// Chunks per room and rank (at least 2 for --kill-decode-rank to land mid-transfer).
    #[arg(long, default_value_t = 2)]
    pub chunks: u32,
    /// Room slots in each decode rank's region.
    #[arg(long, default_value_t = 8)]
    pub slots: u32,
    /// Liveness lease TTL of every rank (whole seconds, at least 1000).
    #[arg(long, default_value_t = 5_000)]
    pub lease_ttl_ms: u64,
    /// How long one NIXL WRITE may take before it is a `transfer_timeout`.
    #[arg(long, default_value_t = 2_000)]
    pub transfer_timeout_ms: u64,
    /// How long the all-reduce waits for a silent rank before counting it Failed.
    #[arg(long, default_value_t = 5_000)]
    pub reduce_timeout_ms: u64,
    /// The survivors' wait_ms (default: lease TTL + 5 s, at most 30 s).
    #[arg(long)]
    pub verdict_wait_ms: Option<u64>,
    /// SIGKILL prefill rank R (R or R@ROOM_INDEX; --at-room without @).
    #[arg(long, value_name = "R[@K]")]
    pub kill_prefill_rank: Vec<String>,
    /// SIGKILL decode rank R between its room's chunks.
    #[arg(long, value_name = "R[@K]")]
    pub kill_decode_rank: Vec<String>,
    /// SIGSTOP decode rank R.
    #[arg(long, value_name = "R[@K]")]
    pub stop_decode_rank: Vec<String>,
    /// Prefill rank R's transfer fails inside NIXL (a WRITE to unregistered memory).
    #[arg(long, value_name = "R[@K]")]
    pub fail_transfer_rank: Vec<String>,
    /// The launcher SIGKILLs decode rank R and starts it again (new NIXL agent).
    #[arg(long, value_name = "R[@K]")]
    pub restart_decode_rank: Vec<String>,
    /// Room index for faults given without @K.
    #[arg(long, default_value_t = 2)]
    pub at_room: u64,
    /// The ranks' logs (default: a new directory under the system temp dir).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Where NIXL is; when given (or ROOTRANK_NIXL_DIR is set) only there.
    #[arg(long, env = "ROOTRANK_NIXL_DIR")]
    pub nixl_dir: Option<PathBuf>,
    /// One JSON object per room, then the report.
    #[arg(long)]
    pub json: bool,
}

pub fn parse_faults(a: &SimulateArgs) -> anyhow::Result<Vec<Fault>> {
    let mut out = Vec::new();
    for (kind, specs) in [
        (FaultKind::KillPrefill, &a.kill_prefill_rank),
        (FaultKind::KillDecode, &a.kill_decode_rank),
        (FaultKind::StopDecode, &a.stop_decode_rank),
        (FaultKind::FailTransfer, &a.fail_transfer_rank),
        (FaultKind::RestartDecode, &a.restart_decode_rank),
    ] {
        for s in specs {
            let (r, k) = match s.split_once('@') {
                Some((r, k)) => (r, k.parse::<u64>().with_context(|| format!("room index in {s:?}"))?),
                None => (s.as_str(), a.at_room),
            };
            let rank = r.parse::<u32>().with_context(|| format!("rank in {s:?}"))?;
            out.push(Fault { kind, rank, at_room: k });
        }
    }
    if !a.kill_decode_rank.is_empty() && a.chunks < 2 {
        bail!("--kill-decode-rank needs --chunks 2 or more (the kill lands between chunks)");
    }
    Ok(out)
}

/// The SimConfig for these flags; NIXL is loaded here first, so a missing library is one clear
/// error before any rank starts.
pub fn config(a: &SimulateArgs) -> anyhow::Result<SimConfig> {
    if a.etcd.etcd_endpoints.is_empty() {
        bail!("no etcd endpoints: pass --etcd-endpoints URL[,URL...] or set ROOTRANK_ETCD_ENDPOINTS (or try `rootrank demo`)");
    }
    let lib = rootrank_transfer_agent::load_nixl(a.nixl_dir.as_deref())?;
    let log_dir = a
        .log_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("rootrank-sim-{}", std::process::id())));
    Ok(SimConfig {
        exe: std::env::current_exe().context("finding the rootrank binary")?,
        etcd_endpoints: a.etcd.etcd_endpoints.clone(),
        etcd_files: {
            a.etcd.access()?; // the files are read and checked here, before any rank starts
            a.etcd.files()
        },
        prefix: a.etcd.prefix.clone(),
        coordinator: a.coordinator.clone(),
        prefill_group: a.prefill_group.clone(),
        decode_group: a.decode_group.clone(),
        ranks: a.ranks,
        rooms: a.rooms,
        room_rate: a.room_rate,
        block_size: a.block_size.max(8),
        chunks: a.chunks.max(1),
        slots: a.slots.max(1),
        lease_ttl_ms: a.lease_ttl_ms,
        transfer_timeout_ms: a.transfer_timeout_ms,
        reduce_timeout_ms: a.reduce_timeout_ms,
        verdict_wait_ms: a.verdict_wait_ms.unwrap_or(a.lease_ttl_ms + 5_000).min(30_000),
        faults: parse_faults(a)?,
        log_dir,
        nixl_dir: Some(lib.libs_dir().to_path_buf()),
    })
}

pub fn run(a: SimulateArgs) -> anyhow::Result<u8> {
    let config = config(&a)?;
    let rt = super::runtime()?;
    let json = a.json;
    let mut print = |s: &RoomSummary| {
        if json {
            println!("{}", serde_json::to_string(s).unwrap_or_default());
        } else {
            println!("{}", s.line());
        }
    };
    // block_on keeps the ranks' spawning thread (their PDEATHSIG parent) the main thread.
    let report = rt.block_on(rootrank_sim::parent::run(config, super::shutdown_signal(), &mut print))?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", final_summary(&report));
    }
    Ok(0)
}

pub fn final_summary(r: &SimReport) -> String {
    let count = |s: &str| r.rooms.iter().filter(|x| x.status == s).count();
    let mut out = format!(
        "simulate: {} rooms: {} success, {} failed, {} incomplete{}\n",
        r.rooms.len(),
        count("success"),
        count("failed"),
        count("incomplete"),
        if r.stopped_early { " (stopped)" } else { "" }
    );
    let mut culprits: std::collections::BTreeMap<String, usize> = Default::default();
    for room in &r.rooms {
        if let Some(c) = &room.culprit {
            let s = |v: &serde_json::Value| v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string());
            *culprits
                .entry(format!(
                    "{} rank {} {} ({})",
                    s(&c["group"]),
                    s(&c["rank"]),
                    s(&c["reason"]),
                    s(&c["source"])
                ))
                .or_default() += 1;
        }
    }
    for (c, n) in culprits {
        out.push_str(&format!("  culprit {c}: {n} room(s)\n"));
    }
    // Time inside NIXL WRITEs (post to completion) of the shards that arrived.
    let times: Vec<u64> = r
        .rooms
        .iter()
        .flat_map(|room| room.reports.iter())
        .filter(|rep| rep.own == rootrank_sim::kvpoll::SUCCESS)
        .filter_map(|rep| rep.transfer_us)
        .collect();
    if !times.is_empty() {
        let mean_us = times.iter().sum::<u64>() as f64 / times.len() as f64;
        let mib = r.shard_bytes as f64 / (1024.0 * 1024.0);
        out.push_str(&format!(
            "  transfers: {} shards of {} bytes, mean {mean_us:.0} us in NIXL per shard ({:.0} MiB/s per rank)\n",
            times.len(),
            r.shard_bytes,
            if mean_us > 0.0 { mib / (mean_us / 1e6) } else { 0.0 }
        ));
    }
    for m in &r.measurements {
        out.push_str(&format!("  measured: {}: {:.1} ms\n", m.what, m.ms));
    }
    out.push_str(&format!("  rank logs: {}\n", r.log_dir.display()));
    out
}
