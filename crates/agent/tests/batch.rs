//! Batched writes keep every promise of single writes, against real etcd: the same etcd state
//! for the same queue, create-if-absent per key inside a batch, and nothing lost or written
//! twice across an etcd restart in the middle of a burst.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use proptest::prelude::*;
use rootrank_agent::{Agent, AgentConfig};
use rootrank_core::Origin;
use rootrank_store::etcd_client::{Client, GetOptions};
use rootrank_store::{LazyClient, RetainedWriter, Written};
use rootrank_testkit::Etcd;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Every key under `prefix`, with the prefix cut off: (value, version, mod_revision).
async fn state(c: &mut Client, prefix: &str) -> BTreeMap<String, (Vec<u8>, i64, i64)> {
    let r = c.get(prefix, Some(GetOptions::new().with_prefix())).await.unwrap();
    r.kvs()
        .iter()
        .map(|kv| {
            let key = String::from_utf8_lossy(&kv.key()[prefix.len()..]).into_owned();
            (key, (kv.value().to_vec(), kv.version(), kv.mod_revision()))
        })
        .collect()
}

fn writer(etcd: &Etcd) -> RetainedWriter {
    RetainedWriter::new(
        LazyClient::new(rootrank_store::EtcdAccess::plain(vec![etcd.endpoint()])),
        Duration::from_secs(600),
    )
}

#[test]
fn batched_and_single_writes_leave_the_same_state() {
    let etcd = Etcd::start().unwrap();
    let rt = runtime();
    // The runner takes a `Fn`: the writers and the client are borrowed per case.
    let client = tokio::sync::Mutex::new(rt.block_on(Client::connect([etcd.endpoint()], None)).unwrap());
    let batched = tokio::sync::Mutex::new(writer(&etcd));
    let single = tokio::sync::Mutex::new(writer(&etcd));
    let case = std::cell::Cell::new(0u32);
    // Queues long enough to span several batches, over few keys so duplicates are common,
    // with some keys already in etcd before the queue is written.
    let queues = (
        proptest::collection::vec((0u8..24, 0u8..4), 1..150),
        proptest::collection::btree_set(0u8..24, 0..6),
    );
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(24));
    runner
        .run(&queues, |(queue, existing)| {
            case.set(case.get() + 1);
            let (a, b) = (format!("/batch/{}/a/", case.get()), format!("/batch/{}/b/", case.get()));
            let (outcomes_batched, outcomes_single, state_a, state_b) = rt.block_on(async {
                let (mut client, mut batched, mut single) =
                    (client.lock().await, batched.lock().await, single.lock().await);
                for k in &existing {
                    for p in [&a, &b] {
                        client.put(format!("{p}k{k}"), b"before".to_vec(), None).await.unwrap();
                    }
                }
                let keys_a: Vec<String> = queue.iter().map(|(k, _)| format!("{a}k{k}")).collect();
                let values: Vec<Vec<u8>> = queue.iter().map(|(_, v)| format!("v{v}").into_bytes()).collect();
                let records: Vec<(&str, &[u8])> = keys_a
                    .iter()
                    .zip(&values)
                    .map(|(k, v)| (k.as_str(), v.as_slice()))
                    .collect();
                let outcomes_batched = batched.write_records(&records, None).await;
                let mut outcomes_single = Vec::new();
                for ((k, _), v) in queue.iter().zip(&values) {
                    let key = format!("{b}k{k}");
                    outcomes_single.push(
                        single
                            .write(rootrank_store::Retained::Record { key: &key, value: v }, None)
                            .await,
                    );
                }
                (
                    outcomes_batched,
                    outcomes_single,
                    state(&mut client, &a).await,
                    state(&mut client, &b).await,
                )
            });
            prop_assert_eq!(&outcomes_batched, &outcomes_single);
            // Same keys, same values, each written once (version 1 unless it was there before).
            let strip = |s: &BTreeMap<String, (Vec<u8>, i64, i64)>| {
                s.iter()
                    .map(|(k, (v, ver, _))| (k.clone(), v.clone(), *ver))
                    .collect::<Vec<_>>()
            };
            prop_assert_eq!(strip(&state_a), strip(&state_b));
            prop_assert!(state_a.values().all(|(_, version, _)| *version == 1));
            Ok(())
        })
        .unwrap();
}

#[test]
fn create_if_absent_holds_inside_a_batch() {
    let etcd = Etcd::start().unwrap();
    let rt = runtime();
    rt.block_on(async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        c.put("/t/k5", b"theirs".to_vec(), None).await.unwrap();
        let mut w = writer(&etcd);
        let records: [(&str, &[u8]); 5] = [
            ("/t/k1", b"a1"),
            ("/t/k5", b"mine"),
            ("/t/k3", b"first"),
            ("/t/k3", b"second"),
            ("/t/k4", b"a4"),
        ];
        let out = w.write_records(&records, None).await;
        assert_eq!(
            out,
            [
                Written::Yes,
                Written::AlreadyThere,
                Written::Yes,
                Written::AlreadyThere,
                Written::Yes
            ]
        );
        let s = state(&mut c, "/t/").await;
        assert_eq!(s["k5"].0, b"theirs", "an existing key is never overwritten");
        assert_eq!(s["k3"].0, b"first", "the first value of a key in a batch wins");
        // The three new keys went in one transaction: one revision.
        assert_eq!(s["k1"].2, s["k3"].2);
        assert_eq!(s["k1"].2, s["k4"].2);
    });
}

