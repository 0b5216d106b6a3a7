//! Part 4: scale. Thousands of groups with live leases kept alive, a million retained room
//! records: coordinator memory per record, load time, verdict latency at that size, keepalive
//! load on etcd; and the core index alone, in-process, with a counting allocator.

use std::time::{Duration, Instant};

use anyhow::Context;
use rootrank_core::{Event, GroupId, Index, IndexConfig, Keys, RoomId};
use serde_json::{json, Value};

use crate::procs::{self, Coordinator, Env};
use crate::state::{self, KeepAlives, Put};
use crate::util::{rss_bytes, CpuMark};

#[derive(Clone, Debug)]
pub struct ScaleCfg {
    pub groups: usize,
    pub ranks: u32,
    pub records: usize,
    pub records_per_room: u32,
    pub ttl_s: i64,
    pub keepalive_window: Duration,
    pub verdict_duration: Duration,
    pub conns: usize,
}

impl ScaleCfg {
    pub fn full() -> Self {
        ScaleCfg {
            groups: 2_000,
            ranks: 16,
            records: 1_000_000,
            records_per_room: 8,
            // Not the agents' 5 s default: 32,000 leases at 5 s need 19,200 keepalives/s, and
            // the etcd of a 2-core machine sustains about 6,000/s; its range reads then take
            // over 2 s, and the coordinator's snapshot (2 s per page, restarted from scratch on
            // any page timeout) never finishes. 30 s (3,200/s) keeps etcd able to serve the
            // load. `--ttl-s 5` reproduces the overload.
            ttl_s: 30,
            keepalive_window: Duration::from_secs(10),
            verdict_duration: Duration::from_secs(10),
            conns: 16,
        }
    }
    pub fn smoke() -> Self {
        ScaleCfg {
            groups: 2,
            ranks: 16,
            records: 104,
            records_per_room: 8,
            ttl_s: 5,
            keepalive_window: Duration::from_secs(1),
            verdict_duration: Duration::from_secs(1),
            conns: 16,
        }
    }
}

const PREFIX: &str = crate::verdicts::PREFIX;

