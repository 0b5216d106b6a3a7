//! An etcd stall longer than the lease TTL (issue 28, finding 4), on real etcd, two real
//! coordinators and real rank processes: etcd SIGSTOPped for 6 s with 2 s leases used to
//! record every rank of the group `lease_expired`, and a room failed meanwhile could name a
//! rank whose process never stopped. The coordinators saw etcd silent; on resume they hold
//! the vanished keys until they know which processes lived on: those are `lease_lost` (no
//! death, never a culprit), and the one rank SIGKILLed during the stall is still the culprit.

use std::time::Duration;

use rootrank_testkit::node::{down_prefix, list};
use rootrank_testkit::{agreed_verdict, events_within, eventually, signal, Coordinator, Etcd, Rank};
use serde_json::Value;

const T: Duration = Duration::from_secs(40);
const G: &str = "stall-4";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_loses_leases_not_ranks_and_a_rank_killed_meanwhile_is_still_the_culprit() {
    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    let a = Coordinator::start(&ep, &[]).await.unwrap();
    let b = Coordinator::start(&ep, &[]).await.unwrap();
    let mut ranks: Vec<Rank> = (0..4).map(|r| Rank::start(&ep, G, r, 4, 2000).unwrap()).collect();
    let old: Vec<String> = ranks.iter().map(|r| r.incarnation.clone()).collect();
    for c in [&a, &b] {
        eventually(T, "the group healthy", || async {
            matches!(c.get(&format!("/v1/health?group={G}")).await, Ok((200, _))).then_some(())
        })
        .await
        .unwrap();
    }

    let (_, view) = a.get("/v1/groups").await.unwrap();
    let before_stall = view["revision"].as_i64().expect("/v1/groups says its revision");

    // etcd stops (a disk that blocks its fsync, a paused VM) for 3 TTLs; rank 3 is SIGKILLed
    // meanwhile, and rank 0 meets the generic error of room 300, which its agent queues.
    let pid = etcd.inner.pid().expect("etcd runs");
    signal(pid, libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(1));
    ranks[3].kill9();
    ranks[0]
        .send("fail 300 propagated peer_disconnect NIXL KVSender Exception")
        .unwrap();
    std::thread::sleep(Duration::from_secs(5));
    signal(pid, libc::SIGCONT);

    // Room 300: rank 3's death, on both replicas alike, never a rank that lived on.
    let v = agreed_verdict([&a, &b], 300, &format!("group={G}"), T, |v| v["status"] == "resolved")
        .await
        .unwrap();
    assert_eq!(v["culprit"]["rank"], 3, "{v}");
    assert_eq!(v["culprit"]["reason"], "lease_expired", "{v}");

    // What etcd keeps: ranks 0-2's old incarnations lease_lost, naming the stall and the new
    // incarnation; rank 3's lease_expired. Each certificate written once.
    for r in 0..4u32 {
        let certs = eventually(T, "the old incarnation certified", || async {
            let c = list(&ep, &down_prefix(G, r)).await.ok()?;
            (!c.is_empty()).then_some(c)
        })
        .await
        .unwrap();
        assert_eq!(certs.len(), 1, "rank {r}: {certs:?}");
        let c: &Value = &certs[0].value;
        assert_eq!(
            c["incarnation"].to_string().trim_matches('"'),
            old[r as usize],
            "rank {r}: {c}"
        );
        let want = if r == 3 { "lease_expired" } else { "lease_lost" };
        assert_eq!(c["reason"], want, "rank {r}: {c}");
        if r < 3 {
            let detail = c["detail"].as_str().unwrap_or("");
            assert!(
                detail.contains("etcd was silent") && detail.contains("registered again"),
                "{detail}"
            );
        }
    }

    // Health names rank 3 only; ranks 0-2 are live on new incarnations.
    for c in [&a, &b] {
        let (status, h) = c.get(&format!("/v1/health?group={G}")).await.unwrap();
        assert_eq!(status, 503, "{h}");
        let named: Vec<u64> = h["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["rank"].as_u64())
            .collect();
        assert_eq!(named, vec![3], "{h}");
    }
    for (r, rank) in ranks.iter_mut().enumerate().take(3) {
        assert_eq!(rank.send("flush").unwrap(), "flushed", "rank {r} still runs");
    }

    // What the plugin's fail fast acts on: a certified `down`. Ranks 0-2 were sent `down`
    // uncertified when their keys vanished, then `live`; only rank 3 is sent certified.
    for c in [&a, &b] {
        let events = events_within(&c.url, before_stall, Duration::from_secs(2))
            .await
            .unwrap();
        let downs = |r: u64, certified: bool| {
            events
                .iter()
                .filter(|e| e["event"] == "rank" && e["group"] == G && e["rank"] == r && e["state"] == "down")
                .filter(|e| e["certified"] == certified)
                .count()
        };
        for r in 0..3 {
            assert_eq!(downs(r, true), 0, "rank {r}: {events:?}");
            assert!(downs(r, false) >= 1, "rank {r}: {events:?}");
        }
        assert_eq!(downs(3, true), 1, "{events:?}");
    }
}
