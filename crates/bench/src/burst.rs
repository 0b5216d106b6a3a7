//! Part 6: the incident burst. One rank of a group of 8 fails every room in flight at once
//! (its `local` records for 500 rooms) and the 7 survivors publish `propagated` for every
//! room: 4,000 records together. Measured with the agents writing one put per record and
//! batched, in the same run: first record to the last room's verdict `resolved` at the
//! coordinator (as 500 waiting schedulers see it: one long poll per room), etcd and
//! coordinator CPU per record, and the commit-to-visible lag under a sustained 5,000
//! records/s.

use std::time::{Duration, Instant};

use rootrank_core::Origin;
use serde_json::{json, Value};

use crate::ingest::{self, Rig, RANKS};
use crate::procs::{self, Coordinator, Env};
use crate::util::{CpuMark, Dist};

#[derive(Clone, Debug)]
pub struct BurstCfg {
    /// Rooms in flight on the group when the rank fails.
    pub rooms: usize,
    /// Bursts per mode (each on a fresh group).
    pub bursts: usize,
    /// The sustained stage: offered records/s, agents, duration.
    pub rate: u64,
    pub agents: usize,
    pub duration: Duration,
    pub probe_rate: f64,
}

impl BurstCfg {
    pub fn full() -> Self {
        BurstCfg {
            rooms: 500,
            bursts: 5,
            rate: 5_000,
            agents: 32,
            duration: Duration::from_secs(6),
            probe_rate: 50.0,
        }
    }
    pub fn smoke() -> Self {
        BurstCfg {
            rooms: 20,
            bursts: 1,
            rate: 200,
            agents: 8,
            duration: Duration::from_secs(1),
            probe_rate: 20.0,
        }
    }
}

const PREFIX: &str = crate::verdicts::PREFIX;
/// The rank that fails every room.
const CULPRIT: usize = 3;

pub async fn run(env: &Env, cfg: &BurstCfg) -> anyhow::Result<Value> {
    let mut modes = serde_json::Map::new();
    for (mode_no, (mode, max_batch)) in [("single", 1usize), ("batched", rootrank_store::MAX_BATCH_RECORDS)]
        .into_iter()
        .enumerate()
    {
        // A fresh etcd and coordinator per mode: the second mode must not pay for the
        // first one's records in etcd's backend.
        let dir = env.subdir(&format!("burst-{mode}"))?;
        let etcd = procs::start_etcd(&dir, &[])?;
        let endpoint = etcd.endpoint();
        let etcd_pid = procs::etcd_pid(&etcd)?;
        let coord = Coordinator::start(env, &endpoint, PREFIX, Duration::from_secs(30)).await?;
        let rig = Rig::new(&coord, etcd_pid, &endpoint).await?;
        let mut bursts = Vec::new();
        for b in 0..cfg.bursts {
            let group_prefix = format!("burst-{mode}-{b}");
            let agents = ingest::start_agents(&endpoint, RANKS, &group_prefix, max_batch).await?;
            let salt = 70_000 + (mode_no * 1_000 + b) as u64;
            bursts.push(one_burst(&coord, etcd_pid, &agents, &format!("{group_prefix}-0"), cfg.rooms, salt).await?);
            ingest::stop_agents(agents).await?;
        }
        let agents = ingest::start_agents(&endpoint, cfg.agents, &format!("sustained-{mode}"), max_batch).await?;
        let groups = cfg.agents.div_ceil(RANKS).max(1);
        let sustained = ingest::stage(
            &rig,
            &agents,
            groups,
            cfg.rate,
            cfg.duration,
            cfg.probe_rate,
            90 + mode_no as u64,
        )
        .await?;
        ingest::stop_agents(agents).await?;
        let median = |field: &str| {
            let mut v: Vec<f64> = bursts.iter().filter_map(|b| b[field].as_f64()).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
        };
        let summary = json!({
            "first_record_to_last_resolved_ms": median("first_record_to_last_resolved_ms"),
            "last_enqueue_to_last_resolved_ms": median("last_enqueue_to_last_resolved_ms"),
            "first_record_to_all_written_ms": median("first_record_to_all_written_ms"),
            "etcd_us_per_record": median("etcd_us_per_record"),
            "coordinator_us_per_record": median("coordinator_us_per_record"),
        });
        modes.insert(
            mode.to_string(),
            json!({"max_batch": max_batch, "bursts": bursts, "median": summary, "sustained": sustained}),
        );
    }
    Ok(json!({
        "setup": {
            "ranks": RANKS, "rooms": cfg.rooms, "records_per_burst": cfg.rooms * RANKS, "bursts_per_mode": cfg.bursts,
            "sustained_rate": cfg.rate, "sustained_agents": cfg.agents, "sustained_s": cfg.duration.as_secs_f64(),
            "how": "per mode a fresh etcd and coordinator; 8 agents (Agent::start) in the bench process on a fresh group per burst; a long poll (wait_ms, view=compact) per room is opened first; then rank 3 records `local` nixl_error and ranks 0-2,4-7 `propagated` for every room, enqueued room by room; resolved = the long poll's answer. Medians over the bursts. `single`: max_batch 1 (one create-if-absent per record, as before batching); `batched`: max_batch 64.",
        },
        "modes": Value::Object(modes),
    }))
}

