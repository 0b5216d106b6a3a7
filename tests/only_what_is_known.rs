//! Only what is known, said as known (issue 28, finding 5), on real etcd, a real coordinator
//! and real rank processes. Each case is what a foreign writer, a typo or a missing rank did
//! to a coordinator that answered with confidence: a put over a record that turned a resolved
//! room back to `pending`, a record for rank 9 of a group of 4 named culprit, an `at` that is
//! no time read as "now", room key `02009` read as room 2009, a group nobody registered
//! called healthy, and a room nobody recorded resolved with nothing saying it was inferred.

use std::time::Duration;

use rootrank_store::etcd_client;
use rootrank_testkit::{eventually, Coordinator, Etcd, Rank};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(20);

async fn verdict(c: &Coordinator, room: u64, query: &str) -> Value {
    let (status, v) = c
        .get(&format!("/v1/rooms/{room}/verdict{query}"))
        .await
        .expect("coordinator answers");
    assert_eq!(status, 200, "{v}");
    v
}

async fn invalid(c: &Coordinator, kind: &str) -> f64 {
    let Ok((_, m)) = c.get("/metrics").await else {
        return 0.0;
    };
    let line = format!("rootrank_invalid_records_total{{kind=\"{kind}\"}} ");
    m.as_str()
        .unwrap_or("")
        .lines()
        .find_map(|l| l.strip_prefix(&line)?.parse().ok())
        .unwrap_or(0.0)
}

