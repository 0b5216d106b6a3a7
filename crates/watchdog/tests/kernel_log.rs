//! The /dev/kmsg reader on this machine.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use rootrank_watchdog::{KernelLog, KernelLogError, OOM_LOG_GRACE};

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Opens the real log: as root with /dev/kmsg present it must work;
/// otherwise it must fail with the typed error that says why.
fn open_or_assert_typed_error() -> Option<KernelLog> {
    match KernelLog::open() {
        Ok(log) => {
            assert!(log.is_available());
            Some(log)
        }
        Err(e) => {
            let present = Path::new("/dev/kmsg").exists();
            assert!(
                !(is_root() && present),
                "root with /dev/kmsg present must be able to open it, got: {e}"
            );
            match e {
                KernelLogError::PermissionDenied { .. } => assert!(present),
                KernelLogError::NotFound { .. } => assert!(!present),
                other => panic!("unexpected error kind: {other:?}"),
            }
            None
        }
    }
}

#[test]
fn open_reads_only_new_records() {
    let Some(log) = open_or_assert_typed_error() else {
        return;
    };
    // Seeked to the end: the boot log already in the buffer is not replayed.
    std::thread::sleep(Duration::from_millis(100));
    let before = log.stats().records;
    assert!(before < 5, "old records were replayed: {before}");
    // Write a harmless line (no OOM/Xid wording, so no host monitor reacts)
    // and see the reader pick it up.
    let nonce = format!(
        "<14>rootrank-watchdog self-test {} {}\n",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    let mut kmsg = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/kmsg")
        .expect("root can write /dev/kmsg");
    kmsg.write_all(nonce.as_bytes()).expect("write /dev/kmsg");
    let deadline = Instant::now() + Duration::from_secs(2);
    while log.stats().records <= before {
        assert!(Instant::now() < deadline, "reader did not see the new record");
        std::thread::sleep(Duration::from_millis(5));
    }
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

#[tokio::test]
async fn unavailable_log_does_not_wait() {
    let log = KernelLog::unavailable();
    let t = Instant::now();
    assert!(log.wait_for_oom(1, t, Duration::from_secs(5)).await.is_none());
    // Behaviour, not speed: it answered without waiting out its 5 s timeout.
    assert!(t.elapsed() < Duration::from_secs(5) / 2, "{:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_oom_sees_a_line_that_lands_late_and_is_capped() {
    let Some(log) = open_or_assert_typed_error() else {
        return;
    };
    let log = std::sync::Arc::new(log);
    let since = Instant::now();
    // The OOM line lands 5 ms after the death was noticed.
    let feeder = {
        let log = std::sync::Arc::clone(&log);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            log.ingest("Out of memory: Killed process 31337 (python3) total-vm:10kB, anon-rss:9kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0");
        })
    };
    let t = Instant::now();
    let got = log.wait_for_oom(31337, since, Duration::from_secs(10)).await;
    let waited = t.elapsed();
    let _ = feeder.await;
    let o = got.expect("late OOM line found");
    assert_eq!(o.anon_rss_kb, Some(9));
    assert!(waited < OOM_LOG_GRACE + Duration::from_millis(10), "{waited:?}");

    // No line at all: gives up after the grace, even if asked for 10 s.
    let t = Instant::now();
    assert!(log.wait_for_oom(31338, since, Duration::from_secs(10)).await.is_none());
    let waited = t.elapsed();
    assert!(waited >= OOM_LOG_GRACE, "{waited:?}");
    assert!(waited < OOM_LOG_GRACE + Duration::from_millis(50), "{waited:?}");

    // An OOM from before the watch started is not blamed.
    let later = Instant::now();
    assert!(log.oom_kill_for_since(31337, later).is_none());
}
