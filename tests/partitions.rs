//! Partitions, for real: a coordinator replica and a rank run in a network namespace of their
//! own, reaching etcd over a veth pair; an nftables rule in that namespace blackholes etcd
//! (packets dropped, no reset: what a dead switch looks like). The replica turns `/readyz`
//! to 503 and answers verdicts with 503 instead of as if current, then recovers by itself at
//! the heal without losing the death that happened meanwhile; the rank keeps its records in
//! its queue and delivers every one after the heal. Needs root (namespaces, nftables).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use rootrank_store::embedded::{EmbeddedEtcd, EtcdOptions};
use rootrank_testkit::{eventually, free_port, python_with_rootrank, require_root, rootrank_bin, Coordinator, Rank};

fn run(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace joined to the host by a veth pair: host 10.231.N.1, namespace 10.231.N.2.
struct Netns {
    name: String,
    host_if: String,
    host_ip: String,
    ns_ip: String,
}

impl Netns {
    /// The `k`th namespace of this test process (tests of one binary run at once).
    fn create(k: u32) -> Netns {
        let n = 20 + (std::process::id() + 97 * k) % 200;
        let ns = Netns {
            name: format!("rrpart{n}"),
            host_if: format!("rrh{n}"),
            host_ip: format!("10.231.{n}.1"),
            ns_ip: format!("10.231.{n}.2"),
        };
        let ns_if = format!("rrn{n}");
        let _ = Command::new("ip").args(["netns", "del", &ns.name]).output();
        let _ = Command::new("ip").args(["link", "del", &ns.host_if]).output();
        run(&["ip", "netns", "add", &ns.name]);
        run(&["ip", "link", "add", &ns.host_if, "type", "veth", "peer", "name", &ns_if]);
        run(&["ip", "link", "set", &ns_if, "netns", &ns.name]);
        run(&["ip", "addr", "add", &format!("{}/24", ns.host_ip), "dev", &ns.host_if]);
        run(&["ip", "link", "set", &ns.host_if, "up"]);
        run(&[
            "ip",
            "netns",
            "exec",
            &ns.name,
            "ip",
            "addr",
            "add",
            &format!("{}/24", ns.ns_ip),
            "dev",
            &ns_if,
        ]);
        run(&["ip", "netns", "exec", &ns.name, "ip", "link", "set", &ns_if, "up"]);
        run(&["ip", "netns", "exec", &ns.name, "ip", "link", "set", "lo", "up"]);
        ns
    }

    /// Drops every packet from the namespace to etcd (the host's `port`) without a reset.
    /// The test still reaches the namespace's coordinator (its answers are not to that port).
    fn partition(&self, port: u16) {
        let rules = format!(
            "add table inet rrpart; add chain inet rrpart out {{ type filter hook output priority 0; policy accept; }}; add rule inet rrpart out ip daddr {} tcp dport {port} drop",
            self.host_ip
        );
        run(&["ip", "netns", "exec", &self.name, "nft", &rules]);
    }

    fn heal(&self) {
        run(&[
            "ip", "netns", "exec", &self.name, "nft", "delete", "table", "inet", "rrpart",
        ]);
    }

    fn command(&self, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).output();
    }
}