fn record(group: &str, rank: u32, room: &str, origin: &str, reason: &str, at: &str) -> String {
    json!({"v": 1, "group": group, "rank": rank, "room": room, "origin": origin, "reason": reason,
        "detail": format!("{reason} written by hand"), "at": at})
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overwrite_out_of_range_rank_bad_at_or_odd_room_key_changes_no_verdict() {
    let etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut ranks: Vec<Rank> = (0..4)
        .map(|r| Rank::start(&etcd.endpoint(), "prefill-9", r, 4, 5000).unwrap())
        .collect();
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let now = rootrank_core::time::format_ms(rootrank_store::unix_ms());
    let p = "/rootrank/v1/groups/prefill-9/rooms";

    // Room 71: rank 2 failed it first; the others saw the generic error.
    ranks[2].fail(71, "local", "nixl_error", "NIXL_ERR_BACKEND").unwrap();
    ranks[2].flush().unwrap();
    for r in [0, 1, 3] {
        ranks[r]
            .fail(71, "propagated", "peer_disconnect", "NIXL KVSender Exception")
            .unwrap();
        ranks[r].flush().unwrap();
    }
    let first = eventually(T, "room 71 resolved", || async {
        let v = verdict(&coord, 71, "").await;
        (v["status"] == "resolved").then_some(v)
    })
    .await
    .unwrap();
    assert_eq!(first["culprit"]["rank"], 2, "{first}");

    // A foreign writer puts over rank 2's record: resolved stays resolved, same culprit,
    // same reason (the first value counts), and the overwrite is counted.
    client
        .put(
            format!("{p}/71/ranks/2"),
            record("prefill-9", 2, "71", "propagated", "other", &now),
            None,
        )
        .await
        .unwrap();
    eventually(T, "the overwrite counted", || async {
        (invalid(&coord, "overwrite").await >= 1.0).then_some(())
    })
    .await
    .unwrap();
    let after = verdict(&coord, 71, "").await;
    assert_eq!(after["status"], "resolved", "{after}");
    assert_eq!(after["culprit"], first["culprit"], "{after}");

    // Room 72: a `local` record for rank 9 of this group of 4, written first, then the
    // group's real records (all propagated): rank 9 is no rank of the group.
    client
        .put(
            format!("{p}/72/ranks/9"),
            record("prefill-9", 9, "72", "local", "oom_gpu", &now),
            None,
        )
        .await
        .unwrap();
    // Room 73: a `local` record whose `at` is no time.
    client
        .put(
            format!("{p}/73/ranks/1"),
            record("prefill-9", 1, "73", "local", "oom_gpu", "yesterday"),
            None,
        )
        .await
        .unwrap();
    // Room 2009, written under the key `02009`.
    client
        .put(
            format!("{p}/02009/ranks/3"),
            record("prefill-9", 3, "2009", "local", "oom_gpu", &now),
            None,
        )
        .await
        .unwrap();
    for room in [72u64, 73, 2009] {
        ranks[0]
            .fail(room, "propagated", "peer_disconnect", "NIXL KVSender Exception")
            .unwrap();
    }
    ranks[0].flush().unwrap();
    eventually(T, "the bad records counted", || async {
        (invalid(&coord, "room").await >= 2.0 && invalid(&coord, "key").await >= 1.0).then_some(())
    })
    .await
    .unwrap();
    for room in [72u64, 73, 2009] {
        let v = verdict(&coord, room, "").await;
        assert_ne!(
            v["status"], "resolved",
            "room {room}: no rank of the group failed it: {v}"
        );
        assert!(v["culprit"].is_null(), "room {room}: {v}");
    }
    // A room key spelled otherwise is refused at the API too.
    let (status, body) = coord.get("/v1/rooms/02009/verdict").await.unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_room")),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_nobody_registered_is_unhealthy_and_an_unrecorded_room_says_it_was_inferred() {
    let etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let now = rootrank_core::time::format_ms(rootrank_store::unix_ms());

    // Only room records name decode-4: no rank of it ever registered.
    client
        .put(
            "/rootrank/v1/groups/decode-4/rooms/5/ranks/0",
            record("decode-4", 0, "5", "propagated", "peer_disconnect", &now),
            None,
        )
        .await
        .unwrap();
    let health = eventually(T, "decode-4 known", || async {
        let (status, v) = coord.get("/v1/health?group=decode-4").await.ok()?;
        (v["revision"].as_i64()? > 1).then_some((status, v))
    })
    .await
    .unwrap();
    assert_eq!(health.0, 503, "a group with no live rank is not healthy: {}", health.1);
    assert!(
        health.1["ranks"][0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no rank")),
        "{}",
        health.1
    );

    // prefill-8 loses rank 1 to SIGKILL; nobody records room 404 (a mistyped room, say).
    let mut ranks: Vec<Rank> = (0..2)
        .map(|r| Rank::start(&etcd.endpoint(), "prefill-8", r, 2, 1000).unwrap())
        .collect();
    eventually(T, "prefill-8 healthy", || async {
        (coord.get("/v1/health?group=prefill-8").await.ok()?.0 == 200).then_some(())
    })
    .await
    .unwrap();
    ranks[1].kill9();
    let v = eventually(T, "room 404 resolved from the death", || async {
        let v = verdict(&coord, 404, "?group=prefill-8").await;
        (v["status"] == "resolved").then_some(v)
    })
    .await
    .unwrap();
    assert_eq!(v["culprit"]["rank"], 1, "{v}");
    let deaths: Vec<&Value> = v["evidence"].as_array().unwrap().iter().collect();
    assert!(
        !deaths.is_empty() && deaths.iter().all(|e| e["inferred_from_death"] == true),
        "the evidence says it was inferred: {v}"
    );
    assert!(
        v["explain"].as_str().unwrap().contains("No rank recorded room 404"),
        "{v}"
    );

    // With a record of the room, the same death is evidence, not an inference.
    ranks[0]
        .fail(405, "propagated", "peer_disconnect", "NIXL KVSender Exception")
        .unwrap();
    ranks[0].flush().unwrap();
    let v = eventually(T, "room 405 resolved", || async {
        let v = verdict(&coord, 405, "").await;
        (v["status"] == "resolved").then_some(v)
    })
    .await
    .unwrap();
    assert_eq!(v["culprit"]["rank"], 1, "{v}");
    assert!(
        v["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e.get("inferred_from_death").is_none()),
        "{v}"
    );
}
