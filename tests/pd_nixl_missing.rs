//! A missing NIXL library is a clear error and a non-zero exit, never the nixl-sys stubs'
//! abort(), for both `simulate` and `demo`.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use rootrank_testkit::nixl::NIXL_DIR_ENV;
use rootrank_testkit::nixl_dir;

const BIN: &str = env!("CARGO_BIN_EXE_rootrank");

fn check(args: &[&str]) {
    // The real library is in ./.cache/nixl of the directory the command runs in, where the
    // default search looks: had the named directory not been taken as the only place to look,
    // NIXL would load.
    let cwd = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(cwd.path().join(".cache")).expect("mkdir .cache");
    std::os::unix::fs::symlink(nixl_dir().expect("NIXL for the tests"), cwd.path().join(".cache/nixl"))
        .expect("link .cache/nixl");
    let empty = tempfile::tempdir().expect("tempdir");
    let out = Command::new(BIN)
        .args(args)
        .current_dir(cwd.path())
        .env(NIXL_DIR_ENV, empty.path())
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
