//! A real memory-cgroup OOM kill seen by `rootrank node-watch`: the certificate says
//! `oom_host`, from the kernel log and the cgroup's oom_kill counter, not just "it exited".
//!
//! Needs root (to create a cgroup and read /dev/kmsg): without it the test fails, saying so,
//! rather than passing without having run (as the watchdog crate's real OOM test does).

use std::io::Write;
use std::process::{Command, Stdio};

use rootrank_testkit::node::{self, wait_certificate, NodeWatch};
use rootrank_testkit::{require_root, Etcd, MemoryCgroup};

const LIMIT: u64 = 64 * 1024 * 1024;

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_killed_rank_is_certified_oom_host() -> anyhow::Result<()> {
    require_root(
        "oom_killed_rank_is_certified_oom_host",
        "to create a memory cgroup and read /dev/kmsg",
    );
    let cg = MemoryCgroup::create("node-oom", LIMIT)?;
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
    cg.add(pid)?;

    // Register it as a rank the way an agent would: a live record on a liveness lease.
    let mut c = node::client(&ep).await?;
    let lease = c.lease_grant(30, None).await?.id();
    let record = serde_json::json!({
        "v": 1, "group": "oom-0", "rank": 0, "group_size": 1,
        "host": read_trimmed("/proc/sys/kernel/hostname"),
        "boot_id": read_trimmed("/proc/sys/kernel/random/boot_id"),
        "pid": pid, "lease_ttl_ms": 30_000,
    });
    node::register_by_hand(&mut c, "oom-0", 0, &record, lease).await?;
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
