//! `rootrank simulate` leaves no rank behind: `--rooms 0` stops cleanly on SIGTERM, and a
//! SIGKILLed parent takes its ranks with it (PR_SET_PDEATHSIG).

use std::process::Stdio;
use std::time::{Duration, Instant};

use rootrank_testkit::nixl::NIXL_DIR_ENV;
use rootrank_testkit::pd::live_pids;
use rootrank_testkit::{alive, nixl_dir, repo_root, Etcd};

const BIN: &str = env!("CARGO_BIN_EXE_rootrank");
use tokio::io::{AsyncBufReadExt, BufReader};

/// Starts `simulate --rooms 0 --json` and returns it once a first room is over.
async fn start_forever(
    etcd: &str,
    logs: &std::path::Path,
) -> (
    tokio::process::Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    let mut child = tokio::process::Command::new(BIN)
        .args([
            "simulate",
            "--json",
            "--ranks",
            "2",
            "--rooms",
            "0",
            "--room-rate",
            "20",
            "--block-size",
            "65536",
            "--lease-ttl-ms",
            "1000",
            "--etcd-endpoints",
            etcd,
            "--log-dir",
        ])
        .arg(logs)
        .current_dir(repo_root())
        .env(NIXL_DIR_ENV, nixl_dir().expect("NIXL for the tests"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn simulate");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("a first room within 30 s")
        .expect("read")
        .expect("a line");
    let v: serde_json::Value = serde_json::from_str(&first).expect("JSON room line");
    assert_eq!(v["status"], "success", "{v}");
    (child, lines)
}

async fn wait_all_gone(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "ranks still alive: {:?}",
            pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_forever_run_cleanly() {
    let etcd = Etcd::start().expect("etcd");
    let logs = tempfile::tempdir().expect("tempdir");
    let (mut child, mut lines) = start_forever(&etcd.endpoint(), logs.path()).await;
    let mut pids = live_pids(&etcd.endpoint(), "prefill-0").await.unwrap();
    pids.extend(live_pids(&etcd.endpoint(), "decode-0").await.unwrap());
    assert_eq!(pids.len(), 4, "four ranks registered with their pids: {pids:?}");

    rootrank_testkit::try_signal(child.id().expect("pid"), libc::SIGTERM).expect("SIGTERM to simulate");
    let mut last = String::new();
    while let Ok(Some(l)) = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("output ends")
    {
        last = l;
    }
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("exits")
        .expect("wait");
    assert!(status.success(), "{status:?}");
    let report: serde_json::Value = serde_json::from_str(&last).expect("final report");
    assert_eq!(report["stopped_early"], true, "{report}");
    wait_all_gone(&pids).await;
    // Each rank went through its agent's clean exit: a shutdown certificate, no live key.
    assert!(live_pids(&etcd.endpoint(), "prefill-0").await.unwrap().is_empty());
    let mut c = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![etcd.endpoint()]))
        .await
        .expect("client");
    let all = c
        .get(
            "/rootrank/v1/groups/",
            Some(rootrank_store::etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("get");
    let shutdowns = all
        .kvs()
        .iter()
        .filter(|kv| kv.key_str().is_ok_and(|k| k.contains("/down/")))
        .filter(|kv| serde_json::from_slice::<serde_json::Value>(kv.value()).is_ok_and(|v| v["reason"] == "shutdown"))
        .count();
    assert_eq!(shutdowns, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_parent_takes_its_ranks_with_it() {
    let etcd = Etcd::start().expect("etcd");
    let logs = tempfile::tempdir().expect("tempdir");
    let (mut child, _lines) = start_forever(&etcd.endpoint(), logs.path()).await;
    let mut pids = live_pids(&etcd.endpoint(), "prefill-0").await.unwrap();
    pids.extend(live_pids(&etcd.endpoint(), "decode-0").await.unwrap());
    assert_eq!(pids.len(), 4, "{pids:?}");
    assert!(pids.iter().all(|&p| alive(p)));
    child.start_kill().expect("SIGKILL simulate");
    let _ = child.wait().await;
    wait_all_gone(&pids).await;
}
