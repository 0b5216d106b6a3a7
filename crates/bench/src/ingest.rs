//! Part 2: ingest. Many agents publish room records at rising offered rates; probes measure the
//! lag from etcd commit to the verdict being visible at the coordinator; CPU of coordinator and
//! etcd per record shows where the bottleneck is.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rootrank_agent::{Agent, AgentConfig, AgentError};
use rootrank_core::{GroupId, Keys, Origin, RoomId};
use serde_json::{json, Value};

use crate::procs::{self, Coordinator, Env};
use crate::util::{CpuMark, Dist};

#[derive(Clone, Debug)]
pub struct IngestCfg {
    pub agents: usize,
    pub rates: Vec<u64>,
    pub duration: Duration,
    /// Lag probes per second during each stage.
    pub probe_rate: f64,
    /// The agents' `max_batch` (1: one put per record).
    pub max_batch: usize,
}

impl IngestCfg {
    pub fn full() -> Self {
        IngestCfg {
            agents: 128,
            rates: vec![500, 1_000, 2_000, 5_000, 10_000, 20_000],
            duration: Duration::from_secs(6),
            probe_rate: 50.0,
            max_batch: rootrank_store::MAX_BATCH_RECORDS,
        }
    }
    pub fn smoke() -> Self {
        IngestCfg {
            agents: 8,
            rates: vec![200],
            duration: Duration::from_secs(1),
            probe_rate: 20.0,
            max_batch: rootrank_store::MAX_BATCH_RECORDS,
        }
    }
}

const PREFIX: &str = crate::verdicts::PREFIX;
pub(crate) const RANKS: usize = 8;

pub async fn run(env: &Env, cfg: &IngestCfg) -> anyhow::Result<Value> {
    let dir = env.subdir("ingest")?;
    let etcd = procs::start_etcd(&dir, &[])?;
    let endpoint = etcd.endpoint();
    let coord = Coordinator::start(env, &endpoint, PREFIX, Duration::from_secs(30)).await?;
    let rig = Rig::new(&coord, procs::etcd_pid(&etcd)?, &endpoint).await?;
    let groups = cfg.agents.div_ceil(RANKS).max(1);
    let agents = start_agents(&endpoint, cfg.agents.max(1), "ingest", cfg.max_batch).await?;
    let mut stages = Vec::new();
    for (stage_no, &rate) in cfg.rates.iter().enumerate() {
        let st = stage(
            &rig,
            &agents,
            groups,
            rate,
            cfg.duration,
            cfg.probe_rate,
            stage_no as u64,
        )
        .await?;
        let saturated = st["saturated"].as_bool().unwrap_or(true);
        stages.push(st);
        if saturated {
            break;
        }
    }
    stop_agents(agents).await?;
    Ok(json!({
        "setup": {
            "agents": cfg.agents, "groups": groups, "ranks_per_group": RANKS, "stage_s": cfg.duration.as_secs_f64(),
            "records_per_room": RANKS, "probe_rate_per_s": cfg.probe_rate, "max_batch": cfg.max_batch,
            "how": "agents (Agent::start, one thread + etcd connection each) in the bench process; each room gets 1 local + 7 propagated records from one group's ranks; probes: a long-poll verdict (wait_ms) is opened, then the probe's record is written with create-if-absent; lag = verdict answer - put response (commit acknowledged), clamped at 0",
        },
        "stages": stages,
    }))
}

/// What a stage measures against: the coordinator, the probe's own etcd client, and the
/// processes whose CPU is counted (coordinator, etcd, this process).
pub(crate) struct Rig {
    url: String,
    http: reqwest::Client,
    probe_client: rootrank_store::etcd_client::Client,
    probe_lease: i64,
    pids: [u32; 3],
}

impl Rig {
    pub(crate) async fn new(coord: &Coordinator, etcd_pid: u32, endpoint: &str) -> anyhow::Result<Rig> {
        let mut probe_client =
            rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![endpoint.to_string()])).await?;
        let probe_lease = probe_client.lease_grant(3600, None).await?.id();
        Ok(Rig {
            url: coord.url.clone(),
            http: crate::util::http_client(Duration::from_secs(10))?,
            probe_client,
            probe_lease,
            pids: [coord.pid, etcd_pid, std::process::id()],
        })
    }
}

