//! The parallel snapshot reader against a real etcd (3.4 from Debian, as in production):
//! every key under the prefix exactly once and nothing else, all at one revision while
//! writers keep writing, and etcd walking a bounded multiple of the keys rather than their
//! square.

use std::collections::BTreeMap;

use rootrank_core::Event;
use rootrank_store::embedded::{EmbeddedEtcd, EtcdOptions};
use rootrank_store::etcd_client::{Client, GetOptions, Txn, TxnOp};

const PREFIX: &str = "/rr/v1/";

/// Keys shaped like rootrank's: groups with live keys, certificates and room records.
fn layout(groups: usize, rooms: usize) -> Vec<(String, String)> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut out = Vec::new();
    for g in 0..groups {
        for r in 0..8 {
            out.push((format!("{PREFIX}groups/pd-{g}/ranks/{r}/live"), format!("live {g} {r}")));
        }
        out.push((
            format!("{PREFIX}groups/pd-{g}/ranks/3/down/{}", 1000 + g),
            format!("down {g}"),
        ));
        for _ in 0..rooms {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let room = x >> 1;
            for r in 0..8 {
                out.push((
                    format!("{PREFIX}groups/pd-{g}/rooms/{room}/ranks/{r}"),
                    format!("{room} {r}"),
                ));
            }
        }
    }
    out.push((format!("{PREFIX}coordinators/a"), "c".into()));
    out
}

async fn write(client: &mut Client, kvs: &[(String, String)]) {
    for chunk in kvs.chunks(128) {
        let ops: Vec<TxnOp> = chunk
            .iter()
            .map(|(k, v)| TxnOp::put(k.as_str(), v.as_str(), None))
            .collect();
        client.txn(Txn::new().and_then(ops)).await.unwrap();
    }
}

fn start_etcd() -> (tempfile::TempDir, EmbeddedEtcd) {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EmbeddedEtcd::start(&dir.path().join("etcd"), &EtcdOptions::default()).unwrap();
    (dir, etcd)
}

fn by_key(events: Vec<Event>) -> BTreeMap<String, (String, i64)> {
    let mut out = BTreeMap::new();
    for ev in events {
        let Event::Put {
            key, value, revision, ..
        } = ev
        else {
            panic!("a snapshot holds puts only");
        };
        let key = String::from_utf8(key).unwrap();
        let old = out.insert(key.clone(), (String::from_utf8(value).unwrap(), revision));
        assert!(old.is_none(), "{key} read twice");
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_once_and_only_under_the_prefix_whatever_the_readers() {
    let (_dir, etcd) = start_etcd();
    let mut client = Client::connect([etcd.endpoint()], None).await.unwrap();
    let kvs = layout(700, 16); // 700 x (8 + 1 + 128) + 1 = 95,901 keys
    write(&mut client, &kvs).await;
    // Neighbours on both sides of the prefix must never be read.
    write(
        &mut client,
        &[
            ("/rr/v0/x".into(), "no".into()),
            ("/rr/v10".into(), "no".into()),
            ("/rr/v1".into(), "no".into()),
        ],
    )
    .await;
    let want: BTreeMap<String, String> = kvs.into_iter().collect();
    for readers in [1, 3, 8] {
        let mut events = Vec::new();
        let stats = rootrank_store::snapshot_pages(&client, PREFIX, 0, readers, |page| {
            assert!(page.len() as i64 <= rootrank_store::PAGE);
            events.extend(page)
        })
        .await
        .unwrap();
        let got = by_key(events);
        assert_eq!(got.len(), want.len(), "{readers} readers");
        for (k, v) in &want {
            assert_eq!(got.get(k).map(|(v, _)| v), Some(v), "{readers} readers: {k}");
        }
        assert_eq!(stats.keys, want.len() as u64);
        assert_eq!(stats.busy_readers, readers as u64, "every reader got a part");
        // Paging from the prefix to its end would walk sum(n - i * page) ~ n^2 / (2 page)
        // index entries (~9.7x n here); bounded ranges walk a small multiple of n.
        assert!(
            stats.walked < 4 * stats.keys,
            "{readers} readers: etcd walked {} index entries for {} keys in {} requests",
            stats.walked,
            stats.keys,
            stats.requests
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_revision_while_writers_keep_writing() {
    let (_dir, etcd) = start_etcd();
    let mut client = Client::connect([etcd.endpoint()], None).await.unwrap();
    write(&mut client, &layout(200, 16)).await;
    // A writer adds and overwrites keys all through the read.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = tokio::spawn({
        let (mut c, stop) = (client.clone(), stop.clone());
        async move {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let g = i % 200;
                c.put(format!("{PREFIX}groups/pd-{g}/rooms/{i}/ranks/0"), "late", None)
                    .await
                    .unwrap();
                c.put(
                    format!("{PREFIX}groups/pd-{g}/ranks/0/live"),
                    format!("rewritten {i}"),
                    None,
                )
                .await
                .unwrap();
                i += 1;
            }
            i
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let mut events = Vec::new();
    let stats = rootrank_store::snapshot_pages(&client, PREFIX, 0, 4, |page| events.extend(page))
        .await
        .unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writer.await.unwrap();
    assert!(written > 10, "the writer wrote during the read ({written} rounds)");
    let got = by_key(events);
    // Exactly etcd's state at that revision, as one read at that revision gives it.
    let at = client
        .get(
            PREFIX,
            Some(GetOptions::new().with_prefix().with_revision(stats.revision)),
        )
        .await
        .unwrap();
    let want: BTreeMap<String, (String, i64)> = at
        .kvs()
        .iter()
        .map(|kv| {
            (
                kv.key_str().unwrap().to_string(),
                (kv.value_str().unwrap().to_string(), kv.mod_revision()),
            )
        })
        .collect();
    assert_eq!(got, want);
    assert!(got.values().all(|(_, rev)| *rev <= stats.revision));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revision_compacted_mid_read_is_an_error_not_a_partial_snapshot() {
    let (_dir, etcd) = start_etcd();
    let mut client = Client::connect([etcd.endpoint()], None).await.unwrap();
    write(&mut client, &layout(700, 16)).await;
    // On the first page, a write moves etcd past the snapshot's revision and compacts up to
    // it: the readers' remaining requests at the old revision cannot be answered.
    let mut compactor = Some(client.clone());
    let result = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        rootrank_store::snapshot_pages(&client, PREFIX, 0, 4, |_page| {
            if let Some(mut c) = compactor.take() {
                tokio::spawn(async move {
                    let put = c.put(format!("{PREFIX}late"), "x", None).await.unwrap();
                    let rev = put.header().unwrap().revision();
                    c.compact(rev, None).await.unwrap();
                });
            }
        }),
    )
    .await
    .expect("the read ends, it does not hang");
    let err = result.expect_err("a compacted revision cannot give a whole snapshot");
    assert!(err.to_string().contains("compacted"), "{err}");
    assert!(rootrank_store::is_compacted(&err), "{err:?}");
}
