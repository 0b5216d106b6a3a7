//! `rootrank node-watch` against real etcd, a real coordinator and real rank processes that
//! are not its children: a SIGKILLed rank is certified through its pidfd, and the verdict
//! names it long before its lease could have expired.

use rootrank_testkit::node::{list, live_key, wait_certificate, NodeWatch};
use rootrank_testkit::{Coordinator, Etcd, Rank};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_rank_is_certified_and_named_before_its_lease_expires() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let coord = Coordinator::start(&ep, &[]).await?;
    let watch = NodeWatch::start(&ep)?;
    // A long TTL: if the verdict resolves while the live key is still there, it came from
    // the watchdog and not from the lease.
    let mut survivor = Rank::start(&ep, "prefill-0", 0, 2, 30_000)?;
    let mut victim = Rank::start(&ep, "prefill-0", 1, 2, 30_000)?;
    watch.wait_watching("prefill-0", 1, victim.pid).await?;
    watch.wait_watching("prefill-0", 0, survivor.pid).await?;

    let victim_pid = victim.pid;
    let incarnation = victim.incarnation.clone();
    victim.kill9();
    survivor.fail(77, "propagated", "nixl_error", "NIXL KVSender Exception")?;
    survivor.flush()?;

    let (status, v) = coord.get("/v1/rooms/77/verdict?wait_ms=20000").await?;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "resolved", "{v}\nnode-watch log:\n{}", watch.log_text());
    let culprit = &v["culprit"];
    assert_eq!(culprit["group"], "prefill-0", "{v}");
    assert_eq!(culprit["rank"], 1, "{v}");
    assert_eq!(culprit["source"], "down_certificate", "{v}");
    assert_eq!(culprit["reason"], "process_exit", "{v}");
    assert_eq!(culprit["pid"], victim_pid, "{v}");
    assert_eq!(culprit["incarnation"], incarnation.as_str(), "{v}");
    assert_eq!(v["action"], "abort_and_restart_group", "{v}");

    // The killed rank's lease (30 s) has not run out: the verdict came from the watchdog.
    // (On a host lease, node-watch deletes the dead rank's keys itself once it certified it.)
    let live = list(&ep, &live_key("prefill-0", 1)).await?;
    if rootrank_testkit::node::host_lease_mode().is_none() {
        assert_eq!(live.len(), 1, "the killed rank's live key should still exist");
        assert_eq!(live[0].value["pid"], victim_pid);
    }

    let cert = wait_certificate(&ep, "prefill-0", 1, &incarnation).await?;
    assert_eq!(cert.value["source"], "watchdog", "{:?}", cert);
    assert_eq!(cert.value["reason"], "process_exit", "{:?}", cert);
    assert_eq!(cert.value["pid"], victim_pid, "{:?}", cert);
    assert_eq!(cert.value["incarnation"], incarnation.as_str(), "{:?}", cert);
    assert!(cert.value["host"].is_string(), "{:?}", cert);
    assert!(
        cert.value["registered_revision"].as_i64().is_some_and(|r| r > 0),
        "{:?}",
        cert
    );
    assert_eq!(cert.version, 1, "written once");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_kernel_log_it_says_so_once_and_still_reports() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let watch = NodeWatch::start_with(&ep, &["--kernel-log", "/nonexistent/kmsg"])?;
    let mut victims = Vec::new();
    for r in 0..2 {
        let v = Rank::start(&ep, "decode-0", r, 2, 30_000)?;
        watch.wait_watching("decode-0", r, v.pid).await?;
        victims.push((r, v));
    }
    for (r, mut v) in victims {
        let inc = v.incarnation.clone();
        v.kill9();
        let cert = wait_certificate(&ep, "decode-0", r, &inc).await?;
        assert_eq!(cert.value["source"], "watchdog", "{cert:?}");
        assert_eq!(cert.value["reason"], "process_exit", "{cert:?}");
    }
    let log = watch.log_text();
    assert_eq!(log.matches("kernel log unavailable").count(), 1, "said once:\n{log}");
    Ok(())
}

/// SPEC rule 5 with the node watchdog: prefill rank 1's WRITE failed because decode rank 1 was
/// SIGKILLed; the watchdog certified the decode rank; the prefill group's verdict names the
/// prefill rank as culprit and the decode rank, with the watchdog's reason, as its cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_record_naming_a_killed_decode_peer_gets_the_watchdogs_cause() -> anyhow::Result<()> {
    use rootrank_agent::{Agent, AgentConfig};
    use rootrank_core::{Origin, Peer};
    use std::time::Duration;

    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let coord = Coordinator::start(&ep, &[]).await?;
    let watch = NodeWatch::start(&ep)?;
    let mut decode = Rank::start(&ep, "decode-0", 1, 2, 30_000)?;
    watch.wait_watching("decode-0", 1, decode.pid).await?;
    let incarnation = decode.incarnation.clone();
    decode.kill9();
    wait_certificate(&ep, "decode-0", 1, &incarnation).await?;

    let prefill = Agent::start(AgentConfig::new(vec![ep.clone()], "prefill-0", 1, 2)?)?;
    let peer = Peer {
        group: Some("decode-0".into()),
        rank: Some(1),
        agent: None,
        endpoint: None,
    };
    prefill.record_failure(
        88,
        Origin::Local,
        "nixl_error",
        "NIXL_ERR_REMOTE_DISCONNECT",
        Some(peer),
    )?;
    let p = std::sync::Arc::new(prefill);
    let flusher = p.clone();
    assert!(tokio::task::spawn_blocking(move || flusher.flush(Duration::from_secs(10))).await?);

    let (status, v) = coord.get("/v1/rooms/88/verdict?group=prefill-0&wait_ms=20000").await?;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (&v["culprit"]["group"], &v["culprit"]["rank"]),
        (&"prefill-0".into(), &1.into()),
        "{v}"
    );
    assert_eq!(v["culprit"]["reason"], "nixl_error", "{v}");
    let cause = &v["cause"];
    assert_eq!(cause["group"], "decode-0", "{v}");
    assert_eq!(cause["rank"], 1, "{v}");
    assert_eq!(
        cause["reason"],
        "process_exit",
        "{v}\nnode-watch log:\n{}",
        watch.log_text()
    );
    assert_eq!(cause["source"], "down_certificate", "{v}");
    assert_eq!(cause["incarnation"], incarnation.as_str(), "{v}");
    assert!(
        v["advice"].as_str().is_some_and(|a| a.contains("decode-0 rank 1")),
        "{v}"
    );
    let (_, compact) = coord.get("/v1/rooms/88/verdict?group=prefill-0&view=compact").await?;
    assert_eq!(
        compact["cause"],
        serde_json::json!({"group": "decode-0", "rank": 1, "reason": "process_exit"})
    );
    let closer = p.clone();
    tokio::task::spawn_blocking(move || closer.shutdown(Duration::from_secs(5))).await?;
    Ok(())
}
