//! Part 13: a mass death (issue 28). N live keys on one lease (a fleet's ranks on a switch
//! that failed, or an etcd leader's lease loss) revoked under read load: three loops of
//! `get --prefix --keys-only` on etcd, as operators' scripts give it. Measured at each size:
//! the time until every rank is `down` on a coordinator (`/v1/groups`), until every death is
//! certified in etcd (so a restart loses none), until `rootrank node-watch` has applied every
//! delete (its log's `live_gone_total`), what `/readyz` answered meanwhile, and the
//! coordinator's RSS before, after and at its peak.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rootrank_core::{GroupId, Keys};
use rootrank_store::etcd_client::{Client, GetOptions};
use serde_json::{json, Value};

use crate::procs::{self, Coordinator, Env};
use crate::state::{self, Put};
use crate::util::{http_client, rss_bytes};

#[derive(Clone, Debug)]
pub struct MassDeathCfg {
    /// Live keys on the one lease, one size after the other (a fresh etcd for each).
    pub sizes: Vec<usize>,
    /// Loops reading the whole prefix's keys while the lease is revoked.
    pub readers: usize,
}

impl MassDeathCfg {
    pub fn full() -> Self {
        MassDeathCfg {
            sizes: vec![1_000, 10_000, 100_000],
            readers: 3,
        }
    }
    pub fn smoke() -> Self {
        MassDeathCfg {
            sizes: vec![200],
            readers: 1,
        }
    }
}

pub(crate) const PREFIX: &str = "/rootrank/v1";
const GROUP_SIZE: u32 = 8;
/// Longest any step may take before the size is recorded as failed.
const STEP: Duration = Duration::from_secs(600);

pub async fn run(env: &Env, cfg: &MassDeathCfg) -> anyhow::Result<Value> {
    let node_watch = crate::detection::node_watch_bin(env).ok();
    let mut sizes = Vec::new();
    for &n in &cfg.sizes {
        eprintln!("rootrank-bench: mass-death: {n} keys ...");
        let v = match one(env, n, cfg.readers, node_watch.as_deref()).await {
            Ok(v) => v,
            Err(e) => json!({"keys": n, "error": format!("{e:#}")}),
        };
        sizes.push(v);
    }
    Ok(json!({
        "setup": {
            "readers": cfg.readers,
            "how": "per size: a fresh etcd, one coordinator (release build) and one rootrank node-watch; N live keys (groups of 8, on other hosts) on one lease; while READERS loops run `get --prefix --keys-only` on etcd, the lease is revoked (one revision, N deletes). Times are from the revoke's answer: until /v1/groups counts every rank down at a revision at or past the deletes, until etcd holds N down certificates, and until node-watch's log says it applied N live-key deletes",
        },
        "sizes": sizes,
    }))
}

