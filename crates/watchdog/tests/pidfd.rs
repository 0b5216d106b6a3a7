//! Process watches on real processes: our children and a non-child.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rootrank_watchdog::pidfd::proc_start_time;
use rootrank_watchdog::{
    classify, diagnose, reason, Evidence, ExitInfo, ExitObserved, KernelLog, PidWatch, ProcessExit, ProcessWatcher,
    WatchError,
};
use tokio::sync::mpsc::UnboundedReceiver;

/// Only there so a missed exit fails the test instead of hanging it; never a speed limit (the
/// latency is measured by `cargo run --release -p rootrank-watchdog --example pidfd_latency`).
const HANG_GUARD: Duration = Duration::from_secs(20);

async fn next<K>(rx: &mut UnboundedReceiver<ProcessExit<K>>) -> ProcessExit<K> {
    tokio::time::timeout(HANG_GUARD, rx.recv())
        .await
        .expect("a ProcessExit (none came before the hang guard)")
        .expect("channel open")
}

fn sleeper() -> std::process::Child {
    Command::new("sleep").arg("30").spawn().expect("spawn sleep")
}

/// Starts `sleep 30` as a grandchild whose parent exits at once, so it is
/// re-parented away from us: a process that is NOT our child.
fn non_child_sleeper() -> u32 {
    let mut sh = Command::new("sh")
        .args(["-c", "sleep 30 & echo $!"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn sh");
    let mut line = String::new();
    // Read one line only: the sleep keeps the pipe open for 30 s.
    BufReader::new(sh.stdout.take().expect("stdout piped"))
        .read_line(&mut line)
        .expect("read grandchild pid");
    sh.wait().expect("sh exits");
    line.trim().parse().expect("pid printed by sh")
}

fn sigkill(pid: u32) {
    // SAFETY: kill has no memory-safety preconditions.
    let r = unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    assert_eq!(r, 0, "kill {pid}");
}

#[tokio::test]
async fn child_killed_by_sigkill_reports_signal_9() {
    let (w, mut rx) = ProcessWatcher::new();
    let mut child = sleeper();
    let pid = child.id();
    w.add("rank0", pid).expect("watch child");
    assert_eq!(w.watched(), vec![("rank0", pid)]);
    let killed_at = Instant::now();
    child.kill().expect("SIGKILL child");
    let ev = next(&mut rx).await;
    let latency = ev.noticed_at.duration_since(killed_at);
    assert_eq!(ev.key, "rank0");
    assert_eq!(ev.pid, pid);
    assert_eq!(ev.observed, ExitObserved::Exited);
    assert_eq!(ev.exit, Some(ExitInfo::signaled(9)));
    assert!(ev.start_time.is_some());
    eprintln!("child's SIGKILL noticed after {latency:?}");
    assert!(w.is_empty(), "a reported watch is gone from the watcher");
    // WNOWAIT: the status is still there for the child's owner.
    let status = child.wait().expect("owner can still reap");
    assert_eq!(ExitInfo::from(status), ExitInfo::signaled(9));

    let c = diagnose(&ev, &KernelLog::unavailable(), None).await;
    assert_eq!(c.reason, reason::PROCESS_EXIT);
    assert_eq!(c.detail, "killed by signal 9 (SIGKILL)");
}

#[tokio::test]
async fn child_exiting_with_code_3_reports_code_3() {
    let (w, mut rx) = ProcessWatcher::new();
    let mut child = Command::new("sh")
        .args(["-c", "sleep 0.2; exit 3"])
        .spawn()
        .expect("spawn sh");
    w.add(7u32, child.id()).expect("watch child");
    let ev = next(&mut rx).await;
    assert_eq!(ev.key, 7);
    assert_eq!(ev.exit, Some(ExitInfo::exited(3)));
    let c = classify(&Evidence {
        exit: ev.exit,
        ..Evidence::default()
    });
    assert_eq!((c.reason, c.detail.as_str()), ("process_exit", "exited with code 3"));
    assert_eq!(child.wait().expect("reap").code(), Some(3));
}

#[tokio::test]
async fn non_child_killed_reports_no_status() {
    let pid = non_child_sleeper();
    // Field 4 of /proc/PID/stat is the parent pid: not us.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let ppid: u32 = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|p| p.parse().ok())
        .expect("ppid field");
    assert_ne!(ppid, std::process::id(), "test setup: must not be our child");
    let (w, mut rx) = ProcessWatcher::new();
    w.add("rank1", pid).expect("watch non-child");
    let killed_at = Instant::now();
    sigkill(pid);
    let ev = next(&mut rx).await;
    assert_eq!(ev.pid, pid);
    assert_eq!(ev.observed, ExitObserved::Exited);
    assert_eq!(ev.exit, None, "waitid must not give a non-child's status");
    eprintln!(
        "non-child's SIGKILL noticed after {:?}",
        ev.noticed_at.duration_since(killed_at)
    );
    let c = diagnose(&ev, &KernelLog::unavailable(), Some("0000:3b:00.0")).await;
    assert_eq!(c.reason, reason::PROCESS_EXIT);
    assert_eq!(c.detail, "process exited (status unknown: not our child)");
}

#[tokio::test]
async fn kernel_oom_line_makes_it_oom_host() {
    let (w, mut rx) = ProcessWatcher::new();
    let mut child = sleeper();
    let pid = child.id();
    w.add("r", pid).expect("watch");
    let log = KernelLog::unavailable();
    log.ingest(&format!("oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/rank,task_memcg=/rank,task=sleep,pid={pid},uid=0"));
    log.ingest(&format!("Memory cgroup out of memory: Killed process {pid} (sleep) total-vm:8kB, anon-rss:4kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0"));
    child.kill().expect("kill");
    let ev = next(&mut rx).await;
    let c = diagnose(&ev, &log, None).await;
    assert_eq!(c.reason, reason::OOM_HOST);
    assert_eq!(
        c.detail,
        format!("OOM killer killed pid {pid} (sleep): anon-rss 4 kB, total-vm 8 kB, constraint CONSTRAINT_MEMCG, memcg /rank")
    );
    // An Xid on the rank's GPU loses to the OOM, but wins over a bare exit.
    log.ingest("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.");
    let c = diagnose(&ev, &log, Some("00000000:3B:00.0")).await;
    assert_eq!(c.reason, reason::OOM_HOST);
    let no_oom = ProcessExit {
        pid: pid + 100_000,
        ..ev.clone()
    };
    let c = diagnose(&no_oom, &log, Some("00000000:3B:00.0")).await;
    assert_eq!(
        (c.reason, c.detail.as_str()),
        ("gpu_xid", "Xid 79 on 0000:3b:00: GPU has fallen off the bus")
    );
    let _ = child.wait();
}

#[tokio::test]
async fn reused_pid_is_reported_exited_not_watched() {
    let (w, mut rx) = ProcessWatcher::new();
    let mut child = sleeper();
    let pid = child.id();
    let real = proc_start_time(pid).expect("start time");
    // The caller registered the process with a different start time: this
    // pid now belongs to someone else.
    w.add_with_start_time("stale", pid, real + 1234).expect("add");
    let ev = next(&mut rx).await;
    assert_eq!(ev.observed, ExitObserved::PidReused);
    assert_eq!(ev.exit, None);
    assert_eq!(ev.start_time, Some(real));
    assert!(w.is_empty());
    // With the right start time it is watched as usual.
    w.add_with_start_time("fresh", pid, real).expect("add");
    assert_eq!(w.len(), 1);
    child.kill().expect("kill");
    let ev = next(&mut rx).await;
    assert_eq!(
        (ev.key, ev.observed, ev.exit),
        ("fresh", ExitObserved::Exited, Some(ExitInfo::signaled(9)))
    );
    let _ = child.wait();
}

#[tokio::test]
async fn missing_pid_is_reported_already_gone() {
    let (w, mut rx) = ProcessWatcher::new();
    let mut child = Command::new("true").spawn().expect("spawn true");
    let pid = child.id();
    child.wait().expect("reap"); // fully gone now
    w.add("gone", pid).expect("add");
    let ev = next(&mut rx).await;
    assert_eq!(ev.observed, ExitObserved::AlreadyGone);
    assert_eq!(ev.exit, None);
}

#[tokio::test]
async fn removed_or_replaced_watches_stay_silent() {
    let (w, mut rx) = ProcessWatcher::new();
    let mut a = sleeper();
    let mut b = sleeper();
    w.add("k", a.id()).expect("add a");
    assert!(w.remove(&"k"));
    assert!(!w.remove(&"k"));
    w.add("k", a.id()).expect("re-add a");
    w.add("k", b.id()).expect("replace with b");
    assert_eq!(w.watched(), vec![("k", b.id())]);
    a.kill().expect("kill a");
    let _ = a.wait();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), rx.recv())
            .await
            .is_err(),
        "no event for a removed/replaced watch"
    );
    b.kill().expect("kill b");
    let ev = next(&mut rx).await;
    assert_eq!(ev.pid, b.id());
    let _ = b.wait();
}

