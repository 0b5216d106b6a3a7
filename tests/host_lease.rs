//! v5: `rootrank node-watch --host-lease-ttl-ms`, one liveness lease per host (issue 29), with
//! real etcd, a real coordinator, real `rootrank rank` processes and a real node-watch.
//!
//! What a user checks: the ranks ride on the host's lease (their own leases run out and they
//! stay live under their own incarnations); a killed rank is still certified in milliseconds
//! and named; node-watch stopping is no death (`lease_lost`, the ranks register again on
//! their own); a host that dies whole (its node-watch and its ranks) is a death of each rank;
//! a rank stopped with SIGSTOP is found as a lease per rank finds it.

use std::time::Duration;

use rootrank_store::etcd_client::Client;
use rootrank_testkit::harness::eventually;
use rootrank_testkit::node::{client, live_key, wait_certificate, NodeWatch};
use rootrank_testkit::{Coordinator, Etcd, Rank};

const HOST_TTL: &str = "2000";
/// The ranks' own TTL: the test outlives it several times over.
const OWN_TTL_MS: u64 = 2_000;

/// The live key's lease and record.
async fn live(c: &mut Client, group: &str, rank: u32) -> anyhow::Result<Option<(i64, serde_json::Value)>> {
    let resp = c.get(live_key(group, rank), None).await?;
    Ok(resp
        .kvs()
        .first()
        .map(|kv| (kv.lease(), serde_json::from_slice(kv.value()).unwrap_or_default())))
}

/// Waits until the rank's live key rides on a lease that is not its incarnation's, the
/// record naming `incarnation`; returns the host lease.
async fn wait_adopted(ep: &str, group: &str, rank: u32, incarnation: &str) -> anyhow::Result<i64> {
    let c = client(ep).await?;
    eventually(
        Duration::from_secs(20),
        &format!("{group}/{rank} on the host lease"),
        || {
            let mut c = c.clone();
            async move {
                let (lease, rec) = live(&mut c, group, rank).await.ok()??;
                (rec["incarnation"] == incarnation && lease.to_string() != incarnation).then_some(lease)
            }
        },
    )
    .await
}

/// A host: etcd, a coordinator, node-watch on a host lease, and `size` ranks of `group`, each
/// watched and on the host lease; with the host lease each rides on.
struct Host {
    _etcd: Etcd,
    ep: String,
    coord: Coordinator,
    watch: NodeWatch,
    ranks: Vec<Rank>,
    host_leases: Vec<i64>,
}

async fn start_host(group: &str, size: u32) -> anyhow::Result<Host> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let coord = Coordinator::start(&ep, &[]).await?;
    let watch = NodeWatch::start_with(&ep, &["--host-lease-ttl-ms", HOST_TTL])?;
    let (mut ranks, mut host_leases) = (Vec::new(), Vec::new());
    for r in 0..size {
        let rank = Rank::start(&ep, group, r, size, OWN_TTL_MS)?;
        watch.wait_watching(group, r, rank.pid).await?;
        host_leases.push(wait_adopted(&ep, group, r, &rank.incarnation).await?);
        ranks.push(rank);
    }
    Ok(Host {
        _etcd: etcd,
        ep,
        coord,
        watch,
        ranks,
        host_leases,
    })
}

