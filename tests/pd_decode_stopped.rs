//! SIGSTOP of a decode peer: NIXL reports nothing, the WRITE times out, the prefill rank
//! records `transfer_timeout`, and the sender never hangs (the simulation finishes).

use rootrank_testkit::pd::{room_record, simulate};
use rootrank_testkit::{Coordinator, Etcd};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_decode_peer_is_a_recorded_transfer_timeout() {
    let etcd = Etcd::start().expect("etcd");
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.expect("coordinator");
    let logs = tempfile::tempdir().expect("tempdir");
    // 16 MiB in one chunk: more than socket buffers take from a stopped receiver.
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
            "16777216",
            "--chunks",
            "1",
            "--slots",
            "2",
            "--transfer-timeout-ms",
            "800",
            "--lease-ttl-ms",
            "1000",
            "--coordinator",
            &coord.url,
            "--stop-decode-rank",
            "0@1",
        ],
    )
    .await
    .expect("simulate");
    // Every room came to an end: nobody hung on the stopped peer.
    assert_eq!(run.rooms.len(), 3);
    assert!(run.rooms.iter().all(|r| r["status"] != "incomplete"), "{:?}", run.rooms);
    assert_eq!(run.room(0).unwrap()["status"], "success");
    let room1 = run.room(1).unwrap();
    assert_eq!(room1["status"], "failed", "{room1}");
    let room = run.room_id(1).unwrap();
    let rec = room_record(&etcd.endpoint(), "prefill-0", &room, 0)
        .await
        .expect("etcd read")
        .expect("prefill rank 0's record");
    assert_eq!(rec["origin"], "local", "{rec}");
    assert_eq!(rec["reason"], "transfer_timeout", "{rec}");
    assert_eq!(rec["peer"]["group"], "decode-0");
    assert_eq!(rec["peer"]["rank"], 0);
    let detail = rec["detail"].as_str().expect("detail");
    assert!(
        detail.contains(&format!("NIXL transfer encountered ERR room={room}")),
        "{detail}"
    );
    assert!(detail.contains("did not complete within 800 ms"), "{detail}");
    // The other prefill rank asked and was told who.
    let survivor = room1["reports"]
        .as_array()
        .expect("reports")
        .iter()
        .find(|r| r["rank"] == 1)
        .expect("rank 1");
    assert_eq!(survivor["verdict"]["status"], "resolved", "{survivor}");
    assert_eq!(survivor["verdict"]["culprit"]["rank"], 0, "{survivor}");
    assert_eq!(
        survivor["verdict"]["culprit"]["reason"], "transfer_timeout",
        "{survivor}"
    );
}
