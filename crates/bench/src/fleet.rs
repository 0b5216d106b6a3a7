//! Part 14: the fleet (issue 29). R simulated ranks on a real 3-member etcd cluster on
//! loopback (etcd's production timing), each rank a real lease kept alive every TTL/3 and a
//! real live key, as agents do, all from this one process. Groups are TP=16 across two hosts
//! of 8 ranks (so a dead host leaves survivors that record the room in flight, as SGLang's
//! ranks do). Measured at each size: etcd CPU at steady state (all members, per second and per
//! 1,000 ranks) and the keepalives it served, the coordinator's start-up to `/readyz` and its
//! RSS, a verdict's and a long poll's latency under that load, and three failures, one after
//! the other: one host (8 ranks), one rack (`rack_hosts` hosts of 8 ranks), 10 % of the fleet
//! at once. A failure stops the keepalives of its ranks' leases (a host that died sends
//! nothing; etcd expires the leases); the survivors of each group hit record the room in
//! flight at once. Timed from the stop: every death down on the coordinator, every death
//! certified in etcd, every room in flight resolved.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rootrank_core::{GroupId, Keys};
use rootrank_store::embedded::{EmbeddedEtcd, EtcdOptions};
use rootrank_store::etcd_client::Client;
use serde_json::{json, Value};

use crate::mass_death::{all_live, totals};
use crate::procs::{Coordinator, Env};
use crate::state::{self, KeepAlives, Put};
use crate::util::{http_client, rss_bytes, CpuMark, Dist};

#[derive(Clone, Debug)]
pub struct FleetCfg {
    /// Fleet sizes in ranks, one after the other (a fresh cluster for each).
    pub sizes: Vec<usize>,
    /// Lease TTL of every rank, at least; see `keepalive_budget`.
    pub ttl_s: i64,
    /// Keepalives per second the etcd of this machine is given: a size that would need more
    /// at `ttl_s` runs with a TTL long enough to stay within it (`3 x ranks / budget`), so
    /// the coordinator's side is measured at that size too. `None`: always `ttl_s`.
    pub keepalive_budget: Option<f64>,
    /// Hosts (of 8 ranks) in the rack that fails.
    pub rack_hosts: usize,
    /// Steady-state window over which etcd's CPU is measured.
    pub window: Duration,
    /// `GET /v1/events` readers connected through the failures (schedulers and dashboards
    /// following the fleet): each must receive every certified death.
    pub subscribers: usize,
    /// v5: one lease per host of 8 ranks (`node-watch --host-lease-ttl-ms`), each live record
    /// naming its rank's incarnation; `false`: a lease per rank, as without node-watch.
    pub host_lease: bool,
    /// After the failures, failed rooms (one record each) written over the fleet's groups,
    /// then a second coordinator started on it all: the goal's "100,000 ranks and 1,000,000
    /// rooms" start-up and RSS (0: skipped).
    pub rooms: usize,
}

impl FleetCfg {
    pub fn full() -> Self {
        FleetCfg {
            sizes: vec![10_000, 30_000],
            // Not the agents' 5 s: 30,000 leases at 5 s need 18,000 keepalives/s, three times
            // what this machine's etcd serves (`rootrank-bench keepalive`). The figures are per
            // keepalive and per rank, so they scale to any TTL.
            ttl_s: 15,
            // 10,000 ranks at 15 s: 2,000/s took 1.1 cores of the 3 members here; 30,000 at
            // 15 s (6,000/s) put the cluster into back-to-back leader elections.
            keepalive_budget: Some(2_000.0),
            rack_hosts: 40,
            window: Duration::from_secs(15),
            subscribers: 1_000,
            host_lease: false,
            rooms: 0,
        }
    }
    pub fn smoke() -> Self {
        FleetCfg {
            sizes: vec![320],
            ttl_s: 3,
            keepalive_budget: None,
            rack_hosts: 4,
            window: Duration::from_secs(2),
            subscribers: 20,
            host_lease: false,
            rooms: 0,
        }
    }
}

/// The same prefix as the mass-death part, whose readers (`totals`, `certified`) it shares.
const PREFIX: &str = crate::mass_death::PREFIX;
const HOST_RANKS: usize = 8;
const GROUP_SIZE: usize = 2 * HOST_RANKS;
const STEP: Duration = Duration::from_secs(600);
/// Registering the fleet longer than this means etcd cannot carry it here: the size is
/// recorded as where the machine stops, with what etcd said.
const REGISTER_LIMIT: Duration = Duration::from_secs(180);

