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

/// etcd's errors are told apart by their gRPC code, not their text: a write on a revoked lease
/// is "lease not found" (the writers then take a new lease), a read below the compaction is
/// "compacted" (the follower reloads), and neither is the other.
#[tokio::test]
async fn etcd_errors_are_classified_by_their_grpc_code() {
    let dir = tempfile::tempdir().expect("tempdir");
    let etcd = EmbeddedEtcd::start(dir.path(), &EtcdOptions::default()).expect("etcd starts");
    let mut c = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![etcd.endpoint()]))
        .await
        .expect("connect");
    let lease = c.lease_grant(5, None).await.expect("grant").id();
    c.lease_revoke(lease).await.expect("revoke");
    let gone = c
        .put(
            "/k",
            "v",
            Some(rootrank_store::etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await
        .expect_err("a revoked lease cannot carry a key");
    assert!(rootrank_store::is_lease_not_found(&gone), "{gone:?}");
    assert!(!rootrank_store::is_compacted(&gone), "{gone:?}");
    let rev = c
        .put("/k", "v", None)
        .await
        .expect("put")
        .header()
        .expect("header")
        .revision();
    c.put("/k", "w", None).await.expect("put");
    c.compact(rev + 1, None).await.expect("compact");
    let old = c
        .get(
            "/k",
            Some(rootrank_store::etcd_client::GetOptions::new().with_revision(rev)),
        )
        .await
        .expect_err("a compacted revision cannot be read");
    assert!(rootrank_store::is_compacted(&old), "{old:?}");
    assert!(!rootrank_store::is_lease_not_found(&old), "{old:?}");
}
