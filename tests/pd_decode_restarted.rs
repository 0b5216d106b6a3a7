//! A decode rank restarted by its launcher (new process, new NIXL agent, new metadata in
//! etcd): the prefill side loads the new metadata and the next rooms arrive intact.

use rootrank_testkit::pd::simulate;
use rootrank_testkit::Etcd;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_decode_peer_is_reloaded_from_etcd() {
    let etcd = Etcd::start().expect("etcd");
    let logs = tempfile::tempdir().expect("tempdir");
    let run = simulate(
        &etcd.endpoint(),
        logs.path(),
        &[
            "--ranks",
            "2",
            "--rooms",
            "4",
            "--room-rate",
            "10",
            "--block-size",
            "65536",
            "--lease-ttl-ms",
            "1000",
            "--restart-decode-rank",
            "1@2",
        ],
    )
    .await
    .expect("simulate");
    for room in &run.rooms {
        assert_eq!(room["status"], "success", "{room}\nstderr:\n{}", run.stderr);
        assert_eq!(
            room["decode_checks"],
            serde_json::json!([[0, true], [1, true]]),
            "{room}"
        );
    }
    let log = std::fs::read_to_string(logs.path().join("prefill-0-1.log")).expect("prefill rank 1's log");
    let loads = log.matches("peer metadata loaded").count();
    assert_eq!(
        loads, 2,
        "the first decode rank 1, then its restarted successor:\n{log}"
    );
    assert!(log.contains("loaded its new metadata"), "{log}");
    // Prefill rank 0's peer did not change: one load only.
    let log0 = std::fs::read_to_string(logs.path().join("prefill-0-0.log")).expect("prefill rank 0's log");
    assert_eq!(log0.matches("peer metadata loaded").count(), 1, "{log0}");
}
