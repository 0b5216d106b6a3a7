//! Part 9: start-up. How long a coordinator replica takes from spawn to `/readyz` with a
//! million records in etcd (its failover time), reading the snapshot with 1..N parallel
//! readers, next to the load the coordinator did before parallel reads (one reader paging
//! from the prefix to its end), replayed in this process with the same index code.
//! [`compare`] is also run by the scale part, where 32,000 leases are kept alive meanwhile.

use std::time::{Duration, Instant};

use rootrank_core::{Event, GroupId, Index, IndexConfig, Keys, Output};
use rootrank_store::etcd_client::{Client, GetOptions};
use serde_json::{json, Value};

use crate::procs::{self, Coordinator, Env};
use crate::state;
use crate::util::CpuMark;

#[derive(Clone, Debug)]
pub struct StartupCfg {
    pub records: usize,
    pub groups: usize,
    pub readers: Vec<usize>,
    /// Records per room (each from another rank): 8, a TP=8 group's every rank; 1, a room
    /// only its failing rank recorded (the fleet goal's 1,000,000 rooms).
    pub per_room: u32,
}

impl StartupCfg {
    pub fn full() -> Self {
        StartupCfg {
            records: 1_000_000,
            groups: 2_000,
            readers: vec![1, 2, rootrank_store::DEFAULT_READERS, 8],
            per_room: 8,
        }
    }
    pub fn smoke() -> Self {
        StartupCfg {
            records: 2_000,
            groups: 8,
            readers: vec![1, rootrank_store::DEFAULT_READERS],
            per_room: 8,
        }
    }
}

const PREFIX: &str = crate::verdicts::PREFIX;

pub async fn run(env: &Env, cfg: &StartupCfg) -> anyhow::Result<Value> {
    let dir = env.subdir("startup")?;
    let etcd = procs::start_large_etcd(&dir)?;
    let endpoint = etcd.endpoint();
    let etcd_pid = procs::etcd_pid(&etcd)?;
    let clients = state::clients(&endpoint, 8).await?;
    let keys = Keys::new(PREFIX);
    let gids: Vec<GroupId> = (0..cfg.groups.max(1))
        .map(|g| GroupId::new(&state::group_name("scale", g)))
        .collect::<Result<_, _>>()?;
    let t = Instant::now();
    let per_room = cfg.per_room.clamp(1, 8);
    let rooms = cfg.records.div_ceil(per_room as usize);
    let (_, written) = state::write_rooms(&clients, &keys, &gids, rooms, per_room, 42).await?;
    let write_s = t.elapsed().as_secs_f64();
    let mut out = compare(env, &endpoint, etcd_pid, &cfg.readers, true).await?;
    out["setup"] = json!({
        "records": written, "groups": cfg.groups, "write_s": write_s, "records_per_room": per_room, "rooms": rooms,
        "how": "room records only (records_per_room per room), no leases kept alive; the scale part repeats the comparison with 32,000 live leases renewed meanwhile",
    });
    Ok(out)
}

