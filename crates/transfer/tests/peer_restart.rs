//! A peer that dies and comes back under the same name with new metadata:
//! its stale metadata fails cleanly, a plain reload is refused, and
//! `replace_peer` makes it reachable again.

mod common;

use std::time::Duration;

use common::{fill_region, fnv1a64, load, Peer};
use rootrank_testkit::try_signal;
use rootrank_transfer::{TransferAgent, TransferError};

#[test]
fn restarted_peer_is_reachable_after_replace_peer() {
    let lib = load();
    let tmp = tempfile::tempdir().expect("tempdir");
    const LEN: usize = 64 << 10;
    let t = Duration::from_secs(5);
    let mut first = Peer::spawn(tmp.path(), "decode-rank3", LEN);
    let mut agent = TransferAgent::new(&lib, "prefill-rank3").expect("agent");
    let src = agent.register_dram(LEN).expect("register");
    fill_region(&mut agent, src, 9);
    let (name, old_region) = first.connect(&mut agent);
    agent
        .write(&name, src, 0, &old_region, 0, LEN, b"before", t)
        .expect("write before restart");
    first.wait_log("before", t);
    try_signal(first.pid(), libc::SIGKILL).expect("SIGKILL the first peer");
    first.child.wait().expect("reap");

    let dir2 = tmp.path().join("restarted");
    std::fs::create_dir(&dir2).expect("mkdir");
    let mut second = Peer::spawn(&dir2, "decode-rank3", LEN);
    let (new_md, new_region) = second.published();

    // Writing with what we had fails fast with a typed error, never hangs.
    let stale = agent
        .write(&name, src, 0, &old_region, 0, LEN, b"stale", t)
        .expect_err("write to the dead incarnation");
    eprintln!("stale: {stale}");
    assert_eq!(stale.reason(), "nixl_error");
    assert_eq!(stale.nixl_status(), Some("NIXL_ERR_BACKEND"));

    // NIXL refuses a second copy of a known agent.
    let refused = agent.load_peer(&new_md).expect_err("duplicate load");
    assert!(matches!(
        refused,
        TransferError::Backend {
            op: "load_remote_md",
            ..
        }
    ));
    assert!(refused.to_string().contains("replace_peer"), "{refused}");

    assert_eq!(agent.replace_peer(&name, &new_md).expect("replace"), name);
    assert!(agent.has_peer(&name));
    let msg = format!(
        "check:0:{LEN}:{:016x}",
        fnv1a64(&agent.region_to_vec(src).expect("bytes"))
    );
    agent
        .write(&name, src, 0, &new_region, 0, LEN, msg.as_bytes(), t)
        .expect("write to restarted peer");
    let line = second.wait_log(&msg, t);
    assert!(line.ends_with(" ok"), "{line}");
    agent.write(&name, src, 0, &new_region, 0, 1, b"quit", t).expect("quit");
    assert!(second.finish(t).success());
}
