//! Part 10: `GET /v1/events` under load. Many readers follow the stream (every decode rank's
//! plugin does, unfiltered) while agents publish room records at a sustained rate; probes
//! write a room that resolves at once and every reader timestamps its `resolved` event, so the
//! lag is etcd commit to delivery at each reader. The coordinator's CPU and memory are read
//! with and without the readers, in the same run.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use rootrank_core::{GroupId, Keys, RoomId};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::ingest::{self, RANKS};
use crate::procs::{self, Coordinator, Env};
use crate::util::{CpuMark, Dist};

#[derive(Clone, Debug)]
pub struct EventsCfg {
    pub readers: usize,
    /// Records/s the agents offer (8 records per room, one of them `local`: one `resolved`
    /// event per 8 records).
    pub rate: u64,
    pub agents: usize,
    pub duration: Duration,
    /// Probe rooms per second.
    pub probe_rate: f64,
}

impl EventsCfg {
    pub fn full() -> Self {
        EventsCfg {
            readers: 1_000,
            rate: 5_000,
            agents: 32,
            duration: Duration::from_secs(8),
            probe_rate: 20.0,
        }
    }
    pub fn smoke() -> Self {
        EventsCfg {
            readers: 20,
            rate: 200,
            agents: 8,
            duration: Duration::from_secs(1),
            probe_rate: 10.0,
        }
    }
}

const PREFIX: &str = crate::verdicts::PREFIX;
const PROBE_GROUP: &str = "probe-0";

/// What one reader saw.
#[derive(Default)]
struct Seen {
    connected: bool,
    events: u64,
    cut_off: bool,
    /// Probe room -> when this reader got its `resolved` event.
    probes: Vec<(u64, Instant)>,
}

pub async fn run(env: &Env, cfg: &EventsCfg) -> anyhow::Result<Value> {
    let dir = env.subdir("events")?;
    let etcd = procs::start_etcd(&dir, &[])?;
    let endpoint = etcd.endpoint();
    let coord = Coordinator::start(env, &endpoint, PREFIX, Duration::from_secs(30)).await?;
    let etcd_pid = procs::etcd_pid(&etcd)?;
    let pids = [coord.pid, etcd_pid, std::process::id()];
    let mut probe_client = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![endpoint.clone()])).await?;
    let probe_lease = probe_client.lease_grant(3600, None).await?.id();
    let groups = cfg.agents.div_ceil(RANKS).max(1);
    let agents = ingest::start_agents(
        &endpoint,
        cfg.agents.max(1),
        "events",
        rootrank_store::MAX_BATCH_RECORDS,
    )
    .await?;

    // The same load without readers first: the coordinator's own cost of the records.
    let quiet = stage(&pids, &agents, groups, cfg, &mut probe_client, probe_lease, 1, None).await?;

    let addr: SocketAddr = coord
        .url
        .trim_start_matches("http://")
        .parse()
        .context("coordinator URL")?;
    let rss_before = crate::util::rss_bytes(coord.pid)?.0;
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Vec<Arc<Mutex<Seen>>> = (0..cfg.readers)
        .map(|_| Arc::new(Mutex::new(Seen::default())))
        .collect();
    let mut tasks = Vec::with_capacity(cfg.readers);
    for s in &seen {
        tasks.push(tokio::spawn(read_events(addr, s.clone(), stop.clone())));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.iter().any(|s| s.lock().map(|s| !s.connected).unwrap_or(true)) {
        anyhow::ensure!(Instant::now() < deadline, "readers did not all connect in 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss_readers = crate::util::rss_bytes(coord.pid)?.0;
    let loaded = stage(
        &pids,
        &agents,
        groups,
        cfg,
        &mut probe_client,
        probe_lease,
        2,
        Some(&seen),
    )
    .await?;
    let rss_after = crate::util::rss_bytes(coord.pid)?;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.abort();
    }
    ingest::stop_agents(agents).await?;
    Ok(json!({
        "setup": {
            "readers": cfg.readers, "offered_records_per_s": cfg.rate, "agents": cfg.agents, "stage_s": cfg.duration.as_secs_f64(),
            "probe_rate_per_s": cfg.probe_rate,
            "how": "readers: raw HTTP/1.0 connections to GET /v1/events (no group filter, as the SGLang plugin follows it) in the bench process; agents publish rooms of 8 records (1 local + 7 propagated: one resolved event per room); probes write a local record in group probe-0 (create-if-absent) and each reader timestamps the probe's resolved event: lag = delivery at that reader - etcd's commit acknowledged to the probe. The same stage runs first with no reader (quiet) for the coordinator's own cost.",
        },
        "quiet": quiet,
        "with_readers": loaded,
        "coordinator_rss_bytes": {
            "before_readers": rss_before, "readers_connected": rss_readers, "after_stage": rss_after.0, "peak": rss_after.1,
        },
    }))
}

/// One stage of `cfg.rate` records/s for `cfg.duration`, with probes; with readers, the lag
/// each reader saw for each probe.
#[allow(clippy::too_many_arguments)]
async fn stage(
    pids: &[u32; 3],
    agents: &Arc<Vec<rootrank_agent::Agent>>,
    groups: usize,
    cfg: &EventsCfg,
    probe_client: &mut rootrank_store::etcd_client::Client,
    probe_lease: i64,
    salt: u64,
    readers: Option<&[Arc<Mutex<Seen>>]>,
) -> anyhow::Result<Value> {
    let events_before: Vec<u64> = readers
        .unwrap_or(&[])
        .iter()
        .map(|s| s.lock().map(|s| s.events).unwrap_or(0))
        .collect();
    let mark = CpuMark::take(pids);
    let duration = cfg.duration;
    let offered = ingest::Offered::start(agents, groups, cfg.rate, duration, 300 + salt);
    // Probes: one room at a time, its commit instant kept.
    let keys = Keys::new(PREFIX);
    let group = GroupId::new(PROBE_GROUP)?;
    let interval = Duration::from_secs_f64(1.0 / cfg.probe_rate.max(0.1));
    let started = Instant::now();
    let mut acked: Vec<(u64, Instant)> = Vec::new();
    let mut i = 0u64;
    while started.elapsed() < duration {
        let room = crate::state::room_id(7_000 + salt, i);
        i += 1;
        let key = keys.room(&group, RoomId::new(room)?, 0);
        let value = crate::state::record_value(&group, 0, room, true, rootrank_store::unix_ms())?;
        if rootrank_store::create_if_absent(probe_client, &key, value, Some(probe_lease)).await? {
            acked.push((room, Instant::now()));
        }
        tokio::time::sleep(interval).await;
    }
    let ingest::OfferedDone {
        enqueued,
        dropped,
        written,
        ..
    } = offered.finish(agents).await?;
    let (cpu, wall) = mark.since(pids);
    // Let the last probes reach every reader.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut out = json!({
        "enqueued": enqueued, "dropped_queue_full": dropped, "written": written,
        "achieved_records_per_s": written as f64 / wall, "probes": acked.len(), "wall_s": wall,
        "cpu": {
            "coordinator_s": cpu[0], "etcd_s": cpu[1], "bench_s": cpu[2],
            "coordinator_cores": cpu[0] / wall, "etcd_cores": cpu[1] / wall, "bench_and_readers_cores": cpu[2] / wall,
        },
    });
    let Some(readers) = readers else { return Ok(out) };
    let mut lags = Vec::new();
    let (mut missing, mut cut_off, mut events) = (0u64, 0u64, Vec::new());
    for (s, before) in readers.iter().zip(events_before) {
        let s = s.lock().map_err(|_| anyhow::anyhow!("reader state poisoned"))?;
        cut_off += u64::from(s.cut_off);
        events.push(s.events - before);
        for (room, at) in &acked {
            match s.probes.iter().find(|(r, _)| r == room) {
                Some((_, got)) => lags.push(got.saturating_duration_since(*at)),
                None => missing += 1,
            }
        }
    }
    events.sort_unstable();
    let resolved_per_s = events.last().copied().unwrap_or(0) as f64 / wall;
    out["delivery_lag"] = serde_json::to_value(Dist::from_durations(&lags))?;
    out["probe_deliveries_missing"] = json!(missing);
    out["readers_cut_off"] = json!(cut_off);
    out["events_per_reader"] = json!({"min": events.first(), "max": events.last()});
    out["events_delivered_per_s"] = json!(resolved_per_s * readers.len() as f64);
    Ok(out)
}

