//! Load generators: wrk (from Debian) for HTTP, and a bounded Rust loop for the etcd-direct
//! path (the range reads a scheduler without rootrank would make).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rootrank_core::{Origin, RoomFailure};
use rootrank_store::etcd_client::{Client, GetOptions};
use serde::{Deserialize, Serialize};

use crate::util::{Dist, QUANTILES};

/// One load run against one target at one concurrency.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Run {
    pub target: String,
    pub conns: usize,
    pub tool: String,
    pub duration_s: f64,
    pub requests: u64,
    pub errors: u64,
    pub rps: f64,
    pub latency: Dist,
}

/// The wrk script: the same Lua request function for every target (so the client's own cost is
/// the same on both sides of a ratio), and a `done` hook printing the figures as one JSON line.
fn wrk_script(paths: &[String]) -> String {
    let list: Vec<String> = paths.iter().map(|p| format!("{p:?}")).collect();
    let qs: Vec<String> = QUANTILES.iter().map(|q| format!("{q}")).collect();
    format!(
        r#"local paths = {{ {paths} }}
local reqs = {{}}
local n = 0
local i = 0
init = function(args)
  for k, p in ipairs(paths) do reqs[k] = wrk.format("GET", p) end
  n = #reqs
  i = math.random(n)
end
request = function()
  i = i + 7919
  return reqs[(i % n) + 1]
end
done = function(summary, latency, requests)
  local qs = {{ {qs} }}
  local parts = {{}}
  for _, q in ipairs(qs) do
    local v
    if q <= 0 then v = latency.min elseif q >= 100 then v = latency.max else v = latency:percentile(q) end
    parts[#parts + 1] = string.format("[%s,%d]", tostring(q), v)
  end
  local e = summary.errors
  io.write(string.format('RRBENCH {{"requests":%d,"duration_us":%d,"errors":%d,"mean_us":%f,"cdf":[%s]}}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency.mean, table.concat(parts, ",")))
end
"#,
        paths = list.join(", "),
        qs = qs.join(", ")
    )
}

#[derive(Deserialize)]
struct WrkOut {
    requests: u64,
    duration_us: u64,
    errors: u64,
    mean_us: f64,
    cdf: Vec<(f64, f64)>,
}

/// Runs wrk against `base` + one of `paths` per request, for `duration`, with `conns`
/// connections (bounded by wrk's own duration; the process is killed if it overruns).
pub fn wrk(
    work: &Path,
    target: &str,
    base: &str,
    paths: &[String],
    conns: usize,
    duration: Duration,
) -> anyhow::Result<Run> {
    wrk_with(work, target, base, paths, conns, duration, &[])
}

/// [`wrk`] with request headers (`Name: value`), to `http://` or `https://` loopback.
pub fn wrk_with(
    work: &Path,
    target: &str,
    base: &str,
    paths: &[String],
    conns: usize,
    duration: Duration,
    headers: &[String],
) -> anyhow::Result<Run> {
    if !base.starts_with("http://127.0.0.1:") && !base.starts_with("https://127.0.0.1:") {
        bail!("load may only target loopback, not {base}");
    }
    let script = work.join(format!("wrk-{target}-{conns}.lua"));
    std::fs::write(&script, wrk_script(paths))?;
    let threads = conns.clamp(1, 2);
    let secs = duration.as_secs().max(1);
    let out = std::process::Command::new("wrk")
        .args(["-t", &threads.to_string(), "-c", &conns.to_string()])
        .args(["-d", &format!("{secs}s"), "--timeout", "5s"])
        .args(headers.iter().flat_map(|h| ["-H", h.as_str()]))
        .arg("-s")
        .arg(&script)
        .arg(base)
        .output()
        .context("running wrk (Debian package wrk)")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RRBENCH "))
        .with_context(|| {
            format!(
                "wrk printed no result: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    let w: WrkOut = serde_json::from_str(line).with_context(|| format!("wrk result {line:?}"))?;
    let dur = w.duration_us as f64 / 1e6;
    Ok(Run {
        target: target.to_string(),
        conns,
        tool: "wrk 4.1 (Lua request + done)".into(),
        duration_s: dur,
        requests: w.requests,
        errors: w.errors,
        rps: if dur > 0.0 { w.requests as f64 / dur } else { 0.0 },
        latency: Dist::from_cdf(w.requests, w.mean_us, w.cdf),
    })
}

/// What a scheduler without rootrank would decide from etcd: the culprit rank, if any.
pub async fn resolve_from_etcd(
    client: &mut Client,
    prefix: &str,
    group: &str,
    room: u64,
) -> anyhow::Result<Option<(u32, &'static str)>> {
    let room_prefix = format!("{prefix}/groups/{group}/rooms/{room}/");
    let ranks_prefix = format!("{prefix}/groups/{group}/ranks/");
    let records = client
        .get(room_prefix.as_str(), Some(GetOptions::new().with_prefix()))
        .await?;
    let ranks = client
        .get(ranks_prefix.as_str(), Some(GetOptions::new().with_prefix()))
        .await?;
    // Rule 1: the local record with the lowest revision.
    let mut best: Option<(i64, u32)> = None;
    for kv in records.kvs() {
        let Ok(rec) = RoomFailure::parse(kv.value()) else {
            continue;
        };
        if rec.origin == Origin::Local && best.is_none_or(|(r, _)| kv.mod_revision() < r) {
            best = Some((kv.mod_revision(), rec.rank));
        }
    }
    if let Some((_, rank)) = best {
        return Ok(Some((rank, "room_record")));
    }
    // Rule 2, simplified: the earliest down certificate of the group.
    let mut down: Option<(i64, u32)> = None;
    for kv in ranks.kvs() {
        let key = String::from_utf8_lossy(kv.key());
        if !key.contains("/down/") {
            continue;
        }
        let Ok(rec) = rootrank_core::RankDown::parse(kv.value()) else {
            continue;
        };
        if down.is_none_or(|(r, _)| kv.mod_revision() < r) {
            down = Some((kv.mod_revision(), rec.rank));
        }
    }
    Ok(down.map(|(_, rank)| (rank, "down")))
}

/// Drives [`resolve_from_etcd`] with `conns` concurrent loops (one etcd connection each) for
/// `duration` or `max_requests`, whichever comes first.
pub async fn etcd_direct(
    endpoint: &str,
    prefix: &str,
    rooms: Arc<Vec<(String, u64)>>,
    conns: usize,
    duration: Duration,
    max_requests: u64,
) -> anyhow::Result<Run> {
    if !endpoint.starts_with("http://127.0.0.1:") {
        bail!("load may only target loopback, not {endpoint}");
    }
    let clients = crate::state::clients(endpoint, conns).await?;
    let per_task = (max_requests / conns.max(1) as u64).max(1);
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::new();
    for (t, mut client) in clients.into_iter().enumerate() {
        let rooms = rooms.clone();
        let prefix = prefix.to_string();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            let mut i = crate::state::mix(t as u64) as usize;
            let mut done = 0u64;
            while done < per_task && Instant::now() < deadline {
                i = i.wrapping_add(7919);
                let (g, room) = &rooms[i % rooms.len()];
                let s = Instant::now();
                match resolve_from_etcd(&mut client, &prefix, g, *room).await {
                    Ok(Some(_)) => lat.push(s.elapsed().as_secs_f64() * 1e6),
                    _ => errors += 1,
                }
                done += 1;
            }
            (lat, errors)
        }));
    }
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await?;
        lat.extend(l);
        errors += e;
    }
    let dur = start.elapsed().as_secs_f64();
    let requests = lat.len() as u64 + errors;
    Ok(Run {
        target: "etcd_direct".into(),
        conns,
        tool: "rootrank-bench loop (etcd-client: 2 range reads + JSON decode + rule 1/2)".into(),
        duration_s: dur,
        requests,
        errors,
        rps: lat.len() as f64 / dur,
        latency: Dist::from_us(lat),
    })
}
