//! `rootrank simulate` as a real process tree (real NIXL, real etcd), and reads of what its
//! ranks wrote.

use std::path::Path;

use anyhow::{bail, Context};
use serde_json::Value;

use crate::{nixl_dir, repo_root, rootrank_bin};

/// What one `rootrank simulate --json` run printed.
pub struct Run {
    pub rooms: Vec<Value>,
    pub report: Value,
    pub stderr: String,
}

impl Run {
    /// The line of room `idx`; an error naming the run's stderr when there is none.
    pub fn room(&self, idx: u64) -> anyhow::Result<&Value> {
        self.rooms
            .iter()
            .find(|r| r["idx"] == idx)
            .ok_or_else(|| anyhow::anyhow!("no room {idx} in the output; stderr:\n{}", self.stderr))
    }

    /// The room id (a decimal string) of room `idx`.
    pub fn room_id(&self, idx: u64) -> anyhow::Result<String> {
        let room = self.room(idx)?;
        room["room"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow::anyhow!("room {idx} has no decimal room id: {room}"))
    }
}

/// Runs `rootrank simulate --json` with `args` against `etcd`, in the repo root, with the
/// tests' NIXL ([`nixl_dir`]), and parses its output. An error on a non-zero exit.
pub async fn simulate(etcd: &str, log_dir: &Path, args: &[&str]) -> anyhow::Result<Run> {
    let out = tokio::process::Command::new(rootrank_bin())
        .arg("simulate")
        .args(["--json", "--etcd-endpoints", etcd, "--log-dir"])
        .arg(log_dir)
        .args(args)
        .current_dir(repo_root())
        .env(crate::nixl::NIXL_DIR_ENV, nixl_dir()?)
        .env("ROOTRANK_LOG", "info")
        .kill_on_drop(true)
        .output()
        .await
        .context("running rootrank simulate")?;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    if !out.status.success() {
        bail!(
            "simulate failed: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        );
    }
    let mut rooms = stdout
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("not JSON: {l}")))
        .collect::<anyhow::Result<Vec<Value>>>()?;
    let Some(report) = rooms.pop() else {
        bail!("simulate printed no final report line; stderr:\n{stderr}");
    };
    Ok(Run { rooms, report, stderr })
}

/// The RoomFailure `rank` of `group` wrote for `room`, read straight from etcd.
pub async fn room_record(etcd: &str, group: &str, room: &str, rank: u32) -> anyhow::Result<Option<Value>> {
    let mut c = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![etcd.to_string()])).await?;
    let key = format!("/rootrank/v1/groups/{group}/rooms/{room}/ranks/{rank}");
    let resp = c.get(key, None).await?;
    resp.kvs()
        .first()
        .map(|kv| serde_json::from_slice(kv.value()).context("room record is not JSON"))
        .transpose()
}

/// The pids in the live records of `group` (ranks register with their pids).
pub async fn live_pids(etcd: &str, group: &str) -> anyhow::Result<Vec<u32>> {
    let mut c = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![etcd.to_string()])).await?;
    let prefix = format!("/rootrank/v1/groups/{group}/ranks/");
    let resp = c
        .get(
            prefix,
            Some(rootrank_store::etcd_client::GetOptions::new().with_prefix()),
        )
        .await?;
    Ok(resp
        .kvs()
        .iter()
        // Live keys, not their host copies (`groups/_hosts/HOST/GROUP/RANK/live`).
        .filter(|kv| {
            kv.key_str()
                .is_ok_and(|k| k.ends_with("/live") && k.contains("/ranks/"))
        })
        .filter_map(|kv| serde_json::from_slice::<Value>(kv.value()).ok())
        .filter_map(|v| v["pid"].as_u64().and_then(|p| u32::try_from(p).ok()))
        .collect())
}
