//! The node watchdog across its own restarts and etcd's: every death is reported, none
//! twice (each certificate key is written exactly once: etcd's per-key `version` stays 1).

use rootrank_testkit::node::{down_prefix, list, wait_certificate, NodeWatch};
use rootrank_testkit::{Etcd, Rank};

const G: &str = "prefill-0";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deaths_reported_once_across_watchdog_and_etcd_restarts() -> anyhow::Result<()> {
    let mut etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let mut watch = NodeWatch::start(&ep)?;
    let ranks: Vec<Rank> = (0..4)
        .map(|r| Rank::start(&ep, G, r, 4, 30_000))
        .collect::<Result<_, _>>()?;
    let mut ranks: Vec<Option<Rank>> = ranks.into_iter().map(Some).collect();
    let pid = |ranks: &[Option<Rank>], r: usize| ranks[r].as_ref().map_or(0, |x| x.pid);
    for r in 0..4 {
        watch.wait_watching(G, r as u32, pid(&ranks, r)).await?;
    }

    // 1. Rank 1 dies while no watchdog runs; its live key (30 s lease) is still there when
    //    the next one starts, so it still counts as dead.
    watch.kill9();
    let mut r1 = ranks[1].take().ok_or_else(|| anyhow::anyhow!("rank 1"))?;
    let inc1 = r1.incarnation.clone();
    r1.kill9();
    watch.restart()?;
    let cert = wait_certificate(&ep, G, 1, &inc1).await?;
    assert_eq!(cert.value["source"], "watchdog", "{cert:?}");
    assert_eq!(cert.value["reason"], "process_exit", "{cert:?}");
    assert!(
        cert.value["detail"]
            .as_str()
            .is_some_and(|d| d.contains("already gone when the watchdog started")),
        "{cert:?}"
    );

    // 2. Another restart: rank 1's incarnation already has a certificate and must be
    //    skipped, the living ranks watched again.
    watch.restart()?;
    for r in [0, 2, 3] {
        watch.wait_watching(G, r as u32, pid(&ranks, r)).await?;
    }

    // 3. Rank 2 dies while etcd is down: written once etcd is back.
    let mut r2 = ranks[2].take().ok_or_else(|| anyhow::anyhow!("rank 2"))?;
    let inc2 = r2.incarnation.clone();
    etcd.kill();
    r2.kill9();
    // Seen and tried while etcd is down...
    rootrank_testkit::eventually(
        std::time::Duration::from_secs(20),
        "a write attempt while etcd is down",
        || {
            let log = watch.log_text();
            async move { log.contains("down certificate not written yet").then_some(()) }
        },
    )
    .await?;
    // ...and written once it is back.
    etcd.restart()?;
    let cert = wait_certificate(&ep, G, 2, &inc2).await?;
    assert_eq!(cert.value["source"], "watchdog", "{cert:?}");

    // 4. A new incarnation of rank 1 replaces the old record; the watch follows it (the
    //    watch was re-created after the etcd restart).
    let mut r1b = Rank::start(&ep, G, 1, 4, 30_000)?;
    assert_ne!(r1b.incarnation, inc1);
    watch.wait_watching(G, 1, r1b.pid).await?;
    let (inc1b, pid1b) = (r1b.incarnation.clone(), r1b.pid);
    r1b.kill9();
    let cert = wait_certificate(&ep, G, 1, &inc1b).await?;
    assert_eq!(cert.value["pid"], pid1b, "{cert:?}");

    // 5. A last death as a barrier: certificates are written in order, so once this one is
    //    there, any duplicate of the earlier ones would have been attempted already.
    let mut r3 = ranks[3].take().ok_or_else(|| anyhow::anyhow!("rank 3"))?;
    let inc3 = r3.incarnation.clone();
    r3.kill9();
    wait_certificate(&ep, G, 3, &inc3).await?;

    let mut keys: Vec<(String, i64)> = Vec::new();
    for r in 0..4 {
        for s in list(&ep, &down_prefix(G, r)).await? {
            assert_eq!(s.value["source"], "watchdog", "{s:?}");
            keys.push((s.key, s.version));
        }
    }
    let want: Vec<String> = [(1, &inc1), (1, &inc1b), (2, &inc2), (3, &inc3)]
        .iter()
        .map(|(r, i)| format!("{}{i}", down_prefix(G, *r)))
        .collect();
    let mut got: Vec<String> = keys.iter().map(|(k, _)| k.clone()).collect();
    got.sort();
    let mut want_sorted = want.clone();
    want_sorted.sort();
    assert_eq!(
        got, want_sorted,
        "one certificate per dead incarnation, none for the living rank 0"
    );
    assert!(
        keys.iter().all(|(_, v)| *v == 1),
        "each written exactly once: {keys:?}\n{}",
        watch.log_text()
    );
    Ok(())
}