#[tokio::test]
async fn pid_watch_direct() {
    let mut child = sleeper();
    let watch = PidWatch::open(child.id()).expect("pidfd");
    assert_eq!(watch.pid(), child.id());
    assert!(!watch.has_exited());
    assert_eq!(watch.exit_status(), None, "still running");
    child.kill().expect("kill");
    tokio::time::timeout(HANG_GUARD, watch.exited())
        .await
        .expect("exited in time")
        .expect("no error");
    assert!(watch.has_exited());
    assert_eq!(watch.exit_status(), Some(ExitInfo::signaled(9)));
    // exit_status does not reap; reap() does, after which the owner cannot.
    assert_eq!(watch.reap(), Some(ExitInfo::signaled(9)));
    assert!(child.try_wait().is_err(), "already reaped");
}

#[test]
fn errors_are_typed() {
    assert!(matches!(PidWatch::open(0), Err(WatchError::InvalidPid(0))));
    assert!(matches!(PidWatch::open(u32::MAX), Err(WatchError::InvalidPid(_))));
    // Outside a runtime: a typed error, not tokio's panic.
    let mut child = sleeper();
    match PidWatch::open(child.id()) {
        Err(WatchError::NoRuntime) => {}
        other => panic!("expected NoRuntime, got {other:?}"),
    }
    let (w, _rx) = ProcessWatcher::<u8>::new();
    assert!(matches!(w.add(1, child.id()), Err(WatchError::NoRuntime)));
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test]
async fn plain_sigkill_skips_the_oom_wait_when_the_cgroup_counter_is_still() {
    let log = KernelLog::open_or_unavailable();
    let (w, mut rx) = ProcessWatcher::new();
    let mut child = sleeper();
    w.add("k9", child.id()).expect("watch");
    child.kill().expect("kill");
    let ev = next(&mut rx).await;
    // From here on tokio's clock is paused: it moves only to the next timer when every task
    // waits, so `waited` is exactly how long diagnose waited on timers, whatever the machine's
    // speed.
    tokio::time::pause();
    let t = tokio::time::Instant::now();
    let c = diagnose(&ev, &log, None).await;
    let waited = t.elapsed();
    assert_eq!(
        (c.reason, c.detail.as_str()),
        ("process_exit", "killed by signal 9 (SIGKILL)")
    );
    match &ev.cgroup_oom {
        Some(d) => {
            assert!(!d.killed(), "{d:?}");
            // The cgroup already said "no OOM": the kernel log's grace is not waited out.
            assert_eq!(waited, Duration::ZERO, "no wait expected");
        }
        None if log.is_available() => {
            assert!(waited >= rootrank_watchdog::OOM_LOG_GRACE, "{waited:?}");
        }
        None => assert_eq!(waited, Duration::ZERO, "an unavailable log is not waited on"),
    }
    let _ = child.wait();
}
