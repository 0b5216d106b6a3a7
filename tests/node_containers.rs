//! `rootrank node-watch` and ranks in containers (SPEC section 4): a rank in its own pid
//! namespace with the host's hostname (a container on the host network, usual for RDMA)
//! publishes its namespace's pid. node-watch maps it to the host pid through `NSpid` and
//! checks `start_ticks`; a host process that merely has the record's pid number is never
//! watched, never certified. That refusal is counted in `rootrank_unverified_pids_total`,
//! in the log and at `--metrics-listen`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rootrank_agent::procfs;
use rootrank_testkit::node::{client, list, live_key, register_by_hand, wait_certificate, NodeWatch};
use rootrank_testkit::{free_port, promtool_check_metrics, rootrank_bin, scrape_metrics, Etcd};

/// A `rootrank rank` process as pid 1 of a new pid namespace (`unshare --pid --fork
/// --mount-proc`), same hostname and network as the host.
struct ContainedRank {
    unshare: Child,
    _stdin: std::process::ChildStdin,
    /// The rank's pid in its namespace, as it printed it (and its live record says).
    inner_pid: u32,
    /// The rank's pid on the host.
    host_pid: u32,
    incarnation: String,
}

impl ContainedRank {
    fn start(endpoint: &str, group: &str, rank: u32) -> anyhow::Result<ContainedRank> {
        let bin = rootrank_bin();
        let mut unshare = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc"])
            .arg(&bin)
            .args(["rank", "--etcd-endpoints", endpoint, "--group", group])
            .args([
                "--rank",
                &rank.to_string(),
                "--group-size",
                "2",
                "--lease-ttl-ms",
                "30000",
            ])
            .env("ROOTRANK_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdin = unshare.stdin.take().ok_or_else(|| anyhow::anyhow!("no stdin"))?;
        let mut out = BufReader::new(unshare.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?);
        let mut line = String::new();
        out.read_line(&mut line)?;
        // `registered incarnation=INC pid=PID`
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .map(str::to_string)
                .ok_or_else(|| anyhow::anyhow!("rank did not register: {line:?}"))
        };
        let incarnation = field("incarnation=")?;
        let inner_pid: u32 = field("pid=")?.parse()?;
        // unshare forks once: the rank is its only child.
        let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", unshare.id()))?;
        let host_pid: u32 = children
            .split_whitespace()
            .next()
            .ok_or_else(|| anyhow::anyhow!("unshare has no child"))?
            .parse()?;
        Ok(ContainedRank {
            unshare,
            _stdin: stdin,
            inner_pid,
            host_pid,
            incarnation,
        })
    }

    /// SIGKILL to the rank, from the host, as the OOM killer would.
    fn kill9(&self) {
        // SAFETY: kill(2) with a pid and a signal; the rank is unshare's unreaped child.
        unsafe {
            libc::kill(self.host_pid as i32, libc::SIGKILL);
        }
    }
}

impl Drop for ContainedRank {
    fn drop(&mut self) {
        self.kill9();
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}

fn unshare_works() -> bool {
    Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_in_its_own_pid_namespace_is_watched_by_its_host_pid_and_a_namesake_never_is() -> anyhow::Result<()> {
    assert!(
        unshare_works(),
        "this test needs `unshare --pid --fork --mount-proc` (util-linux, as root)"
    );
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let metrics_addr = format!("127.0.0.1:{}", free_port()?);
    let watch = NodeWatch::start_with(&ep, &["--metrics-listen", &metrics_addr])?;

    let rank = ContainedRank::start(&ep, "prefill-0", 0)?;
    assert_ne!(rank.inner_pid, rank.host_pid);
    let live = list(&ep, &live_key("prefill-0", 0)).await?;
    assert_eq!(live.len(), 1);
    let rec = &live[0].value;
    assert_eq!(rec["pid"], rank.inner_pid, "the record has the rank's own pid: {rec}");
    let rank_ns = procfs::pid_ns(Some(rank.host_pid)).expect("the rank's pid namespace");
    assert_eq!(rec["pid_ns"], rank_ns, "{rec}");
    assert_ne!(Some(rank_ns), procfs::pid_ns(None), "a namespace of its own");
    assert_eq!(
        rec["start_ticks"],
        procfs::start_ticks(Some(rank.host_pid)).expect("start"),
        "{rec}"
    );
    watch.wait_watching("prefill-0", 0, rank.host_pid).await?;
    // Served from the start, at zero: dashboards see a zero rather than a gap.
    let before = scrape_metrics(&metrics_addr).await?;
    assert!(before.contains("\nrootrank_unverified_pids_total 0\n"), "{before}");

    // A host process whose pid is the number a record names, in the rank's namespace, where
    // no process has that pid. Its start time is the record's: only the namespace tells them
    // apart. A node-watch that took the pid as a host pid would watch it and certify rank 1
    // dead when it exits.
    let mut namesake = Command::new("sleep").arg("600").spawn()?;
    let namesake_pid = namesake.id();
    let mut c = client(&ep).await?;
    let lease = c.lease_grant(60, None).await?.id();
    let fake = serde_json::json!({
        "v": 1, "group": "prefill-0", "rank": 1, "group_size": 2,
        "host": std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim(),
        "boot_id": std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?.trim(),
        "pid": namesake_pid,
        "pid_ns": rank_ns,
        "start_ticks": procfs::start_ticks(Some(namesake_pid)).expect("start"),
    });
    register_by_hand(&mut c, "prefill-0", 1, &fake, lease).await?;
    rootrank_testkit::eventually(Duration::from_secs(20), "node-watch refusing rank 1", || {
        let log = watch.log_text();
        async move { log.contains("cannot verify this rank's process").then_some(()) }
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}; node-watch log:\n{}", watch.log_text()))?;
    namesake.kill()?;
    namesake.wait()?;

    let killed_at = Instant::now();
    rank.kill9();
    let cert = wait_certificate(&ep, "prefill-0", 0, &rank.incarnation).await?;
    let seen_after = killed_at.elapsed();
    println!(
        "SIGKILL of the contained rank to its certificate in etcd (as polled by the test): {:.1} ms",
        seen_after.as_secs_f64() * 1000.0
    );
    if let Some(line) = watch
        .log_text()
        .lines()
        .find(|l| l.contains("down certificate written"))
    {
        println!("node-watch: {line}");
    }
    assert_eq!(cert.value["source"], "watchdog", "{cert:?}");
    assert_eq!(cert.value["reason"], "process_exit", "{cert:?}");
    assert_eq!(cert.value["pid"], rank.host_pid, "the host pid: {cert:?}");

    // The namesake died before the rank; node-watch never watched it, so no certificate.
    let certs = list(&ep, "/rootrank/v1/groups/prefill-0/ranks/1/down/").await?;
    assert!(certs.is_empty(), "{certs:?}\nnode-watch log:\n{}", watch.log_text());
    let log = watch.log_text();
    assert!(!log.contains("watching prefill-0/1 "), "{log}");
    assert!(log.contains("rootrank_unverified_pids_total=1"), "{log}");
    // The same count is served, in the families node-watch owns, and passes promtool.
    let text = scrape_metrics(&metrics_addr).await?;
    assert!(text.contains("\nrootrank_unverified_pids_total 1\n"), "{text}");
    let families: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
    assert_eq!(
        families,
        [
            "# TYPE rootrank_node_watch_events_total counter",
            "# TYPE rootrank_unverified_pids_total counter"
        ],
        "{text}"
    );
    promtool_check_metrics(&text)?;
    Ok(())
}
