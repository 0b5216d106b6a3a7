//! SIGKILL of a decode peer in the middle of a room's transfer: the prefill rank records a
//! first-hand (`local`) failure naming that peer, and the coordinator names the prefill rank.

use rootrank_testkit::pd::{room_record, simulate};
use rootrank_testkit::{Coordinator, Etcd};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_peer_killed_mid_transfer_is_a_local_nixl_error() {
    let etcd = Etcd::start().expect("etcd");
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.expect("coordinator");
    let logs = tempfile::tempdir().expect("tempdir");
    let run = simulate(
        &etcd.endpoint(),
        logs.path(),
        &[
            "--ranks",
            "2",
            "--rooms",
            "3",
            "--room-rate",
            "10",
            "--block-size",
            "1048576",
            "--chunks",
            "2",
            "--lease-ttl-ms",
            "1000",
            "--coordinator",
            &coord.url,
            "--kill-decode-rank",
            "1@1",
        ],
    )
    .await
    .expect("simulate");
    assert_eq!(run.room(0).unwrap()["status"], "success");
    let room1 = run.room(1).unwrap();
    assert_eq!(room1["status"], "failed", "{room1}");
    let room = run.room_id(1).unwrap();

    let rec = room_record(&etcd.endpoint(), "prefill-0", &room, 1)
        .await
        .expect("etcd read")
        .unwrap_or_else(|| panic!("no record of prefill rank 1 for room {room}; stderr:\n{}", run.stderr));
    assert_eq!(rec["origin"], "local", "{rec}");
    // The kill lands between the room's two chunks; the next WRITE fails inside NIXL with a
    // backend error while the dead peer's lease (1 s) still stands, so it is not yet confirmed
    // as a disconnect.
    assert_eq!(rec["reason"], "nixl_error", "{rec}");
    let detail = rec["detail"].as_str().expect("detail");
    assert!(
        detail.contains(&format!("NIXL transfer encountered ERR room={room}")),
        "{detail}"
    );
    assert!(detail.contains("NIXL_ERR_BACKEND"), "{detail}");
    assert_eq!(rec["peer"]["group"], "decode-0", "{rec}");
    assert_eq!(rec["peer"]["rank"], 1, "{rec}");
    assert!(
        rec["peer"]["agent"].as_str().is_some_and(|a| a.len() == 36),
        "a UUID agent name: {rec}"
    );
    assert!(
        rec["peer"]["endpoint"].as_str().is_some_and(|e| e.contains("pid")),
        "{rec}"
    );
    // Rank 0 did not fail itself: its record is propagated, never a root cause.
    let other = room_record(&etcd.endpoint(), "prefill-0", &room, 0)
        .await
        .expect("etcd read")
        .expect("rank 0's record");
    assert_eq!(other["origin"], "propagated", "{other}");
    assert_eq!(other["detail"], "NIXL KVSender Exception");

    let (status, v) = coord
        .get(&format!("/v1/rooms/{room}/verdict?group=prefill-0&wait_ms=5000"))
        .await
        .expect("verdict");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "resolved", "{v}");
    assert_eq!(v["culprit"]["group"], "prefill-0", "{v}");
    assert_eq!(v["culprit"]["rank"], 1, "{v}");
    assert_eq!(v["culprit"]["source"], "room_record", "{v}");
    assert!(
        v["culprit"]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("NIXL_ERR_BACKEND")),
        "{v}"
    );
    // The survivor asked where SGLang raises its generic error and got the same culprit.
    let survivor = room1["reports"]
        .as_array()
        .expect("reports")
        .iter()
        .find(|r| r["rank"] == 0)
        .expect("rank 0 reported");
    assert_eq!(
        survivor["generic"],
        format!("KVTransferError(bootstrap_room={room}): NIXL KVSender Exception")
    );
    assert_eq!(survivor["verdict"]["culprit"]["rank"], 1, "{survivor}");
}