pub async fn run(env: &Env, cfg: &ScaleCfg) -> anyhow::Result<Value> {
    let dir = env.subdir("scale")?;
    let etcd = procs::start_large_etcd(&dir)?;
    let endpoint = etcd.endpoint();
    let etcd_pid = procs::etcd_pid(&etcd)?;
    let clients = state::clients(&endpoint, 8).await?;
    let keys = Keys::new(PREFIX);
    let gids: Vec<GroupId> = (0..cfg.groups)
        .map(|g| GroupId::new(&state::group_name("scale", g)))
        .collect::<Result<_, _>>()?;
    let interval = Duration::from_millis((cfg.ttl_s as u64 * 1000 / 3).max(100));

    // Records first, on one retention lease in batched transactions, while etcd is not yet
    // busy renewing 32,000 leases (the order does not change the state the coordinator loads).
    let t = Instant::now();
    let per_room = cfg.records_per_room.min(cfg.ranks).max(1);
    let rooms = cfg.records.div_ceil(per_room as usize);
    let (room_list, written) = state::write_rooms(&clients, &keys, &gids, rooms, per_room, 42).await?;
    let records_s = t.elapsed().as_secs_f64();
    // Let etcd apply its backlog before the leases: a linearizable read waits for it.
    let t = Instant::now();
    let mut c0 = clients[0].clone();
    while t.elapsed() < Duration::from_secs(120) {
        let s = Instant::now();
        let ok = c0
            .get(
                keys.root(),
                Some(
                    rootrank_store::etcd_client::GetOptions::new()
                        .with_keys_only()
                        .with_limit(1),
                ),
            )
            .await
            .is_ok();
        if ok && s.elapsed() < Duration::from_millis(50) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settle_s = t.elapsed().as_secs_f64();

    // Live keys: leases granted in chunks, each chunk kept alive at once (as agents do, TTL/3),
    // so early leases do not expire while later ones are still being granted.
    let t = Instant::now();
    let n_live = cfg.groups * cfg.ranks as usize;
    let mut leases = Vec::with_capacity(n_live);
    let mut keepalives = Vec::new();
    let (mut live_written, mut live_lost) = (0usize, 0usize);
    // A lease etcd would not grant (overloaded) is skipped: rank slots are taken in order, so
    // the last slots of the run are then left without a live key.
    let mut leases_asked = 0usize;
    while leases_asked < n_live {
        let chunk = (n_live - leases_asked).min(2_000);
        leases_asked += chunk;
        let got = state::grant_leases(&clients, chunk, cfg.ttl_s, 64)
            .await
            .with_context(|| format!("granting live leases ({} granted so far)", leases.len()))?;
        keepalives.push(KeepAlives::start(&clients, &got, interval, Duration::from_secs(3600)));
        // The chunk's live keys at once, while their leases are fresh.
        let first = leases.len();
        let mut puts = Vec::with_capacity(got.len());
        for (j, lease) in got.iter().enumerate() {
            let (g, r) = (
                (first + j) / cfg.ranks as usize,
                ((first + j) % cfg.ranks as usize) as u32,
            );
            puts.push(Put {
                key: keys.live(&gids[g], r),
                value: state::live_value(&gids[g], r, cfg.ranks, cfg.ttl_s as u64 * 1000)?,
                lease: Some(*lease),
            });
        }
        let (ok, lost) = state::write_live(&clients[0], puts)
            .await
            .context("writing live keys")?;
        live_written += ok;
        live_lost += lost;
        leases.extend(got);
    }
    let live_s = t.elapsed().as_secs_f64();

    // Keepalive load alone: nothing else talks to etcd in this window.
    let sent_before: u64 = keepalives
        .iter()
        .map(|k| k.sent.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    let mark = CpuMark::take(&[etcd_pid, std::process::id()]);
    tokio::time::sleep(cfg.keepalive_window).await;
    let (ka_cpu, ka_wall) = mark.since(&[etcd_pid, std::process::id()]);
    let sent_after: u64 = keepalives
        .iter()
        .map(|k| k.sent.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    let etcd_rss = rss_bytes(etcd_pid).map(|r| r.0).unwrap_or(0);

    // Start-up, while the leases are kept alive: the serial load as it was, next to one and
    // the default number of parallel snapshot readers.
    let startup =
        crate::startup::compare(env, &endpoint, etcd_pid, &[1, rootrank_store::DEFAULT_READERS], false).await?;

    // An empty coordinator (a prefix with nothing under it) for the baseline RSS.
    let empty = Coordinator::start(env, &endpoint, "/rootrank-empty/v1", Duration::from_secs(30)).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (empty_rss, _) = rss_bytes(empty.pid)?;
    drop(empty);

    let coord = Coordinator::start(env, &endpoint, PREFIX, Duration::from_secs(600)).await?;
    let load_s = coord.start_to_ready.as_secs_f64();
    // The coordinator's own CPU for the whole load: the rest of the wall time is waiting on etcd.
    let load_cpu_s = crate::util::cpu_seconds(coord.pid).unwrap_or(f64::NAN);
    let live_seen = live_ranks(&coord.url).await.unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss_loaded, hwm_loaded) = rss_bytes(coord.pid)?;
    let index_rooms = metric(&coord.url, "rootrank_index_rooms").await.unwrap_or(f64::NAN);
    let paths = crate::verdicts::verdict_paths(&room_list, 10_000);
    if let Some(p) = paths.first() {
        crate::verdicts::check_resolved(&coord.url, p).await?;
    }
    let mark = CpuMark::take(&[coord.pid]);
    let (work, url, p2, conns, dur) = (
        env.work.clone(),
        coord.url.clone(),
        paths.clone(),
        cfg.conns,
        cfg.verdict_duration,
    );
    let verdict =
        tokio::task::spawn_blocking(move || crate::load::wrk(&work, "verdict_at_scale", &url, &p2, conns, dur))
            .await??;
    let (vcpu, _) = mark.since(&[coord.pid]);
    let (rss_after_load, hwm_after_load) = rss_bytes(coord.pid)?;
    let (mut sent, mut failed, mut expired) = (0, 0, 0);
    let mut first_error = None;
    for k in keepalives {
        if first_error.is_none() {
            first_error = k.first_error.lock().ok().and_then(|e| e.clone());
        }
        sent += k.sent.load(std::sync::atomic::Ordering::Relaxed);
        failed += k.failed.load(std::sync::atomic::Ordering::Relaxed);
        expired += k.expired.load(std::sync::atomic::Ordering::Relaxed);
        k.stop();
    }
    drop(coord);
    drop(etcd);

    let core = tokio::task::spawn_blocking({
        let cfg = cfg.clone();
        move || core_index(&cfg)
    })
    .await??;
    let per_record = |b: u64| {
        if written > 0 {
            (b as f64 - empty_rss as f64) / written as f64
        } else {
            0.0
        }
    };
    Ok(json!({
        "setup": {
            "groups": cfg.groups, "ranks_per_group": cfg.ranks, "live_leases": n_live, "lease_ttl_s": cfg.ttl_s,
            "keepalive_interval_ms": interval.as_millis() as u64, "keepalive_tasks": n_live, "keepalive_connections": clients.len(),
            "records": written, "rooms": rooms, "records_per_room": per_room,
            "etcd_quota_backend_bytes": procs::LARGE_QUOTA_BYTES,
        },
        "populate": {
            "settle_s": settle_s, "live_keys_s": live_s, "live_keys_written": live_written,
            "live_keys_lost": live_lost, "leases_not_granted": n_live - leases.len(),
            "keepalives_needed_per_s": n_live as f64 / interval.as_secs_f64(), "records_s": records_s,
            "records_per_s": if records_s > 0.0 { written as f64 / records_s } else { 0.0 },
        },
        "keepalive_only": {
            "window_s": ka_wall, "keepalives_sent": sent_after - sent_before,
            "keepalives_per_s": (sent_after - sent_before) as f64 / ka_wall,
            "etcd_cpu_cores": ka_cpu[0] / ka_wall, "bench_client_cpu_cores": ka_cpu[1] / ka_wall,
            "etcd_cpu_us_per_keepalive": if sent_after > sent_before { ka_cpu[0] * 1e6 / (sent_after - sent_before) as f64 } else { 0.0 },
            "etcd_rss_bytes": etcd_rss,
            "total_sent": sent, "failed": failed, "expired_leases": expired, "first_error": first_error,
        },
        "coordinator": {
            "start_to_ready_s": load_s, "cpu_s_at_ready": load_cpu_s,
            "live_ranks_seen_at_ready": live_seen,
            "empty_rss_bytes": empty_rss,
            "loaded_rss_bytes": rss_loaded, "loaded_hwm_bytes": hwm_loaded,
            "rss_after_verdict_load_bytes": rss_after_load, "hwm_after_verdict_load_bytes": hwm_after_load,
            "rss_bytes_per_record": per_record(rss_loaded),
            "hwm_bytes_per_record": per_record(hwm_loaded),
            "index_rooms_metric": index_rooms,
        },
        "startup": startup,
        "verdict": {
            "run": verdict,
            "server_cpu_us_per_request": if verdict.requests > 0 { vcpu[0] * 1e6 / verdict.requests as f64 } else { 0.0 },
        },
        "core_index": core,
    }))
}

/// Live ranks the coordinator knows, over all groups.
async fn live_ranks(url: &str) -> Option<u64> {
    let http = crate::util::http_client(Duration::from_secs(30)).ok()?;
    let v: Value = http
        .get(format!("{url}/v1/groups"))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    Some(v["groups"].as_array()?.iter().filter_map(|g| g["live"].as_u64()).sum())
}

/// The Prometheus value of an unlabelled metric.
pub async fn metric(url: &str, name: &str) -> Option<f64> {
    let http = crate::util::http_client(Duration::from_secs(10)).ok()?;
    let text = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with(name) && l.as_bytes().get(name.len()) == Some(&b' '))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The core index alone: the same live keys and records fed to `Index::apply` one event at a
/// time (the events are generated and dropped as they go), bytes counted by the allocator.
pub fn core_index(cfg: &ScaleCfg) -> anyhow::Result<Value> {
    if !crate::alloc::installed() {
        return Ok(json!({"available": false, "reason": "the counting allocator is not installed in this binary"}));
    }
    let keys = Keys::new(PREFIX);
    let gids: Vec<GroupId> = (0..cfg.groups)
        .map(|g| GroupId::new(&state::group_name("scale", g)))
        .collect::<Result<_, _>>()?;
    let now = rootrank_store::unix_ms();
    crate::alloc::start();
    let mut index = Index::new(IndexConfig {
        prefix: PREFIX.into(),
        ..IndexConfig::default()
    });
    let mut rev = 1i64;
    let t = Instant::now();
    for (g, gid) in gids.iter().enumerate() {
        for r in 0..cfg.ranks {
            let ev = Event::Put {
                key: keys.live(gid, r).into_bytes(),
                value: state::live_value(gid, r, cfg.ranks, cfg.ttl_s as u64 * 1000)?,
                lease: 1_000_000 + (g as i64) * 100 + r as i64,
                revision: rev,
                create_revision: rev,
                observed_at_ms: now,
            };
            rev += 1;
            drop(index.apply(ev));
        }
    }
    let after_live = crate::alloc::read();
    let live_s = t.elapsed().as_secs_f64();
    let per_room = cfg.records_per_room.min(cfg.ranks).max(1);
    let rooms = cfg.records.div_ceil(per_room as usize);
    let t = Instant::now();
    let mut records = 0u64;
    for i in 0..rooms {
        let gid = &gids[i % cfg.groups];
        let room = state::room_id(42, i as u64);
        for r in 0..per_room {
            let ev = Event::Put {
                key: keys.room(gid, RoomId::new(room)?, r).into_bytes(),
                value: state::record_value(gid, r, room, r == (i as u32 % per_room), now)?,
                lease: 7,
                revision: rev,
                create_revision: rev,
                observed_at_ms: now,
            };
            rev += 1;
            records += 1;
            drop(index.apply(ev));
        }
    }
    let records_s = t.elapsed().as_secs_f64();
    let after = crate::alloc::stop();
    let record_bytes = (after.live - after_live.live).max(0) as f64;
    let indexed = index.record_count();
    drop(index);
    Ok(json!({
        "available": true,
        "records": records, "indexed_records": indexed, "live_keys": gids.len() * cfg.ranks as usize,
        "live_keys_bytes": after_live.live,
        "live_key_bytes_each": after_live.live as f64 / (gids.len().max(1) * cfg.ranks as usize) as f64,
        "records_bytes": record_bytes,
        "bytes_per_record": if records > 0 { record_bytes / records as f64 } else { 0.0 },
        "total_bytes": after.live, "peak_bytes": after.peak,
        "apply_live_s": live_s, "apply_records_s": records_s,
        "records_applied_per_s": if records_s > 0.0 { records as f64 / records_s } else { 0.0 },
        "note": "includes JSON decoding and key parsing per event; the generated events themselves are freed as they are applied",
    }))
}
