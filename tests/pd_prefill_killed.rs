//! SIGKILL of one prefill rank of four: it leaves no record of its own, yet every survivor's
//! room resolves to it once its lease expires (`source: lease_expired`).

use rootrank_testkit::pd::simulate;
use rootrank_testkit::{Coordinator, Etcd};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_rooms_resolve_to_the_killed_prefill_rank() {
    let etcd = Etcd::start().expect("etcd");
    let coord = Coordinator::start(&etcd.endpoint(), &[]).await.expect("coordinator");
    let logs = tempfile::tempdir().expect("tempdir");
    let run = simulate(
        &etcd.endpoint(),
        logs.path(),
        &[
            "--ranks",
            "4",
            "--rooms",
            "5",
            "--room-rate",
            "10",
            "--block-size",
            "65536",
            "--lease-ttl-ms",
            "1000",
            "--coordinator",
            &coord.url,
            "--kill-prefill-rank",
            "1@2",
        ],
    )
    .await
    .expect("simulate");
    for idx in 0..2 {
        assert_eq!(
            run.room(idx).unwrap()["status"],
            "success",
            "{}",
            run.room(idx).unwrap()
        );
    }
    for idx in 2..5 {
        let room = run.room(idx).unwrap();
        assert_eq!(room["status"], "failed", "{room}");
        let reports = room["reports"].as_array().expect("reports");
        let ranks: Vec<u64> = reports.iter().filter_map(|r| r["rank"].as_u64()).collect();
        assert_eq!(ranks, vec![0, 2, 3], "the three survivors reported: {room}");
        for r in reports {
            // Each survivor only saw Failed from the all-reduce, and no survivor is left
            // with an unresolved room: its wait outlasts the 1 s lease.
            assert!(
                r["generic"]
                    .as_str()
                    .is_some_and(|g| g.ends_with("NIXL KVSender Exception")),
                "{r}"
            );
            let v = &r["verdict"];
            assert_eq!(v["status"], "resolved", "survivor {} room {idx}: {v}", r["rank"]);
            assert_eq!(v["culprit"]["group"], "prefill-0", "{v}");
            assert_eq!(v["culprit"]["rank"], 1, "{v}");
            assert_eq!(v["culprit"]["source"], "lease_expired", "{v}");
            assert_eq!(v["action"], "abort_and_restart_group", "{v}");
        }
        // Any replica asked later says the same.
        let id = run.room_id(idx).unwrap();
        let (status, v) = coord
            .get(&format!("/v1/rooms/{id}/verdict?group=prefill-0"))
            .await
            .expect("verdict");
        assert_eq!(status, 200);
        assert_eq!(v["status"], "resolved", "{v}");
        assert_eq!(v["culprit"]["rank"], 1, "{v}");
        let pid = run.report["prefill_pids"][1].as_u64().expect("pid of rank 1");
        assert_eq!(v["culprit"]["pid"], pid, "the verdict names the killed process: {v}");
    }
}
