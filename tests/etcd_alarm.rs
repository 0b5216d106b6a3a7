//! etcd out of space (issue 28, finding 3), on real etcd with a small `--quota-backend-bytes`
//! filled until etcd raises its NOSPACE alarm: `/readyz` says so (it stayed 200 before) and
//! `rootrank_etcd_alarm{alarm="NOSPACE"}` is 1; a rank that dies meanwhile is still seen down,
//! and its certificate, which etcd refuses while the alarm is raised, is on record once the
//! alarm is disarmed; a record written meanwhile waits in its agent (which counts its retries)
//! and lands then; a rank that starts meanwhile says "etcd database space exceeded" (it said
//! "is etcd reachable?"); a room resolved before the alarm is resolved the same after it.

use std::time::Duration;

use rootrank_store::etcd_client::{self, GetOptions};
use rootrank_testkit::{eventually, Coordinator, Etcd, Rank};

const T: Duration = Duration::from_secs(30);

fn alarm_gauge(metrics: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("rootrank_etcd_alarm{alarm=\"NOSPACE\"} ")?.parse().ok())
}

fn etcdctl(endpoint: &str, args: &[&str]) -> String {
    let out = std::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoint}"))
        .args(args)
        .output()
        .expect("etcdctl runs");
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_etcd_is_named_on_readyz_and_nothing_resolved_changes_after_it_is_disarmed() {
    let etcd = Etcd::start_with(&["--quota-backend-bytes", "4194304"]).unwrap();
    let ep = etcd.endpoint();
    let coord = Coordinator::start(&ep, &[]).await.unwrap();
    let mut ranks: Vec<Rank> = (0..2)
        .map(|r| Rank::start(&ep, "prefill-3", r, 2, 1000).unwrap())
        .collect();
    ranks[0].fail(61, "local", "nixl_error", "NIXL_ERR_BACKEND").unwrap();
    ranks[0].flush().unwrap();
    let before = eventually(T, "room 61 resolved", || async {
        let (_, v) = coord.get("/v1/rooms/61/verdict").await.ok()?;
        (v["status"] == "resolved").then_some(v)
    })
    .await
    .unwrap();
    let (_, m) = coord.get("/metrics").await.unwrap();
    assert_eq!(
        alarm_gauge(m.as_str().unwrap()),
        Some(0.0),
        "the alarm gauge is there at 0"
    );

    // Fill etcd (outside rootrank's prefix, as another tenant would) until it refuses.
    let mut client = etcd_client::Client::connect([ep.clone()], None).await.unwrap();
    let filler = vec![b'x'; 256 * 1024];
    let mut full = false;
    for i in 0..200 {
        if let Err(e) = client.put(format!("/filler/{i}"), filler.clone(), None).await {
            assert!(e.to_string().contains("database space exceeded"), "{e}");
            full = true;
            break;
        }
    }
    assert!(full, "etcd raised no NOSPACE alarm");

    let (status, body) = eventually(T, "/readyz names the alarm", || async {
        let r = coord.get("/readyz").await.ok()?;
        (r.0 == 503).then_some(r)
    })
    .await
    .unwrap();
    assert_eq!(status, 503);
    assert_eq!(body["error"]["code"], "etcd_alarm", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("NOSPACE"), "{body}");
    let (_, m) = coord.get("/metrics").await.unwrap();
    assert_eq!(alarm_gauge(m.as_str().unwrap()), Some(1.0));

    // A record written now waits in its agent, which counts its retries.
    ranks[0]
        .fail(62, "local", "nixl_error", "written while etcd was full")
        .unwrap();
    eventually(T, "the agent counts its retries", || {
        let reply = ranks[0].send("stats").unwrap_or_default();
        let retries: u64 = reply
            .split_whitespace()
            .find_map(|w| w.strip_prefix("retries=")?.parse().ok())
            .unwrap_or(0);
        async move { (retries > 0).then_some(()) }
    })
    .await
    .unwrap();

    // A rank that starts now is told why it cannot register (it said "is etcd reachable?").
    let out = std::process::Command::new(rootrank_testkit::rootrank_bin())
        .args([
            "rank",
            "--etcd-endpoints",
            &ep,
            "--group",
            "prefill-4",
            "--rank",
            "0",
            "--group-size",
            "1",
        ])
        .env("ROOTRANK_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("etcd database space exceeded"), "{stderr}");

    // A rank dies while etcd is full: seen down (etcd still expires leases), though etcd
    // refuses its certificate for now.
    ranks[1].kill9();
    eventually(T, "rank 1 down", || async {
        let (_, g) = coord.get("/v1/groups/prefill-3").await.ok()?;
        (g["ranks"][1]["state"] == "down").then_some(())
    })
    .await
    .unwrap();

    // The operator frees space and disarms.
    client
        .delete("/filler/", Some(etcd_client::DeleteOptions::new().with_prefix()))
        .await
        .unwrap();
    let rev = client.get("/", None).await.unwrap().header().unwrap().revision();
    client.compact(rev, None).await.unwrap();
    client.defragment().await.unwrap();
    let disarmed = etcdctl(&ep, &["alarm", "disarm"]);
    assert!(etcdctl(&ep, &["alarm", "list"]).trim().is_empty(), "{disarmed}");

    eventually(T, "/readyz 200 again", || async {
        (coord.get("/readyz").await.ok()?.0 == 200).then_some(())
    })
    .await
    .unwrap();
    let (_, m) = coord.get("/metrics").await.unwrap();
    assert_eq!(alarm_gauge(m.as_str().unwrap()), Some(0.0));
    // The certificate etcd refused is on record now.
    eventually(T, "rank 1's certificate in etcd", || {
        let mut client = client.clone();
        async move {
            let r = client
                .get(
                    "/rootrank/v1/groups/prefill-3/ranks/1/down/",
                    Some(GetOptions::new().with_prefix()),
                )
                .await
                .ok()?;
            (!r.kvs().is_empty()).then_some(())
        }
    })
    .await
    .unwrap();
    // The record that waited is not lost: it lands once etcd takes writes (after rank 1's
    // death in etcd's order, which is the order verdicts follow).
    eventually(T, "room 62's record that waited", || async {
        let (_, v) = coord.get("/v1/rooms/62/verdict").await.ok()?;
        v["evidence"]
            .as_array()?
            .iter()
            .any(|e| e["kind"] == "room_record" && e["rank"] == 0 && e["origin"] == "local")
            .then_some(())
    })
    .await
    .unwrap();
    let (_, after) = coord.get("/v1/rooms/61/verdict").await.unwrap();
    assert_eq!(after["status"], "resolved", "{after}");
    // The same culprit (`repeat` counts rank 0's rooms, and room 62 is one more).
    for field in ["group", "rank", "incarnation", "reason", "source", "detail"] {
        assert_eq!(after["culprit"][field], before["culprit"][field], "{field}: {after}");
    }
}
