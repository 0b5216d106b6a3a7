//! Start-up with parallel snapshot readers, proven to change nothing: the readers hand pages
//! over in no key order (a group's certificate may arrive after its rooms), and the index
//! decides rooms only once the snapshot is complete. Two coordinators on the same etcd, one
//! reading with 1 reader and one with 8, answer byte-identical groups, failures and verdicts,
//! and the verdicts are the right ones.

use std::time::Duration;

use rootrank_store::etcd_client::{Txn, TxnOp};
use rootrank_testkit::{eventually, Coordinator, Etcd};
use serde_json::{json, Value};

const GROUPS: u64 = 300;
const ROOMS_PER_GROUP: u64 = 20; // 48,000 records: more than 8 pages, so the first range is cut at once
const SIZE: u64 = 8;

fn group(g: u64) -> String {
    format!("{}-{g}", if g % 2 == 0 { "prefill" } else { "decode" })
}

fn room(g: u64, i: u64) -> u64 {
    // Spread over the whole room space, as SGLang's random bootstrap rooms are.
    let mut z = (g * 1_000 + i).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) >> 1
}

/// The rank to blame in group `g`, and whether a certificate (rather than its own record)
/// says so: every third group lost a rank to the OOM killer before its rooms failed, and its
/// rooms hold only `propagated` records.
fn culprit(g: u64) -> (u64, bool) {
    (g % SIZE, g % 3 == 0)
}

/// The log without terminal colours.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

async fn body(url: &str) -> (u16, Vec<u8>) {
    let r = rootrank_tls::http_client(None)
        .unwrap()
        .build()
        .unwrap()
        .get(url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.bytes().await.unwrap().to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_snapshot_readers_build_the_same_index_as_one() {
    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    let mut c = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![ep.clone()]))
        .await
        .unwrap();
    let p = "/rootrank/v1/groups";
    let now = rootrank_store::unix_ms();
    let at = |ms: i64| rootrank_core::time::format_ms(ms);
    // Certificates first: the deaths come before the rooms' records in revision order, as
    // the watchdog's certificate comes before the records of the rooms the death fails.
    let mut ops = Vec::new();
    for g in 0..GROUPS {
        let (rank, certified) = culprit(g);
        if certified {
            let v = json!({"v": 1, "group": group(g), "rank": rank, "incarnation": (7000 + g).to_string(),
                "reason": "oom_host", "detail": "killed by the kernel OOM killer", "source": "watchdog",
                "at": at(now - 1_000), "host": "node-1", "pid": 4000 + g});
            ops.push(TxnOp::put(
                format!("{p}/{}/ranks/{rank}/down/{}", group(g), 7000 + g),
                v.to_string(),
                None,
            ));
        }
    }
    for chunk in ops.chunks(128) {
        c.txn(Txn::new().and_then(chunk.to_vec())).await.unwrap();
    }
    let mut ops = Vec::new();
    for g in 0..GROUPS {
        let (culprit_rank, certified) = culprit(g);
        for i in 0..ROOMS_PER_GROUP {
            for r in 0..SIZE {
                let local = r == culprit_rank && !certified;
                let v = json!({"v": 1, "group": group(g), "rank": r, "room": room(g, i).to_string(),
                    "origin": if local { "local" } else { "propagated" },
                    "reason": if local { "nixl_error" } else { "peer_disconnect" },
                    "detail": if local { "NIXL_ERR_BACKEND: connection reset" } else { "Failed due to an unknown reason from another rank" },
                    "at": at(now)});
                ops.push(TxnOp::put(
                    format!("{p}/{}/rooms/{}/ranks/{r}", group(g), room(g, i)),
                    v.to_string(),
                    None,
                ));
            }
        }
    }
    for chunk in ops.chunks(128) {
        c.txn(Txn::new().and_then(chunk.to_vec())).await.unwrap();
    }

    let one = Coordinator::start(&ep, &["--snapshot-readers", "1"]).await.unwrap();
    let eight = Coordinator::start(&ep, &["--snapshot-readers", "8"]).await.unwrap();
    // The parallel load really ran in parts (a log line per snapshot says how it read).
    let log = eventually(Duration::from_secs(10), "the snapshot log line", || async {
        let text = strip_ansi(&eight.log_text());
        text.lines().find(|l| l.contains("snapshot read")).map(str::to_string)
    })
    .await
    .unwrap();
    assert!(log.contains("readers=8"), "{log}");
    assert!(
        !log.contains("busy_readers=1 "),
        "the load was split between readers: {log}"
    );
    // Every record and certificate, plus the first replica's presence key.
    let keys: u64 = log
        .split_whitespace()
        .find_map(|w| w.strip_prefix("keys="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(keys > GROUPS * ROOMS_PER_GROUP * SIZE + GROUPS / 3, "{log}");

    // Byte-identical at the same revision: each replica's presence key is written while the
    // other loads, so wait until both have applied the same last event.
    eventually(Duration::from_secs(20), "both replicas at one revision", || async {
        let (ra, rb) = (one.get("/v1/groups").await.ok()?, eight.get("/v1/groups").await.ok()?);
        let (ra, rb) = (ra.1["revision"].as_i64()?, rb.1["revision"].as_i64()?);
        (ra == rb).then_some(())
    })
    .await
    .unwrap();

    let mut paths = vec!["/v1/groups".to_string(), "/v1/failures?limit=100".to_string()];
    for g in (0..GROUPS).step_by(7) {
        paths.push(format!("/v1/groups/{}", group(g)));
        paths.push(format!(
            "/v1/rooms/{}/verdict?group={}",
            room(g, g % ROOMS_PER_GROUP),
            group(g)
        ));
    }
    for path in &paths {
        let (a, b) = (
            body(&format!("{}{path}", one.url)).await,
            body(&format!("{}{path}", eight.url)).await,
        );
        assert_eq!(a.0, 200, "{path}: {}", String::from_utf8_lossy(&a.1));
        // Where they first differ, with some context (the bodies are hundreds of KB).
        let at =
            a.1.iter()
                .zip(&b.1)
                .position(|(x, y)| x != y)
                .unwrap_or(a.1.len().min(b.1.len()));
        let around =
            |v: &[u8]| String::from_utf8_lossy(&v[at.saturating_sub(300)..(at + 300).min(v.len())]).into_owned();
        assert!(
            a == b,
            "{path} differs between 1 and 8 snapshot readers at byte {at}:\n{}\n{}",
            around(&a.1),
            around(&b.1)
        );
    }
    // And the answers are right, not merely equal.
    for g in 0..GROUPS {
        let (rank, certified) = culprit(g);
        let url = format!("{}/v1/rooms/{}/verdict?group={}", eight.url, room(g, 0), group(g));
        let (status, raw) = body(&url).await;
        assert_eq!(status, 200);
        let v: Value = serde_json::from_slice(&raw).unwrap();
        assert_eq!(v["status"], "resolved", "{v}");
        assert_eq!(v["culprit"]["rank"], rank, "{v}");
        assert_eq!(
            v["culprit"]["source"],
            if certified { "down_certificate" } else { "room_record" },
            "{v}"
        );
    }
    let (_, metrics) = body(&format!("{}/metrics", eight.url)).await;
    let metrics = String::from_utf8(metrics).unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l == format!("rootrank_index_rooms {}", GROUPS * ROOMS_PER_GROUP)),
        "rootrank_index_rooms should be {}",
        GROUPS * ROOMS_PER_GROUP
    );
}