/// A `GET /v1/events` stream read line by line: an HTTP/1.0 request, so the body is the
/// stream itself (no chunked framing).
pub(crate) struct EventLines {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
    carry: Vec<u8>,
}

impl EventLines {
    pub(crate) async fn open(addr: SocketAddr) -> Option<EventLines> {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream
            .write_all(b"GET /v1/events HTTP/1.0\r\nAccept: text/event-stream\r\n\r\n")
            .await
            .ok()?;
        Some(EventLines {
            stream,
            buf: vec![0u8; 64 * 1024],
            carry: Vec::new(),
        })
    }

    /// The complete lines that arrived with the next read (maybe none); `None` at the end.
    pub(crate) async fn next_lines(&mut self) -> Option<Vec<Vec<u8>>> {
        let n = match self.stream.read(&mut self.buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => n,
        };
        self.carry.extend_from_slice(&self.buf[..n]);
        let Some(last_nl) = self.carry.iter().rposition(|b| *b == b'\n') else {
            return Some(Vec::new());
        };
        let lines = self.carry[..last_nl]
            .split(|b| *b == b'\n')
            .map(<[u8]>::to_vec)
            .collect();
        self.carry.drain(..=last_nl);
        Some(lines)
    }
}

/// One reader: lines scanned as they come; only probe events are parsed.
async fn read_events(addr: SocketAddr, seen: Arc<Mutex<Seen>>, stop: Arc<AtomicBool>) {
    let Some(mut lines) = EventLines::open(addr).await else {
        return;
    };
    while !stop.load(Ordering::Relaxed) {
        let Some(got) = lines.next_lines().await else { return };
        let now = Instant::now();
        let Ok(mut st) = seen.lock() else { return };
        st.connected = true;
        for line in got {
            if line.starts_with(b"data:") {
                st.events += 1;
                if let Some(room) = probe_room(&line) {
                    st.probes.push((room, now));
                }
            } else if line.starts_with(b"event: error") {
                st.cut_off = true;
            }
        }
    }
}

/// The room of a probe's `resolved` event (`"groups":["probe-0"]`), if this line is one.
fn probe_room(line: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(line).ok()?;
    if !text.contains("\"groups\":[\"probe-0\"]") {
        return None;
    }
    let at = text.find("\"room\":\"")? + 8;
    let end = text[at..].find('"')?;
    text[at..at + end].parse().ok()
}
