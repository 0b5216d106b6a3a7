//! Cross-process DRAM transfers through the simulated deployment arrive intact and notified,
//! and the ranks register like any rank (pids, NIXL agent names).

use rootrank_testkit::pd::simulate;
use rootrank_testkit::processes_mentioning;
use rootrank_testkit::Etcd;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_shards_arrive_intact_and_notified() {
    let etcd = Etcd::start().expect("etcd");
    let logs = tempfile::tempdir().expect("tempdir");
    let run = simulate(
        &etcd.endpoint(),
        logs.path(),
        &[
            "--ranks",
            "2",
            "--rooms",
            "4",
            "--room-rate",
            "20",
            "--block-size",
            "65536",
            "--chunks",
            "3",
            "--lease-ttl-ms",
            "1000",
        ],
    )
    .await
    .expect("simulate");
    assert_eq!(run.rooms.len(), 4, "stderr:\n{}", run.stderr);
    for room in &run.rooms {
        assert_eq!(room["status"], "success", "{room}");
        assert_eq!(room["reduced"], 4, "KVPoll Success after the MIN all-reduce: {room}");
        // Decode checked every source's bytes, and only after all its tagged notifications
        // ({room}_kv_{chunk}_{is_last}_{src}) were in.
        assert_eq!(
            room["decode_checks"],
            serde_json::json!([[0, true], [1, true]]),
            "{room}"
        );
        let r: u64 = room["room"].as_str().expect("decimal").parse().expect("u64");
        assert!(r <= i64::MAX as u64);
    }
    let pids = run.report["prefill_pids"].as_array().expect("pids");
    assert!(pids.iter().all(|p| p.as_u64().is_some_and(|p| p > 0)), "{pids:?}");

    // Their live records carried pids and NIXL agent names while they ran; after the clean
    // exit each wrote a shutdown certificate (the launcher wrote none: the ranks' own agents did).
    let mut c = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![etcd.endpoint()]))
        .await
        .expect("client");
    let downs = c
        .get(
            "/rootrank/v1/groups/",
            Some(rootrank_store::etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("get");
    let shutdowns = downs
        .kvs()
        .iter()
        .filter(|kv| kv.key_str().is_ok_and(|k| k.contains("/down/")))
        .filter(|kv| {
            serde_json::from_slice::<serde_json::Value>(kv.value())
                .is_ok_and(|v| v["reason"] == "shutdown" && v["source"] == "agent")
        })
        .count();
    assert_eq!(shutdowns, 4, "every rank exited cleanly through its agent");
    let left: Vec<String> = processes_mentioning("sim-rank")
        .into_iter()
        .filter(|p| p.contains(&etcd.endpoint()))
        .collect();
    assert!(left.is_empty(), "ranks left behind: {left:?}");
}
