//! The kernel log reader: on a regular file standing in for /dev/kmsg (runs anywhere), and on
//! this machine's /dev/kmsg (needs root: fails, never passes, without it).

use std::future::Future;
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use rootrank_watchdog::kernel_log::KMSG_PATH;
use rootrank_watchdog::{KernelLog, KernelLogError, KernelLogStats, OOM_LOG_GRACE};

/// Only there so a broken reader fails the test instead of hanging it; never a speed limit.
const HANG_GUARD: Duration = Duration::from_secs(20);

/// Polls `done` until it holds; panics after [`HANG_GUARD`].
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + HANG_GUARD;
    while !done() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A /dev/kmsg record of the OOM killer killing `pid`.
fn oom_record(pid: u32, seq: u32) -> String {
    format!("3,{seq},{seq}000,-;Out of memory: Killed process {pid} (python3) total-vm:10kB, anon-rss:9kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0\n")
}

fn append(path: &Path, record: &str) {
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .expect("open for append");
    // One write: the reader sees the whole record or none of it.
    f.write_all(record.as_bytes()).expect("append");
}

#[test]
fn open_path_reads_only_what_is_appended_after_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kmsg");
    // Already logged before the reader opens: an OOM kill that is not ours to explain.
    std::fs::write(&path, format!("{}6,2,2000,-;boot chatter\n", oom_record(4242, 1))).expect("write");
    let log = KernelLog::open_path(&path).expect("a regular file stands in for /dev/kmsg");
    assert!(log.is_available());

    append(&path, &oom_record(5151, 3));
    wait_for("the appended OOM record is read", || log.oom_kill_for(5151).is_some());
    // The reader reads in order: had it started at the beginning, it would have read the old
    // kill before the new one.
    assert!(
        log.oom_kill_for(4242).is_none(),
        "a record from before open was replayed"
    );
    assert_eq!(
        log.stats(),
        KernelLogStats {
            records: 1,
            events: 1,
            overwritten: 0
        }
    );

    append(&path, "6,4,4000,-;rootrank-watchdog self-test, not an event\n");
    wait_for("the appended harmless record is read", || log.stats().records == 2);
    assert_eq!(log.stats().events, 1, "a harmless record is counted, not an event");
    assert_eq!(log.len(), 1);
}

/// Reads every record available on `f` now (one per read), returning them.
fn drain(f: &mut std::fs::File) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match f.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.push(String::from_utf8_lossy(&buf[..n]).into_owned()),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return out,
            // Overwritten before we read them: the next read goes on with the oldest left.
            Err(e) if e.kind() == ErrorKind::BrokenPipe => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => panic!("reading {KMSG_PATH}: {e}"),
        }
    }
}

#[test]
fn dev_kmsg_reader_sees_new_records_only() {
    rootrank_testkit::require_root("dev_kmsg_reader_sees_new_records_only", "to read and write /dev/kmsg");
    assert!(
        Path::new(KMSG_PATH).exists(),
        "dev_kmsg_reader_sees_new_records_only needs {KMSG_PATH}; mount it, or leave this test out with `--skip dev_kmsg_reader_sees_new_records_only`"
    );
    // Our own reader, at the end before the log opens: every record the log may see, ours sees.
    let mut ours = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(KMSG_PATH)
        .expect("root can read /dev/kmsg");
    ours.seek(SeekFrom::End(0)).expect("seek /dev/kmsg to its end");
    let log = KernelLog::open().expect("root with /dev/kmsg present must be able to open it");
    assert!(log.is_available());

    // A harmless line (no OOM/Xid wording, so no host monitor reacts).
    let nonce = format!(
        "rootrank-watchdog self-test {} {}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    let mut kmsg = std::fs::OpenOptions::new()
        .write(true)
        .open(KMSG_PATH)
        .expect("root can write /dev/kmsg");
    kmsg.write_all(format!("<14>{nonce}\n").as_bytes())
        .expect("write /dev/kmsg");
    let mut since_ours = Vec::new();
    wait_for("our record is in the kernel log", || {
        since_ours.extend(drain(&mut ours));
        since_ours.iter().any(|r| r.contains(&nonce))
    });
    wait_for("the log's reader sees a new record", || log.stats().records > 0);

    // Started at the end, the log reader has seen nothing older than our reader's start: a
    // replay of the ring buffer (read in one burst, before any new record) would break this.
    let seen = log.stats().records;
    since_ours.extend(drain(&mut ours));
    assert!(
        seen <= since_ours.len() as u64,
        "the log read {seen} records, but only {} were logged since it opened: old records were replayed",
        since_ours.len()
    );
    assert_eq!(log.stats().events, 0, "the self-test line is not an event");
}

#[test]
fn missing_device_is_a_typed_not_found() {
    match KernelLog::open_path(Path::new("/nonexistent/kmsg")) {
        Err(KernelLogError::NotFound { path }) => {
            assert_eq!(path, Path::new("/nonexistent/kmsg"));
            let msg = KernelLogError::NotFound { path }.to_string();
            assert!(msg.contains("mount the host's /dev/kmsg"), "{msg}");
        }
        other => panic!("expected NotFound, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn unavailable_log_answers_none() {
    let log = KernelLog::unavailable();
    assert!(!log.is_available());
    assert!(log.oom_kill_for(1).is_none());
    assert!(log.xid_for("0000:3b:00", Instant::now()).is_none());
    assert_eq!(log.len(), 0);
}

#[test]
fn unavailable_log_answers_without_waiting() {
    let log = KernelLog::unavailable();
    let mut wait = std::pin::pin!(log.wait_for_oom(1, Instant::now(), Duration::from_secs(5)));
    // Behaviour, not speed: the very first poll has the answer, nothing is waited on.
    let first = wait.as_mut().poll(&mut Context::from_waker(Waker::noop()));
    assert!(matches!(first, Poll::Ready(None)), "{first:?}");
}

/// On tokio's paused clock: it advances only to the next timer when every task waits, so
/// elapsed times below are exactly what the code waited on, not wall-clock speed.
#[tokio::test(start_paused = true)]
async fn wait_for_oom_wakes_on_a_late_line_and_gives_up_after_the_grace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kmsg");
    std::fs::write(&path, "").expect("write");
    // An available log (a reader is running), so wait_for_oom really waits.
    let log = Arc::new(KernelLog::open_path(&path).expect("open a file as the kernel log"));
    let since = Instant::now();
    // The OOM line lands 5 ms after the death was noticed.
    let feeder = {
        let log = Arc::clone(&log);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            log.ingest("Out of memory: Killed process 31337 (python3) total-vm:10kB, anon-rss:9kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0");
        })
    };
    let t = tokio::time::Instant::now();
    let got = log.wait_for_oom(31337, since, Duration::from_secs(10)).await;
    let waited = t.elapsed();
    feeder.await.expect("feeder");
    let o = got.expect("late OOM line found");
    assert_eq!(o.anon_rss_kb, Some(9));
    assert!(
        waited < OOM_LOG_GRACE,
        "woken by the line, not by the grace running out: {waited:?}"
    );

    // No line at all: gives up after the grace, though asked to wait 10 s.
    let t = tokio::time::Instant::now();
    assert!(log.wait_for_oom(31338, since, Duration::from_secs(10)).await.is_none());
    let waited = t.elapsed();
    assert!(waited >= OOM_LOG_GRACE, "waited out the grace: {waited:?}");
    assert!(waited < Duration::from_secs(10), "capped at the grace: {waited:?}");

    // An OOM from before the watch started is not blamed.
    let later = Instant::now();
    assert!(log.oom_kill_for_since(31337, later).is_none());
}
