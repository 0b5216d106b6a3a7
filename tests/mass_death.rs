//! A mass death on real etcd (issue 28, finding 1): 16,000 and 100,000 live keys on one lease
//! (a fleet's ranks, or a node-watch's hosts) revoked under read load is one etcd revision
//! with that many deletes. The coordinator must see every one of them down, two replicas must
//! agree at the same revision, and every death must be on record in etcd (its `lease_expired`
//! certificate) so that restarting both changes nothing.
//!
//! Before the fix the whole revision came as one watch message over the gRPC client's 4 MiB
//! limit, which ended the stream at every attempt, and the follower resumed after the
//! revision the watch's `created` answer carried: the deaths were skipped for good. Then, with
//! fragments, 16,000 deletes still took 21 s to arrive under this read load, because the watch
//! asked for previous values and etcd 3.4 reads each with a range of its own (0.7 s without).

use std::time::Duration;

use rootrank_store::etcd_client::{self, GetOptions, PutOptions, Txn, TxnOp};
use rootrank_testkit::{eventually, Coordinator, Etcd};
use serde_json::Value;

const GROUP_SIZE: u32 = 8;
const T: Duration = Duration::from_secs(300);
const PREFIX: &str = "/rootrank/v1";

/// (live, down) over every group, and the revision the answer reflects.
async fn totals(c: &Coordinator) -> Option<(u64, u64, i64)> {
    let (status, v) = c.get("/v1/groups").await.ok()?;
    if status != 200 {
        return None;
    }
    let groups = v["groups"].as_array()?;
    let sum = |field: &str| groups.iter().map(|g| g[field].as_u64().unwrap_or(0)).sum::<u64>();
    Some((sum("live"), sum("down"), v["revision"].as_i64().unwrap_or(0)))
}

async fn groups_body(c: &Coordinator) -> Value {
    let (status, mut v) = c.get("/v1/groups").await.expect("coordinator answers");
    assert_eq!(status, 200, "{v}");
    if let Some(o) = v.as_object_mut() {
        o.remove("revision");
    }
    v
}

/// One etcd process and two coordinators per size: the sizes run one after the other.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_thousand_keys_on_one_lease_revoked_under_read_load_are_all_down_on_both_replicas_and_after_restarts() {
    mass_death(16_000).await;
}

/// A fleet's worth (12,500 hosts x 8 GPUs): tens of MB in one revision, in fragments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_keys_on_one_lease_revoked_under_read_load_are_all_down_on_both_replicas_and_after_restarts()
{
    mass_death(100_000).await;
}

