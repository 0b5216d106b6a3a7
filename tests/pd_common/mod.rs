//! Shared by the `pd_*` tests: real NIXL (fetched when missing, never skipped), real etcd, a
//! real coordinator, and `rootrank simulate` as a real process tree.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_rootrank");

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Makes sure `<repo>/.cache/nixl` holds NIXL, running `scripts/fetch-nixl.sh` when it does
/// not; fails the test when that does not work.
pub fn ensure_nixl() {
    static FETCH: Once = Once::new();
    FETCH.call_once(|| {
        let root = repo_root();
        let capi = root.join(".cache/nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so");
        if capi.is_file() {
            return;
        }
        let status = Command::new("bash")
            .arg(root.join("scripts/fetch-nixl.sh"))
            .status()
            .expect("run scripts/fetch-nixl.sh");
        assert!(status.success(), "scripts/fetch-nixl.sh failed: {status}");
        assert!(capi.is_file(), "fetch-nixl.sh did not produce {}", capi.display());
    });
}

/// What one `rootrank simulate --json` run printed.
pub struct Run {
    pub rooms: Vec<Value>,
    pub report: Value,
    pub stderr: String,
}

impl Run {
    pub fn room(&self, idx: u64) -> &Value {
        self.rooms
            .iter()
            .find(|r| r["idx"] == idx)
            .unwrap_or_else(|| panic!("no room {idx} in the output; stderr:\n{}", self.stderr))
    }
    pub fn room_id(&self, idx: u64) -> String {
        self.room(idx)["room"]
            .as_str()
            .expect("room is a decimal string")
            .to_string()
    }
}

/// Runs `rootrank simulate --json` with `args` against `etcd`, in the repo root, and parses
/// its output. Fails the test on a non-zero exit.
pub async fn simulate(etcd: &str, log_dir: &Path, args: &[&str]) -> Run {
    ensure_nixl();
    let out = tokio::process::Command::new(BIN)
        .arg("simulate")
        .args(["--json", "--etcd-endpoints", etcd, "--log-dir"])
        .arg(log_dir)
        .args(args)
        .current_dir(repo_root())
        .env_remove("ROOTRANK_NIXL_DIR")
        .env("ROOTRANK_LOG", "info")
        .kill_on_drop(true)
        .output()
        .await
        .expect("run rootrank simulate");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "simulate failed: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let mut values: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let report = values.pop().expect("a final report line");
    Run {
        rooms: values,
        report,
        stderr,
    }
}

/// The RoomFailure `rank` of `group` wrote for `room`, read straight from etcd.
pub async fn room_record(etcd: &str, group: &str, room: &str, rank: u32) -> Option<Value> {
    let mut c = rootrank_store::connect(&[etcd.to_string()]).await.expect("etcd client");
    let key = format!("/rootrank/v1/groups/{group}/rooms/{room}/ranks/{rank}");
    let resp = c.get(key, None).await.expect("etcd get");
    resp.kvs()
        .first()
        .map(|kv| serde_json::from_slice(kv.value()).expect("record is JSON"))
}

/// Every process whose command line mentions `needle`, except ourselves.
pub fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut out = Vec::new();
    let me = std::process::id().to_string();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !name.chars().all(|c| c.is_ascii_digit()) || name == me {
                continue;
            }
            if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                if cmd.contains(needle) {
                    out.push(format!("{name}: {cmd}"));
                }
            }
        }
    }
    out
}

/// Whether `pid` is a live process (a zombie or a vanished pid is not).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// The pids in the live records of `group` (ranks register with their pids).
pub async fn live_pids(etcd: &str, group: &str) -> Vec<u32> {
    let mut c = rootrank_store::connect(&[etcd.to_string()]).await.expect("etcd client");
    let prefix = format!("/rootrank/v1/groups/{group}/ranks/");
    let resp = c
        .get(
            prefix,
            Some(rootrank_store::etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("etcd get");
    resp.kvs()
        .iter()
        .filter(|kv| kv.key_str().is_ok_and(|k| k.ends_with("/live")))
        .filter_map(|kv| serde_json::from_slice::<Value>(kv.value()).ok())
        .filter_map(|v| v["pid"].as_u64().and_then(|p| u32::try_from(p).ok()))
        .collect()
}
