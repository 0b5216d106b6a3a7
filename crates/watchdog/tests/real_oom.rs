//! A real OOM kill, end to end: a child in a 64 MiB memory cgroup eats
//! memory until the kernel's memcg OOM killer kills it, and the watchdog
//! must call it `oom_host` from the kernel log and the cgroup counter.
//!
//! Needs root (to create a cgroup and read /dev/kmsg): without it the test
//! fails, saying so, rather than passing without having run.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rootrank_testkit::{require_root, MemoryCgroup};
use rootrank_watchdog::{diagnose, reason, ExitInfo, KernelLog, ProcessWatcher};

const LIMIT: u64 = 64 * 1024 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_memcg_oom_kill_is_classified_oom_host() {
    require_root(
        "real_memcg_oom_kill_is_classified_oom_host",
        "to create a memory cgroup and read /dev/kmsg",
    );
    let cg = MemoryCgroup::create("oom-test", LIMIT).expect("root can create a memory cgroup");
    let klog = KernelLog::open().expect("root can open /dev/kmsg");

    // The child waits for a go, so it is in the cgroup and watched first.
    let mut child = Command::new("sh")
        .args(["-c", "read go; exec tail -n 1 /dev/zero"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn sh");
    let pid = child.id();
    cg.add(pid).expect("move child into cgroup");

    let (w, mut rx) = ProcessWatcher::new();
    w.add("oom-victim", pid).expect("watch");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(b"go\n").expect("go");
    drop(stdin);

    let started = Instant::now();
    let ev = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("the OOM killer acts within 30 s")
        .expect("channel open");
    let noticed = ev.noticed_at.duration_since(started);
    let diag_start = Instant::now();
    let c = diagnose(&ev, &klog, None).await;
    let diag_took = diag_start.elapsed();
    eprintln!(
        "OOM death noticed {noticed:?} after go; diagnosis took {diag_took:?}: {} / {}",
        c.reason, c.detail
    );

    assert_eq!(ev.exit, Some(ExitInfo::signaled(9)), "OOM kills are SIGKILL");
    let delta = ev.cgroup_oom.clone().expect("cgroup counters readable");
    assert!(delta.killed(), "cgroup oom_kill went up: {delta:?}");
    assert!(delta.file.starts_with(cg.path()), "{:?}", delta.file);
    assert_eq!(c.reason, reason::OOM_HOST);
    let oom = klog
        .oom_kill_for_since(pid, ev.watched_since)
        .expect("kernel log names the victim");
    assert_eq!(oom.comm, "tail");
    assert!(oom.memcg_oom, "{oom:?}");
    assert!(
        c.detail.starts_with(&format!("OOM killer killed pid {pid} (tail)")),
        "{}",
        c.detail
    );

    let status = child.wait().expect("reap");
    assert_eq!(ExitInfo::from(status), ExitInfo::signaled(9));
    assert!(cg.path().exists());
}