/// An etcd listening on loopback (the host's processes) and on the namespace's veth (its
/// processes): (etcd, its client port, its directory, for the test's logs too).
fn etcd_for(ns: &Netns) -> (EmbeddedEtcd, u16, tempfile::TempDir) {
    let port = free_port().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let etcd = EmbeddedEtcd::start(
        dir.path(),
        &EtcdOptions {
            client_port: port,
            extra_args: vec![
                "--listen-client-urls".into(),
                format!("http://127.0.0.1:{port},http://{}:{port}", ns.host_ip),
            ],
            ..EtcdOptions::default()
        },
    )
    .unwrap();
    (etcd, port, dir)
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `rootrank rank` inside the namespace, driven over its stdin.
struct NsRank {
    _child: Killed,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl NsRank {
    fn send(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim_end().to_string()
    }
}

/// `rootrank.Coordinator("A,B").verdict(66, wait_ms=30000)`, timed.
const PYTHON_LONG_POLL: &str = r#"
import json, sys, time, rootrank
c = rootrank.Coordinator(sys.argv[1])
t = time.monotonic()
v = c.verdict(66, group="part-0", wait_ms=30000)
print(json.dumps({"elapsed_s": time.monotonic() - t, "status": v["status"], "culprit": v["culprit"]}))
"#;

async fn status(url: &str) -> Option<(u16, serde_json::Value)> {
    rootrank_testkit::get(url).await.ok()
}

/// Waits until the coordinator at `url` says it is current with etcd.
async fn ready(url: &str, timeout: Duration) {
    eventually(timeout, &format!("{url}/readyz 200"), || async {
        status(&format!("{url}/readyz"))
            .await
            .filter(|(s, _)| *s == 200)
            .map(|_| ())
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_replica_says_not_current_and_recovers_and_a_partitioned_rank_loses_nothing() {
    require_root("partitions", "network namespaces and nftables");
    let ns = Netns::create(0);
    let (etcd, port, dir) = etcd_for(&ns);
    let host_ep = etcd.endpoint();
    let ns_ep = format!("http://{}:{port}", ns.host_ip);

    // Replica B on the host; replica A inside the namespace.
    let b = Coordinator::start(&host_ep, &[]).await.unwrap();
    let a_url = format!("http://{}:9750", ns.ns_ip);
    let a_log = dir.path().join("a.log");
    let _a = Killed(
        ns.command(&rootrank_bin())
            .args([
                "serve",
                "--etcd-endpoints",
                &ns_ep,
                "--listen",
                &format!("{}:9750", ns.ns_ip),
            ])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&a_log).unwrap())
            .stderr(std::fs::File::create(dir.path().join("a.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    ready(&a_url, Duration::from_secs(20)).await;

    // Ranks: a group on the host, and one rank inside the namespace.
    let mut host_ranks: Vec<Rank> = (0..3)
        .map(|r| Rank::start(&host_ep, "part-0", r, 3, 1_000).unwrap())
        .collect();
    let mut child = ns
        .command(&rootrank_bin())
        .args([
            "rank",
            "--etcd-endpoints",
            &ns_ep,
            "--group",
            "part-1",
            "--rank",
            "0",
            "--group-size",
            "1",
        ])
        // A lease that outlives the partition: the rank is cut off, not dead.
        .args(["--lease-ttl-ms", "30000"])
        .env("ROOTRANK_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ns_rank = NsRank {
        stdin: child.stdin.take().unwrap(),
        stdout: BufReader::new(child.stdout.take().unwrap()),
        _child: Killed(child),
    };
    let mut first = String::new();
    ns_rank.stdout.read_line(&mut first).unwrap();
    assert!(first.starts_with("registered "), "{first}");
    eventually(Duration::from_secs(20), "A sees both groups", || async {
        let (_, g) = status(&format!("{a_url}/v1/groups")).await?;
        (g["groups"].as_array()?.len() == 2).then_some(())
    })
    .await
    .unwrap();

    // A scheduler's long poll waits on A (room 77 has no records: pending until the wait ends).
    let long_poll = tokio::spawn({
        let url = format!("{a_url}/v1/rooms/77/verdict?group=part-0&wait_ms=30000");
        async move {
            let asked = Instant::now();
            (status(&url).await, asked.elapsed())
        }
    });
    // And one through the Python client (what the SGLang plugin and schedulers use), given A
    // first, then B: when A answers 503 it must ask B within the same call.
    let python = python_with_rootrank().unwrap();
    let replicas = format!("{a_url},{}", b.url);
    let python_poll = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(["-c", PYTHON_LONG_POLL, &replicas])
            .env_remove("ROOTRANK_COORDINATOR")
            .output()
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The partition.
    ns.partition(port);
    let cut = Instant::now();
    let detected = eventually(Duration::from_secs(60), "A's /readyz 503", || async {
        let (s, _) = status(&format!("{a_url}/readyz")).await?;
        (s == 503).then(|| cut.elapsed())
    })
    .await
    .unwrap();
    eprintln!("partition detected by replica A in {detected:?}");
    // The waiting long poll ends with the readiness, not with its 30 s wait and a stale
    // `pending`: the client can ask another replica within the same call.
    let (answer, waited) = long_poll.await.unwrap();
    let (s, v) = answer.expect("A answered the long poll");
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "not_ready", "{v}");
    eprintln!("the long poll waiting on A answered 503 not_ready after {waited:?}");
    let (s, v) = status(&format!("{a_url}/v1/rooms/1/verdict?group=part-0"))
        .await
        .unwrap();
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "not_ready", "{v}");

    // A host rank fails room 66 now, after the cut: only B can know. The Python call that
    // started on A answers with it, within its one call.
    host_ranks[0].fail(66, "local", "nixl_error", "after the cut").unwrap();
    let out = python_poll.await.unwrap().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["status"], "resolved", "{answer}");
    assert_eq!(answer["culprit"]["group"], "part-0", "{answer}");
    assert_eq!(answer["culprit"]["rank"], 0, "{answer}");
    assert!(answer["elapsed_s"].as_f64().unwrap() < 30.0, "{answer}");
    eprintln!(
        "the Python client's long poll moved from A to B and answered after {:.1} s",
        answer["elapsed_s"].as_f64().unwrap()
    );

    // Meanwhile a host rank dies (B certifies it) and the namespace's rank records failures.
    host_ranks.remove(1).kill9();
    for room in 501..=505 {
        assert_eq!(
            ns_rank.send(&format!("fail {room} local nixl_error cut off from etcd")),
            "ok"
        );
    }
    eventually(Duration::from_secs(20), "B sees part-0 rank 1 down", || async {
        let (_, g) = b.get("/v1/groups/part-0").await.ok()?;
        (g["ranks"][1]["state"] == "down").then_some(())
    })
    .await
    .unwrap();
    let (_, v) = b.get("/v1/rooms/501/verdict?group=part-1").await.unwrap();
    assert_eq!(
        v["evidence"],
        serde_json::json!([]),
        "nothing of the namespace's rank reached etcd yet: {v}"
    );

    // The heal: A is current again by itself and has the death; the rank's queue drains.
    ns.heal();
    let healed = Instant::now();
    ready(&a_url, Duration::from_secs(60)).await;
    eprintln!("replica A current again {:?} after the heal", healed.elapsed());
    eventually(
        Duration::from_secs(20),
        "A has the death from the partition",
        || async {
            let (_, g) = status(&format!("{a_url}/v1/groups/part-0")).await?;
            (g["ranks"][1]["state"] == "down").then_some(())
        },
    )
    .await
    .unwrap();
    let flushed = tokio::task::spawn_blocking(move || ns_rank.send("flush"))
        .await
        .unwrap();
    assert_eq!(flushed, "flushed");
    for room in 501..=505 {
        for url in [&a_url, &b.url] {
            let (_, v) = status(&format!("{url}/v1/rooms/{room}/verdict?group=part-1&wait_ms=10000"))
                .await
                .unwrap();
            assert_eq!(v["status"], "resolved", "{v}");
            assert_eq!(v["culprit"]["group"], "part-1", "{v}");
            assert_eq!(v["culprit"]["reason"], "nixl_error", "{v}");
        }
    }
}

/// node-watch inside a namespace cut off from etcd by a blackhole: it says it is blind within
/// the silence limit (no reset, no error comes: without progress requests its watch would stay
/// open and quiet for ever), re-creates its watch at the heal, and then watches and certifies a
/// rank that registered while it was blind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_node_watch_says_it_is_blind_and_catches_up_at_the_heal() {
    require_root("partitions", "network namespaces and nftables");
    let ns = Netns::create(1);
    let (etcd, port, dir) = etcd_for(&ns);
    let host_ep = etcd.endpoint();
    let log = dir.path().join("node-watch.log");
    let _node_watch = Killed(
        ns.command(&rootrank_bin())
            .args([
                "node-watch",
                "--etcd-endpoints",
                &format!("http://{}:{port}", ns.host_ip),
            ])
            .env("ROOTRANK_LOG", "info,rootrank_node=debug")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::OpenOptions::new().append(true).open(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    let first = Rank::start(&host_ep, "nw-blind", 0, 2, 1_000).unwrap();
    let wait_log = |needle: String, within: Duration| async move {
        eventually(within, &format!("node-watch log: {needle}"), || {
            let found = text().contains(&needle);
            async move { found.then_some(()) }
        })
        .await
    };
    wait_log(
        format!("watching nw-blind/0 pid {} ", first.pid),
        Duration::from_secs(20),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", text()));

    ns.partition(port);
    let cut = Instant::now();
    wait_log("etcd said nothing on the watch".into(), Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", text()));
    eprintln!("node-watch said it was blind {:?} after the blackhole", cut.elapsed());

    // A rank registers while node-watch is blind, then the network heals.
    let mut second = Rank::start(&host_ep, "nw-blind", 1, 2, 30_000).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !text().contains(&format!("pid {} ", second.pid)),
        "node-watch saw through the blackhole"
    );
    ns.heal();
    let healed = Instant::now();
    let needle = format!("watching nw-blind/1 pid {} ", second.pid);
    wait_log(needle, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", text()));
    eprintln!("node-watch watched the new rank {:?} after the heal", healed.elapsed());
    // Its lease (30 s) outlives the test: the certificate is node-watch's.
    let incarnation = second.incarnation.clone();
    second.kill9();
    let cert = rootrank_testkit::node::wait_certificate(&host_ep, "nw-blind", 1, &incarnation)
        .await
        .unwrap();
    assert_eq!(cert.value["source"], "watchdog", "{:?}", cert);
    assert_eq!(cert.value["reason"], "process_exit", "{:?}", cert);
    drop(first);
}
