//! Part 12: long polls parked on their rooms while agents publish other rooms' records at a
//! sustained rate. A long poll waits on its room (`coordinator::waiters`): an etcd batch that
//! does not concern it must cost it nothing. The coordinator's CPU per record is read with no
//! poll and with the polls parked, in the same run; probes park a poll on a room, then write
//! that room's `local` record, and time the poll's answer from the commit.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rootrank_core::{GroupId, Keys, RoomId};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::ingest::{self, RANKS};
use crate::procs::{self, Coordinator, Env};
use crate::util::{CpuMark, Dist};

#[derive(Clone, Debug)]
pub struct LongPollsCfg {
    pub polls: usize,
    pub rate: u64,
    pub agents: usize,
    pub duration: Duration,
    /// Probe rooms per second.
    pub probe_rate: f64,
}

impl LongPollsCfg {
    pub fn full() -> Self {
        LongPollsCfg {
            polls: 2_000,
            rate: 5_000,
            agents: 32,
            duration: Duration::from_secs(8),
            probe_rate: 10.0,
        }
    }
    pub fn smoke() -> Self {
        LongPollsCfg {
            polls: 50,
            rate: 200,
            agents: 8,
            duration: Duration::from_secs(1),
            probe_rate: 5.0,
        }
    }
}

const PREFIX: &str = crate::verdicts::PREFIX;
const PROBE_GROUP: &str = "probe-0";
/// Parked polls ask about rooms nobody writes: pending for their whole wait.
const PARKED_ROOMS: u64 = 9_000_000;

pub async fn run(env: &Env, cfg: &LongPollsCfg) -> anyhow::Result<Value> {
    let dir = env.subdir("long_polls")?;
    let etcd = procs::start_etcd(&dir, &[])?;
    let endpoint = etcd.endpoint();
    // The coordinator's default bound on long polls (4,096) holds the parked ones and probes.
    anyhow::ensure!(
        cfg.polls < 4_000,
        "at most 4,000 parked polls (the coordinator lets 4,096 wait)"
    );
    let coord = Coordinator::start(env, &endpoint, PREFIX, Duration::from_secs(30)).await?;
    let pids = [coord.pid, procs::etcd_pid(&etcd)?, std::process::id()];
    let addr: SocketAddr = coord
        .url
        .trim_start_matches("http://")
        .parse()
        .context("coordinator URL")?;
    let mut probe_client = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![endpoint.clone()])).await?;
    let probe_lease = probe_client.lease_grant(3600, None).await?.id();
    let groups = cfg.agents.div_ceil(RANKS).max(1);
    let agents = ingest::start_agents(
        &endpoint,
        cfg.agents.max(1),
        "long-polls",
        rootrank_store::MAX_BATCH_RECORDS,
    )
    .await?;
    let stage_args = Stage {
        pids,
        addr,
        groups,
        cfg: cfg.clone(),
    };
    let quiet = stage_args.run(&agents, &mut probe_client, probe_lease, 1).await?;

    // Park the polls: each asks again when answered (a wait that ended), as a scheduler would.
    let answered = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::with_capacity(cfg.polls);
    for i in 0..cfg.polls as u64 {
        let (answered, stop) = (answered.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if long_poll(addr, PARKED_ROOMS + i).await.is_none() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                answered.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // Connected and parked (no way to see it from outside but time).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_parked = crate::util::rss_bytes(coord.pid)?.0;
    let answered_before = answered.load(Ordering::Relaxed);
    let parked = stage_args.run(&agents, &mut probe_client, probe_lease, 2).await?;
    let answered_during = answered.load(Ordering::Relaxed) - answered_before;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.abort();
    }
    ingest::stop_agents(agents).await?;
    Ok(json!({
        "setup": {
            "polls": cfg.polls, "offered_records_per_s": cfg.rate, "agents": cfg.agents, "stage_s": cfg.duration.as_secs_f64(),
            "probe_rate_per_s": cfg.probe_rate,
            "how": "parked polls: raw HTTP/1.0 GET /v1/rooms/{r}/verdict?wait_ms=30000 on rooms nobody writes (pending for the whole wait), in the bench process; agents publish rooms of 8 records in other rooms; each probe parks a poll on a fresh room, then writes its local record (create-if-absent): wake = the poll's answer - etcd's commit acknowledged. The same stage runs first with no parked poll.",
        },
        "quiet": quiet,
        "parked": parked,
        "parked_polls_answered_during_stage": answered_during,
        "coordinator_rss_bytes_parked": rss_parked,
    }))
}