async fn mass_death(ranks: u32) {
    let _one = ONE_AT_A_TIME.lock().await;
    let etcd = Etcd::start().unwrap();
    let mut a = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut b = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let lease = client.lease_grant(60, None).await.unwrap().id();
    let now = rootrank_core::time::format_ms(rootrank_store::unix_ms());
    let ids: Vec<u32> = (0..ranks).collect();
    for chunk in ids.chunks(128) {
        let ops: Vec<TxnOp> = chunk
            .iter()
            .map(|i| {
                let (group, rank) = (format!("fleet-{}", i / GROUP_SIZE), i % GROUP_SIZE);
                let value = serde_json::json!({
                    "v": 1, "group": group, "rank": rank, "group_size": GROUP_SIZE,
                    "role": "prefill", "host": format!("host-{}", i / GROUP_SIZE), "pid": 1000 + i,
                    "boot_id": "00000000-0000-0000-0000-000000000000", "started_at": now,
                    "lease_ttl_ms": 5000, "agent": "rootrank-agent/test", "nixl_agent": null, "gpu": null,
                });
                TxnOp::put(
                    format!("{PREFIX}/groups/{group}/ranks/{rank}/live"),
                    value.to_string(),
                    Some(PutOptions::new().with_lease(lease)),
                )
            })
            .collect();
        client.txn(Txn::new().and_then(ops)).await.unwrap();
    }
    for c in [&a, &b] {
        eventually(T, "every rank live", || async {
            totals(c).await.filter(|t| t.0 == ranks as u64).map(|_| ())
        })
        .await
        .unwrap();
    }

    // Read load on etcd, as operators' `etcdctl get --prefix --keys-only` loops give it.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..3 {
        let (mut c, stop) = (client.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = c
                    .get(PREFIX, Some(GetOptions::new().with_prefix().with_keys_only()))
                    .await;
            }
        }));
    }
    let revoked_at = std::time::Instant::now();
    let revoked = client.lease_revoke(lease).await.unwrap();
    let deletes_revision = revoked.header().map(|h| h.revision()).unwrap();
    eprintln!("etcd revoked the lease in {:.1} s", revoked_at.elapsed().as_secs_f64());

    for c in [&a, &b] {
        let seen = eventually(T, "every rank down", || async {
            totals(c).await.filter(|t| t.0 == 0 && t.1 == ranks as u64)
        })
        .await;
        let Ok((_, down, revision)) = seen else {
            let log = c.log_text();
            let tail: String = log.lines().rev().take(30).collect::<Vec<_>>().join("\n");
            panic!(
                "not every rank down: {:?}; log (newest first):\n{tail}",
                totals(c).await
            );
        };
        assert!(revision >= deletes_revision, "{revision} < {deletes_revision}");
        assert_eq!(down, ranks as u64);
        let (status, health) = c.get("/v1/health?group=fleet-0").await.unwrap();
        assert_eq!(status, 503, "a dead group is unhealthy: {health}");
        // Current again (under this load a replica may have been briefly behind: that is
        // what /readyz is for, and it must come back).
        eventually(T, "current again", || async {
            matches!(c.get("/readyz").await, Ok((200, _))).then_some(())
        })
        .await
        .unwrap();
        eprintln!(
            "all down on a replica {:.1} s after the revoke",
            revoked_at.elapsed().as_secs_f64()
        );
        if std::env::var_os("MASS_DEATH_LOG").is_some() {
            eprintln!("{}", c.log_text());
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in load {
        let _ = l.await;
    }
    // Byte for byte the same answer once both are past the deletes.
    assert_eq!(groups_body(&a).await, groups_body(&b).await);

    // Every death on record in etcd, so nothing depends on a replica's memory.
    eventually(T, "every death certified in etcd", || {
        let mut client = client.clone();
        async move {
            // In pages: 200,000 keys are over the gRPC client's 4 MiB answer limit.
            let (mut from, end) = (format!("{PREFIX}/groups/"), format!("{PREFIX}/groups0"));
            let mut certified = 0;
            loop {
                let opts = GetOptions::new()
                    .with_range(end.as_str())
                    .with_keys_only()
                    .with_limit(20_000);
                let r = client.get(from.as_str(), Some(opts)).await.ok()?;
                certified += r
                    .kvs()
                    .iter()
                    .filter(|kv| String::from_utf8_lossy(kv.key()).contains("/down/"))
                    .count();
                match r.kvs().last() {
                    Some(kv) if r.more() => from = format!("{}\0", String::from_utf8_lossy(kv.key())),
                    _ => break,
                }
            }
            eprintln!("certified {certified}");
            (certified == ranks as usize).then_some(())
        }
    })
    .await
    .unwrap_or_else(|e| {
        for c in [&a, &b] {
            let log = c.log_text();
            let lines: Vec<&str> = log
                .lines()
                .filter(|l| !l.contains("rank state changed") && !l.contains("live key vanished"))
                .collect();
            eprintln!("{}", lines[lines.len().saturating_sub(40)..].join("\n"));
        }
        panic!("{e}")
    });

    eprintln!(
        "every death certified {:.1} s after the revoke",
        revoked_at.elapsed().as_secs_f64()
    );
    a.restart().await.unwrap();
    b.restart().await.unwrap();
    for c in [&a, &b] {
        eventually(T, "still every rank down after a restart", || async {
            totals(c).await.filter(|t| t.0 == 0 && t.1 == ranks as u64).map(|_| ())
        })
        .await
        .unwrap();
    }
    assert_eq!(groups_body(&a).await, groups_body(&b).await);
}

/// The node watchdog's follower under the same mass death ("both followers", issue 28): 16,000
/// live keys of other hosts on one lease revoked under read load. A node-watch watching the
/// whole fleet (`--watch-scope fleet`) applies every delete (its log counts them), and a rank
/// of this host that registers right after the deletes and is SIGKILLed is certified through
/// its pidfd, as is one that ran before: had the follower skipped past the deletes or stalled
/// in them, the new rank would not be watched, and with no coordinator running nothing else
/// certifies it (its lease is 30 s). A node-watch in the default host scope, beside it,
/// receives none of the fleet's keys (issue 29: watch traffic independent of the fleet's
/// size, `rootrank_node_watch_events_total`) and watches the same two ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_watch_applies_a_mass_death_whole_and_still_certifies_the_ranks_of_its_host() {
    use rootrank_testkit::node::{wait_certificate, NodeWatch};
    use rootrank_testkit::{free_port, Rank};
    let _one = ONE_AT_A_TIME.lock().await;
    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    let ranks = 16_000u32;
    let mut client = etcd_client::Client::connect([ep.clone()], None).await.unwrap();
    let lease = client.lease_grant(60, None).await.unwrap().id();
    let now = rootrank_core::time::format_ms(rootrank_store::unix_ms());
    let ids: Vec<u32> = (0..ranks).collect();
    for chunk in ids.chunks(128) {
        let ops: Vec<TxnOp> = chunk
            .iter()
            .map(|i| {
                let (group, rank) = (format!("fleet-{}", i / GROUP_SIZE), i % GROUP_SIZE);
                let value = serde_json::json!({
                    "v": 1, "group": group, "rank": rank, "group_size": GROUP_SIZE,
                    "role": "prefill", "host": format!("elsewhere-{}", i / GROUP_SIZE), "pid": 1000 + i,
                    "boot_id": "00000000-0000-0000-0000-000000000000", "started_at": now,
                    "lease_ttl_ms": 5000, "agent": "rootrank-agent/test", "nixl_agent": null, "gpu": null,
                });
                TxnOp::put(
                    format!("{PREFIX}/groups/{group}/ranks/{rank}/live"),
                    value.to_string(),
                    Some(PutOptions::new().with_lease(lease)),
                )
            })
            .collect();
        client.txn(Txn::new().and_then(ops)).await.unwrap();
    }
    let watch = NodeWatch::start_with(&ep, &["--watch-scope", "fleet"]).unwrap();
    let metrics = format!("127.0.0.1:{}", free_port().unwrap());
    let host_watch = NodeWatch::start_with(&ep, &["--metrics-listen", &metrics]).unwrap();
    for w in [&watch, &host_watch] {
        eventually(T, "node-watch loaded", || {
            let done = w.log_text().contains("node watchdog loaded the ranks from etcd");
            async move { done.then_some(()) }
        })
        .await
        .unwrap();
    }
    assert!(
        watch.log_text().contains(&format!("live={ranks} ")),
        "node-watch loaded the fleet: {}",
        watch.log_text()
    );
    assert!(
        host_watch.log_text().contains("keys=0 live=0 "),
        "node-watch in the host scope loaded nothing of other hosts: {}",
        host_watch.log_text()
    );
    let mut before = Rank::start(&ep, "local-0", 0, 2, 30_000).unwrap();
    watch.wait_watching("local-0", 0, before.pid).await.unwrap();
    host_watch.wait_watching("local-0", 0, before.pid).await.unwrap();

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..3 {
        let (mut c, stop) = (client.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = c
                    .get(PREFIX, Some(GetOptions::new().with_prefix().with_keys_only()))
                    .await;
            }
        }));
    }
    let revoked_at = std::time::Instant::now();
    client.lease_revoke(lease).await.unwrap();
    let mut after = Rank::start(&ep, "local-0", 1, 2, 30_000).unwrap();
    watch.wait_watching("local-0", 1, after.pid).await.unwrap();
    host_watch.wait_watching("local-0", 1, after.pid).await.unwrap();
    let applied = format!("live_gone_total={ranks} ");
    eventually(T, "node-watch applied every delete", || {
        let done = watch.log_text().contains(&applied);
        async move { done.then_some(()) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; node-watch log:\n{}", watch.log_text()));
    eprintln!(
        "node-watch applied {ranks} deletes {:.1} s after the revoke",
        revoked_at.elapsed().as_secs_f64()
    );
    // The fleet's 16,000 puts and 16,000 deletes went to the fleet-scope watch; the host
    // scope's got its two ranks' live copies (and their two deletes, at most).
    let events = node_watch_events(&metrics).await;
    assert!(
        (2..=8).contains(&events),
        "the host-scope node-watch received {events} etcd keys; expected its 2 ranks' only"
    );
    let incarnations = [before.incarnation.clone(), after.incarnation.clone()];
    before.kill9();
    after.kill9();
    for (rank, inc) in incarnations.iter().enumerate() {
        let cert = wait_certificate(&ep, "local-0", rank as u32, inc).await.unwrap();
        assert_eq!(cert.value["source"], "watchdog", "rank {rank}: {cert:?}");
        assert_eq!(cert.value["reason"], "process_exit", "rank {rank}: {cert:?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in load {
        let _ = l.await;
    }
}

/// `rootrank_node_watch_events_total` at a node-watch's `--metrics-listen`.
async fn node_watch_events(addr: &str) -> u64 {
    let text = rootrank_testkit::scrape_metrics(addr).await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("rootrank_node_watch_events_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no rootrank_node_watch_events_total in:\n{text}"))
}