/// Start-up with the records already in etcd under the bench prefix: a real coordinator per
/// reader count, spawn to `/readyz`, then the load as it was (replayed in-process). With
/// `settle`, each load starts on an idle etcd: right after a million writes (or after the
/// serial load's 100 million index walks) etcd is busy for a while by itself, and a load then
/// measures that too.
pub async fn compare(
    env: &Env,
    endpoint: &str,
    etcd_pid: u32,
    readers: &[usize],
    settle: bool,
) -> anyhow::Result<Value> {
    let mut runs = Vec::new();
    for &r in readers {
        let settled_s = if settle { settle_etcd(etcd_pid).await } else { 0.0 };
        let mark = CpuMark::take(&[etcd_pid]);
        let args = vec!["--snapshot-readers".to_string(), r.to_string()];
        let coord = Coordinator::start_with(env, endpoint, PREFIX, Duration::from_secs(600), &args).await?;
        let (etcd_cpu, _) = mark.since(&[etcd_pid]);
        let rooms = crate::scale::metric(&coord.url, "rootrank_index_rooms").await;
        runs.push(json!({
            "readers": r,
            "start_to_ready_s": coord.start_to_ready.as_secs_f64(),
            "coordinator_cpu_s": crate::util::cpu_seconds(coord.pid).unwrap_or(f64::NAN),
            "etcd_cpu_s": etcd_cpu,
            "rooms": rooms,
            "etcd_settled_s": settled_s,
        }));
    }
    let settled_s = if settle { settle_etcd(etcd_pid).await } else { 0.0 };
    let me = std::process::id();
    let mark = CpuMark::take(&[etcd_pid, me]);
    let before = serial_before(endpoint).await?;
    let (cpu, wall) = mark.since(&[etcd_pid, me]);
    let before = json!({
        "how": "one reader paging 5,000 keys at a time from the prefix to its end (the coordinator's load before parallel reads), applied to the same Index in this process",
        "load_s": wall, "keys": before.0, "rooms": before.1,
        "etcd_cpu_s": cpu[0], "loader_cpu_s": cpu[1], "etcd_settled_s": settled_s,
    });
    let before_rooms = before["rooms"].as_f64();
    for run in &mut runs {
        run["same_rooms_as_before"] = json!(run["rooms"].as_f64() == before_rooms);
    }
    let best = runs
        .iter()
        .map(|r| r["start_to_ready_s"].as_f64().unwrap_or(f64::NAN))
        .fold(f64::NAN, f64::min);
    let default = runs
        .iter()
        .find(|r| r["readers"].as_u64() == Some(rootrank_store::DEFAULT_READERS as u64))
        .map(|r| r["start_to_ready_s"].clone())
        .unwrap_or(Value::Null);
    Ok(json!({
        "before": before,
        "runs": runs,
        "default_readers": rootrank_store::DEFAULT_READERS,
        "default_start_to_ready_s": default,
        "best_start_to_ready_s": best,
    }))
}

/// Waits (up to a minute) until etcd uses under 5% of a core over half a second. Returns
/// how long that took.
async fn settle_etcd(etcd_pid: u32) -> f64 {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(60) {
        let mark = CpuMark::take(&[etcd_pid]);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (cpu, wall) = mark.since(&[etcd_pid]);
        if cpu[0] / wall < 0.05 {
            break;
        }
    }
    started.elapsed().as_secs_f64()
}

/// The coordinator's snapshot load before parallel reads, kept here as the baseline: pages
/// of 5,000 from the prefix to its end, each request's range running to the prefix's end
/// (etcd 3.4 walks all of it for every page), applied to an index as they arrive.
/// Returns (keys, rooms).
async fn serial_before(endpoint: &str) -> anyhow::Result<(usize, usize)> {
    let mut client = Client::connect([endpoint], None).await?;
    let prefix = Keys::new(PREFIX).root();
    let end = rootrank_store::prefix_end(prefix.as_bytes());
    let mut start = prefix.as_bytes().to_vec();
    let mut revision = 0;
    let mut index = Index::new(IndexConfig {
        prefix: PREFIX.into(),
        ..IndexConfig::default()
    });
    let now = rootrank_store::unix_ms();
    let mut keys = 0;
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(5_000);
        if revision > 0 {
            opts = opts.with_revision(revision);
        }
        let mut resp = client.get(start.clone(), Some(opts)).await?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        let more = resp.more();
        let kvs = resp.take_kvs();
        let Some(last) = kvs.last() else { break };
        start = last.key().to_vec();
        start.push(0);
        keys += kvs.len();
        let page: Vec<Event> = kvs.into_iter().map(|kv| rootrank_store::put_event(kv, now)).collect();
        let invalid = index
            .load_snapshot_page(page)
            .into_iter()
            .filter(|o| matches!(o, Output::Invalid { .. }))
            .count();
        if invalid > 0 {
            anyhow::bail!("{invalid} invalid records in the bench's own data");
        }
        if !more {
            break;
        }
    }
    index.finish_snapshot(revision);
    Ok((keys, index.room_count()))
}
