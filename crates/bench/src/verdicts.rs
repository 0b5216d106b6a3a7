//! Part 1: verdict lookups over HTTP, side by side with the HTTP floor (`/healthz` of the same
//! server) and with resolving the same verdicts straight from etcd.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::load::{self, Run};
use crate::procs::{self, Coordinator, Env};
use crate::state::{self, KeepAlives};
use crate::util::CpuMark;

#[derive(Clone, Debug)]
pub struct VerdictsCfg {
    pub groups: usize,
    pub ranks: u32,
    pub rooms: usize,
    pub records_per_room: u32,
    pub conns: Vec<usize>,
    pub duration: Duration,
}

impl VerdictsCfg {
    pub fn full() -> Self {
        VerdictsCfg {
            groups: 64,
            ranks: 8,
            rooms: 10_000,
            records_per_room: 8,
            conns: vec![1, 16, 64],
            duration: Duration::from_secs(10),
        }
    }
    pub fn smoke() -> Self {
        VerdictsCfg {
            groups: 2,
            ranks: 8,
            rooms: 13,
            records_per_room: 8,
            conns: vec![1, 16],
            duration: Duration::from_secs(1),
        }
    }
}

pub const PREFIX: &str = "/rootrank/v1";

/// The verdict paths the load asks for (a scheduler names the group it runs).
pub fn verdict_paths(rooms: &[(String, u64)], max: usize) -> Vec<String> {
    let step = (rooms.len() / max.max(1)).max(1);
    rooms
        .iter()
        .step_by(step)
        .take(max)
        .map(|(g, r)| format!("/v1/rooms/{r}/verdict?group={g}"))
        .collect()
}

/// Checks a verdict path answers `resolved` before timing it (a benchmark of 404s is no benchmark).
pub async fn check_resolved(url: &str, path: &str) -> anyhow::Result<()> {
    let http = crate::util::http_client(Duration::from_secs(5))?;
    let v: Value = http.get(format!("{url}{path}")).send().await?.json().await?;
    if v["status"] != "resolved" {
        bail!("verdict {path} is not resolved: {v}");
    }
    Ok(())
}

pub async fn run(env: &Env, cfg: &VerdictsCfg) -> anyhow::Result<Value> {
    let dir = env.subdir("verdicts")?;
    let etcd = procs::start_etcd(&dir, &[])?;
    let endpoint = etcd.endpoint();
    let clients = state::clients(&endpoint, 4).await?;
    let t = std::time::Instant::now();
    let data = state::populate(
        &clients,
        PREFIX,
        "prefill",
        cfg.groups,
        cfg.ranks,
        60,
        cfg.rooms,
        cfg.records_per_room,
        1,
    )
    .await?;
    let populate_s = t.elapsed().as_secs_f64();
    // The live keys must outlive the run: renewed well inside their 60 s TTL.
    let keepalives = KeepAlives::start(
        &clients,
        &data.leases,
        Duration::from_secs(20),
        Duration::from_secs(3600),
    );
    let coord = Coordinator::start(env, &endpoint, PREFIX, Duration::from_secs(60)).await?;
    let paths = verdict_paths(&data.rooms, 10_000);
    let first = paths.first().context("no rooms")?;
    check_resolved(&coord.url, first).await?;
    let compact_paths: Vec<String> = paths.iter().map(|p| format!("{p}&view=compact")).collect();
    let bytes_of = |path: String| {
        let url = coord.url.clone();
        async move {
            let http = crate::util::http_client(Duration::from_secs(5))?;
            anyhow::Ok(http.get(format!("{url}{path}")).send().await?.bytes().await?.len())
        }
    };
    let answer_bytes = json!({
        "verdict": bytes_of(first.clone()).await?,
        "verdict_compact": bytes_of(format!("{first}&view=compact")).await?,
        "healthz": bytes_of("/healthz".to_string()).await?,
    });
    let rooms = Arc::new(data.rooms.clone());
    let mut runs: Vec<Value> = Vec::new();
    let mut ratios = Vec::new();
    for &conns in &cfg.conns {
        let healthz = timed_wrk(env, &coord, "healthz", &["/healthz".to_string()], conns, cfg.duration).await?;
        let verdict = timed_wrk(env, &coord, "verdict", &paths, conns, cfg.duration).await?;
        let compact = timed_wrk(env, &coord, "verdict_compact", &compact_paths, conns, cfg.duration).await?;
        let etcd_direct = {
            let mark = CpuMark::take(&[procs::etcd_pid(&etcd)?]);
            let r = load::etcd_direct(&endpoint, PREFIX, rooms.clone(), conns, cfg.duration, 50_000_000).await?;
            let (cpu, _) = mark.since(&[procs::etcd_pid(&etcd)?]);
            (r, cpu[0])
        };
        ratios.push(json!({
            "conns": conns,
            "verdict_over_healthz_rps": ratio(verdict.0.rps, healthz.0.rps),
            "compact_over_healthz_rps": ratio(compact.0.rps, healthz.0.rps),
            "verdict_p99_over_healthz_p99": ratio(verdict.0.latency.p99_us, healthz.0.latency.p99_us),
            "compact_p99_over_healthz_p99": ratio(compact.0.latency.p99_us, healthz.0.latency.p99_us),
            "verdict_over_etcd_direct_rps": ratio(verdict.0.rps, etcd_direct.0.rps),
            "etcd_direct_p99_over_verdict_p99": ratio(etcd_direct.0.latency.p99_us, verdict.0.latency.p99_us),
        }));
        runs.push(run_json(&healthz.0, "coordinator", healthz.1));
        runs.push(run_json(&verdict.0, "coordinator", verdict.1));
        runs.push(run_json(&compact.0, "coordinator", compact.1));
        runs.push(run_json(&etcd_direct.0, "etcd", etcd_direct.1));
    }
    keepalives.stop();
    drop(coord);
    Ok(json!({
        "setup": {
            "groups": cfg.groups, "ranks_per_group": cfg.ranks, "rooms": cfg.rooms,
            "records_per_room": cfg.records_per_room, "records": data.records, "live_keys": data.live_keys,
            "local_records_per_room": 1, "duration_s": cfg.duration.as_secs_f64(), "populate_s": populate_s,
            "distinct_verdict_paths": paths.len(),
            "answer_bytes": answer_bytes,
            "note": "coordinator, etcd, wrk and the etcd-direct loop share the machine's cores",
        },
        "runs": runs,
        "ratios": ratios,
    }))
}

async fn timed_wrk(
    env: &Env,
    coord: &Coordinator,
    target: &str,
    paths: &[String],
    conns: usize,
    duration: Duration,
) -> anyhow::Result<(Run, f64)> {
    let mark = CpuMark::take(&[coord.pid]);
    let (work, target2, url, paths2) = (env.work.clone(), target.to_string(), coord.url.clone(), paths.to_vec());
    let run = tokio::task::spawn_blocking(move || load::wrk(&work, &target2, &url, &paths2, conns, duration)).await??;
    let (cpu, _) = mark.since(&[coord.pid]);
    Ok((run, cpu[0]))
}

fn run_json(r: &Run, server: &str, server_cpu_s: f64) -> Value {
    let mut v = serde_json::to_value(r).unwrap_or(Value::Null);
    v["server"] = json!(server);
    v["server_cpu_s"] = json!(server_cpu_s);
    v["server_cpu_us_per_request"] = json!(if r.requests > 0 {
        server_cpu_s * 1e6 / r.requests as f64
    } else {
        0.0
    });
    v
}

pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}
