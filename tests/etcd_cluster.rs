//! A three-member etcd cluster loses a member while ranks publish: etcd-client keeps sending
//! a share of requests to the dead endpoint and its watches die, so every loop must retry.
//! Nothing published is lost, and verdicts keep coming.

use std::time::Duration;

use rootrank_testkit::{eventually, Coordinator, EtcdCluster, Rank};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_member_down_loses_nothing_and_the_coordinator_keeps_answering() {
    let mut cluster = EtcdCluster::start(3).unwrap();
    let endpoints = cluster.endpoints();
    let coord = Coordinator::start(&endpoints, &[]).await.unwrap();
    let mut rs: Vec<Rank> = (0..2)
        .map(|r| Rank::start(&endpoints, "prefill-7", r, 2, 5000).unwrap())
        .collect();
    cluster.members[0].kill();
    for room in 0..40u64 {
        rs[1]
            .fail(700 + room, "local", "nixl_error", "NIXL_ERR_BACKEND")
            .unwrap();
        rs[0]
            .fail(700 + room, "propagated", "other", "NIXL KVSender Exception")
            .unwrap();
    }
    for r in &mut rs {
        r.flush().unwrap();
    }
    for room in 0..40u64 {
        let v = eventually(Duration::from_secs(30), "both records of the room", || async {
            let (s, v) = coord.get(&format!("/v1/rooms/{}/verdict", 700 + room)).await.ok()?;
            (s == 200 && v["evidence"].as_array().map(Vec::len) == Some(2)).then_some(v)
        })
        .await
        .unwrap();
        assert_eq!(v["culprit"]["rank"], 1);
    }
    // The member comes back; the cluster and everything on it carry on.
    cluster.members[0].restart().unwrap();
    rs[0].fail(799, "local", "transfer_timeout", "x").unwrap();
    rs[0].flush().unwrap();
    let v = eventually(Duration::from_secs(30), "the new room", || async {
        let (_, v) = coord.get("/v1/rooms/799/verdict").await.ok()?;
        (v["status"] == "resolved").then_some(v)
    })
    .await
    .unwrap();
    assert_eq!(v["culprit"]["reason"], "transfer_timeout");
    let (_, g) = coord.get("/v1/groups/prefill-7").await.unwrap();
    assert_eq!(g["ranks"][0]["state"], "live", "{g}");
    assert_eq!(g["ranks"][1]["state"], "live", "{g}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumed_after_compaction_reloads_the_index() {
    use rootrank_store::etcd_client::Client;
    let mut cluster = EtcdCluster::start(3).unwrap();
    // The coordinator talks to member 0 only; the others stay up to write and compact.
    let coord = Coordinator::start(&cluster.members[0].endpoint(), &[]).await.unwrap();
    let other = cluster.members[1].endpoint();
    let mut r = Rank::start(&other, "prefill-8", 0, 1, 5000).unwrap();
    r.fail(800, "local", "nixl_error", "before").unwrap();
    r.flush().unwrap();
    // A second group, whose rank 1 will die while the coordinator cannot watch.
    let mut g9: Vec<Rank> = (0..2)
        .map(|rank| Rank::start(&other, "prefill-9", rank, 2, 1_000).unwrap())
        .collect();
    eventually(Duration::from_secs(20), "prefill-9 live on the coordinator", || async {
        let (_, g) = coord.get("/v1/groups/prefill-9").await.ok()?;
        (g["ranks"][1]["state"] == "live").then_some(())
    })
    .await
    .unwrap();
    eventually(Duration::from_secs(20), "room 800", || async {
        let (_, v) = coord.get("/v1/rooms/800/verdict").await.ok()?;
        (v["status"] == "resolved").then_some(())
    })
    .await
    .unwrap();
    cluster.members[0].kill();
    // While the coordinator's member is down: new records, then a compaction past them.
    for room in 801..811u64 {
        r.fail(room, "local", "ucx_error", "during").unwrap();
    }
    r.flush().unwrap();
    let mut c = Client::connect([other.clone()], None).await.unwrap();
    // prefill-9 rank 1 is SIGKILLed and its lease expires (nobody certifies it: the only
    // coordinator is cut off); rank 0 records the room it was in as a victim sees it.
    g9.remove(1).kill9();
    eventually(Duration::from_secs(20), "rank 1's live key gone from etcd", || {
        let mut c = c.clone();
        async move {
            let got = c.get("/rootrank/v1/groups/prefill-9/ranks/1/live", None).await.ok()?;
            got.kvs().is_empty().then_some(())
        }
    })
    .await
    .unwrap();
    g9[0]
        .fail(812, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    g9[0].flush().unwrap();
    // Compacted strictly past the outage's records: one more write, and the compaction at
    // its revision. At the records' own last revision, a watch resumed exactly there (the
    // coordinator may have seen every revision before it) would still be served.
    let rev = c
        .put("/outside-the-prefix/marker", "x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    c.compact(
        rev,
        Some(rootrank_store::etcd_client::CompactionOptions::new().with_physical()),
    )
    .await
    .unwrap();
    // The coordinator is held still until its member has applied the compaction: a member
    // just back may serve a watch from its own older state for a moment, and then the
    // resumed watch would not meet the compaction this test is about.
    let coord_pid = coord.pid().unwrap();
    rootrank_testkit::signal(coord_pid, libc::SIGSTOP);
    cluster.members[0].restart().unwrap();
    let mine = cluster.members[0].endpoint();
    eventually(
        Duration::from_secs(30),
        "the compaction applied on the coordinator's member",
        || {
            let mine = mine.clone();
            async move {
                let mut m = Client::connect([mine], None).await.ok()?;
                let old = m
                    .get(
                        "/",
                        Some(rootrank_store::etcd_client::GetOptions::new().with_revision(rev - 1)),
                    )
                    .await;
                matches!(old, Err(e) if e.to_string().contains("compacted")).then_some(())
            }
        },
    )
    .await
    .unwrap();
    rootrank_testkit::signal(coord_pid, libc::SIGCONT);
    for room in 801..811u64 {
        let v = eventually(Duration::from_secs(30), "a room written during the outage", || async {
            let (s, v) = coord.get(&format!("/v1/rooms/{room}/verdict")).await.ok()?;
            (s == 200 && v["status"] == "resolved").then_some(v)
        })
        .await
        .unwrap();
        assert_eq!(v["culprit"]["reason"], "ucx_error");
    }
    assert_eq!(
        coord.get("/v1/rooms/800/verdict").await.unwrap().1["culprit"]["reason"],
        "nixl_error"
    );
    // The death it did not watch (its delete was compacted away) is counted all the same:
    // rank 1 is down, the victim's room names it, and its certificate is in etcd.
    let v = eventually(Duration::from_secs(30), "room 812 resolved", || async {
        let (_, v) = coord.get("/v1/rooms/812/verdict?group=prefill-9").await.ok()?;
        (v["status"] == "resolved").then_some(v)
    })
    .await
    .unwrap();
    assert_eq!(
        (&v["culprit"]["rank"], &v["culprit"]["reason"]),
        (&serde_json::json!(1), &serde_json::json!("lease_expired")),
        "{v}"
    );
    let (_, g) = coord.get("/v1/groups/prefill-9").await.unwrap();
    assert_eq!(g["ranks"][1]["state"], "down", "{g}");
    let certs = eventually(Duration::from_secs(20), "rank 1's certificate", || {
        let mut c = c.clone();
        async move {
            let got = c
                .get(
                    "/rootrank/v1/groups/prefill-9/ranks/1/down/",
                    Some(rootrank_store::etcd_client::GetOptions::new().with_prefix()),
                )
                .await
                .ok()?;
            (!got.kvs().is_empty()).then(|| got.kvs().len())
        }
    })
    .await
    .unwrap();
    assert_eq!(certs, 1);
    let log = coord.log_text();
    assert!(
        log.contains("compacted") && log.contains("reloading"),
        "the reload path ran:\n{log}"
    );
    let (_, m) = coord.get("/metrics").await.unwrap();
    let restarts = m
        .as_str()
        .unwrap()
        .lines()
        .find(|l| l.starts_with("rootrank_etcd_watch_restarts_total "))
        .unwrap()
        .to_string();
    assert_ne!(restarts, "rootrank_etcd_watch_restarts_total 0");
}
