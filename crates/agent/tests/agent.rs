//! The agent's promises to its host, against real etcd: it never blocks, never panics, drops
//! and counts when its queue is full, and rejects bad input without writing anything.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rootrank_agent::{Agent, AgentConfig, AgentError};
use rootrank_core::Origin;
use rootrank_store::etcd_client::{Client, GetOptions};
use rootrank_testkit::Etcd;

#[test]
fn a_full_queue_drops_and_counts_instead_of_blocking_the_host() {
    // Nothing listens here: every publish attempt fails and the queue fills up.
    let port = rootrank_testkit::free_port().unwrap();
    let mut cfg = AgentConfig::new(vec![format!("http://127.0.0.1:{port}")], "prefill-0", 0, 1).unwrap();
    cfg.queue_capacity = 8;
    let agent = Agent::start(cfg).unwrap();
    let mut accepted = 0;
    let mut full = 0;
    for room in 0..40u64 {
        match agent.record_failure(room, Origin::Local, "nixl_error", "x", None) {
            Ok(()) => accepted += 1,
            Err(AgentError::QueueFull { capacity: 8 }) => full += 1,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!((8..=9).contains(&accepted), "{accepted}"); // the publisher may hold one
    assert_eq!(full, 40 - accepted);
    assert_eq!(agent.stats().dropped.load(Ordering::Relaxed), full as u64);
    // Shutdown is bounded even though etcd never answers.
    let started = Instant::now();
    assert!(!agent.shutdown(Duration::from_millis(300)));
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn bad_input_is_rejected_and_never_written() {
    let etcd = Etcd::start().unwrap();
    let agent = Agent::start(AgentConfig::new(vec![etcd.endpoint()], "prefill-0", 1, 2).unwrap()).unwrap();
    assert!(agent.wait_registered(Duration::from_secs(10)).is_some());
    assert!(matches!(
        agent.record_failure(1 << 63, Origin::Local, "nixl_error", "", None),
        Err(AgentError::Invalid(_))
    ));
    assert!(matches!(
        agent.record_failure(1, Origin::Local, "NIXL Error!", "", None),
        Err(AgentError::Invalid(_))
    ));
    assert!(matches!(agent.record_down("", "", None), Err(AgentError::Invalid(_))));
    agent
        .record_failure(2, Origin::Local, "nixl_error", &"é".repeat(5000), None)
        .unwrap();
    assert!(agent.flush(Duration::from_secs(10)));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let kvs = rt.block_on(async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        c.get(
            "/rootrank/v1/groups/prefill-0/rooms/",
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .unwrap()
        .kvs()
        .to_vec()
    });
    assert_eq!(kvs.len(), 1, "only the valid record was written");
    let v: serde_json::Value = serde_json::from_slice(kvs[0].value()).unwrap();
    assert_eq!(v["room"], "2");
    assert!(v["detail"].as_str().unwrap().len() <= 4096, "detail capped at 4 KiB");
    assert_ne!(
        kvs[0].lease(),
        agent.incarnation().unwrap().lease_id(),
        "records never ride on the liveness lease"
    );
    assert!(agent.shutdown(Duration::from_secs(10)));
}

#[test]
fn invalid_config_is_a_clear_error() {
    assert!(AgentConfig::new(vec![], "prefill-0", 4, 4).is_err());
    assert!(AgentConfig::new(vec![], "bad group", 0, 4).is_err());
    let mut cfg = AgentConfig::new(vec!["http://127.0.0.1:1".into()], "g", 0, 1).unwrap();
    cfg.lease_ttl = Duration::from_millis(10);
    let err = Agent::start(cfg).err().unwrap().to_string();
    assert!(err.contains("lease_ttl"), "{err}");
    let cfg = AgentConfig::new(vec![], "g", 0, 1).unwrap();
    assert!(Agent::start(cfg)
        .err()
        .unwrap()
        .to_string()
        .contains("ROOTRANK_ETCD_ENDPOINTS"));
}

#[test]
fn a_host_that_saturates_every_core_does_not_starve_the_keepalive() {
    let etcd = Etcd::start().unwrap();
    let mut cfg = AgentConfig::new(vec![etcd.endpoint()], "prefill-0", 0, 1).unwrap();
    cfg.lease_ttl = Duration::from_secs(2);
    let agent = Agent::start(cfg).unwrap();
    let first = agent.wait_registered(Duration::from_secs(10)).unwrap();
    // The host burns every core (and then some) for three lease TTLs.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spinners: Vec<_> = (0..2 * std::thread::available_parallelism().map_or(2, |n| n.get()))
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                }
                x
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(6));
    stop.store(true, Ordering::Relaxed);
    for s in spinners {
        let _ = s.join();
    }
    // Same incarnation: the lease never lapsed, and the live key is still there.
    assert_eq!(agent.incarnation(), Some(first));
    assert_eq!(agent.stats().registrations.load(Ordering::Relaxed), 1);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let live = rt.block_on(async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        c.get("/rootrank/v1/groups/prefill-0/ranks/0/live", None)
            .await
            .unwrap()
            .kvs()
            .to_vec()
    });
    assert_eq!(live.first().map(|kv| kv.lease()), Some(first.lease_id()));
    assert!(agent.shutdown(Duration::from_secs(10)));
}

