//! SIGSTOP of the receiving peer: NIXL reports nothing, so a write with a
//! short timeout must come back as `Timeout`, promptly, and the agent stays
//! usable once the peer runs again.

mod common;

use std::time::{Duration, Instant};

use common::{fill_region, fnv1a64, load, Peer};
use rootrank_testkit::try_signal;
use rootrank_transfer::{RegionId, RemoteRegion, TransferAgent, TransferError};

const LEN: usize = 16 << 20;

/// A receiving peer that took one write and was then SIGSTOPped, and the agent writing to it.
struct Stopped {
    peer: Peer,
    agent: TransferAgent,
    src: RegionId,
    name: String,
    remote: RemoteRegion,
}

fn stopped_peer(lib: &rootrank_transfer::NixlLibrary, tmp: &tempfile::TempDir, rank: u32) -> Stopped {
    let mut peer = Peer::spawn(tmp.path(), &format!("decode-rank{rank}"), LEN);
    let mut agent = TransferAgent::new(lib, &format!("prefill-rank{rank}")).expect("agent");
    let src = agent.register_dram(LEN).expect("register");
    fill_region(&mut agent, src, 3);
    let (name, remote) = peer.connect(&mut agent);
    agent
        .write(&name, src, 0, &remote, 0, LEN, b"warmup", Duration::from_secs(10))
        .expect("warm-up write");
    peer.wait_log("warmup", Duration::from_secs(10));
    try_signal(peer.pid(), libc::SIGSTOP).expect("SIGSTOP the peer");
    // Give the stop a moment to land before posting.
    std::thread::sleep(Duration::from_millis(20));
    Stopped {
        peer,
        agent,
        src,
        name,
        remote,
    }
}

#[test]
fn sigstop_of_receiver_times_out_without_hanging() {
    let lib = load();
    let tmp = tempfile::tempdir().expect("tempdir");
    let Stopped {
        mut peer,
        mut agent,
        src,
        name,
        remote,
    } = stopped_peer(&lib, &tmp, 2);

    let timeout = Duration::from_millis(300);
    let t = Instant::now();
    let result = agent.write(&name, src, 0, &remote, 0, LEN, b"while-stopped", timeout);
    let took = t.elapsed();
    eprintln!("write to stopped peer: {result:?} after {took:?}");
    let err = match result {
        Err(e) => e,
        Ok(stats) => panic!("a 16 MiB write to a stopped peer completed: {stats:?}"),
    };
    match &err {
        TransferError::Timeout { after_ms, peer } => {
            assert_eq!(*after_ms, 300);
            assert_eq!(peer, &name);
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert_eq!(err.reason(), "transfer_timeout");
    assert_eq!(err.nixl_status(), None);
    assert!(took >= timeout, "returned before the timeout: {took:?}");
    // A hang guard, not a speed check: a shared CI machine may be slow to schedule us.
    assert!(
        took < timeout + Duration::from_secs(10),
        "hung past the timeout: {took:?}"
    );

    // Small writes time out too (none of them may hang).
    let t = Instant::now();
    let small = agent.write(&name, src, 0, &remote, 0, 4096, b"small-while-stopped", timeout);
    eprintln!("4 KiB write to stopped peer: {small:?} after {:?}", t.elapsed());
    assert!(t.elapsed() < timeout + Duration::from_secs(10), "a small write hung");
    // The timed-out WRITEs are kept, not released, while NIXL may still read their buffer.
    assert!(
        agent.abandoned_transfers() >= 1,
        "the 16 MiB write was released while in progress"
    );

    // Resume: the peer works again and checks what a fresh write carries.
    try_signal(peer.pid(), libc::SIGCONT).expect("SIGCONT the peer");
    fill_region(&mut agent, src, 4);
    let msg = format!("check:0:{LEN}:{:016x}", fnv1a64(&agent.region_to_vec(src).expect("b")));
    agent
        .write(&name, src, 0, &remote, 0, LEN, msg.as_bytes(), Duration::from_secs(10))
        .expect("write after SIGCONT");
    let line = peer.wait_log(&msg, Duration::from_secs(10));
    assert!(line.ends_with(" ok"), "{line}");
    // The abandoned WRITEs settled once the peer ran again, and were released.
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.abandoned_transfers() > 0 {
        assert!(
            Instant::now() < deadline,
            "abandoned WRITEs never settled after SIGCONT"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    agent
        .write(&name, src, 0, &remote, 0, 1, b"quit", Duration::from_secs(10))
        .expect("quit");
    assert!(peer.finish(Duration::from_secs(10)).success());
}

/// An agent dropped while a WRITE into a stopped peer is still in progress: NIXL may still
/// read the buffer, so the agent leaks it (and says so) instead of freeing it; nothing hangs
/// or crashes, and the process goes on.
#[test]
fn dropping_an_agent_with_a_stuck_write_keeps_its_buffer_alive() {
    let lib = load();
    let tmp = tempfile::tempdir().expect("tempdir");
    let Stopped {
        peer,
        mut agent,
        src,
        name,
        remote,
    } = stopped_peer(&lib, &tmp, 3);
    let stuck = agent.write(&name, src, 0, &remote, 0, LEN, b"stuck", Duration::from_millis(300));
    assert!(matches!(stuck, Err(TransferError::Timeout { .. })), "{stuck:?}");
    assert_eq!(agent.abandoned_transfers(), 1);
    drop(agent);
    // A new agent in the same process works.
    let mut again = TransferAgent::new(&lib, "prefill-rank3-again").expect("a new agent after the leak");
    assert!(again.register_dram(4096).is_ok());
    let _ = try_signal(peer.pid(), libc::SIGKILL);
}
