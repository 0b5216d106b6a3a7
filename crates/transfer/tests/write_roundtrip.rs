//! A cross-process DRAM WRITE over real NIXL/UCX arrives intact, and its
//! notification reaches the receiving process.

mod common;

use std::time::{Duration, Instant};

use common::{fill_region, fnv1a64, load, Peer};
use rootrank_transfer::TransferAgent;

#[test]
fn cross_process_write_arrives_intact_with_notification() {
    let lib = load();
    let tmp = tempfile::tempdir().expect("tempdir");
    const LEN: usize = 1 << 20;
    let mut peer = Peer::spawn(tmp.path(), "decode-rank0", LEN);

    let t0 = Instant::now();
    let mut agent = TransferAgent::new(&lib, "prefill-rank0").expect("agent");
    eprintln!("sender agent up in {:?}", t0.elapsed());
    let src = agent.register_dram(LEN).expect("register");
    fill_region(&mut agent, src, 42);
    let (name, remote) = peer.connect(&mut agent);
    assert_eq!(remote.len, LEN as u64);

    // Whole region, then a sub-range at an offset into a different place.
    let whole = fnv1a64(&agent.region_to_vec(src).expect("bytes"));
    let msg = format!("check:0:{LEN}:{whole:016x}");
    let stats = agent
        .write(&name, src, 0, &remote, 0, LEN, msg.as_bytes(), Duration::from_secs(10))
        .expect("write whole region");
    assert_eq!(stats.bytes, LEN as u64);
    eprintln!("1 MiB write took {:?}", stats.elapsed);
    let line = peer.wait_log(&msg, Duration::from_secs(10));
    assert!(line.ends_with(" ok"), "receiver says: {line}");
    assert!(line.starts_with("notif prefill-rank0 "), "sender name: {line}");

    fill_region(&mut agent, src, 7);
    let part = &agent.region_to_vec(src).expect("bytes")[100..100 + 4096];
    let msg = format!("check:8192:4096:{:016x}", fnv1a64(part));
    agent
        .write(
            &name,
            src,
            100,
            &remote,
            8192,
            4096,
            msg.as_bytes(),
            Duration::from_secs(10),
        )
        .expect("write sub-range");
    let line = peer.wait_log(&msg, Duration::from_secs(10));
    assert!(line.ends_with(" ok"), "receiver says: {line}");

    // Out-of-range requests are refused before NIXL sees them.
    let err = agent
        .write(&name, src, 0, &remote, 1, LEN, b"", Duration::from_secs(1))
        .expect_err("out of range");
    assert_eq!(err.reason(), "other");
    let err = agent
        .write("nobody", src, 0, &remote, 0, 1, b"", Duration::from_secs(1))
        .expect_err("unknown peer");
    assert!(matches!(err, rootrank_transfer::TransferError::PeerNotLoaded { .. }));

    agent
        .write(&name, src, 0, &remote, 0, 1, b"quit", Duration::from_secs(10))
        .expect("quit");
    let status = peer.finish(Duration::from_secs(10));
    assert!(status.success(), "peer exit: {status}; log:\n{}", peer.log());
}
