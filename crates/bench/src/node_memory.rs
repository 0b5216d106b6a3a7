//! Part 8: `rootrank node-watch`'s memory with a million room records in etcd, next to an
//! empty etcd, in the same run. The node watchdog runs on every host; it needs the live keys
//! and certificate ids, never the room records, so its memory must not grow with them.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rootrank_core::{GroupId, Keys};
use serde_json::{json, Value};

use crate::procs::{self, Env};
use crate::state;
use crate::util::rss_bytes;

#[derive(Clone, Debug)]
pub struct NodeMemoryCfg {
    pub records: usize,
    pub groups: usize,
}

impl NodeMemoryCfg {
    pub fn full() -> Self {
        NodeMemoryCfg {
            records: 1_000_000,
            groups: 1_000,
        }
    }
    pub fn smoke() -> Self {
        NodeMemoryCfg {
            records: 1_000,
            groups: 4,
        }
    }
}

const PREFIX: &str = crate::verdicts::PREFIX;
const EMPTY_PREFIX: &str = "/rootrank-empty/v1";
const RANKS: u32 = 8;

pub async fn run(env: &Env, cfg: &NodeMemoryCfg) -> anyhow::Result<Value> {
    let bin = crate::detection::node_watch_bin(env).map_err(|e| anyhow::anyhow!(e))?;
    let dir = env.subdir("node-memory")?;
    let etcd = procs::start_large_etcd(&dir)?;
    let endpoint = etcd.endpoint();
    let clients = state::clients(&endpoint, 8).await?;

    let empty = measure(&bin, &dir, &endpoint, EMPTY_PREFIX, "fleet").await?;

    let t = Instant::now();
    let keys = Keys::new(PREFIX);
    let gids: Vec<GroupId> = (0..cfg.groups.max(1))
        .map(|g| GroupId::new(&state::group_name("node", g)))
        .collect::<Result<_, _>>()?;
    let rooms = cfg.records.div_ceil(RANKS as usize);
    let (_, written) = state::write_rooms(&clients, &keys, &gids, rooms, RANKS, 8).await?;
    let write_s = t.elapsed().as_secs_f64();
    // The whole-prefix watch reads every record (the worst case); the host scope, the
    // default, reads its host's copies only.
    let populated = measure(&bin, &dir, &endpoint, PREFIX, "fleet").await?;
    let populated_host_scope = measure(&bin, &dir, &endpoint, PREFIX, "host").await?;
    let (e, p) = (empty["rss_bytes"].as_f64(), populated["rss_bytes"].as_f64());
    Ok(json!({
        "setup": {
            "records": written, "groups": cfg.groups, "write_s": write_s,
            "how": "rootrank node-watch --watch-scope fleet started on an empty prefix, then on one holding the records (room records only: a host's watchdog needs live keys and certificate ids), then the default --watch-scope host on the same (it reads its host's copies only); RSS and peak RSS (VmHWM) read once it logs that it loaded the ranks from etcd",
        },
        "empty": empty,
        "populated": populated,
        "populated_host_scope": populated_host_scope,
        "rss_ratio": match (e, p) { (Some(e), Some(p)) if e > 0.0 => p / e, _ => f64::NAN },
    }))
}

async fn measure(
    bin: &std::path::Path,
    dir: &std::path::Path,
    endpoint: &str,
    prefix: &str,
    scope: &str,
) -> anyhow::Result<Value> {
    let log_path = dir.join(format!("node-watch{}-{scope}.log", prefix.replace('/', "_")));
    let log = std::fs::File::create(&log_path)?;
    let started = Instant::now();
    let mut child = std::process::Command::new(bin)
        .args([
            "node-watch",
            "--etcd-endpoints",
            endpoint,
            "--prefix",
            prefix,
            "--watch-scope",
            scope,
        ])
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawning {}", bin.display()))?;
    let pid = child.id();
    let loaded = loop {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        if text.contains("node watchdog loaded the ranks from etcd") {
            break started.elapsed();
        }
        if let Ok(Some(st)) = child.try_wait() {
            bail!("node-watch exited ({st}); log {}", log_path.display());
        }
        if started.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            bail!("node-watch did not load in 300 s; log {}", log_path.display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss, hwm) = rss_bytes(pid)?;
    let _ = child.kill();
    let _ = child.wait();
    Ok(
        json!({"prefix": prefix, "watch_scope": scope, "rss_bytes": rss, "hwm_bytes": hwm, "start_to_loaded_s": loaded.as_secs_f64()}),
    )
}
