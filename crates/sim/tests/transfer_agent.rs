//! The embedded transfer agent against real etcd and real NIXL, two agents in one process:
//! metadata through etcd, an intact notified WRITE, a NIXL failure recorded as `local` with
//! the peer, a confirmed disconnect, and recovery once the peer comes back as a new agent.

use std::time::Duration;

use rootrank_agent::AgentConfig;
use rootrank_sim::pattern;
use rootrank_testkit::Etcd;
use rootrank_transfer::RemoteRegion;
use rootrank_transfer_agent::{random_room, NixlLibrary, PeerRef, RankAgent};

const LEN: usize = 1 << 20;
const WAIT: Duration = Duration::from_secs(30);

/// The tests' NIXL (`ROOTRANK_NIXL_DIR`, else `<repo>/.cache/nixl`, fetched when missing).
fn nixl() -> NixlLibrary {
    let dir = rootrank_testkit::nixl_dir().expect("NIXL for the tests");
    NixlLibrary::load(Some(&dir)).expect("NIXL loads")
}

fn config(etcd: &str, group: &str, rank: u64) -> AgentConfig {
    let mut c = AgentConfig::new(vec![etcd.to_string()], group, rank, 2).expect("config");
    c.lease_ttl = Duration::from_secs(1);
    c
}

fn record(etcd: &str, rt: &tokio::runtime::Runtime, room: u64) -> serde_json::Value {
    rt.block_on(async {
        let mut c = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![etcd.to_string()]))
            .await
            .expect("client");
        let key = format!("/rootrank/v1/groups/prefill-0/rooms/{room}/ranks/1");
        for _ in 0..3000 {
            let resp = c.get(key.as_str(), None).await.expect("get");
            if let Some(kv) = resp.kvs().first() {
                return serde_json::from_slice(kv.value()).expect("JSON");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no record at {key}");
    })
}