/// One stage: `rate` records/s offered for `duration` over `agents` (RANKS per group), with
/// lag probes; then drained. `salt` keeps each stage's rooms apart.
pub(crate) async fn stage(
    rig: &Rig,
    agents: &Arc<Vec<Agent>>,
    groups: usize,
    rate: u64,
    duration: Duration,
    probe_rate: f64,
    salt: u64,
) -> anyhow::Result<Value> {
    let mark = CpuMark::take(&rig.pids);
    let offered = Offered::start(agents, groups, rate, duration, 100 + salt);
    let probes = probe_stage(
        &rig.url,
        &rig.http,
        &rig.probe_client,
        rig.probe_lease,
        probe_rate,
        duration,
        5_000 + salt,
    )
    .await;
    let OfferedDone {
        enqueued,
        dropped,
        written,
        sending,
    } = offered.finish(agents).await?;
    let sent_s = sending.as_secs_f64();
    let (cpu, wall) = mark.since(&rig.pids);
    let (lag_ack, lag_sent, put_lat, probe_failures) = probes?;
    let achieved = written as f64 / wall;
    let per = |c: f64| if written > 0 { c * 1e6 / written as f64 } else { 0.0 };
    let saturated = achieved < 0.9 * rate as f64 || dropped > 0 || wall > sent_s + 2.0;
    Ok(json!({
        "offered_rate": rate,
        "enqueued": enqueued,
        "dropped_queue_full": dropped,
        "written": written,
        "wall_s": wall,
        "drain_s": wall - sent_s,
        "achieved_rate": achieved,
        "saturated": saturated,
        "lag_commit_to_visible": lag_ack,
        "lag_send_to_visible": lag_sent,
        "probe_put_latency": put_lat,
        "probe_failures": probe_failures,
        "cpu": {
            "coordinator_s": cpu[0], "etcd_s": cpu[1], "bench_and_agents_s": cpu[2],
            "coordinator_cores": cpu[0] / wall, "etcd_cores": cpu[1] / wall, "bench_and_agents_cores": cpu[2] / wall,
            "coordinator_us_per_record": per(cpu[0]), "etcd_us_per_record": per(cpu[1]),
            "bench_and_agents_us_per_record": per(cpu[2]),
        },
    }))
}

/// `n` agents in groups `{group_prefix}-{i / RANKS}`, registered.
pub(crate) async fn start_agents(
    endpoint: &str,
    n: usize,
    group_prefix: &str,
    max_batch: usize,
) -> anyhow::Result<Arc<Vec<Agent>>> {
    let (endpoint, group_prefix) = (endpoint.to_string(), group_prefix.to_string());
    let agents = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<Agent>> {
        let mut agents = Vec::with_capacity(n);
        for i in 0..n {
            let group = format!("{group_prefix}-{}", i / RANKS);
            let mut cfg = AgentConfig::new(vec![endpoint.clone()], &group, (i % RANKS) as u64, RANKS as u64)?;
            cfg.queue_capacity = 100_000;
            cfg.max_batch = max_batch;
            agents.push(Agent::start(cfg)?);
        }
        for a in &agents {
            a.wait_registered(Duration::from_secs(30))
                .context("an agent did not register in 30 s")?;
        }
        Ok(agents)
    })
    .await??;
    Ok(Arc::new(agents))
}

pub(crate) async fn stop_agents(agents: Arc<Vec<Agent>>) -> anyhow::Result<()> {
    let agents = Arc::try_unwrap(agents).map_err(|_| anyhow::anyhow!("agents still shared"))?;
    tokio::task::spawn_blocking(move || {
        for a in agents {
            a.shutdown(Duration::from_secs(2));
        }
    })
    .await?;
    Ok(())
}

pub(crate) fn published(agents: &[Agent]) -> u64 {
    agents.iter().map(|a| a.stats().published.load(Ordering::Relaxed)).sum()
}

/// A load being offered: `rate` records/s for `duration`, paced on an OS thread as ranks' own
/// threads would call `record_failure`. Started, then (whatever the stage does meanwhile)
/// finished: the driver joined and the agents drained.
pub(crate) struct Offered {
    driver: std::thread::JoinHandle<(u64, u64)>,
    published_before: u64,
    started: Instant,
}

/// What an offered load came to.
pub(crate) struct OfferedDone {
    pub enqueued: u64,
    pub dropped: u64,
    /// Written to etcd by the agents (all of what they accepted, unless the drain timed out).
    pub written: u64,
    /// From the start to the driver's end (longer than asked when it could not keep pace).
    pub sending: Duration,
}

impl Offered {
    pub(crate) fn start(agents: &Arc<Vec<Agent>>, groups: usize, rate: u64, duration: Duration, salt: u64) -> Self {
        let published_before = published(agents);
        let agents = agents.clone();
        let driver = std::thread::spawn(move || drive(&agents, groups, rate, duration, salt));
        Offered {
            driver,
            published_before,
            started: Instant::now(),
        }
    }