/// etcd's `etcd_server_leader_changes_seen_total` summed over the members (a leader lost
/// under load shows here first).
async fn leader_changes(http: &reqwest::Client, endpoints: &[String]) -> u64 {
    let mut total = 0;
    for e in endpoints {
        let Ok(r) = http.get(format!("{e}/metrics")).send().await else {
            continue;
        };
        let Ok(text) = r.text().await else {
            continue;
        };
        total += text
            .lines()
            .find_map(|l| l.strip_prefix("etcd_server_leader_changes_seen_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0) as u64;
    }
    total
}

pub async fn run(env: &Env, cfg: &FleetCfg) -> anyhow::Result<Value> {
    let mut sizes = Vec::new();
    for &n in &cfg.sizes {
        eprintln!("rootrank-bench: fleet: {n} ranks ...");
        let v = match one(env, cfg, n).await {
            Ok(v) => v,
            Err(e) => json!({"ranks": n, "error": format!("{e:#}")}),
        };
        eprintln!("rootrank-bench: fleet: {v}");
        sizes.push(v);
    }
    let summary = summary_line(&sizes, cfg.rack_hosts * HOST_RANKS);
    Ok(json!({
        "setup": {
            "ttl_s": cfg.ttl_s,
            "keepalive_budget_per_s": cfg.keepalive_budget,
            "rack_ranks": cfg.rack_hosts * HOST_RANKS,
            "window_s": cfg.window.as_secs_f64(),
            "how": "per size: a fresh 3-member etcd cluster on loopback (100 ms heartbeat, 1 s election timeout); R ranks in groups of 16 (two hosts of 8), each a lease kept alive every TTL/3 over 8 shared connections and a live key on it, written from the bench process; one coordinator (release build). Steady state: etcd CPU of all members over the window, less the idle cluster's (measured before any lease) for the per-rank and per-keepalive figures. Then one host, one rack, 10 % of the fleet fail in turn: their keepalives stop, the 8 surviving ranks of each group hit record a propagated failure for a room in flight; times from the stop",
        },
        "sizes": sizes,
        "summary": summary,
    }))
}

/// The one line the part ends with: the largest size that ran.
pub fn summary_line(sizes: &[Value], rack_ranks: usize) -> String {
    let Some(s) = sizes.iter().rev().find(|s| s.get("error").is_none()) else {
        return "fleet: no size ran (see the errors in results.json)".into();
    };
    let f = |v: &Value| v.as_f64().map_or("?".into(), |x| format!("{x:.2}"));
    format!(
        "fleet: {} ranks, rack of {rack_ranks} down in {} s, etcd {} ms CPU per s per 1000 ranks, coordinator {} MiB",
        s["ranks"],
        f(&s["failures"]["rack"]["all_down_s"]),
        s["steady"]["etcd_cpu_ms_per_s_per_1000_ranks"]
            .as_f64()
            .map_or("?".into(), |x| format!("{x:.1}")),
        s["coordinator"]["rss_steady_bytes"]
            .as_f64()
            .map_or("?".into(), |x| format!("{:.0}", x / 1048576.0)),
    )
}

/// A 3-member cluster with etcd's production timing and a quota for the fleet's history.
fn start_cluster(dir: &std::path::Path) -> anyhow::Result<Vec<EmbeddedEtcd>> {
    let opts = EtcdOptions {
        fast: false,
        extra_args: vec![
            "--quota-backend-bytes".into(),
            crate::procs::LARGE_QUOTA_BYTES.to_string(),
        ],
        ..EtcdOptions::default()
    };
    rootrank_store::embedded::start_cluster(dir, 3, &opts, Duration::from_secs(60))
        .map_err(|e| anyhow::anyhow!("a 3-member etcd cluster would not start: {e}"))
}

/// The host of rank `r` of group `g`: each group spans two hosts of 8.
fn host_of(g: usize, r: u32) -> String {
    format!("host-{}", g * 2 + r as usize / HOST_RANKS)
}

/// Counts the events of a watch on `prefix` until the task is aborted: what a node-watch
/// watching it would receive.
fn count_watch(
    client: &Client,
    prefix: String,
) -> (
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (mut client, counter) = (client.clone(), seen.clone());
    let task = tokio::spawn(async move {
        let opts = rootrank_store::etcd_client::WatchOptions::new().with_prefix();
        let Ok(mut stream) = client.watch(prefix, Some(opts)).await else {
            return;
        };
        while let Ok(Some(resp)) = stream.message().await {
            counter.fetch_add(resp.events().len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
    });
    (task, seen)
}

/// One `GET /v1/events` reader: counts the certified `down` rank events it receives, until
/// the task is aborted.
async fn subscribe(addr: std::net::SocketAddr, downs: std::sync::Arc<std::sync::atomic::AtomicU64>) {
    let Some(mut lines) = crate::events::EventLines::open(addr).await else {
        return;
    };
    while let Some(got) = lines.next_lines().await {
        let certified_downs = got
            .iter()
            .filter(|l| {
                l.starts_with(b"data:") && contains(l, b"\"state\":\"down\"") && contains(l, b"\"certified\":true")
            })
            .count();
        downs.fetch_add(certified_downs as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Of `groups`, those with fewer than `per_group` down certificates in etcd (the rest are
/// fully certified).
async fn certified_in(
    client: &mut Client,
    keys: &Keys,
    gids: &[GroupId],
    groups: &[usize],
    per_group: usize,
) -> anyhow::Result<Vec<usize>> {
    let mut pending = Vec::new();
    for &g in groups {
        let prefix = format!("{}/groups/{}/ranks/", keys.prefix(), gids[g]);
        let opts = rootrank_store::etcd_client::GetOptions::new()
            .with_prefix()
            .with_keys_only();
        let r = client.get(prefix.as_str(), Some(opts)).await?;
        let downs = r
            .kvs()
            .iter()
            .filter(|kv| String::from_utf8_lossy(kv.key()).contains("/down/"))
            .count();
        if downs < per_group {
            pending.push(g);
        }
    }
    Ok(pending)
}

/// The incarnation a rank on a host lease names in its live record (node-watch leaves the
/// rank's own lease id there; here a unique number: that lease, granted and left to run out,
/// costs etcd nothing at steady state and is not simulated).
fn host_lease_incarnation(g: usize, r: u32) -> anyhow::Result<rootrank_core::Incarnation> {
    Ok(rootrank_core::Incarnation::new(
        1_000_000_000_000 + (g * GROUP_SIZE) as i64 + i64::from(r),
    )?)
}

/// What the node-watch of each host does when its rank processes die (pidfd): a down
/// certificate per rank, create-if-absent on a retention lease, then the dead ranks' keys
/// deleted from the host lease (`rootrank_node::host_lease::release`). One task per host.
async fn node_watches_certify(
    clients: Vec<Client>,
    keys: Keys,
    gids: Vec<GroupId>,
    ranks: Vec<(usize, u32)>,
    ttl_ms: u64,
) -> anyhow::Result<()> {
    use rootrank_store::etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
    let retention = clients[0].clone().lease_grant(24 * 3600, None).await?.id();
    let mut by_host: std::collections::BTreeMap<String, Vec<(usize, u32)>> = Default::default();
    for &(g, r) in &ranks {
        by_host.entry(host_of(g, r)).or_default().push((g, r));
    }
    let mut tasks = Vec::new();
    for (i, (host, ranks)) in by_host.into_iter().enumerate() {
        let mut client = clients[i % clients.len()].clone();
        let (keys, gids) = (keys.clone(), gids.clone());
        tasks.push(tokio::spawn(async move {
            let mut release = Vec::new();
            for (g, r) in ranks {
                let incarnation = host_lease_incarnation(g, r)?;
                let down = rootrank_core::RankDown {
                    v: rootrank_core::records::SCHEMA_VERSION,
                    group: gids[g].clone(),
                    rank: r,
                    incarnation,
                    reason: rootrank_core::Reason::new("oom_host")?,
                    detail: "OOM killer killed the rank process (simulated node-watch)".into(),
                    source: rootrank_core::DownSource::Watchdog,
                    at: None,
                    exit: None,
                    log_tail: None,
                    host: Some(host.clone()),
                    pid: None,
                    observed_revision: None,
                    registered_revision: None,
                    lease_ttl_ms: Some(ttl_ms),
                    group_size: Some(GROUP_SIZE as u32),
                    role: None,
                };
                let key = keys.down(&gids[g], r, incarnation);
                let put = TxnOp::put(
                    key.as_str(),
                    serde_json::to_vec(&down)?,
                    Some(PutOptions::new().with_lease(retention)),
                );
                let txn = Txn::new()
                    .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                    .and_then([put]);
                txn_retried(&mut client, txn)
                    .await
                    .with_context(|| format!("certifying rank {r} of group {g}"))?;
                release.push(TxnOp::delete(keys.live(&gids[g], r), None));
                if let Some(k) = keys.host_copy(&host, &gids[g], r, rootrank_core::HostCopyOf::Live) {
                    release.push(TxnOp::delete(k, None));
                }
            }
            txn_retried(&mut client, Txn::new().and_then(release))
                .await
                .context("releasing the dead ranks' keys")?;
            Ok::<(), anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await.context("a node-watch task")??;
    }
    Ok(())
}

/// A transaction retried with backoff for up to ~10 s, as node-watch's writer retries (a
/// leader change on this loaded machine answers "leader changed" once in a while).
async fn txn_retried(client: &mut Client, txn: rootrank_store::etcd_client::Txn) -> anyhow::Result<()> {
    let mut wait = Duration::from_millis(50);
    let mut tries = 0;
    loop {
        match client.txn(txn.clone()).await {
            Ok(_) => return Ok(()),
            Err(e) if tries < 10 => {
                tries += 1;
                tracing::debug!(error = %e, "txn failed; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Ranks `0..8` of the groups `groups` (the first host of each).
fn first_hosts(groups: std::ops::Range<usize>) -> Vec<(usize, u32)> {
    groups
        .flat_map(|g| (0..HOST_RANKS as u32).map(move |r| (g, r)))
        .collect()
}

async fn one(env: &Env, cfg: &FleetCfg, n: usize) -> anyhow::Result<Value> {
    let groups = n / GROUP_SIZE;
    let tenth_groups = (n / 10).div_ceil(HOST_RANKS);
    // With host leases, a second rack whose rank processes die while their hosts (and
    // node-watches) live on: node-watch certifies each death (the 2 s goal).
    let proc_rack_hosts = if cfg.host_lease { cfg.rack_hosts } else { 0 };
    if 1 + cfg.rack_hosts + tenth_groups + proc_rack_hosts > groups {
        bail!(
            "{n} ranks are too few for a host, a rack of {} hosts and 10 % in distinct groups",
            cfg.rack_hosts
        );
    }
    let dir = env.subdir(&format!("fleet-{n}"))?;
    let members = start_cluster(&dir)?;
    let endpoints: Vec<String> = members.iter().map(|m| m.endpoint()).collect();
    let etcd_pids: Vec<u32> = members.iter().filter_map(|m| m.pid()).collect();
    let clients = state::clients(&endpoints.join(","), 8).await?;
    // The cluster's own cost (raft heartbeats), so the ranks' cost is what is added to it.
    let idle_mark = CpuMark::take(&etcd_pids);
    tokio::time::sleep(cfg.window.min(Duration::from_secs(5))).await;
    let (idle_cpu, idle_wall) = idle_mark.since(&etcd_pids);
    let etcd_idle_ms_per_s = idle_cpu.iter().sum::<f64>() * 1e3 / idle_wall;
    let keys = Keys::new(PREFIX);
    let gids: Vec<GroupId> = (0..groups)
        .map(|g| GroupId::new(&state::group_name("fleet", g)))
        .collect::<Result<_, _>>()?;
    let leases_n = if cfg.host_lease { n / HOST_RANKS } else { n };
    let ttl_s = match cfg.keepalive_budget {
        Some(b) if b > 0.0 => cfg.ttl_s.max((3.0 * leases_n as f64 / b).ceil() as i64),
        _ => cfg.ttl_s,
    };
    let interval = Duration::from_millis(ttl_s as u64 * 1000 / 3);
    let ttl_ms = ttl_s as u64 * 1000;

    // The failure sets, in distinct groups: each its own keepalives, so it can be stopped.
    let host = first_hosts(0..1);
    let rack = first_hosts(1..1 + cfg.rack_hosts);
    let tenth = first_hosts(1 + cfg.rack_hosts..1 + cfg.rack_hosts + tenth_groups);
    let proc_rack_start = 1 + cfg.rack_hosts + tenth_groups;
    let rack_processes = first_hosts(proc_rack_start..proc_rack_start + proc_rack_hosts);
    let failing: std::collections::HashSet<(usize, u32)> = host
        .iter()
        .chain(&rack)
        .chain(&rack_processes)
        .chain(&tenth)
        .copied()
        .collect();
    let rest: Vec<(usize, u32)> = (0..groups)
        .flat_map(|g| (0..GROUP_SIZE as u32).map(move |r| (g, r)))
        .filter(|x| !failing.contains(x))
        .collect();

    // node-watch's watch traffic in each scope over the whole run, from registering through
    // the failures: the copies of one host of the rack (8 ranks that register, then die),
    // and the fleet's `groups/` (every event). Opened before anything is written.
    let watched_host = host_of(1, 0);
    let (host_watch, host_events) = count_watch(&clients[3], keys.host_copies(&watched_host));
    let (fleet_watch, fleet_events) = count_watch(&clients[4], format!("{PREFIX}/groups/"));
    tokio::time::sleep(Duration::from_millis(200)).await;

    let probe_http = http_client(Duration::from_secs(5))?;
    let leader_changes_idle = leader_changes(&probe_http, &endpoints).await;
    let t = Instant::now();
    let mut steady_keepalives = Vec::new();
    let mut sets = Vec::new();
    let mut lost = 0usize;
    for (name, ranks) in [
        ("host", &host),
        ("rack", &rack),
        ("rack_processes", &rack_processes),
        ("tenth", &tenth),
        ("rest", &rest),
    ] {
        if ranks.is_empty() {
            continue;
        }
        // Granted in chunks, each kept alive at once, so early leases never lapse meanwhile.
        let mut chunk_keepalives = Vec::new();
        for chunk in ranks.chunks(2_000) {
            if t.elapsed() > REGISTER_LIMIT {
                bail!(
                    "etcd could not register {n} ranks within {REGISTER_LIMIT:?} ({} leader changes meanwhile): this is where this machine stops",
                    leader_changes(&probe_http, &endpoints)
                        .await
                        .saturating_sub(leader_changes_idle)
                );
            }
            // With host leases, one per host: the chunk's ranks by host, in order (every
            // failure set and the rest are whole hosts).
            let hosts: Vec<String> = {
                let mut h: Vec<String> = chunk.iter().map(|&(g, r)| host_of(g, r)).collect();
                h.dedup();
                h
            };
            let wanted = if cfg.host_lease { hosts.len() } else { chunk.len() };
            let leases = state::grant_leases(&clients, wanted, ttl_s, 64)
                .await
                .with_context(|| format!("registering {n} ranks at a {ttl_s} s TTL: etcd could not keep up after {:.0} s; this is where this machine stops", t.elapsed().as_secs_f64()))?;
            if leases.len() < wanted {
                bail!(
                    "etcd granted {} of {} leases: overloaded at this size",
                    leases.len(),
                    wanted
                );
            }
            let lease_of = |i: usize, host: &str| -> i64 {
                if cfg.host_lease {
                    hosts.iter().position(|h| h == host).map_or(0, |p| leases[p])
                } else {
                    leases[i]
                }
            };
            chunk_keepalives.push(KeepAlives::start(
                &clients,
                &leases,
                interval,
                Duration::from_secs(3600),
            ));
            // The live key and its host copy, as an agent writes them.
            let mut puts = Vec::with_capacity(2 * chunk.len());
            for (i, &(g, r)) in chunk.iter().enumerate() {
                let host = host_of(g, r);
                let lease = &lease_of(i, &host);
                let mut value = state::live_value_on(&host, &gids[g], r, GROUP_SIZE as u32, ttl_ms)?;
                if cfg.host_lease {
                    // As node-watch leaves it: the record names the rank's own incarnation (here
                    // a unique number: the rank's own lease, granted and left to run out, costs
                    // etcd nothing at steady state and is not simulated).
                    let mut rec = rootrank_core::RankLive::parse(&value)?;
                    rec.incarnation = Some(host_lease_incarnation(g, r)?);
                    value = serde_json::to_vec(&rec)?;
                }
                if let Some(key) = keys.host_copy(&host, &gids[g], r, rootrank_core::HostCopyOf::Live) {
                    puts.push(Put {
                        key,
                        value: value.clone(),
                        lease: Some(*lease),
                    });
                }
                puts.push(Put {
                    key: keys.live(&gids[g], r),
                    value,
                    lease: Some(*lease),
                });
            }
            lost += state::write_live(&clients[0], puts)
                .await
                .with_context(|| format!("writing live keys of {n} ranks at a {ttl_s} s TTL: etcd could not keep up; this is where this machine stops"))?
                .1;
        }
        if name == "rest" {
            steady_keepalives = chunk_keepalives;
        } else {
            sets.push((name, ranks.clone(), chunk_keepalives));
        }
    }
    if lost > 0 {
        bail!("{lost} live keys could not be written: etcd overloaded at this size");
    }
    let register_s = t.elapsed().as_secs_f64();

    // A resolved room per group (rank 9's local record), for the verdict latency.
    let mut puts = Vec::new();
    let mut resolved_rooms = Vec::new();
    for (g, gid) in gids.iter().enumerate() {
        let room = state::room_id(29, g as u64);
        puts.push(Put {
            key: keys.room(gid, rootrank_core::RoomId::new(room)?, 9),
            value: state::record_value(gid, 9, room, true, rootrank_store::unix_ms())?,
            lease: None,
        });
        resolved_rooms.push((gid.as_str().to_string(), room));
    }
    state::write_all(&clients, puts, 4).await?;

    let coordinator = Coordinator::start(env, &endpoints.join(","), PREFIX, STEP).await?;
    let start_to_ready_s = coordinator.start_to_ready.as_secs_f64();
    let http = http_client(Duration::from_secs(30))?;
    all_live(&http, &coordinator.url, n).await?;

    // Steady state.
    // One counter of every keepalive task, summed.
    let count = |field: fn(&KeepAlives) -> &std::sync::atomic::AtomicU64| -> u64 {
        sets.iter()
            .flat_map(|s| s.2.iter())
            .chain(&steady_keepalives)
            .map(|k| field(k).load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    };
    let sent_before = count(|k| &k.sent);
    let leaders_before = leader_changes(&probe_http, &endpoints).await;
    let mark = CpuMark::take(&etcd_pids);
    let coord_mark = CpuMark::take(&[coordinator.pid]);
    let window_started = Instant::now();
    // Verdicts and long polls while the window runs.
    let mut verdict_samples = Vec::new();
    let mut poll_samples = Vec::new();
    let mut i = 0u64;
    while window_started.elapsed() < cfg.window {
        let (group, room) = &resolved_rooms[i as usize % resolved_rooms.len()];
        let s = Instant::now();
        let r = http
            .get(format!("{}/v1/rooms/{room}/verdict?group={group}", coordinator.url))
            .send()
            .await?;
        if r.status().as_u16() == 200 && r.bytes().await.is_ok() {
            verdict_samples.push(s.elapsed());
        }
        if i.is_multiple_of(10) {
            if let Some(d) = long_poll_probe(&http, &coordinator.url, &clients[1], &keys, &gids[0], i).await? {
                poll_samples.push(d);
            }
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let window_s = window_started.elapsed().as_secs_f64();
    let (etcd_cpu_members, _) = mark.since(&etcd_pids);
    let etcd_cpu_s: f64 = etcd_cpu_members.iter().sum();
    let (coord_cpu, _) = coord_mark.since(&[coordinator.pid]);
    let coord_cpu_s: f64 = coord_cpu.iter().sum();
    let keepalives_per_s = (count(|k| &k.sent) - sent_before) as f64 / window_s;
    let failed = count(|k| &k.failed);
    let expired = count(|k| &k.expired);
    let leader_changes_in_window = leader_changes(&probe_http, &endpoints)
        .await
        .saturating_sub(leaders_before);
    let live_at_end = totals(&http, &coordinator.url).await.map_or(0, |t| t.0);
    let (rss_steady, _) = rss_bytes(coordinator.pid)?;
    // One Prometheus scrape at this size (after the window and the RSS reading, so it is in
    // neither): `rootrank_rank_up` has a series per rank.
    let scrape_started = Instant::now();
    let metrics_text = http
        .get(format!("{}/metrics", coordinator.url))
        .send()
        .await?
        .text()
        .await?;
    let scrape = json!({
        "bytes": metrics_text.len(),
        "seconds": scrape_started.elapsed().as_secs_f64(),
        "rank_up_series": metrics_text.lines().filter(|l| l.starts_with("rootrank_rank_up{")).count(),
    });
    let etcd_cpu_ms_per_s = etcd_cpu_s * 1e3 / window_s;
    let steady = json!({
        "window_s": window_s,
        "etcd_cpu_ms_per_s": etcd_cpu_ms_per_s,
        "etcd_cpu_ms_per_s_by_member": etcd_cpu_members.iter().map(|c| c * 1e3 / window_s).collect::<Vec<_>>(),
        "etcd_idle_ms_per_s": etcd_idle_ms_per_s,
        // Above the idle cluster: what the ranks add, the figure that extrapolates.
        "etcd_cpu_ms_per_s_per_1000_ranks": (etcd_cpu_ms_per_s - etcd_idle_ms_per_s).max(0.0) * 1000.0 / n as f64,
        "keepalives_per_s": keepalives_per_s,
        "etcd_cpu_us_per_keepalive": if keepalives_per_s > 0.0 { (etcd_cpu_ms_per_s - etcd_idle_ms_per_s).max(0.0) * 1e3 / keepalives_per_s } else { 0.0 },
        "coordinator_cpu_ms_per_s": coord_cpu_s * 1e3 / window_s,
        "keepalive_failures": failed,
        "leases_expired": expired,
        "live_at_end": live_at_end,
        "leader_changes_in_window": leader_changes_in_window,
        "leader_changes_while_registering": leaders_before.saturating_sub(leader_changes_idle),
        "verdict": Dist::from_durations(&verdict_samples),
        "long_poll_wake": Dist::from_durations(&poll_samples),
        "metrics_scrape": scrape,
    });

    // Event readers through the failures, connected before the first.
    let events_addr: std::net::SocketAddr = coordinator
        .url
        .trim_start_matches("http://")
        .parse()
        .context("the coordinator's address")?;
    let subscribers: Vec<_> = (0..cfg.subscribers)
        .map(|_| {
            let downs = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            (tokio::spawn(subscribe(events_addr, downs.clone())), downs)
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let fewest_downs = || {
        subscribers
            .iter()
            .map(|(_, d)| d.load(std::sync::atomic::Ordering::Relaxed))
            .min()
            .unwrap_or(u64::MAX)
    };

    // The failures, one after the other; `down` and certificates count up across them.
    let mut failures = serde_json::Map::new();
    // Keepalives of hosts whose rank processes died: still renewed to the end.
    let mut living_hosts = Vec::new();
    // Ranks failed so far: each must end down on the coordinator and certified in etcd.
    let mut dead = 0usize;
    for (name, ranks, keepalives) in sets {
        let dead_groups: Vec<usize> = {
            let mut g: Vec<usize> = ranks.iter().map(|x| x.0).collect();
            g.dedup();
            g
        };
        dead += ranks.len();
        let stopped = Instant::now();
        // A whole host that dies sends nothing: its keepalives stop. Rank processes that die
        // on a living host are certified by its node-watch (one task per host, as in
        // production), whose host lease keeps being renewed.
        let node_watches = if name == "rack_processes" {
            living_hosts.extend(keepalives);
            Some(tokio::spawn(node_watches_certify(
                clients.clone(),
                keys.clone(),
                gids.clone(),
                ranks.clone(),
                ttl_ms,
            )))
        } else {
            for k in keepalives {
                k.stop();
            }
            None
        };
        // The survivors of each group hit record the room in flight (ranks 8..16 propagated).
        let mut puts = Vec::new();
        let mut rooms = Vec::new();
        for &g in &dead_groups {
            let room = state::room_id(2900 + dead as u64, g as u64);
            for r in HOST_RANKS as u32..GROUP_SIZE as u32 {
                puts.push(Put {
                    key: keys.room(&gids[g], rootrank_core::RoomId::new(room)?, r),
                    value: state::record_value(&gids[g], r, room, false, rootrank_store::unix_ms())?,
                    lease: None,
                });
            }
            rooms.push((gids[g].as_str().to_string(), room));
        }
        state::write_all(&clients, puts, 4).await?;
        // Four checks, each polling on its own (one slow answer at 100,000 ranks must not
        // delay another's reading), each timed from the stop.
        let deadline = stopped + STEP;
        let timeout = || anyhow::anyhow!("{name}: not all seen in {STEP:?}; logs in {}", dir.display());
        let down = async {
            while totals(&http, &coordinator.url).await.is_none_or(|t| t.1 < dead as u64) {
                if Instant::now() > deadline {
                    return Err(timeout().context("down on the coordinator"));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(stopped.elapsed().as_secs_f64())
        };
        let certified = async {
            let mut client = clients[2].clone();
            let mut pending: Vec<usize> = dead_groups.clone();
            loop {
                // An etcd error (a leader change) is asked again at the next poll.
                if let Ok(still) =
                    certified_in(&mut client, &keys, &gids, &pending, ranks.len() / dead_groups.len()).await
                {
                    pending = still;
                }
                if pending.is_empty() {
                    return Ok(stopped.elapsed().as_secs_f64());
                }
                if Instant::now() > deadline {
                    return Err(timeout().context("certified in etcd"));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let resolved = async {
            let mut unresolved = rooms.clone();
            let mut culprit_in_dead_host = 0usize;
            loop {
                let mut still = Vec::new();
                for (group, room) in unresolved {
                    // A connection the server closed as the request went out (keep-alive
                    // race under load) is asked again, not a failed run.
                    let answer = async {
                        http.get(format!(
                            "{}/v1/rooms/{room}/verdict?group={group}&view=compact",
                            coordinator.url
                        ))
                        .send()
                        .await?
                        .json::<Value>()
                        .await
                    };
                    let v = match answer.await {
                        Ok(v) => v,
                        Err(e) => {
                            tracing::debug!(error = %e, "verdict poll failed; asking again");
                            still.push((group, room));
                            continue;
                        }
                    };
                    if v["status"] == "resolved" {
                        // A culprit outside the dead host would be a wrong answer.
                        if v["culprit"]["rank"].as_u64().is_some_and(|r| r < HOST_RANKS as u64) {
                            culprit_in_dead_host += 1;
                        }
                    } else {
                        still.push((group, room));
                    }
                }
                unresolved = still;
                if unresolved.is_empty() {
                    return Ok((stopped.elapsed().as_secs_f64(), culprit_in_dead_host));
                }
                if Instant::now() > deadline {
                    return Err(timeout().context("rooms resolved"));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        // Every reader has every certified death so far (a death is sent once certified).
        let events = async {
            while fewest_downs() < dead as u64 {
                if Instant::now() > deadline {
                    return Err(timeout().context("every subscriber's events"));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(stopped.elapsed().as_secs_f64())
        };
        let node_watches = async {
            match node_watches {
                Some(task) => task.await.context("the node-watches' task")?,
                None => Ok(()),
            }
        };
        let (down_s, certified_s, resolved, events_s, ()) =
            tokio::try_join!(down, certified, resolved, events, node_watches)?;
        let (resolved_s, culprit_in_dead_host) = resolved;
        if culprit_in_dead_host != rooms.len() {
            bail!(
                "{name}: {} of {} rooms named a culprit outside the dead host",
                rooms.len() - culprit_in_dead_host,
                rooms.len()
            );
        }
        failures.insert(
            name.to_string(),
            json!({
                "ranks": ranks.len(),
                "rooms_in_flight": rooms.len(),
                "all_down_s": down_s,
                "all_certified_s": certified_s,
                "rooms_resolved_s": resolved_s,
                "all_subscribers_have_every_death_s": events_s,
                "bound_leases_only_s": ttl_s as f64 + 2.0,
                // A key on a host lease is held 2 s (the coordinator's HOST_GONE_MS) before it
                // is certified, in case its node-watch only stopped: a host that dies whole is
                // certified TTL + etcd's lessor (<= 0.5 s) + 2 s after its last keepalive.
                "bound_host_lease_s": ttl_s as f64 + 2.5,
                "bound_node_watch_s": 2.0,
                "how": if name == "rack_processes" { "rank processes died, their hosts' node-watches live and certify each death (a put per certificate, then the rank's keys deleted from the host lease)" } else { "the ranks' leases are no longer renewed (hosts that died whole)" },
            }),
        );
    }
    let (rss_after, rss_peak) = rss_bytes(coordinator.pid)?;
    let most_downs = subscribers
        .iter()
        .map(|(_, d)| d.load(std::sync::atomic::Ordering::Relaxed))
        .max()
        .unwrap_or(0);
    let (fewest, subscribed) = (fewest_downs(), subscribers.len());
    for (task, _) in subscribers {
        task.abort();
    }
    let watch_events = json!({
        "host": watched_host,
        "host_scope": host_events.load(std::sync::atomic::Ordering::Relaxed),
        "fleet_scope": fleet_events.load(std::sync::atomic::Ordering::Relaxed),
    });
    host_watch.abort();
    fleet_watch.abort();
    // The rooms go to a coordinator started after them (a replica's failover at that size);
    // the first one is stopped so it does not share the 2 cores indexing them meanwhile.
    drop(coordinator);
    let with_rooms = if cfg.rooms > 0 {
        with_rooms(env, &endpoints, &clients, &keys, &gids, cfg.rooms).await?
    } else {
        Value::Null
    };
    for k in steady_keepalives.into_iter().chain(living_hosts) {
        k.stop();
    }
    Ok(json!({
        "ranks": n,
        "groups": groups,
        "liveness": if cfg.host_lease { "a lease per host of 8 ranks" } else { "a lease per rank" },
        "leases": leases_n,
        "ttl_s": ttl_s,
        "register_s": register_s,
        "coordinator": {
            "start_to_ready_s": start_to_ready_s,
            "rss_steady_bytes": rss_steady,
            "rss_after_bytes": rss_after,
            "rss_peak_bytes": rss_peak,
        },
        "steady": steady,
        "failures": Value::Object(failures),
        "with_rooms": with_rooms,
        "node_watch_events": watch_events,
        "events": {
            "subscribers": subscribed,
            "certified_downs_per_subscriber": {"min": fewest, "max": most_downs},
            "deaths": dead,
        },
    }))
}

/// `rooms` failed rooms (one local record each, on a retention lease) written over the fleet's
/// groups while its survivors stay alive, then a second coordinator started on it all: spawn
/// to `/readyz` and its RSS once ready (what a replica's failover costs at that size).
async fn with_rooms(
    env: &Env,
    endpoints: &[String],
    clients: &[Client],
    keys: &Keys,
    gids: &[GroupId],
    rooms: usize,
) -> anyhow::Result<Value> {
    let t = Instant::now();
    let (_, records) = state::write_rooms(clients, keys, gids, rooms, 1, 29).await?;
    let write_s = t.elapsed().as_secs_f64();
    let second = Coordinator::start(env, &endpoints.join(","), PREFIX, STEP).await?;
    let (rss, _) = rss_bytes(second.pid)?;
    let indexed = crate::scale::metric(&second.url, "rootrank_index_rooms").await;
    Ok(json!({
        "rooms": rooms,
        "records": records,
        "write_s": write_s,
        "start_to_ready_s": second.start_to_ready.as_secs_f64(),
        "rss_bytes": rss,
        "rooms_indexed": indexed,
    }))
}

/// Parks a long poll on a fresh room of `group`, then writes the room's local record: the
/// time from etcd's acknowledgement to the poll's answer.
async fn long_poll_probe(
    http: &reqwest::Client,
    url: &str,
    client: &Client,
    keys: &Keys,
    group: &GroupId,
    i: u64,
) -> anyhow::Result<Option<Duration>> {
    let room = state::room_id(2929, i);
    let poll = tokio::spawn({
        let (http, u) = (
            http.clone(),
            format!(
                "{url}/v1/rooms/{room}/verdict?group={}&wait_ms=10000&view=compact",
                group.as_str()
            ),
        );
        async move {
            let v: Value = http.get(u).send().await.ok()?.json().await.ok()?;
            Some((v["status"] == "resolved", Instant::now()))
        }
    });
    // Let the poll park first.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut c = client.clone();
    c.put(
        keys.room(group, rootrank_core::RoomId::new(room)?, 3),
        state::record_value(group, 3, room, true, rootrank_store::unix_ms())?,
        None,
    )
    .await?;
    let acked = Instant::now();
    Ok(match poll.await {
        Ok(Some((true, answered))) => Some(answered.saturating_duration_since(acked)),
        _ => None,
    })
}
