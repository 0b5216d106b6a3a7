//! A missing NIXL library is a clear error and a non-zero exit, never the nixl-sys stubs'
//! abort(), for both `simulate` and `demo`.

mod pd_common;

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use pd_common::{ensure_nixl, repo_root, BIN};

fn check(args: &[&str]) {
    // The real library is in <repo>/.cache/nixl and the command runs in the repo: had the
    // named directory not been taken as the only place to look, NIXL would load.
    ensure_nixl();
    let empty = tempfile::tempdir().expect("tempdir");
    let out = Command::new(BIN)
        .args(args)
        .current_dir(repo_root())
        .env("ROOTRANK_NIXL_DIR", empty.path())
        .output()
        .expect("run rootrank");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), None, "killed by a signal (abort?): {stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("NIXL runtime not found"), "{stderr}");
    assert!(stderr.contains("libnixl_capi.so"), "{stderr}");
    assert!(
        stderr.contains(&empty.path().display().to_string()),
        "says where it looked: {stderr}"
    );
    assert!(stderr.contains("scripts/fetch-nixl.sh"), "says what to do: {stderr}");
}

#[test]
fn simulate_without_nixl_is_a_clear_error() {
    check(&["simulate", "--etcd-endpoints", "http://127.0.0.1:9", "--rooms", "1"]);
}

#[test]
fn demo_without_nixl_is_a_clear_error() {
    check(&["demo"]);
}