async fn one(env: &Env, n: usize, readers: usize, node_watch: Option<&std::path::Path>) -> anyhow::Result<Value> {
    let dir = env.subdir(&format!("mass-death-{n}"))?;
    let etcd = procs::start_large_etcd(&dir)?;
    let endpoint = etcd.endpoint();
    let clients = state::clients(&endpoint, 2).await?;
    let mut client = clients[0].clone();
    let lease = client.lease_grant(600, None).await?.id();
    let keys = Keys::new(PREFIX);
    let mut puts = Vec::with_capacity(n);
    for i in 0..n {
        let group = GroupId::new(&state::group_name("mass", i / GROUP_SIZE as usize))?;
        let rank = (i % GROUP_SIZE as usize) as u32;
        puts.push(Put {
            key: keys.live(&group, rank),
            value: state::live_value(&group, rank, GROUP_SIZE, 5_000)?,
            lease: Some(lease),
        });
    }
    state::write_all(&clients, puts, 2).await?;
    let coordinator = Coordinator::start(env, &endpoint, PREFIX, STEP).await?;
    let http = http_client(Duration::from_secs(10))?;
    all_live(&http, &coordinator.url, n).await?;
    let node = match node_watch {
        Some(bin) => Some(NodeWatch::start(bin, &dir, &endpoint).await?),
        None => None,
    };
    let rss_before = rss_bytes(coordinator.pid)?.0;

    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..readers {
        let (mut c, stop) = (clients[1].clone(), stop.clone());
        load.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = c
                    .get(PREFIX, Some(GetOptions::new().with_prefix().with_keys_only()))
                    .await;
            }
        }));
    }
    // `/readyz` sampled every 50 ms from just before the revoke until every rank is down.
    let sampling = Arc::new(AtomicBool::new(true));
    let readyz = tokio::spawn(sample_readyz(http.clone(), coordinator.url.clone(), sampling.clone()));
    let revoked_at = Instant::now();
    let revoked = client.lease_revoke(lease).await?;
    let revoke_s = revoked_at.elapsed().as_secs_f64();
    let deletes_revision = revoked.header().map_or(0, |h| h.revision());

    let mut node_done: Option<f64> = None;
    let mut coordinator_done: Option<f64> = None;
    let deadline = revoked_at + STEP;
    while coordinator_done.is_none() || (node.is_some() && node_done.is_none()) {
        if Instant::now() > deadline {
            bail!(
                "{n} keys: not every death seen in {STEP:?} (coordinator {coordinator_done:?}, node-watch {node_done:?}); logs in {}",
                dir.display()
            );
        }
        if coordinator_done.is_none()
            && totals(&http, &coordinator.url)
                .await
                .is_some_and(|t| t.0 == 0 && t.1 == n as u64 && t.2 >= deletes_revision)
        {
            coordinator_done = Some(revoked_at.elapsed().as_secs_f64());
            sampling.store(false, Ordering::Relaxed);
        }
        if let (Some(w), None) = (&node, node_done) {
            if w.live_gone_total() >= n as u64 {
                node_done = Some(revoked_at.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sampling.store(false, Ordering::Relaxed);
    let (ready_200, ready_other) = readyz.await.unwrap_or((0, 0));
    let mut certified_s = None;
    while Instant::now() < deadline {
        if certified(&mut client).await? >= n {
            certified_s = Some(revoked_at.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for l in load {
        let _ = l.await;
    }
    let (rss_after, rss_peak) = rss_bytes(coordinator.pid)?;
    let v = json!({
        "keys": n,
        "revoke_s": revoke_s,
        "all_down_coordinator_s": coordinator_done,
        "all_certified_s": certified_s,
        "all_down_node_watch_s": node_done,
        "node_watch": if node.is_some() { "measured" } else { "not available (rootrank binary not built)" },
        "readyz_during": {"ok_200": ready_200, "other": ready_other},
        "coordinator_rss_before_bytes": rss_before,
        "coordinator_rss_after_bytes": rss_after,
        "coordinator_rss_peak_bytes": rss_peak,
    });
    eprintln!("rootrank-bench: mass-death: {v}");
    Ok(v)
}

/// Waits until the coordinator counts `n` live ranks.
pub(crate) async fn all_live(http: &reqwest::Client, url: &str, n: usize) -> anyhow::Result<()> {
    wait_for(STEP, "every rank live on the coordinator", || async {
        totals(http, url).await.filter(|t| t.0 == n as u64).map(|_| ())
    })
    .await
}

/// (live, down, revision) over every group of `/v1/groups`.
pub(crate) async fn totals(http: &reqwest::Client, url: &str) -> Option<(u64, u64, i64)> {
    let r = http.get(format!("{url}/v1/groups")).send().await.ok()?;
    if r.status().as_u16() != 200 {
        return None;
    }
    let v: Value = r.json().await.ok()?;
    let groups = v["groups"].as_array()?;
    let sum = |field: &str| groups.iter().map(|g| g[field].as_u64().unwrap_or(0)).sum::<u64>();
    Some((sum("live"), sum("down"), v["revision"].as_i64().unwrap_or(0)))
}

async fn sample_readyz(http: reqwest::Client, url: String, on: Arc<AtomicBool>) -> (u64, u64) {
    let (mut ok, mut other) = (0, 0);
    while on.load(Ordering::Relaxed) {
        match http.get(format!("{url}/readyz")).send().await {
            Ok(r) if r.status().as_u16() == 200 => ok += 1,
            _ => other += 1,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (ok, other)
}

/// Down certificates in etcd, read in pages (100,000 keys are over gRPC's 4 MiB answer).
pub(crate) async fn certified(client: &mut Client) -> anyhow::Result<usize> {
    let (mut from, end) = (format!("{PREFIX}/groups/"), format!("{PREFIX}/groups0"));
    let mut count = 0;
    loop {
        let opts = GetOptions::new()
            .with_range(end.as_str())
            .with_keys_only()
            .with_limit(20_000);
        let r = client.get(from.as_str(), Some(opts)).await?;
        count += r
            .kvs()
            .iter()
            .filter(|kv| String::from_utf8_lossy(kv.key()).contains("/down/"))
            .count();
        match r.kvs().last() {
            Some(kv) if r.more() => from = format!("{}\0", String::from_utf8_lossy(kv.key())),
            _ => return Ok(count),
        }
    }
}

pub(crate) async fn wait_for<T, F, Fut>(within: Duration, what: &str, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("{what}: not within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `rootrank node-watch` on the bench's etcd, its log read for what it applied.
struct NodeWatch {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl NodeWatch {
    async fn start(bin: &std::path::Path, dir: &std::path::Path, endpoint: &str) -> anyhow::Result<NodeWatch> {
        let log = dir.join("node-watch.log");
        let f = std::fs::File::create(&log)?;
        let child = std::process::Command::new(bin)
            .args([
                "--json-logs",
                "node-watch",
                "--etcd-endpoints",
                endpoint,
                "--prefix",
                PREFIX,
                // The dead keys are other hosts': only the whole-fleet watch receives them
                // (the host scope, the default, would receive none of them).
                "--watch-scope",
                "fleet",
            ])
            // Every applied batch, at debug (the large ones are at info anyway).
            .env("ROOTRANK_LOG", "info,rootrank_node::sync=debug")
            .stdin(std::process::Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))?;
        let w = NodeWatch { child, log };
        wait_for(STEP, "node-watch loaded", || async {
            std::fs::read_to_string(&w.log)
                .ok()
                .filter(|t| t.contains("node watchdog loaded the ranks from etcd"))
                .map(|_| ())
        })
        .await?;
        Ok(w)
    }

    /// The last `live_gone_total` its log says (0 before any delete).
    fn live_gone_total(&self) -> u64 {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .rev()
            .find_map(|l| {
                let rest = l.split("\"live_gone_total\":").nth(1)?;
                rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
            })
            .unwrap_or(0)
    }
}

impl Drop for NodeWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
