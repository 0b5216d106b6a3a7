//! Verdicts follow etcd, not anybody's clock (issue 28, finding 2), on real etcd, two real
//! coordinators and real rank processes whose wall clocks are set off by libfaketime (as on a
//! host whose NTP is broken): a survivor's clock 10 s, 60 s or 10 min behind or ahead used to
//! leave its room `unknown` for good or `pending` for ten minutes. Here one replica's own
//! clock is 10 min ahead too, and both replicas answer alike.

use std::time::Duration;

use rootrank_testkit::pd::room_record;
use rootrank_testkit::{agreed_verdict, clock_skew_env, Coordinator, Etcd, Rank};
use serde_json::Value;

const T: Duration = Duration::from_secs(30);

/// Survivor clock offsets, seconds.
const SKEWS: [i64; 6] = [-600, -60, -10, 0, 10, 600];

async fn agreed(replicas: [&Coordinator; 2], room: u64, group: &str, done: fn(&Value) -> bool) -> Value {
    agreed_verdict(replicas, room, &format!("group={group}"), T, done)
        .await
        .unwrap()
}

fn resolved(v: &Value) -> bool {
    v["status"] == "resolved"
}

fn unix_s() -> i64 {
    rootrank_store::unix_ms() / 1000
}

/// How far a coordinator's wall clock is from this test's, in seconds, from the `date`
/// header of its answer (so a test knows its skew took effect).
async fn clock_offset_s(c: &Coordinator) -> i64 {
    let client = rootrank_tls::http_client(None)
        .expect("an HTTP client")
        .build()
        .expect("an HTTP client");
    let r = client
        .get(format!("{}/healthz", c.url))
        .send()
        .await
        .expect("coordinator answers");
    let date = r
        .headers()
        .get("date")
        .and_then(|d| d.to_str().ok())
        .unwrap_or("")
        .to_string();
    let then = httpdate::parse_http_date(&date).expect("a date header");
    let then = then.duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs() as i64;
    then - unix_s()
}

/// How far a record's `at` is from this test's clock, in seconds.
fn at_offset_s(record: &Value) -> i64 {
    let at = rootrank_core::time::parse_ms(record["at"].as_str().unwrap_or("")).expect("an RFC 3339 at");
    at / 1000 - unix_s()
}

/// Within 5 s of the offset asked for.
fn near(actual: i64, wanted: i64) -> bool {
    (actual - wanted).abs() <= 5
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_survivor_whose_clock_is_off_gets_the_verdict_of_one_on_time() {
    let etcd = Etcd::start().unwrap();
    // Replica b's host clock is 10 minutes ahead: its windows are on its monotonic clock.
    let a = Coordinator::start(&etcd.endpoint(), &[]).await.unwrap();
    let b = Coordinator::start_with_env(&etcd.endpoint(), &[], &clock_skew_env(600).unwrap())
        .await
        .unwrap();
    let off = clock_offset_s(&b).await;
    assert!(near(off, 600), "replica b's clock is {off} s off, not 600");

    // Per skew, a group of 2 with 2 s leases: rank 0 (the survivor) runs with its clock off,
    // rank 1 dies by SIGKILL 0.1 s after rank 0 recorded the generic error of room 100+i.
    let mut groups = Vec::new();
    for (i, skew) in SKEWS.iter().enumerate() {
        let g = format!("skew-{i}");
        let survivor =
            Rank::start_with_env(&etcd.endpoint(), &g, 0, 2, 2000, &[], &clock_skew_env(*skew).unwrap()).unwrap();
        let sibling = Rank::start(&etcd.endpoint(), &g, 1, 2, 2000).unwrap();
        groups.push((g, survivor, sibling));
    }
    for (i, (_, survivor, _)) in groups.iter_mut().enumerate() {
        survivor
            .fail(
                100 + i as u64,
                "propagated",
                "peer_disconnect",
                "NIXL KVSender Exception",
            )
            .unwrap();
        survivor.flush().unwrap();
        let record = room_record(&etcd.endpoint(), &format!("skew-{i}"), &(100 + i).to_string(), 0)
            .await
            .unwrap()
            .expect("the survivor's record is in etcd");
        let off = at_offset_s(&record);
        assert!(
            near(off, SKEWS[i]),
            "the survivor's at is {off} s off, not {}: {record}",
            SKEWS[i]
        );
    }

    // Before the death each room is pending, and both replicas say so in the same words (the
    // window's length, not a countdown of this replica's).
    for (i, (g, _, _)) in groups.iter().enumerate() {
        let v = agreed([&a, &b], 100 + i as u64, g, |v| v["status"] == "pending").await;
        assert!(
            v["explain"]
                .as_str()
                .unwrap_or("")
                .contains("within 3.0 s of its first record"),
            "skew {}: {v}",
            SKEWS[i]
        );
    }

    std::thread::sleep(Duration::from_millis(100));
    for (_, _, sibling) in groups.iter_mut() {
        sibling.kill9();
    }

    let mut answers = Vec::new();
    for (i, (g, _, _)) in groups.iter().enumerate() {
        let v = agreed([&a, &b], 100 + i as u64, g, resolved).await;
        answers.push((SKEWS[i], v));
    }
    for (skew, v) in &answers {
        assert_eq!(v["culprit"]["rank"], 1, "survivor {skew} s off: {v}");
        assert_eq!(v["culprit"]["reason"], "lease_expired", "survivor {skew} s off: {v}");
        assert_eq!(v["action"], "abort_and_restart_group", "survivor {skew} s off: {v}");
    }
    // The same verdict as with no skew, but for the names.
    let control = &answers[3].1;
    for (skew, v) in &answers {
        for field in ["status", "action"] {
            assert_eq!(v[field], control[field], "{field}, survivor {skew} s off");
        }
        let unnamed = |v: &Value| {
            v["advice"]
                .as_str()
                .unwrap_or("")
                .split_once(' ')
                .map(|(_, a)| a.to_string())
        };
        assert_eq!(unnamed(v), unnamed(control), "advice, survivor {skew} s off");
        assert_eq!(
            v["culprit"]["reason"], control["culprit"]["reason"],
            "survivor {skew} s off"
        );
    }

    // Still so 4 s later: nothing a clock says reopens or changes a settled room.
    std::thread::sleep(Duration::from_secs(4));
    for (i, (g, _, _)) in groups.iter().enumerate() {
        let v = agreed([&a, &b], 100 + i as u64, g, resolved).await;
        assert_eq!(v["culprit"]["rank"], 1, "skew {}: {v}", SKEWS[i]);
    }
}
