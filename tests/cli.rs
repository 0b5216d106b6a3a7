//! The CLI as a user types it: `serve` with its own private etcd, `why` and `status`, their
//! exit codes, and a clear error when etcd is nowhere to be found.

use std::process::{Command, Stdio};
use std::time::Duration;

use rootrank_testkit::{eventually, free_port, get, Rank};

const BIN: &str = env!("CARGO_BIN_EXE_rootrank");

struct Killed(std::process::Child);
impl Drop for Killed {
    fn drop(&mut self) {
        // SIGTERM first: serve stops its private etcd on the way out.
        rootrank_testkit::signal(self.0.id(), libc::SIGTERM);
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_without_endpoints_runs_a_private_etcd_and_why_status_work() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().unwrap();
    let log = dir.path().join("serve.log");
    let child = Command::new(BIN)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
        .arg(dir.path())
        .env_remove("ROOTRANK_ETCD_ENDPOINTS")
        .stderr(std::fs::File::create(&log).unwrap())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let serve = Killed(child);
    let url = format!("http://127.0.0.1:{port}");
    eventually(Duration::from_secs(20), "readyz", || async {
        (get(&format!("{url}/readyz")).await.ok()?.0 == 200).then_some(())
    })
    .await
    .unwrap();
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("started a private etcd"), "{said}");
    let endpoint = said
        .split_whitespace()
        .find(|w| w.starts_with("http://127.0.0.1:"))
        .unwrap()
        .trim_end_matches(',')
        .to_string();
    assert!(dir.path().join("etcd").exists());

    let why = |room: &str| {
        Command::new(BIN)
            .args(["why", room, "--coordinator", &url])
            .output()
            .unwrap()
    };
    // Nothing known yet: pending, exit 3.
    let out = why("5");
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stdout).contains("pending"));
    // Bad input: exit 1 with the API's message.
    let out = why("not-a-room");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid_room"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Usage error: exit 2.
    assert_eq!(Command::new(BIN).args(["why"]).output().unwrap().status.code(), Some(2));

    let mut r = Rank::start(&endpoint, "decode-0", 0, 1, 5000).unwrap();
    r.fail(5, "local", "peer_disconnect", "remote agent was disconnected")
        .unwrap();
    r.flush().unwrap();
    let out = Command::new(BIN)
        .args(["why", "5", "--wait-ms", "5000", "--json", "--coordinator", &url])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["culprit"]["reason"], "peer_disconnect");
    let out = Command::new(BIN)
        .args(["status", "--coordinator", &url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("decode-0"), "{text}");
    let out = Command::new(BIN)
        .args(["status", "--group", "decode-0", "--coordinator", &url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("live") && text.contains("peer_disconnect"), "{text}");
    r.exit().unwrap();
    drop(serve);
}

#[test]
fn serve_says_what_to_do_when_no_etcd_binary_exists() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .env("PATH", dir.path()) // no etcd here
        .env_remove("ROOTRANK_ETCD_ENDPOINTS")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no etcd binary on PATH") && err.contains("--etcd-endpoints"),
        "{err}"
    );
}

#[test]
fn why_without_a_coordinator_says_where_it_looked() {
    let port = free_port().unwrap();
    let out = Command::new(BIN)
        .args(["why", "1", "--coordinator", &format!("http://127.0.0.1:{port}")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach the coordinator"), "{err}");
}