async fn one_burst(
    coord: &Coordinator,
    etcd_pid: u32,
    agents: &std::sync::Arc<Vec<rootrank_agent::Agent>>,
    group: &str,
    rooms: usize,
    salt: u64,
) -> anyhow::Result<Value> {
    let room_ids: Vec<u64> = (0..rooms as u64).map(|i| crate::state::room_id(salt, i)).collect();
    // One waiting scheduler per room, before anything fails.
    let http = rootrank_tls::http_client(None)?
        .pool_max_idle_per_host(rooms)
        .timeout(Duration::from_secs(40))
        .build()?;
    let polls: Vec<_> = room_ids
        .iter()
        .map(|room| {
            let url = format!(
                "{}/v1/rooms/{room}/verdict?group={group}&wait_ms=30000&view=compact",
                coord.url
            );
            let http = http.clone();
            tokio::spawn(async move {
                let v: Value = http.get(url).send().await.ok()?.json().await.ok()?;
                (v["status"] == "resolved").then(Instant::now)
            })
        })
        .collect();
    // Let every long poll reach the server (they wait there for up to 30 s).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let published_before = ingest::published(agents);
    let pids = [etcd_pid, coord.pid];
    let mark = CpuMark::take(&pids);
    let first = Instant::now();
    let mut enqueued = 0u64;
    for &room in &room_ids {
        for (rank, agent) in agents.iter().enumerate() {
            let (origin, reason) = if rank == CULPRIT {
                (Origin::Local, "nixl_error")
            } else {
                (Origin::Propagated, "other")
            };
            if agent
                .record_failure(room, origin, reason, "rootrank-bench burst", None)
                .is_ok()
            {
                enqueued += 1;
            }
        }
    }
    let last_enqueue = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(60);
    while ingest::published(agents) - published_before < enqueued && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let all_written = Instant::now();
    let mut resolved = Vec::with_capacity(rooms);
    for p in polls {
        if let Ok(Some(at)) = p.await {
            resolved.push(at);
        }
    }
    let (cpu, _) = mark.since(&pids);
    let written = ingest::published(agents) - published_before;
    let last = resolved.iter().max().copied();
    let ms =
        |a: Instant, b: Option<Instant>| b.map_or(f64::NAN, |b| b.saturating_duration_since(a).as_secs_f64() * 1e3);
    let per = |c: f64| if written > 0 { c * 1e6 / written as f64 } else { 0.0 };
    let after_first: Vec<Duration> = resolved.iter().map(|t| t.saturating_duration_since(first)).collect();
    Ok(json!({
        "group": group,
        "enqueued": enqueued,
        "written": written,
        "rooms_resolved": resolved.len(),
        "enqueue_ms": (last_enqueue - first).as_secs_f64() * 1e3,
        "first_record_to_all_written_ms": (all_written - first).as_secs_f64() * 1e3,
        "first_record_to_last_resolved_ms": ms(first, last),
        "last_enqueue_to_last_resolved_ms": ms(last_enqueue, last),
        "resolved_after_first_record": Dist::from_durations(&after_first),
        "etcd_us_per_record": per(cpu[0]),
        "coordinator_us_per_record": per(cpu[1]),
    }))
}
