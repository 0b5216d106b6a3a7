//! SIGKILL of the receiving peer while the sender keeps writing: the sender
//! gets a typed error quickly and never hangs; a restarted peer of the same
//! name can be loaded again after `forget_peer`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{fill_region, fnv1a64, load, Peer};
use rootrank_transfer::{TransferAgent, TransferError};

#[test]
fn sigkill_of_receiver_mid_transfer_is_a_typed_error_and_peer_can_be_reloaded() {
    let lib = load();
    let tmp = tempfile::tempdir().expect("tempdir");
    const LEN: usize = 4 << 20;
    let mut peer = Peer::spawn(tmp.path(), "decode-rank1", LEN);
    let mut agent = TransferAgent::new(&lib, "prefill-rank1").expect("agent");
    let src = agent.register_dram(LEN).expect("register");
    fill_region(&mut agent, src, 1);
    let (name, remote) = peer.connect(&mut agent);

    // The link works before the kill.
    agent
        .write(&name, src, 0, &remote, 0, LEN, b"warmup", Duration::from_secs(10))
        .expect("warm-up write");
    peer.wait_log("warmup", Duration::from_secs(10));

    // Kill the receiver from another thread while 4 MiB writes are in flight.
    let pid = peer.pid();
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let killer = {
        let killed_at = Arc::clone(&killed_at);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            *killed_at.lock().expect("lock") = Some(Instant::now());
            rootrank_testkit::try_signal(pid, libc::SIGKILL)
        })
    };

    let timeout = Duration::from_secs(5);
    let started = Instant::now();
    let mut writes_ok = 0u32;
    let (err, call_took) = loop {
        let t = Instant::now();
        match agent.write(&name, src, 0, &remote, 0, LEN, b"", timeout) {
            Ok(_) => writes_ok += 1,
            Err(e) => break (e, t.elapsed()),
        }
        assert!(started.elapsed() < Duration::from_secs(30), "writes never failed");
    };
    let failed_at = Instant::now();
    killer.join().expect("killer thread").expect("kill succeeded");
    let killed_at = killed_at.lock().expect("lock").expect("kill time");
    let surfaced = failed_at.saturating_duration_since(killed_at);
    eprintln!("{writes_ok} writes of 4 MiB went through before the kill");
    eprintln!("after SIGKILL: {err}");
    eprintln!("  reason={} status={:?}", err.reason(), err.nixl_status());
    eprintln!("  surfaced {surfaced:?} after kill(2); the failing call took {call_took:?}");

    assert!(call_took < timeout, "the failing write ran into its timeout: {err}");
    assert!(surfaced < Duration::from_secs(2), "took {surfaced:?} to notice");
    match &err {
        TransferError::Backend {
            op,
            status,
            detail,
            peer: Some(p),
        } => {
            assert!(["post_xfer_req", "get_xfer_status"].contains(op), "op {op}");
            assert_eq!(status, "NIXL_ERR_BACKEND");
            assert_eq!(p, &name);
            assert!(detail.contains(&name), "detail names the peer: {detail}");
        }
        other => panic!("unexpected error kind: {other:?}"),
    }
    assert_eq!(err.reason(), "nixl_error");
    assert_eq!(err.nixl_status(), Some("NIXL_ERR_BACKEND"));
    assert!(err.to_string().contains("NIXL_ERR_BACKEND"), "{err}");
    assert!(err.is_transfer_failure());

    // The test knows the process is dead (reaped): it may say so.
    let status = peer.child.wait().expect("reap");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    let confirmed = err.confirm_disconnect();
    assert_eq!(confirmed.reason(), "peer_disconnect");
    assert_eq!(confirmed.nixl_status(), Some("NIXL_ERR_BACKEND"));

    // Later writes keep failing promptly: no hang.
    let t = Instant::now();
    let again = agent.write(&name, src, 0, &remote, 0, 4096, b"", timeout);
    assert!(again.is_err(), "write to a dead peer succeeded");
    assert!(t.elapsed() < Duration::from_secs(1), "took {:?}", t.elapsed());

    // A restarted peer (same name, new metadata) is reachable after forget_peer.
    agent.forget_peer(&name).expect("forget dead peer");
    assert!(matches!(
        agent.write(&name, src, 0, &remote, 0, 1, b"", timeout),
        Err(TransferError::PeerNotLoaded { .. })
    ));
    let dir2 = tmp.path().join("restart");
    std::fs::create_dir(&dir2).expect("mkdir");
    let mut peer2 = Peer::spawn(&dir2, "decode-rank1", LEN);
    let (name2, remote2) = peer2.connect(&mut agent);
    assert_eq!(name2, name);
    let msg = format!("check:0:{LEN}:{:016x}", fnv1a64(&agent.region_to_vec(src).expect("b")));
    agent
        .write(
            &name2,
            src,
            0,
            &remote2,
            0,
            LEN,
            msg.as_bytes(),
            Duration::from_secs(10),
        )
        .expect("write to restarted peer");
    let line = peer2.wait_log(&msg, Duration::from_secs(10));
    assert!(line.ends_with(" ok"), "{line}");
    agent
        .write(&name2, src, 0, &remote2, 0, 1, b"quit", Duration::from_secs(10))
        .expect("quit");
    assert!(peer2.finish(Duration::from_secs(10)).success());
}
