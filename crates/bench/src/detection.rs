//! Part 3: detection. Time from a rank's SIGKILL to a resolved verdict, for a room the survivor
//! reported `propagated`: a long-poll verdict is open when the rank is killed, and returns when
//! the lease expiry reaches the coordinator. Kills run in parallel batches (one group of two
//! ranks per kill) so 50 kills at a 5 s TTL take a few TTLs, not 50.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::procs::{self, Coordinator, Env, RankProc};
use crate::util::Dist;

#[derive(Clone, Debug)]
pub struct DetectionCfg {
    /// (lease TTL in seconds, kills).
    pub variants: Vec<(u64, usize)>,
    /// Variants to list as skipped (smoke mode), so every variant is in the results.
    pub skipped: Vec<u64>,
    pub batch: usize,
    /// Also try the node watchdog variant when `rootrank node-watch` exists.
    pub watchdog: bool,
}

impl DetectionCfg {
    pub fn full() -> Self {
        DetectionCfg {
            variants: vec![(5, 50), (1, 50)],
            skipped: vec![],
            batch: 25,
            watchdog: true,
        }
    }
    pub fn smoke() -> Self {
        DetectionCfg {
            variants: vec![(1, 3)],
            skipped: vec![5],
            batch: 3,
            watchdog: false,
        }
    }
}

const PREFIX: &str = crate::verdicts::PREFIX;

pub async fn run(env: &Env, cfg: &DetectionCfg) -> anyhow::Result<Value> {
    let dir = env.subdir("detection")?;
    let etcd = procs::start_etcd(&dir, &[])?;
    let endpoint = etcd.endpoint();
    let coord = Coordinator::start(env, &endpoint, PREFIX, Duration::from_secs(30)).await?;
    let mut variants = Vec::new();
    for &(ttl, kills) in &cfg.variants {
        let v = variant(env, &endpoint, &coord, ttl, kills, cfg.batch, &format!("lease{ttl}")).await?;
        variants
            .push(json!({"name": format!("lease_only_ttl_{ttl}s"), "ttl_s": ttl, "with_watchdog": false, "result": v}));
    }
    for &ttl in &cfg.skipped {
        variants.push(json!({"name": format!("lease_only_ttl_{ttl}s"), "ttl_s": ttl, "with_watchdog": false, "skipped": "smoke mode"}));
    }
    let watchdog = if !cfg.watchdog {
        json!({"available": false, "reason": "not requested (smoke mode)"})
    } else {
        match node_watch_bin(env) {
            Err(why) => json!({"available": false, "reason": why}),
            Ok(bin) => {
                // The watchdog writes down certificates on its own; the same kills then measure
                // kill -> resolved with it running next to the lease.
                let log = std::fs::File::create(dir.join("node-watch.log"))?;
                let mut child = std::process::Command::new(&bin)
                    .args(["node-watch", "--etcd-endpoints", &endpoint])
                    .stdin(std::process::Stdio::null())
                    .stdout(log.try_clone()?)
                    .stderr(log)
                    .spawn()?;
                tokio::time::sleep(Duration::from_secs(1)).await;
                let kills = cfg.variants.first().map_or(50, |v| v.1);
                let r = variant(env, &endpoint, &coord, 5, kills, cfg.batch, "watchdog5").await;
                let _ = child.kill();
                let _ = child.wait();
                match r {
                    Ok(v) => json!({"available": true, "binary": bin.display().to_string(), "ttl_s": 5, "result": v}),
                    Err(e) => {
                        json!({"available": true, "binary": bin.display().to_string(), "error": format!("{e:#}")})
                    }
                }
            }
        }
    };
    Ok(json!({
        "setup": {
            "how": "per kill: a group of 2 rank processes (rootrank-bench rank: an embedded Agent), the survivor reports the room `propagated` (flushed to etcd), a long-poll verdict (wait_ms=30000, group=) is opened, then the other rank is SIGKILLed; figure = SIGKILL to the long poll answering resolved",
            "batch": cfg.batch,
        },
        "variants": variants,
        "watchdog": watchdog,
    }))
}