struct Stage {
    pids: [u32; 3],
    addr: SocketAddr,
    groups: usize,
    cfg: LongPollsCfg,
}

impl Stage {
    /// `cfg.rate` records/s for `cfg.duration`, with probes.
    async fn run(
        &self,
        agents: &Arc<Vec<rootrank_agent::Agent>>,
        probe_client: &mut rootrank_store::etcd_client::Client,
        probe_lease: i64,
        salt: u64,
    ) -> anyhow::Result<Value> {
        let mark = CpuMark::take(&self.pids);
        let duration = self.cfg.duration;
        let offered = ingest::Offered::start(agents, self.groups, self.cfg.rate, duration, 500 + salt);
        let keys = Keys::new(PREFIX);
        let group = GroupId::new(PROBE_GROUP)?;
        let interval = Duration::from_secs_f64(1.0 / self.cfg.probe_rate.max(0.1));
        let started = Instant::now();
        let mut wakes: Vec<Duration> = Vec::new();
        let mut missed = 0u64;
        let mut i = 0u64;
        while started.elapsed() < duration {
            let room = crate::state::room_id(8_000 + salt, i);
            i += 1;
            let poll = tokio::spawn(long_poll(self.addr, room));
            // Parked before the record is written.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let key = keys.room(&group, RoomId::new(room)?, 0);
            let value = crate::state::record_value(&group, 0, room, true, rootrank_store::unix_ms())?;
            rootrank_store::create_if_absent(probe_client, &key, value, Some(probe_lease)).await?;
            let acked = Instant::now();
            match poll.await? {
                Some((at, true)) => wakes.push(at.saturating_duration_since(acked)),
                _ => missed += 1,
            }
            tokio::time::sleep(interval).await;
        }
        let ingest::OfferedDone {
            enqueued,
            dropped,
            written,
            ..
        } = offered.finish(agents).await?;
        let (cpu, wall) = mark.since(&self.pids);
        Ok(json!({
            "enqueued": enqueued, "dropped_queue_full": dropped, "written": written,
            "achieved_records_per_s": written as f64 / wall, "wall_s": wall,
            "coordinator_us_per_record": cpu[0] * 1e6 / written.max(1) as f64,
            "probe_wake": serde_json::to_value(Dist::from_durations(&wakes))?, "probes_not_resolved": missed,
            "cpu": {
                "coordinator_s": cpu[0], "etcd_s": cpu[1], "bench_s": cpu[2],
                "coordinator_cores": cpu[0] / wall, "etcd_cores": cpu[1] / wall, "bench_and_polls_cores": cpu[2] / wall,
            },
        }))
    }
}

/// One long poll (HTTP/1.0: the body ends with the connection): when it was answered, and
/// whether the verdict was resolved. `None` when the request failed.
async fn long_poll(addr: SocketAddr, room: u64) -> Option<(Instant, bool)> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let req = format!("GET /v1/rooms/{room}/verdict?wait_ms=30000 HTTP/1.0\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut body = Vec::new();
    s.read_to_end(&mut body).await.ok()?;
    let at = Instant::now();
    let text = String::from_utf8_lossy(&body);
    Some((
        at,
        text.starts_with("HTTP/1.") && text.contains("\"status\":\"resolved\""),
    ))
}
