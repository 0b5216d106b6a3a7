//! A process pointed at a directory without NIXL gets a clear, typed error
//! and exits non-zero by itself: it never reaches the nixl-sys stubs' abort().

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use rootrank_transfer::{NixlLibrary, TransferError};

const PEER_BIN: &str = env!("CARGO_BIN_EXE_transfer-peer");

#[test]
fn missing_library_is_a_clear_error_not_an_abort() {
    let empty = tempfile::tempdir().expect("tempdir");
    let out = Command::new(PEER_BIN)
        .args(["load-only", empty.path().to_str().expect("utf-8")])
        .env_remove("ROOTRANK_NIXL_DIR")
        .output()
        .expect("run transfer-peer load-only");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("status {:?}, stderr:\n{stderr}", out.status);

    assert_eq!(out.status.signal(), None, "killed by a signal (abort?): {stderr}");
    assert_ne!(out.status.code(), Some(134), "SIGABRT-style exit: {stderr}");
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("[nixl_error]"), "{stderr}");
    assert!(stderr.contains("NIXL runtime not found"), "{stderr}");
    assert!(stderr.contains("libnixl_capi.so"), "{stderr}");
    assert!(
        stderr.contains(&empty.path().display().to_string()),
        "says where: {stderr}"
    );
    assert!(stderr.contains("scripts/fetch-nixl.sh"), "says what to do: {stderr}");
    assert!(
        !stderr.contains("nixl error: libnixl_capi.so not found"),
        "stub abort text"
    );
}

#[test]
fn broken_library_file_is_library_invalid() {
    // A file with the right name that is not a shared library, next to a
    // plugin folder, in a fresh process.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("libnixl_capi.so"), b"not an ELF").expect("write");
    std::fs::create_dir(dir.path().join("plugins")).expect("mkdir");
    std::fs::write(dir.path().join("plugins/libplugin_UCX.so"), b"x").expect("write");
    let out = Command::new(PEER_BIN)
        .args(["load-only", dir.path().to_str().expect("utf-8")])
        .output()
        .expect("run transfer-peer load-only");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("status {:?}, stderr:\n{stderr}", out.status);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is unusable"), "{stderr}");
    assert!(stderr.contains("dynamic loader"), "{stderr}");
}

#[test]
fn load_in_process_reports_what_was_searched() {
    // In this (test) process nothing else loads NIXL, so an empty explicit
    // directory fails and says where it looked. (Other tests in this binary
    // do not load NIXL.)
    let empty = tempfile::tempdir().expect("tempdir");
    match NixlLibrary::load(Some(empty.path())) {
        Err(e @ TransferError::LibraryMissing { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&empty.path().display().to_string()), "{msg}");
            assert_eq!(e.reason(), "nixl_error");
        }
        other => panic!("expected LibraryMissing, got {other:?}"),
    }
}