/// `rootrank node-watch`, if the workspace's `rootrank` binary has it.
pub(crate) fn node_watch_bin(env: &Env) -> Result<PathBuf, String> {
    let bin = std::env::var_os("ROOTRANK_BIN")
        .map(PathBuf::from)
        .or_else(|| env.exe.parent().map(|d| d.join("rootrank")))
        .ok_or("no rootrank binary path")?;
    if !bin.is_file() {
        return Err(format!(
            "{} not built (make bench and make test build it: cargo build --bin rootrank)",
            bin.display()
        ));
    }
    let ok = std::process::Command::new(&bin)
        .args(["node-watch", "--help"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if ok {
        Ok(bin)
    } else {
        Err(format!(
            "not available: {} has no node-watch subcommand yet",
            bin.display()
        ))
    }
}

async fn variant(
    env: &Env,
    endpoint: &str,
    coord: &Coordinator,
    ttl_s: u64,
    kills: usize,
    batch: usize,
    tag: &str,
) -> anyhow::Result<Value> {
    let http = crate::util::http_client(Duration::from_secs(40))?;
    let mut samples = Vec::new();
    let mut sources = std::collections::BTreeMap::<String, u64>::new();
    let mut failures = Vec::new();
    let started = Instant::now();
    let mut done = 0;
    let mut batch_no = 0;
    while done < kills {
        let b = batch.max(1).min(kills - done);
        let mut pairs = Vec::with_capacity(b);
        for i in 0..b {
            let group = format!("det-{tag}-{batch_no}-{i}");
            let victim = RankProc::spawn(env, endpoint, &group, 0, 2, ttl_s * 1000)?;
            let survivor = RankProc::spawn(env, endpoint, &group, 1, 2, ttl_s * 1000)?;
            pairs.push((group, victim, survivor));
        }
        let pairs = tokio::task::spawn_blocking(move || {
            for (_, v, s) in pairs.iter_mut() {
                v.wait_registered()?;
                s.wait_registered()?;
            }
            Ok::<_, anyhow::Error>(pairs)
        })
        .await??;
        // The coordinator must have seen both live keys, or a vanished key would mean nothing.
        for (group, _, _) in &pairs {
            wait_live(&http, &coord.url, group, 2).await?;
        }
        let mut tasks = Vec::new();
        for (i, (group, mut victim, mut survivor)) in pairs.into_iter().enumerate() {
            let http = http.clone();
            let url = coord.url.clone();
            let room = crate::state::room_id(7_000 + ttl_s, (batch_no * 1_000 + i) as u64);
            tasks.push(tokio::spawn(async move {
                // Staggered so the batch's kills do not all land in one lease-expiry sweep.
                tokio::time::sleep(Duration::from_millis(40 * i as u64)).await;
                let survivor = tokio::task::spawn_blocking(move || {
                    survivor.fail(room, "propagated", "other")?;
                    Ok::<_, anyhow::Error>(survivor)
                })
                .await??;
                let poll = tokio::spawn({
                    let http = http.clone();
                    let url = format!("{url}/v1/rooms/{room}/verdict?group={group}&wait_ms=30000");
                    async move {
                        let v: Value = http.get(url).send().await?.json().await?;
                        Ok::<_, anyhow::Error>((v, Instant::now()))
                    }
                });
                tokio::time::sleep(Duration::from_millis(30)).await;
                let killed = Instant::now();
                victim.kill9();
                let (v, at) = poll.await??;
                drop(survivor);
                let resolved = v["status"] == "resolved" && v["culprit"]["rank"] == 0;
                Ok::<_, anyhow::Error>((
                    resolved,
                    at - killed,
                    v["culprit"]["source"].as_str().unwrap_or("").to_string(),
                    v,
                ))
            }));
        }
        for t in tasks {
            match t.await? {
                Ok((true, d, source, _)) => {
                    samples.push(d);
                    *sources.entry(source).or_default() += 1;
                }
                Ok((false, d, _, v)) => failures.push(format!("not resolved after {d:?}: {}", v["explain"])),
                Err(e) => failures.push(format!("{e:#}")),
            }
        }
        done += b;
        batch_no += 1;
    }
    let dist = Dist::from_durations(&samples);
    Ok(json!({
        "kills": kills,
        "resolved": samples.len(),
        "failures": failures,
        "kill_to_resolved_ms": {
            "p50": dist.p50_us / 1e3, "p90": dist.p90_us / 1e3, "p99": dist.p99_us / 1e3,
            "max": dist.max_us / 1e3, "mean": dist.mean_us / 1e3,
        },
        "latency": dist,
        "culprit_sources": sources,
        "wall_s": started.elapsed().as_secs_f64(),
    }))
}

async fn wait_live(http: &reqwest::Client, url: &str, group: &str, n: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(r) = http.get(format!("{url}/v1/groups/{group}")).send().await {
            if let Ok(v) = r.json::<Value>().await {
                let live = v["ranks"]
                    .as_array()
                    .map_or(0, |a| a.iter().filter(|r| r["state"] == "live").count());
                if live >= n {
                    return Ok(());
                }
            }
        }
        if Instant::now() > deadline {
            anyhow::bail!("group {group}: {n} live ranks not seen by the coordinator in 15 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
