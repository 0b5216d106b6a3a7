//! A real OOM kill, end to end: a child in a 64 MiB memory cgroup eats
//! memory until the kernel's memcg OOM killer kills it, and the watchdog
//! must call it `oom_host` from the kernel log and the cgroup counter.
//!
//! Needs root (to create a cgroup and read /dev/kmsg). Without root the
//! test asserts that the setup fails with a permission error instead.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rootrank_watchdog::cgroup::parse_mountinfo;
use rootrank_watchdog::{diagnose, reason, ExitInfo, KernelLog, ProcessWatcher};

const LIMIT: u64 = 64 * 1024 * 1024;

/// Removes the test cgroup even when an assertion fails.
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

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Creates a memory-limited cgroup on whichever hierarchy has `memory`.
fn make_cgroup() -> Result<CgroupDir, std::io::Error> {
    let mounts = parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo")?);
    let name = format!("rootrank-oom-test-{}", std::process::id());
    if let Some((mnt, _)) = mounts.memory_v1 {
        let dir = CgroupDir(mnt.join(&name));
        std::fs::create_dir(&dir.0)?;
        std::fs::write(dir.0.join("memory.limit_in_bytes"), LIMIT.to_string())?;
        return Ok(dir);
    }
    if let Some((mnt, _)) = mounts.unified {
        let dir = CgroupDir(mnt.join(&name));
        std::fs::create_dir(&dir.0)?;
        std::fs::write(dir.0.join("memory.max"), LIMIT.to_string())?;
        // No swap, so the limit is reached instead of swapping (may be absent).
        let _ = std::fs::write(dir.0.join("memory.swap.max"), "0");
        return Ok(dir);
    }
    Err(std::io::Error::other("no memory cgroup hierarchy mounted"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_memcg_oom_kill_is_classified_oom_host() {
    let cg = match make_cgroup() {
        Ok(cg) => cg,
        Err(e) => {
            assert!(!is_root(), "root must be able to create a memory cgroup: {e}");
            assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
            return;
        }
    };
    let klog = KernelLog::open().expect("root can open /dev/kmsg");

    // The child waits for a go, so it is in the cgroup and watched first.
    let mut child = Command::new("sh")
        .args(["-c", "read go; exec tail -n 1 /dev/zero"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn sh");
    let pid = child.id();
    std::fs::write(cg.0.join("cgroup.procs"), pid.to_string()).expect("move child into cgroup");

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
    assert!(delta.file.starts_with(&cg.0), "{:?}", delta.file);
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
    // Bounded, not fast (the figure is `detection` in `make bench`): the line was there, so the
    // diagnosis never waited out the kernel log's grace several times over.
    assert!(diag_took < rootrank_watchdog::OOM_LOG_GRACE * 10, "{diag_took:?}");

    let status = child.wait().expect("reap");
    assert_eq!(ExitInfo::from(status), ExitInfo::signaled(9));
    assert!(Path::new(&cg.0).exists());
}
