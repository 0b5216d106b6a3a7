//! `rootrank demo` tells the whole story with real etcd and real NIXL, and leaves nothing
//! running.

use rootrank_testkit::nixl::NIXL_DIR_ENV;
use rootrank_testkit::{alive, nixl_dir, processes_mentioning, repo_root};

const BIN: &str = env!("CARGO_BIN_EXE_rootrank");

#[test]
fn demo_narrates_both_failures_and_cleans_up() {
    let out = std::process::Command::new(BIN)
        .arg("demo")
        .current_dir(repo_root())
        .env(NIXL_DIR_ENV, nixl_dir().expect("NIXL for the tests"))
        .env_remove("ROOTRANK_LOG")
        .output()
        .expect("run rootrank demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for needle in [
        "NIXL KVSender Exception",
        "culprit: prefill-0 rank 2",
        "reason:  nixl_error (from room_record)",
        "NIXL_ERR_BACKEND",
        "culprit: prefill-0 rank 1",
        "reason:  lease_expired (from lease_expired)",
        "failed at prefill-0 rank 1: lease_expired",
        "rootrank_root_causes_total{group=\"prefill-0\",rank=\"1\",reason=\"lease_expired\",source=\"lease_expired\"}",
        "rootrank_root_causes_total{group=\"prefill-0\",rank=\"2\",reason=\"nixl_error\",source=\"room_record\"}",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
    // The private etcd and every rank are gone.
    let etcd_line = stdout
        .lines()
        .find(|l| l.starts_with("private etcd (pid "))
        .expect("etcd line");
    let pid: u32 = etcd_line["private etcd (pid ".len()..]
        .split(')')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("pid");
    assert!(!alive(pid), "etcd {pid} still running");
    let url = etcd_line.rsplit(' ').next().expect("url");
    let left: Vec<String> = processes_mentioning("sim-rank")
        .into_iter()
        .filter(|p| p.contains(url))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
