//! A real memory-cgroup OOM kill seen by `rootrank node-watch`: the certificate says
//! `oom_host`, from the kernel log and the cgroup's oom_kill counter, not just "it exited".
//!
//! Needs root (to create a cgroup and read /dev/kmsg); without root the test asserts the
//! setup fails with a permission error instead, as the watchdog crate's real OOM test does.

mod node_common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use node_common::{wait_certificate, NodeWatch};
use rootrank_store::etcd_client::PutOptions;
use rootrank_testkit::Etcd;

const LIMIT: u64 = 64 * 1024 * 1024;

struct CgroupDir(PathBuf);

impl Drop for CgroupDir {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() || !self.0.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The memory controller's mount: (mount point, is cgroup v1).
fn memory_mount() -> Option<(PathBuf, bool)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut unified = None;
    for line in info.lines() {
        let (left, right) = line.split_once(" - ")?;
        let mount_point = left.split_whitespace().nth(4)?;
        let mut r = right.split_whitespace();
        let fstype = r.next()?;
        let opts = r.nth(1).unwrap_or("");
        if fstype == "cgroup" && opts.split(',').any(|o| o == "memory") {
            return Some((PathBuf::from(mount_point), true));
        }
        if fstype == "cgroup2" {
            unified = Some((PathBuf::from(mount_point), false));
        }
    }
    unified
}

fn make_cgroup() -> std::io::Result<CgroupDir> {
    let (mnt, v1) = memory_mount().ok_or_else(|| std::io::Error::other("no memory cgroup mounted"))?;
    let dir = CgroupDir(mnt.join(format!("rootrank-node-oom-{}", std::process::id())));
    std::fs::create_dir(&dir.0)?;
    if v1 {
        std::fs::write(dir.0.join("memory.limit_in_bytes"), LIMIT.to_string())?;
    } else {
        std::fs::write(dir.0.join("memory.max"), LIMIT.to_string())?;
        let _ = std::fs::write(dir.0.join("memory.swap.max"), "0");
    }
    Ok(dir)
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_killed_rank_is_certified_oom_host() -> anyhow::Result<()> {
    let cg = match make_cgroup() {
        Ok(cg) => cg,
        Err(e) => {
            // SAFETY: geteuid has no preconditions.
            let root = unsafe { libc::geteuid() == 0 };
            assert!(!root, "root must be able to create a memory cgroup: {e}");
            assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
            return Ok(());
        }
    };
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let watch = NodeWatch::start(&ep)?;

    // The victim waits for a go, so it is in the cgroup and watched before it eats memory.
    let mut victim = Command::new("sh")
        .args(["-c", "read go; exec tail -n 1 /dev/zero"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    let pid = victim.id();
    std::fs::write(cg.0.join("cgroup.procs"), pid.to_string())?;

    // Register it as a rank the way an agent would: a live record on a liveness lease.
    let mut c = node_common::client(&ep).await?;
    let lease = c.lease_grant(30, None).await?.id();
    let record = serde_json::json!({
        "v": 1, "group": "oom-0", "rank": 0, "group_size": 1,
        "host": read_trimmed("/proc/sys/kernel/hostname"),
        "boot_id": read_trimmed("/proc/sys/kernel/random/boot_id"),
        "pid": pid, "lease_ttl_ms": 30_000,
    });
    c.put(
        node_common::live_key("oom-0", 0),
        record.to_string(),
        Some(PutOptions::new().with_lease(lease)),
    )
    .await?;
    watch.wait_watching("oom-0", 0, pid).await?;

    let mut stdin = victim.stdin.take().ok_or_else(|| anyhow::anyhow!("no stdin"))?;
    stdin.write_all(b"go\n")?;
    drop(stdin);

    let cert = wait_certificate(&ep, "oom-0", 0, &lease.to_string()).await?;
    let status = victim.wait()?;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "OOM kills are SIGKILL");
    assert_eq!(cert.value["source"], "watchdog", "{cert:?}");
    assert_eq!(cert.value["reason"], "oom_host", "{cert:?}\n{}", watch.log_text());
    let detail = cert.value["detail"].as_str().unwrap_or_default();
    assert!(
        detail.starts_with(&format!("OOM killer killed pid {pid} (tail)")),
        "the kernel log names the victim: {detail}"
    );
    assert_eq!(cert.value["pid"], pid);
    Ok(())
}