async fn rank_states(coord: &Coordinator, group: &str) -> anyhow::Result<Vec<(String, String)>> {
    let (_, g) = coord.get(&format!("/v1/groups/{group}")).await?;
    Ok(g["ranks"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|r| {
                    (
                        r["state"].as_str().unwrap_or("?").to_string(),
                        r["incarnation"].as_str().unwrap_or("-").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default())
}

fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let st = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()?;
    anyhow::ensure!(st.success(), "kill {sig} {pid} failed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_ride_on_the_host_lease_and_a_killed_one_is_certified_and_named() -> anyhow::Result<()> {
    let Host {
        ep,
        coord,
        watch,
        mut ranks,
        mut host_leases,
        // Bound, so the etcd process lives as long as the test.
        _etcd,
        ..
    } = start_host("prefill-0", 3).await?;
    host_leases.dedup();
    assert_eq!(host_leases.len(), 1, "one lease for the host: {host_leases:?}");

    // Three own TTLs later: every own lease has run out (nobody keeps it alive), and every
    // rank is still live under the incarnation it registered with.
    tokio::time::sleep(Duration::from_millis(3 * OWN_TTL_MS)).await;
    let mut c = client(&ep).await?;
    for rank in &ranks {
        let own: i64 = rank.incarnation.parse()?;
        let ttl = c.lease_time_to_live(own, None).await?.ttl();
        assert_eq!(ttl, -1, "the own lease {own} is kept alive by nobody, so it ran out");
    }
    let states = rank_states(&coord, "prefill-0").await?;
    let want: Vec<(String, String)> = ranks.iter().map(|r| ("live".into(), r.incarnation.clone())).collect();
    assert_eq!(states, want);

    // The OOM killer takes rank 1; rank 0 sees only the generic error.
    let victim_pid = ranks[1].pid;
    let incarnation = ranks[1].incarnation.clone();
    ranks[1].kill9();
    ranks[0].fail(77, "propagated", "nixl_error", "NIXL KVSender Exception")?;
    ranks[0].flush()?;
    let (status, v) = coord.get("/v1/rooms/77/verdict?wait_ms=20000").await?;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "resolved", "{v}\nnode-watch log:\n{}", watch.log_text());
    assert_eq!(v["culprit"]["rank"], 1, "{v}");
    assert_eq!(v["culprit"]["source"], "down_certificate", "{v}");
    assert_eq!(v["culprit"]["reason"], "process_exit", "{v}");
    assert_eq!(v["culprit"]["pid"], victim_pid, "{v}");
    assert_eq!(v["culprit"]["incarnation"], incarnation.as_str(), "{v}");
    let cert = wait_certificate(&ep, "prefill-0", 1, &incarnation).await?;
    assert_eq!(cert.value["source"], "watchdog", "{cert:?}");
    // No lease of its own runs out for it: node-watch deletes its keys from the host lease.
    eventually(Duration::from_secs(10), "the dead rank's live key deleted", || {
        let mut c = c.clone();
        async move { live(&mut c, "prefill-0", 1).await.ok()?.is_none().then_some(()) }
    })
    .await?;
    let host_copies = rootrank_testkit::node::list(&ep, "/rootrank/v1/groups/_hosts/").await?;
    assert!(
        host_copies.iter().all(|s| !s.key.contains("/prefill-0/1/")),
        "its host copy went with it: {host_copies:?}"
    );
    // The others are untouched, and a clean exit leaves no key behind on the host lease.
    assert_eq!(
        rank_states(&coord, "prefill-0").await?[2],
        ("live".into(), ranks[2].incarnation.clone())
    );
    ranks[2].exit()?;
    eventually(Duration::from_secs(10), "the clean exit's keys deleted", || {
        let mut c = c.clone();
        async move { live(&mut c, "prefill-0", 2).await.ok()?.is_none().then_some(()) }
    })
    .await?;
    let (_, g) = coord.get("/v1/groups/prefill-0").await?;
    assert_eq!(g["ranks"][2]["state"], "shutdown", "{g}");
    assert_eq!(g["ranks"][0]["state"], "live", "{g}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_watch_stopping_is_no_death_its_ranks_register_again_on_their_own() -> anyhow::Result<()> {
    let Host {
        ep,
        coord,
        mut watch,
        ranks,
        // Bound, so the etcd process lives as long as the test.
        _etcd,
        ..
    } = start_host("decode-0", 2).await?;
    watch.kill9();
    // The host lease runs out (2 s); each agent sees its key go and registers again.
    let c = client(&ep).await?;
    let mut fresh = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        let new = eventually(Duration::from_secs(20), "registered again on its own lease", || {
            let mut c = c.clone();
            let old = rank.incarnation.clone();
            async move {
                let (lease, rec) = live(&mut c, "decode-0", r as u32).await.ok()??;
                (lease.to_string() != old && rec.get("incarnation").is_none() && rec["pid"] == rank.pid)
                    .then_some(lease.to_string())
            }
        })
        .await?;
        fresh.push(new);
    }
    // The coordinator held the vanished keys and certified each old incarnation lease_lost:
    // no death, no culprit.
    for (r, rank) in ranks.iter().enumerate() {
        let cert = wait_certificate(&ep, "decode-0", r as u32, &rank.incarnation).await?;
        assert_eq!(
            cert.value["reason"],
            "lease_lost",
            "{cert:?}\ncoordinator log:\n{}",
            coord.log_text()
        );
        assert_eq!(cert.value["source"], "coordinator", "{cert:?}");
        assert!(
            cert.value["detail"]
                .as_str()
                .is_some_and(|d| d.contains("host's lease")),
            "{cert:?}"
        );
    }
    let states = rank_states(&coord, "decode-0").await?;
    let want: Vec<(String, String)> = fresh.iter().map(|i| ("live".into(), i.clone())).collect();
    assert_eq!(states, want);
    // A room the survivors fail now names nobody of this host as dead.
    let (_, unhealthy) = coord.get("/v1/groups/decode-0").await?;
    assert!(
        unhealthy["ranks"]
            .as_array()
            .is_some_and(|a| a.iter().all(|r| r["state"] == "live")),
        "{unhealthy}"
    );

    // node-watch comes back: the ranks move onto its new host lease.
    watch.restart()?;
    for (r, inc) in fresh.iter().enumerate() {
        wait_adopted(&ep, "decode-0", r as u32, inc).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_dies_whole_takes_its_ranks_and_a_stopped_rank_is_found() -> anyhow::Result<()> {
    let Host {
        ep,
        coord,
        mut watch,
        ranks,
        // Bound, so the etcd process lives as long as the test.
        _etcd,
        ..
    } = start_host("prefill-1", 3).await?;
    // A rank frozen while node-watch runs: its own lease would run out after its TTL; on the
    // host lease, node-watch deletes its live key after the host TTL, and the coordinator
    // certifies it once it is clear the process did not register again.
    signal(ranks[2].pid, "-STOP")?;
    let cert = wait_certificate(&ep, "prefill-1", 2, &ranks[2].incarnation).await?;
    assert_eq!(
        cert.value["reason"],
        "lease_expired",
        "{cert:?}\nnode-watch log:\n{}",
        watch.log_text()
    );
    assert_eq!(cert.value["source"], "coordinator", "{cert:?}");

    // The host dies whole: its node-watch and its ranks (frozen: no process can register).
    signal(ranks[0].pid, "-STOP")?;
    signal(ranks[1].pid, "-STOP")?;
    watch.kill9();
    for r in 0..2 {
        let cert = wait_certificate(&ep, "prefill-1", r, &ranks[r as usize].incarnation).await?;
        assert_eq!(cert.value["reason"], "lease_expired", "{cert:?}");
        assert_eq!(cert.value["source"], "coordinator", "{cert:?}");
        assert!(
            cert.value["detail"]
                .as_str()
                .is_some_and(|d| d.contains("host's lease")),
            "{cert:?}"
        );
    }
    let (_, g) = coord.get("/v1/groups/prefill-1").await?;
    assert!(
        g["ranks"]
            .as_array()
            .is_some_and(|a| a.iter().all(|r| r["state"] == "down")),
        "{g}"
    );
    for r in &ranks {
        signal(r.pid, "-CONT")?;
    }
    Ok(())
}
