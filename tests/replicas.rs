//! Coordinator replicas, proven: three replicas on one etcd while ranks publish and die give
//! byte-identical verdicts, groups and failures at the same revision; `rootrank why` with all
//! three fails over when the replica holding its long poll is SIGKILLed; the killed replica,
//! restarted, answers the same bytes.

use std::process::{Command, Stdio};
use std::time::Duration;

use rootrank_testkit::{eventually, Coordinator, Etcd, Rank};

const BIN: &str = env!("CARGO_BIN_EXE_rootrank");

/// The raw body (status, bytes) of a GET.
async fn raw(url: &str) -> Option<(u16, Vec<u8>)> {
    let r = rootrank_tls::http_client(None)
        .unwrap()
        .build()
        .unwrap()
        .get(url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()?;
    let status = r.status().as_u16();
    Some((status, r.bytes().await.ok()?.to_vec()))
}

/// The replica's applied revision (from a verdict).
async fn revision(c: &Coordinator) -> i64 {
    let (_, v) = c.get("/v1/rooms/1/verdict").await.unwrap();
    v["revision"].as_i64().unwrap_or(0)
}

const PATHS: &[&str] = &[
    "/v1/rooms/101/verdict?group=rep-0",
    "/v1/rooms/102/verdict?group=rep-0",
    "/v1/rooms/103/verdict?group=rep-1",
    "/v1/groups",
    "/v1/groups/rep-0",
    "/v1/failures",
];

/// Every path's bytes from every replica, once all have applied the same revision.
async fn same_bytes(replicas: &[&Coordinator]) {
    let at = eventually(Duration::from_secs(20), "replicas at one revision", || async {
        let mut revs = Vec::new();
        for c in replicas {
            revs.push(revision(c).await);
        }
        revs.windows(2).all(|w| w[0] == w[1]).then(|| revs[0])
    })
    .await
    .unwrap();
    for path in PATHS {
        let mut bodies = Vec::new();
        for c in replicas {
            let sep = if path.contains('?') { '&' } else { '?' };
            // min_revision pins the answer to the revision compared (a verdict path only).
            let url = if path.contains("/verdict") {
                format!("{}{path}{sep}min_revision={at}", c.url)
            } else {
                format!("{}{path}", c.url)
            };
            bodies.push(raw(&url).await.unwrap());
        }
        for b in &bodies[1..] {
            assert_eq!(
                b,
                &bodies[0],
                "{path} differs between replicas at revision {at}:\n{}\n{}",
                String::from_utf8_lossy(&bodies[0].1),
                String::from_utf8_lossy(&b.1)
            );
        }
        assert_eq!(bodies[0].0, 200, "{path}: {}", String::from_utf8_lossy(&bodies[0].1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_agree_byte_for_byte_and_why_fails_over_a_killed_one() {
    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    let mut a = Coordinator::start(&ep, &[]).await.unwrap();
    let b = Coordinator::start(&ep, &[]).await.unwrap();
    let c = Coordinator::start(&ep, &[]).await.unwrap();

    let mut ranks: Vec<Rank> = (0..4)
        .map(|r| Rank::start(&ep, "rep-0", r, 4, 1_000).unwrap())
        .collect();
    // A second group with no death: a room there waits for its record (a recent death in
    // rep-0 would resolve any of rep-0's rooms at once, by rule 2).
    let mut other: Vec<Rank> = (0..2)
        .map(|r| Rank::start(&ep, "rep-1", r, 2, 1_000).unwrap())
        .collect();
    // Room 101: rank 0's own transfer failure. Room 102: rank 3 dies, rank 0 saw the room fail.
    ranks[0]
        .fail(101, "local", "nixl_error", "NIXL_ERR_BACKEND to decode-0 rank 2")
        .unwrap();
    ranks[1]
        .fail(101, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    ranks[3].kill9();
    ranks[0]
        .fail(102, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    for r in [&a, &b, &c] {
        eventually(
            Duration::from_secs(20),
            "room 102 resolved on every replica",
            || async {
                let (_, v) = r.get("/v1/rooms/102/verdict?group=rep-0").await.ok()?;
                (v["status"] == "resolved").then_some(())
            },
        )
        .await
        .unwrap();
    }
    same_bytes(&[&a, &b, &c]).await;

    // A scheduler asks about room 103 before any record exists, through all three replicas,
    // A first; A is SIGKILLed while the long poll waits there.
    let urls = format!("{},{},{}", a.url, b.url, c.url);
    let mut why = Command::new(BIN)
        .args([
            "why",
            "103",
            "--group",
            "rep-1",
            "--wait-ms",
            "20000",
            "--coordinator",
            &urls,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A logs each verdict question (debug): the long poll is waiting there once it says so.
    let waiting = eventually(Duration::from_secs(10), "why's long poll waiting on replica A", || {
        let log = a.log_text();
        async move {
            log.lines()
                .any(|l| l.contains("verdict asked") && l.contains("20000") && l.contains("rep-1"))
                .then_some(())
        }
    })
    .await;
    if let Err(e) = waiting {
        let _ = why.kill();
        let out = why.wait_with_output().map(|o| format!("{o:?}")).unwrap_or_default();
        let log: Vec<String> = a
            .log_text()
            .lines()
            .filter(|l| l.contains("verdict"))
            .map(str::to_string)
            .collect();
        panic!("{e}: why: {out}\nA: {log:#?}");
    }
    let killed = std::time::Instant::now();
    a.kill();
    other[1]
        .fail(103, "local", "transfer_timeout", "no notification in 30 s")
        .unwrap();
    let out = tokio::task::spawn_blocking(move || why.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    // A figure for the README, not an assertion (shared machines are noisy).
    eprintln!(
        "why failed over and printed the culprit {:?} after replica A was SIGKILLed",
        killed.elapsed()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("room 103: resolved"), "{stdout}");
    assert!(stdout.contains("culprit: rep-1 rank 1"), "{stdout}");

    // The killed replica, restarted, answers the same bytes as the others.
    let restarted = std::time::Instant::now();
    a.restart().await.unwrap();
    eprintln!("replica A restarted and ready in {:?}", restarted.elapsed());
    same_bytes(&[&a, &b, &c]).await;
}