fn live_kv(etcd: &Etcd, key: &str) -> Option<rootrank_store::etcd_client::KeyValue> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        c.get(key, None).await.unwrap().kvs().first().cloned()
    })
}

/// SPEC section 4: a live key is created only if absent. A second process claiming a
/// (group, rank) another incarnation holds is refused with a clear error, the holder's record
/// stays as it was, and the second registers once the holder is gone.
#[test]
fn a_second_claim_on_a_live_rank_is_refused_until_the_holder_is_gone() {
    let etcd = Etcd::start().unwrap();
    let key = "/rootrank/v1/groups/prefill-0/ranks/3/live";
    let first = Agent::start(AgentConfig::new(vec![etcd.endpoint()], "prefill-0", 3, 4).unwrap()).unwrap();
    let held = first.wait_registered(Duration::from_secs(10)).unwrap();
    let before = live_kv(&etcd, key).unwrap();
    assert_eq!(before.lease(), held.lease_id());
    let record: serde_json::Value = serde_json::from_slice(before.value()).unwrap();
    assert_eq!(record["pid"], std::process::id());
    assert!(record["pid_ns"].as_u64().is_some(), "{record}");
    assert!(record["start_ticks"].as_u64().is_some(), "{record}");

    let second = Agent::start(AgentConfig::new(vec![etcd.endpoint()], "prefill-0", 3, 4).unwrap()).unwrap();
    // Refused: wait_registered gives up as soon as the refusal is known.
    assert_eq!(second.wait_registered(Duration::from_secs(20)), None);
    let why = second.registration_refused().expect("a refusal message");
    assert!(why.contains("rank 3 of group prefill-0"), "{why}");
    assert!(why.contains(&held.to_string()), "names the holder's incarnation: {why}");
    assert!(why.contains("ROOTRANK_INSTANCE"), "says what to check: {why}");
    assert_eq!(second.incarnation(), None);
    assert_eq!(first.registration_refused(), None);
    let after = live_kv(&etcd, key).unwrap();
    assert_eq!(
        (after.lease(), after.mod_revision(), after.value()),
        (before.lease(), before.mod_revision(), before.value()),
        "the holder's live record is untouched"
    );

    // The holder leaves: the second registers on its next quiet retry.
    assert!(first.shutdown(Duration::from_secs(10)));
    let deadline = Instant::now() + Duration::from_secs(30);
    while second.incarnation().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = second.incarnation().expect("registered once the holder was gone");
    assert_ne!(took, held);
    assert_eq!(second.registration_refused(), None);
    assert_eq!(live_kv(&etcd, key).unwrap().lease(), took.lease_id());
    assert!(second.shutdown(Duration::from_secs(10)));
}

/// Create-if-absent does not stand in the way of the rank's own comeback: when its lease is
/// lost (here revoked from outside, as an etcd that saw no keepalive for a TTL would expire
/// it), the live key goes with it and the agent registers a new incarnation.
#[test]
fn a_rank_whose_lease_was_lost_registers_again() {
    let etcd = Etcd::start().unwrap();
    let key = "/rootrank/v1/groups/decode-0/ranks/0/live";
    let mut cfg = AgentConfig::new(vec![etcd.endpoint()], "decode-0", 0, 1).unwrap();
    cfg.lease_ttl = Duration::from_secs(1);
    let agent = Agent::start(cfg).unwrap();
    let first = agent.wait_registered(Duration::from_secs(10)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        c.lease_revoke(first.lease_id()).await.unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while agent.incarnation() == Some(first) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let second = agent.incarnation().unwrap();
    assert_ne!(second, first, "a new incarnation");
    assert_eq!(agent.registration_refused(), None);
    assert_eq!(live_kv(&etcd, key).unwrap().lease(), second.lease_id());
    assert!(agent.shutdown(Duration::from_secs(10)));
}