fn wait_notification(agent: &mut RankAgent, tag: &str) {
    for _ in 0..3000 {
        if agent
            .notifications()
            .expect("notifications")
            .iter()
            .any(|(_, m)| m == tag.as_bytes())
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("notification {tag} never arrived");
}

#[test]
fn writes_failures_and_a_restarted_peer() {
    let lib = nixl();
    let etcd = Etcd::start().expect("etcd");
    let ep = etcd.endpoint();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");

    let mut decode = RankAgent::start(&lib, config(&ep, "decode-0", 1), &[LEN], WAIT).expect("decode agent");
    let mut prefill = RankAgent::start(&lib, config(&ep, "prefill-0", 1), &[LEN], WAIT).expect("prefill agent");
    let peer = PeerRef::new("decode-0", 1);
    prefill.connect_peer(&peer, WAIT).expect("peer metadata from etcd");
    assert_eq!(prefill.peer_info(&peer).agent.as_deref(), Some(decode.name()));

    // An intact, notified WRITE.
    let room = random_room();
    fill_source(&mut prefill, room);
    let tag = format!("{room}_kv_0_1_1");
    prefill
        .write_room(room, &peer, 0, 0, 0, 0, LEN, tag.as_bytes(), Duration::from_secs(10))
        .expect("write");
    wait_notification(&mut decode, &tag);
    assert!(
        pattern::check(&decode.region_to_vec(0).expect("dst"), room, 1, 0),
        "bytes arrived intact"
    );

    // NIXL refuses a range the peer never registered: a local nixl_error naming the peer.
    let room = random_room();
    let real = prefill.peer_region(&peer, 0).expect("region");
    let bogus = RemoteRegion {
        addr: real.addr + (1 << 40),
        ..real
    };
    let err = prefill
        .write_room_to(room, &peer, 0, 0, &bogus, 0, 4096, b"x", Duration::from_secs(5))
        .expect_err("NIXL must refuse");
    assert_eq!(err.reason, "nixl_error");
    assert!(err.recorded);
    let rec = record(&ep, &rt, room);
    assert_eq!(rec["origin"], "local");
    assert_eq!(rec["reason"], "nixl_error");
    assert_eq!(rec["peer"]["group"], "decode-0");
    assert_eq!(rec["peer"]["rank"], 1);
    assert_eq!(rec["peer"]["agent"], decode.name());
    let detail = rec["detail"].as_str().expect("detail");
    assert!(
        detail.starts_with(&format!("NIXL transfer encountered ERR room={room}: [NIXL_ERR_")),
        "{detail}"
    );

    // A peer never connected is named as NIXL names a peer it has not loaded (the verdict's
    // cause then follows it), never flattened into a caller's mistake; a region the peer never
    // published is one (`other`), typed as such.
    let room = random_room();
    let stranger = PeerRef::new("decode-0", 7);
    let err = prefill
        .write_room(room, &stranger, 0, 0, 0, 0, 4096, b"x", Duration::from_secs(5))
        .expect_err("never connected");
    assert_eq!(err.reason, "nixl_error", "{err}");
    assert!(
        matches!(
            err.error,
            rootrank_transfer_agent::TransferAgentError::Transfer(
                rootrank_transfer::TransferError::PeerNotLoaded { .. }
            )
        ),
        "{:?}",
        err.error
    );
    let rec = record(&ep, &rt, room);
    assert_eq!(
        (rec["origin"].as_str(), rec["reason"].as_str()),
        (Some("local"), Some("nixl_error"))
    );
    assert_eq!(
        (rec["peer"]["group"].as_str(), rec["peer"]["rank"].as_u64()),
        (Some("decode-0"), Some(7))
    );
    let err = prefill
        .write_room(random_room(), &peer, 0, 0, 9, 0, 4096, b"x", Duration::from_secs(5))
        .expect_err("no region 9");
    assert_eq!(err.reason, "other", "{err}");
    assert!(
        matches!(
            err.error,
            rootrank_transfer_agent::TransferAgentError::NoSuchRegion { index: 9, .. }
        ),
        "{:?}",
        err.error
    );

    // The peer exits cleanly (its lease is revoked, its nixl key goes with it): the next
    // WRITE fails and etcd confirms the disconnect.
    let old_name = decode.name().to_string();
    assert!(decode.shutdown(Duration::from_secs(10)));
    let room = random_room();
    let err = prefill
        .write_room(room, &peer, 0, 0, 0, 0, LEN, b"to-the-dead", Duration::from_secs(5))
        .expect_err("the peer is gone");
    eprintln!("write to the departed peer: {} ({})", err.reason, err.error);
    let rec = record(&ep, &rt, room);
    assert_eq!(rec["origin"], "local");
    assert_eq!(rec["reason"], err.reason);
    // The key was revoked before the WRITE, so etcd confirms what NIXL's C API cannot say.
    assert_eq!(err.reason, "peer_disconnect", "{err}");
    assert_eq!(err.error.nixl_status(), Some("NIXL_ERR_BACKEND"));

    // It comes back as a new process would: a new NIXL agent for the same rank. The failed
    // write marked the peer stale, so the next write reloads it from etcd by itself.
    let mut decode2 = RankAgent::start(&lib, config(&ep, "decode-0", 1), &[LEN], WAIT).expect("restarted decode");
    assert_ne!(decode2.name(), old_name);
    let room = random_room();
    fill_source(&mut prefill, room);
    let tag = format!("{room}_kv_0_1_1");
    prefill
        .write_room(room, &peer, 0, 0, 0, 0, LEN, tag.as_bytes(), Duration::from_secs(10))
        .expect("write to the restarted peer");
    assert_eq!(prefill.peer_info(&peer).agent.as_deref(), Some(decode2.name()));
    wait_notification(&mut decode2, &tag);
    assert!(pattern::check(&decode2.region_to_vec(0).expect("dst"), room, 1, 0));
    assert!(prefill.shutdown(Duration::from_secs(10)));
    assert!(decode2.shutdown(Duration::from_secs(10)));
}

fn fill_source(agent: &mut RankAgent, room: u64) {
    let mut src = vec![0u8; LEN];
    pattern::fill(&mut src, room, 1, 0);
    agent.write_region(0, 0, &src).expect("src");
}