#[test]
fn an_etcd_that_takes_smaller_transactions_gets_every_record_in_smaller_batches() {
    let etcd = Etcd::start_with(&["--max-txn-ops", "16"]).unwrap();
    runtime().block_on(async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        let keys: Vec<String> = (0..100).map(|i| format!("/small/k{i:03}")).collect();
        let records: Vec<(&str, &[u8])> = keys.iter().map(|k| (k.as_str(), b"v".as_slice())).collect();
        let out = writer(&etcd).write_records(&records, None).await;
        assert!(out.iter().all(|w| *w == Written::Yes), "{out:?}");
        let s = state(&mut c, "/small/").await;
        assert_eq!(s.len(), 100);
        // Split, not given up: transactions of at most 16 records, more than one record each.
        let transactions: std::collections::BTreeSet<i64> = s.values().map(|(_, _, rev)| *rev).collect();
        assert!((7..50).contains(&transactions.len()), "{}", transactions.len());
    });
}

#[test]
fn batches_etcd_takes_whole_and_batches_it_splits_all_land_in_order() {
    // 300 records make batches of 128, 128 and 44: etcd (at most 100 operations) refuses the
    // first two, which are split, and takes the last whole, all while in flight together.
    let etcd = Etcd::start_with(&["--max-txn-ops", "100"]).unwrap();
    runtime().block_on(async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        let keys: Vec<String> = (0..300).map(|i| format!("/mixed/k{i:03}")).collect();
        let values: Vec<String> = (0..300).map(|i| format!("v{i}")).collect();
        let records: Vec<(&str, &[u8])> = keys
            .iter()
            .zip(&values)
            .map(|(k, v)| (k.as_str(), v.as_bytes()))
            .collect();
        let out = writer(&etcd).write_records(&records, None).await;
        assert_eq!(out.len(), 300, "one outcome per record");
        assert!(out.iter().all(|w| *w == Written::Yes), "{out:?}");
        let s = state(&mut c, "/mixed/").await;
        assert_eq!(s.len(), 300, "every record landed");
        for (i, v) in values.iter().enumerate() {
            let k = format!("k{i:03}");
            assert_eq!(s[&k].0, v.as_bytes(), "{k}");
        }
    });
}

fn agent(etcd: &Etcd, group: &str) -> Agent {
    let mut cfg = AgentConfig::new(vec![etcd.endpoint()], group, 2, 8).unwrap();
    cfg.queue_capacity = 10_000;
    let agent = Agent::start(cfg).unwrap();
    assert!(agent.wait_registered(Duration::from_secs(10)).is_some());
    agent
}

#[test]
fn a_burst_is_written_in_few_transactions() {
    let etcd = Etcd::start().unwrap();
    let agent = agent(&etcd, "decode-0");
    for room in 0..500u64 {
        agent
            .record_failure(room, Origin::Propagated, "other", "burst", None)
            .unwrap();
    }
    assert!(agent.flush(Duration::from_secs(30)));
    assert_eq!(agent.stats().published.load(Ordering::Relaxed), 500);
    let s = runtime().block_on(async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        state(&mut c, "/rootrank/v1/groups/decode-0/rooms/").await
    });
    assert_eq!(s.len(), 500);
    let transactions: std::collections::BTreeSet<i64> = s.values().map(|(_, _, rev)| *rev).collect();
    // At most 128 records per transaction: at least 4; one per record would be 500.
    assert!(
        transactions.len() < 100,
        "500 queued records took {} transactions",
        transactions.len()
    );
    assert!(agent.shutdown(Duration::from_secs(10)));
}

#[test]
fn an_etcd_restart_in_the_middle_of_a_burst_loses_and_duplicates_nothing() {
    let mut etcd = Etcd::start().unwrap();
    let agent = agent(&etcd, "prefill-3");
    let n = 3_000u64;
    for room in 0..n / 2 {
        agent
            .record_failure(room, Origin::Local, "nixl_error", "burst", None)
            .unwrap();
    }
    // etcd dies while the first half is being written, and the second half is queued meanwhile.
    etcd.kill();
    for room in n / 2..n {
        agent
            .record_failure(room, Origin::Local, "nixl_error", "burst", None)
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    etcd.restart().unwrap();
    assert!(
        agent.flush(Duration::from_secs(60)),
        "the queue drained after etcd came back"
    );
    let s = runtime().block_on(async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        state(&mut c, "/rootrank/v1/groups/prefill-3/rooms/").await
    });
    assert_eq!(s.len() as u64, n, "every queued record is in etcd");
    assert!(
        s.values().all(|(_, version, _)| *version == 1),
        "no record was written twice"
    );
    for room in 0..n {
        let (v, _, _) = &s[&format!("{room}/ranks/2")];
        let rec: serde_json::Value = serde_json::from_slice(v).unwrap();
        assert_eq!(rec["room"], room.to_string());
    }
    assert_eq!(agent.stats().published.load(Ordering::Relaxed), n);
    assert_eq!(agent.stats().dropped.load(Ordering::Relaxed), 0);
    assert!(agent.shutdown(Duration::from_secs(10)));
}
