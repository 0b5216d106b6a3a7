//! End to end on real etcd, a real coordinator process and real rank processes (each a
//! `rootrank rank` with an embedded agent): SPEC sections 4-6 as an operator sees them.

use std::time::Duration;

use rootrank_store::etcd_client;
use rootrank_testkit::{eventually, Coordinator, Etcd, Rank};
use serde_json::Value;

const T: Duration = Duration::from_secs(20);

fn ranks(etcd: &Etcd, group: &str, n: u32, ttl_ms: u64) -> Vec<Rank> {
    (0..n)
        .map(|r| Rank::start(&etcd.endpoint(), group, r, n, ttl_ms).expect("rank starts"))
        .collect()
}

async fn verdict(c: &Coordinator, room: u64, query: &str) -> Value {
    let (status, v) = c
        .get(&format!("/v1/rooms/{room}/verdict{query}"))
        .await
        .expect("coordinator answers");
    assert_eq!(status, 200, "{v}");
    v
}

async fn resolved(c: &Coordinator, room: u64) -> Value {
    eventually(T, "a resolved verdict", || async {
        let v = verdict(c, room, "").await;
        (v["status"] == "resolved").then_some(v)
    })
    .await
    .expect("verdict resolves")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_record_names_the_failing_rank_over_its_propagated_siblings() {
    let etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut rs = ranks(&etcd, "prefill-0", 4, 5000);
    let room = 9_223_372_036_854_775_807u64; // the largest bootstrap_room SGLang mints
    rs[0]
        .fail(room, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    rs[2]
        .fail(
            room,
            "local",
            "nixl_error",
            "NIXL transfer encountered ERR room=9223372036854775807",
        )
        .unwrap();
    rs[1]
        .fail(room, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    rs[3]
        .fail(room, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    for r in &mut rs {
        r.flush().unwrap();
    }
    let v = resolved(&coord, room).await;
    assert_eq!(v["room"], "9223372036854775807");
    assert_eq!(v["action"], "abort");
    assert_eq!(v["culprit"]["rank"], 2);
    assert_eq!(v["culprit"]["reason"], "nixl_error");
    assert_eq!(v["culprit"]["source"], "room_record");
    assert_eq!(v["culprit"]["pid"], rs[2].pid);
    assert_eq!(v["culprit"]["incarnation"], rs[2].incarnation.as_str());
    let evidence = eventually(T, "all four records", || async {
        let v = verdict(&coord, room, "").await;
        (v["evidence"].as_array().map(Vec::len) == Some(4)).then_some(v)
    })
    .await
    .unwrap();
    assert_eq!(
        evidence["culprit"]["rank"], 2,
        "first local record still wins once all arrived"
    );
    // The CLI says the same, for people, and exits 0 for resolved.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rootrank"))
        .args(["why", &room.to_string(), "--coordinator", &coord.url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("prefill-0 rank 2") && text.contains("nixl_error"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_rank_is_named_once_its_lease_expires() {
    let etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut rs = ranks(&etcd, "prefill-1", 4, 1000);
    let room = 4242u64;
    let victim_pid = rs[3].pid;
    rs[3].kill9(); // as the OOM killer would: no last words
    for r in rs.iter_mut().take(3) {
        r.fail(room, "propagated", "other", "NIXL KVSender Exception").unwrap();
        r.flush().unwrap();
    }
    let v = resolved(&coord, room).await;
    assert_eq!(v["culprit"]["rank"], 3);
    assert_eq!(v["culprit"]["source"], "lease_expired");
    assert_eq!(v["culprit"]["reason"], "lease_expired");
    assert_eq!(v["culprit"]["pid"], victim_pid);
    assert_eq!(v["action"], "abort_and_restart_group");
    let (status, g) = coord.get("/v1/groups/prefill-1").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(g["ranks"][3]["state"], "down", "{g}");
    assert_eq!(g["ranks"][0]["state"], "live", "{g}");
    let (_, all) = coord.get("/v1/groups").await.unwrap();
    let summary = all["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == "prefill-1")
        .unwrap()
        .clone();
    assert_eq!(
        (summary["live"].as_u64(), summary["down"].as_u64()),
        (Some(3), Some(1)),
        "{summary}"
    );
    // The death is persisted as a certificate (written right after the verdict resolved in
    // memory), so it outlives the coordinator: exactly one.
    let client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let certs = eventually(T, "the lease_expired certificate in etcd", || {
        let mut client = client.clone();
        async move {
            let opts = etcd_client::GetOptions::new().with_prefix();
            let r = client
                .get("/rootrank/v1/groups/prefill-1/ranks/3/down/", Some(opts))
                .await
                .ok()?;
            (!r.kvs().is_empty()).then(|| r.kvs().to_vec())
        }
    })
    .await
    .unwrap();
    assert_eq!(certs.len(), 1);
    let cert: Value = serde_json::from_slice(certs[0].value()).unwrap();
    assert_eq!(
        (cert["source"].as_str(), cert["reason"].as_str()),
        (Some("coordinator"), Some("lease_expired"))
    );
    let (_, f) = coord.get("/v1/failures?group=prefill-1").await.unwrap();
    assert_eq!(f["failures"][0]["rank"], 3, "{f}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_returns_as_soon_as_the_culprits_record_lands() {
    let etcd = Etcd::start().unwrap();
    // One long poll at a time: while one waits in the server, any other is turned away with
    // 503 too_many_waiters, which makes "the long poll is waiting in the server" observable.
    let coord = Coordinator::start(&etcd.endpoint(), &["--max-long-polls", "1"])
        .await
        .unwrap();
    let mut rs = ranks(&etcd, "prefill-2", 2, 5000);
    let room = 77u64;
    rs[0]
        .fail(room, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    rs[0].flush().unwrap();
    assert_eq!(verdict(&coord, room, "").await["status"], "pending");
    // A scheduler at the generic fallback asks, willing to wait 30 s.
    let url = format!(
        "{}/v1/rooms/{room}/verdict?group=prefill-2&wait_ms=30000&asking_rank=0",
        coord.url
    );
    let asking = tokio::spawn(async move {
        loop {
            let answer = rootrank_testkit::get(&url).await;
            match &answer {
                // The probe below held the only slot for a moment: ask again, as a client told
                // 503 with Retry-After would.
                Ok((503, v)) if v["error"]["code"] == "too_many_waiters" => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                _ => return answer,
            }
        }
    });
    // Wait until the server holds it: a second long poll (on a room nobody asked about) finds
    // the only slot taken. A request never sent, or answered at once without waiting, never
    // holds the slot, and this times out.
    eventually(T, "the long poll waiting in the coordinator", || async {
        let (status, v) = coord.get("/v1/rooms/78/verdict?group=prefill-2&wait_ms=1").await.ok()?;
        (status == 503 && v["error"]["code"] == "too_many_waiters").then_some(())
    })
    .await
    .expect("the long poll reached the coordinator and waits there");
    assert!(!asking.is_finished(), "the long poll must wait while nothing is known");
    let mut r1 = rs.remove(1);
    tokio::task::spawn_blocking(move || {
        r1.fail(room, "local", "transfer_timeout", "KVSender transfer timed out")
            .unwrap();
        r1.flush().unwrap();
        r1
    })
    .await
    .unwrap();
    // Well before the 30 s wait ends, the answer is there.
    let (status, v) = tokio::time::timeout(Duration::from_secs(10), asking)
        .await
        .expect("long poll returned on landing")
        .unwrap()
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(v["status"], "resolved");
    assert_eq!(v["culprit"]["rank"], 1);
    assert_eq!(v["culprit"]["reason"], "transfer_timeout");
    // A short wait on a room nobody reported ends with what is known: pending.
    let v = verdict(&coord, 78, "?group=prefill-2&wait_ms=200").await;
    assert_eq!(v["status"], "pending");
    assert_eq!(v["action"], "wait");
}

/// The parts of a verdict that are a function of etcd state (not of when it was asked).
fn stable(v: &Value) -> Value {
    serde_json::json!({"status": v["status"], "action": v["action"], "culprit": v["culprit"], "evidence": v["evidence"], "groups": v["groups"]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_coordinator_answers_the_same_verdicts() {
    let etcd = Etcd::start().unwrap();
    let mut coord = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut rs = ranks(&etcd, "prefill-3", 4, 1000);
    rs[1].fail(1001, "local", "nixl_error", "NIXL_ERR_BACKEND").unwrap();
    rs[0]
        .fail(1001, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    rs[2].kill9();
    rs[0]
        .fail(1002, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    rs[3]
        .fail(1002, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    for i in [0, 1, 3] {
        rs[i].flush().unwrap();
    }
    resolved(&coord, 1001).await;
    assert_eq!(resolved(&coord, 1002).await["culprit"]["rank"], 2);
    // Once everything has landed (the death is evidence for both rooms), take the answers.
    let before = [verdict(&coord, 1001, "").await, verdict(&coord, 1002, "").await];
    assert_eq!(before[0]["evidence"].as_array().map(Vec::len), Some(3));
    let (_, group_before) = coord.get("/v1/groups/prefill-3").await.unwrap();
    // The vanished live key is persisted (a certificate) right after it is seen; only what
    // is in etcd survives a restart, so wait for it as an operator would.
    let client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    eventually(T, "rank 2's lease_expired certificate", || {
        let mut client = client.clone();
        async move {
            let opts = etcd_client::GetOptions::new().with_prefix();
            let r = client
                .get("/rootrank/v1/groups/prefill-3/ranks/2/down/", Some(opts))
                .await
                .ok()?;
            (!r.kvs().is_empty()).then_some(())
        }
    })
    .await
    .unwrap();
    coord.restart().await.unwrap();
    for (room, b) in [1001u64, 1002].iter().zip(&before) {
        let after = verdict(&coord, *room, "").await;
        assert_eq!(stable(&after), stable(b), "room {room} after restart");
    }
    let (_, group_after) = coord.get("/v1/groups/prefill-3").await.unwrap();
    assert_eq!(group_after, group_before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_loses_no_record_and_the_coordinator_recovers() {
    let mut etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut rs = ranks(&etcd, "prefill-4", 2, 5000);
    etcd.kill();
    // While etcd is down, the ranks keep failing rooms: the agents queue and retry.
    for room in 0..50u64 {
        rs[0]
            .fail(
                5000 + room,
                "local",
                "ucx_error",
                "UCX ERROR Connection reset by remote peer",
            )
            .unwrap();
        rs[1]
            .fail(5000 + room, "propagated", "other", "NIXL KVSender Exception")
            .unwrap();
    }
    let (ready, _) = eventually(T, "readyz 503 while etcd is down", || async {
        let r = coord.get("/readyz").await.ok()?;
        (r.0 == 503).then_some(r)
    })
    .await
    .unwrap();
    assert_eq!(ready, 503);
    tokio::time::sleep(Duration::from_millis(500)).await;
    etcd.restart().unwrap();
    for r in &mut rs {
        r.flush().unwrap();
    }
    eventually(T, "readyz 200 after etcd is back", || async {
        (coord.get("/readyz").await.ok()?.0 == 200).then_some(())
    })
    .await
    .unwrap();
    for room in 0..50u64 {
        let v = eventually(T, "both records of the room", || async {
            let v = verdict(&coord, 5000 + room, "").await;
            (v["evidence"].as_array().map(Vec::len) == Some(2)).then_some(v)
        })
        .await
        .unwrap();
        assert_eq!(v["culprit"]["rank"], 0);
        assert_eq!(v["culprit"]["reason"], "ucx_error");
    }
    // The ranks are still live: their leases survived the etcd restart.
    let (_, g) = coord.get("/v1/groups/prefill-4").await.unwrap();
    assert_eq!(g["ranks"][0]["state"], "live", "{g}");
    assert_eq!(
        rs[0]
            .send("stats")
            .unwrap()
            .split_whitespace()
            .find(|w| w.starts_with("dropped=")),
        Some("dropped=0")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_json_errors_and_bad_etcd_values_are_skipped_and_counted() {
    let etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut rs = ranks(&etcd, "prefill-5", 2, 5000);
    rs[1].fail(31, "local", "oom_gpu", "CUDA out of memory").unwrap();
    rs[1].flush().unwrap();
    let huge = "9".repeat(16_000); // over the 8 KiB URI bound, under the client's own limit
    let cases: Vec<(String, u16, &str)> = vec![
        ("/v1/rooms/abc/verdict".into(), 400, "invalid_room"),
        ("/v1/rooms/-1/verdict".into(), 400, "invalid_room"),
        ("/v1/rooms/9223372036854775808/verdict".into(), 400, "invalid_room"),
        ("/v1/rooms/1/verdict?group=bad%2Fgroup".into(), 400, "invalid_group"),
        ("/v1/rooms/1/verdict?wait_ms=30001".into(), 400, "invalid_wait_ms"),
        ("/v1/rooms/1/verdict?wait_ms=-5".into(), 400, "invalid_wait_ms"),
        ("/v1/rooms/1/verdict?asking_rank=x".into(), 400, "invalid_asking_rank"),
        ("/v1/rooms/1/verdict?nonsense=1".into(), 400, "invalid_query"),
        ("/v1/rooms/1/verdict?wait_ms=1&wait_ms=2".into(), 400, "invalid_query"),
        ("/v1/groups/nope-never-seen".into(), 404, "unknown_group"),
        ("/v1/groups/a%20b".into(), 400, "invalid_group"),
        ("/v1/failures?limit=0".into(), 400, "invalid_limit"),
        ("/v1/groups?limit=0".into(), 400, "invalid_limit"),
        ("/v1/groups?limit=10001".into(), 400, "invalid_limit"),
        ("/v1/groups?after=prefill-1".into(), 400, "invalid_query"),
        ("/v1/groups?limit=5&after=a%20b".into(), 400, "invalid_group"),
        ("/v2/anything".into(), 404, "not_found"),
        (format!("/v1/rooms/{huge}/verdict"), 400, "request_too_large"),
        (
            format!("/v1/rooms/1/verdict?group={}", "g".repeat(7000)),
            400,
            "invalid_group",
        ),
    ];
    for (path, status, code) in &cases {
        let (s, body) = coord.get(path).await.unwrap();
        assert_eq!(
            (s, body["error"]["code"].as_str()),
            (*status, Some(*code)),
            "{}: {body}",
            &path[..path.len().min(80)]
        );
        assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    // Malformed values written straight into etcd: skipped, counted, serving goes on.
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let bad = [
        ("/rootrank/v1/groups/prefill-5/rooms/31/ranks/0", "{not json"),
        (
            "/rootrank/v1/groups/prefill-5/rooms/32/ranks/0",
            r#"{"v":1,"group":"prefill-5","rank":0,"room":"32","origin":"sideways","reason":"x"}"#,
        ),
        ("/rootrank/v1/groups/prefill-5/ranks/0/down/5", r#"{"v":1}"#),
        (
            "/rootrank/v1/groups/prefill-5/ranks/0/live",
            r#"{"v":1,"group":"prefill-5","rank":7,"group_size":2}"#,
        ),
        ("/rootrank/v1/garbage", "x"),
    ];
    for (k, v) in bad {
        client.put(k, v, None).await.unwrap();
    }
    let metrics = eventually(T, "invalid records counted", || async {
        let (_, m) = coord.get("/metrics").await.ok()?;
        let m = m.as_str()?.to_string();
        let total: f64 = m
            .lines()
            .filter(|l| l.starts_with("rootrank_invalid_records_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        (total >= 5.0).then_some(m)
    })
    .await
    .unwrap();
    assert!(
        metrics.contains("rootrank_invalid_records_total{kind=\"room\"} 2"),
        "{metrics}"
    );
    let v = verdict(&coord, 31, "").await;
    assert_eq!(v["culprit"]["rank"], 1, "the good record still decides");
    assert_eq!(coord.get("/healthz").await.unwrap().0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_pass_promtool() {
    let etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut rs = ranks(&etcd, "prefill-6", 2, 1000);
    rs[0].fail(1, "local", "nixl_error", "x").unwrap();
    rs[0].flush().unwrap();
    resolved(&coord, 1).await;
    // A long poll is timed under its own route label, so it does not skew verdict latency.
    let (s, _) = coord.get("/v1/rooms/1/verdict?wait_ms=50").await.unwrap();
    assert_eq!(s, 200);
    // A rank that shut down cleanly is no outage: it has no rank_up series.
    rs[1].exit().unwrap();
    eventually(T, "rank 1 shut down", || async {
        let (_, g) = coord.get("/v1/groups/prefill-6").await.ok()?;
        (g["ranks"][1]["state"] == "shutdown").then_some(())
    })
    .await
    .unwrap();
    let (_, m) = coord.get("/metrics").await.unwrap();
    let text = m.as_str().unwrap().to_string();
    for name in [
        "rootrank_root_causes_total{",
        "rootrank_verdicts_total{",
        "rootrank_failure_records_total{",
        "rootrank_invalid_records_total{",
        "rootrank_rank_up{",
        "rootrank_index_rooms ",
        "rootrank_resolution_seconds_bucket",
        "rootrank_etcd_watch_restarts_total ",
        "rootrank_http_request_duration_seconds_bucket",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
    assert!(!text.contains("room=\""), "no room id ever becomes a label");
    assert!(text.contains("route=\"/v1/rooms/{room}/verdict (wait_ms)\""), "{text}");
    assert!(
        text.contains("rootrank_rank_up{group=\"prefill-6\",rank=\"0\"} 1"),
        "{text}"
    );
    assert!(
        !text.contains("rootrank_rank_up{group=\"prefill-6\",rank=\"1\"}"),
        "{text}"
    );
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool is installed (make deps installs prometheus)");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The coordinator's resident memory, from /proc (for the log; never asserted on).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Instances restart under new group names (the plugin names groups after `host:port`): once
/// their leases, records and certificates are gone from etcd, `/v1/groups` no longer lists
/// them and the index holds none of their rooms. 1,000 restarts in four waves, each waiting
/// out the retention (`--retention-s 2` here); their metric series go too. The RSS printed
/// after each wave (not asserted: the allocator keeps some freed pages, and the bounded event
/// ring fills up) shows whether memory stays flat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_etcd_no_longer_holds_are_forgotten_after_their_retention() {
    let etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(&etcd.endpoint(), &["--retention-s", "2"])
        .await
        .unwrap();
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let (waves, per_wave) = (4u64, 250u64);
    let listed = |c: &Coordinator| {
        let url = format!("{}/v1/groups", c.url);
        async move {
            let (_, v) = rootrank_testkit::get(&url).await.ok()?;
            Some(v["groups"].as_array()?.len())
        }
    };
    let mut rss = vec![coord.pid().map_or(0, rss_kib)];
    for wave in 0..waves {
        for j in 0..per_wave {
            let i = wave * per_wave + j;
            let g = format!("prefill-host:{}-dp0", 20_000 + i);
            let lease = client.lease_grant(2, None).await.unwrap().id();
            let live = serde_json::json!({"v": 1, "group": g, "rank": 0, "group_size": 1, "lease_ttl_ms": 2000});
            let opts = etcd_client::PutOptions::new().with_lease(lease);
            client
                .put(
                    format!("/rootrank/v1/groups/{g}/ranks/0/live"),
                    live.to_string(),
                    Some(opts.clone()),
                )
                .await
                .unwrap();
            let rec = serde_json::json!({"v": 1, "group": g, "rank": 0, "room": (i + 1).to_string(),
                "origin": "local", "reason": "nixl_error"});
            client
                .put(
                    format!("/rootrank/v1/groups/{g}/rooms/{}/ranks/0", i + 1),
                    rec.to_string(),
                    Some(opts),
                )
                .await
                .unwrap();
        }
        eventually(T, "every instance of the wave listed", || async {
            listed(&coord).await.filter(|n| *n == per_wave as usize)
        })
        .await
        .unwrap();
        // Leases expire (2 s), the coordinator certifies each vanished rank (kept 2 s), then
        // etcd holds nothing for these groups.
        eventually(Duration::from_secs(60), "no instance listed", || async {
            listed(&coord).await.filter(|n| *n == 0)
        })
        .await
        .unwrap();
        let metrics = rootrank_testkit::scrape_metrics(coord.url.trim_start_matches("http://"))
            .await
            .unwrap();
        assert!(
            metrics.lines().any(|l| l == "rootrank_index_rooms 0"),
            "the index still holds rooms of gone groups"
        );
        // The series go right after the index lets the group go (the sync loop drops them
        // once the index lock is released): moments after /v1/groups says so.
        let addr = coord.url.trim_start_matches("http://").to_string();
        eventually(Duration::from_secs(10), "no metric series of a gone group", || async {
            let text = rootrank_testkit::scrape_metrics(&addr).await.ok()?;
            (!text.contains("prefill-host:")).then_some(())
        })
        .await
        .unwrap();
        rss.push(coord.pid().map_or(0, rss_kib));
    }
    eprintln!("coordinator RSS (KiB) before and after each wave of {per_wave} instance restarts: {rss:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_page_through_in_key_order_with_a_cursor() {
    let etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let _a = ranks(&etcd, "page-c", 1, 5000);
    let _b = ranks(&etcd, "page-a", 2, 5000);
    let _c = ranks(&etcd, "page-b", 1, 5000);
    let all = eventually(T, "three groups", || async {
        let (_, all) = coord.get("/v1/groups").await.ok()?;
        (all["groups"].as_array()?.len() == 3).then_some(all)
    })
    .await
    .unwrap();
    assert!(all.get("next").is_none(), "a whole answer has no cursor: {all}");
    // Two at a time, following `next`: the same groups, in key order, and then no cursor.
    let (status, first) = coord.get("/v1/groups?limit=2").await.unwrap();
    assert_eq!(status, 200, "{first}");
    let names = |v: &Value| -> Vec<String> {
        v["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["group"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(&first), ["page-a", "page-b"], "{first}");
    assert_eq!(first["next"], "page-b", "{first}");
    assert_eq!(first["groups"][0]["live"], 2, "{first}");
    let (_, second) = coord.get("/v1/groups?limit=2&after=page-b").await.unwrap();
    assert_eq!(names(&second), ["page-c"], "{second}");
    assert!(second["next"].is_null(), "{second}");
    // A cursor is a group id, not an offset: one that is not a group still pages from there.
    let (_, from_gap) = coord.get("/v1/groups?limit=10&after=page-a0").await.unwrap();
    assert_eq!(names(&from_gap), ["page-b", "page-c"], "{from_gap}");
    let (_, whole) = coord.get("/v1/groups").await.unwrap();
    assert_eq!(names(&whole), ["page-a", "page-b", "page-c"]);
}