    /// Joins the driver, then waits (at most 30 s) until the agents wrote what they accepted.
    pub(crate) async fn finish(self, agents: &[Agent]) -> anyhow::Result<OfferedDone> {
        let driver = self.driver;
        let (enqueued, dropped) = tokio::task::spawn_blocking(move || driver.join())
            .await?
            .map_err(|_| anyhow::anyhow!("driver thread panicked"))?;
        let sending = self.started.elapsed();
        let drain_deadline = Instant::now() + Duration::from_secs(30);
        while published(agents) - self.published_before < enqueued && Instant::now() < drain_deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(OfferedDone {
            enqueued,
            dropped,
            written: published(agents) - self.published_before,
            sending,
        })
    }
}

/// Offers `rate` records/s for `duration`; returns (enqueued, dropped).
pub(crate) fn drive(agents: &[Agent], groups: usize, rate: u64, duration: Duration, salt: u64) -> (u64, u64) {
    let start = Instant::now();
    let mut sent = 0u64;
    let mut dropped = 0u64;
    let mut k = 0u64; // record counter: room k / RANKS, rank k % RANKS
    let per_group = RANKS.min(agents.len()).max(1);
    while start.elapsed() < duration {
        let due = (rate as f64 * start.elapsed().as_secs_f64()) as u64;
        if sent + dropped >= due {
            std::thread::sleep(Duration::from_micros(500));
            continue;
        }
        for _ in 0..(due - sent - dropped).min(1_000) {
            let room_i = k / per_group as u64;
            let rank = (k % per_group as u64) as usize;
            let g = (room_i as usize) % groups;
            let room = crate::state::room_id(salt, room_i);
            let local = rank == (room_i as usize % per_group);
            let (origin, reason) = if local {
                (Origin::Local, "nixl_error")
            } else {
                (Origin::Propagated, "other")
            };
            let idx = (g * RANKS + rank).min(agents.len() - 1);
            match agents[idx].record_failure(room, origin, reason, "rootrank-bench ingest", None) {
                Ok(()) => sent += 1,
                Err(AgentError::QueueFull { .. }) => dropped += 1,
                Err(_) => dropped += 1,
            }
            k += 1;
        }
    }
    (sent, dropped)
}

type ProbeOut = (Dist, Dist, Dist, u64);

async fn probe_stage(
    url: &str,
    http: &reqwest::Client,
    client: &rootrank_store::etcd_client::Client,
    lease: i64,
    rate: f64,
    duration: Duration,
    salt: u64,
) -> anyhow::Result<ProbeOut> {
    let keys = Keys::new(PREFIX);
    let group = GroupId::new("probe-0")?;
    let interval = Duration::from_secs_f64(1.0 / rate.max(0.1));
    let start = Instant::now();
    let mut tasks = Vec::new();
    let mut i = 0u64;
    while start.elapsed() < duration {
        let room = crate::state::room_id(salt, i);
        i += 1;
        let key = keys.room(&group, RoomId::new(room)?, 0);
        let value = crate::state::record_value(&group, 0, room, true, rootrank_store::unix_ms())?;
        let (http, url, mut client) = (http.clone(), url.to_string(), client.clone());
        tasks.push(tokio::spawn(async move {
            let poll = tokio::spawn({
                let http = http.clone();
                let url = format!("{url}/v1/rooms/{room}/verdict?group=probe-0&wait_ms=5000");
                async move {
                    let r = http.get(url).send().await.ok()?;
                    let v: Value = r.json().await.ok()?;
                    let at = Instant::now();
                    (v["status"] == "resolved").then_some(at)
                }
            });
            // Let the long poll reach the server before the write it waits for.
            tokio::time::sleep(Duration::from_millis(3)).await;
            let sent = Instant::now();
            let ok = rootrank_store::create_if_absent(&mut client, &key, value, Some(lease)).await;
            let acked = Instant::now();
            let visible = poll.await.ok().flatten();
            match (ok, visible) {
                (Ok(true), Some(v)) => Some((
                    v.saturating_duration_since(acked),
                    v.saturating_duration_since(sent),
                    acked - sent,
                )),
                _ => None,
            }
        }));
        tokio::time::sleep(interval).await;
    }
    let (mut a, mut s, mut p, mut failures) = (Vec::new(), Vec::new(), Vec::new(), 0u64);
    for t in tasks {
        match t.await {
            Ok(Some((x, y, z))) => {
                a.push(x);
                s.push(y);
                p.push(z);
            }
            _ => failures += 1,
        }
    }
    Ok((
        Dist::from_durations(&a),
        Dist::from_durations(&s),
        Dist::from_durations(&p),
        failures,
    ))
}
