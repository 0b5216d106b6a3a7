//! A private etcd that cannot start says why in the error itself: its log sits in a data
//! directory that tests and benches remove, so "exit status: 2" alone would leave CI's output
//! (and an operator running `rootrank serve`) without the cause.

use rootrank_store::embedded::{EmbeddedError, EmbeddedEtcd, EtcdOptions};

#[test]
fn an_etcd_that_exits_at_start_up_names_its_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = EtcdOptions {
        extra_args: vec!["--no-such-flag".to_string()],
        ..EtcdOptions::default()
    };
    let err = EmbeddedEtcd::start(dir.path(), &opts).expect_err("etcd must refuse an unknown flag");
    assert!(matches!(err, EmbeddedError::Exited { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("flag provided but not defined: -no-such-flag"), "{msg}");
    assert!(
        msg.contains(&dir.path().join("etcd.log").display().to_string()),
        "{msg}"
    );

    // The same data directory still starts a good etcd: the failed attempt changed nothing.
    let etcd = EmbeddedEtcd::start(dir.path(), &EtcdOptions::default()).expect("a good etcd starts");
    assert!(rootrank_store::embedded::health_ok(&format!(
        "127.0.0.1:{}",
        etcd.client_port()
    )));
}
