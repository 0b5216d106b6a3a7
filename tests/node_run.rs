//! `rootrank run` around real processes: exit statuses, stderr tails and signals reach the
//! certificate and the verdict, and the supervisor exits as its child did.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use rootrank_store::etcd_client::PutOptions;
use rootrank_testkit::node::{self, certificates_after_barrier, list, wait_certificate, NodeWatch};
use rootrank_testkit::{
    children_of, eventually, free_port, listening_tcp_ports, promtool_check_metrics, scrape_metrics, try_signal,
    Coordinator, Etcd, Rank,
};

const BIN: &str = env!("CARGO_BIN_EXE_rootrank");

fn run_cmd(endpoint: &str, group: &str, rank: u32, size: u32, extra: &[&str], cmd: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["run", "--etcd-endpoints", endpoint, "--group", group])
        .args(["--rank", &rank.to_string(), "--group-size", &size.to_string()])
        .args(extra)
        .arg("--")
        .args(cmd)
        .env("ROOTRANK_LOG", "info")
        .env("NO_COLOR", "1");
    c
}

/// The one certificate of a rank. Counted behind a revision barrier once the first is there
/// (see `certificates_after_barrier`), so a duplicate that lands just after the first is seen.
async fn only_certificate(endpoint: &str, group: &str, rank: u32) -> anyhow::Result<node::Stored> {
    let certs = certificates_after_barrier(endpoint, group, rank).await?;
    assert_eq!(certs.len(), 1, "one certificate, no duplicate: {certs:?}");
    Ok(certs[0].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_died_because_its_peer_vanished_is_a_victim() -> anyhow::Result<()> {
    // What a TP survivor prints when gloo raises in it after a peer's SIGKILL (torch 2.14.1,
    // collected here), then exits: the supervisor certifies a victim, not a plain exit.
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let script = r#"echo "Traceback (most recent call last):" >&2; echo '  File "utils.py", line 302, in _all_reduce_polls' >&2; echo "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:8355. This is typically caused by a remote worker crashing." >&2; exit 1"#;
    let out = run_cmd(
        &ep,
        "prefill-9",
        0,
        2,
        &["--agent-grace-ms", "100", "--lease-ttl-ms", "30000"],
        &["sh", "-c", script],
    )
    .stdin(Stdio::null())
    .output()?;
    assert_eq!(out.status.code(), Some(1));
    let cert = only_certificate(&ep, "prefill-9", 0).await?;
    let c = &cert.value;
    assert_eq!(c["reason"], "peer_lost", "{c}");
    assert!(
        c["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("RuntimeError: [/__w/pytorch") && d.contains("exited with code 1")),
        "{c}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traceback_and_exit_code_reach_the_verdict() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let coord = Coordinator::start(&ep, &[]).await?;
    let script = r#"echo "hello from stdout"; sleep 0.5; echo "Traceback (most recent call last):" >&2; echo '  File "scheduler.py", line 42, in event_loop' >&2; echo "RuntimeError: CUDA out of memory" >&2; exit 3"#;
    let out = run_cmd(
        &ep,
        "prefill-0",
        1,
        2,
        &["--agent-grace-ms", "100", "--lease-ttl-ms", "30000"],
        &["sh", "-c", script],
    )
    .stdin(Stdio::null())
    .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "rootrank run exits with the child's code; stderr:\n{stderr}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("hello from stdout"),
        "stdout passes through"
    );
    assert!(
        stderr.contains("RuntimeError: CUDA out of memory"),
        "stderr passes through:\n{stderr}"
    );

    let cert = only_certificate(&ep, "prefill-0", 1).await?;
    let c = &cert.value;
    assert_eq!(c["source"], "supervisor", "{c}");
    assert_eq!(c["reason"], "process_exit", "{c}");
    assert_eq!(c["exit"]["code"], 3, "{c}");
    assert!(c["exit"]["signal"].is_null(), "{c}");
    let tail: Vec<String> = serde_json::from_value(c["log_tail"].clone())?;
    assert_eq!(
        tail.iter().rev().take(3).rev().cloned().collect::<Vec<_>>(),
        vec![
            "Traceback (most recent call last):".to_string(),
            "  File \"scheduler.py\", line 42, in event_loop".to_string(),
            "RuntimeError: CUDA out of memory".to_string(),
        ],
        "{c}"
    );
    // The supervisor registered on the shell's behalf and revoked that lease after the
    // certificate: no live key is left behind.
    assert!(list(&ep, &node::live_key("prefill-0", 1)).await?.is_empty());

    let mut survivor = Rank::start(&ep, "prefill-0", 0, 2, 30_000)?;
    survivor.fail(5, "propagated", "nixl_error", "NIXL KVSender Exception")?;
    survivor.flush()?;
    let (status, v) = coord.get("/v1/rooms/5/verdict?wait_ms=20000").await?;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "resolved", "{v}");
    assert_eq!(v["culprit"]["rank"], 1, "{v}");
    assert_eq!(v["culprit"]["source"], "down_certificate", "{v}");
    let culprit_tail = v["culprit"]["log_tail"].as_array().cloned().unwrap_or_default();
    assert!(
        culprit_tail.iter().any(|l| l == "Traceback (most recent call last):")
            && culprit_tail.iter().any(|l| l == "RuntimeError: CUDA out of memory"),
        "{v}"
    );
    // Later still (the coordinator has seen the death and resolved a room on it): still the
    // one certificate, none added by the coordinator.
    let certs = certificates_after_barrier(&ep, "prefill-0", 1).await?;
    assert_eq!(certs.len(), 1, "{certs:?}");
    Ok(())
}

/// Starts `rootrank run -- rootrank rank` and returns (supervisor, child pid, incarnation).
fn run_rank_with_agent(ep: &str, group: &str, rank: u32) -> anyhow::Result<(std::process::Child, u32, String)> {
    let mut sup = run_cmd(ep, group, rank, 1, &[], &[BIN, "rank", "--lease-ttl-ms", "30000"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = sup.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    // "registered incarnation=N pid=P", from the child, through the supervisor.
    let mut inc = None;
    let mut pid = None;
    for w in line.split_whitespace() {
        if let Some(v) = w.strip_prefix("incarnation=") {
            inc = Some(v.to_string());
        }
        if let Some(v) = w.strip_prefix("pid=") {
            pid = v.parse().ok();
        }
    }
    match (pid, inc) {
        (Some(p), Some(i)) => Ok((sup, p, i)),
        _ => anyhow::bail!("unexpected first line from the supervised rank: {line:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_child_with_its_own_agent() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let (mut sup, child_pid, incarnation) = run_rank_with_agent(&ep, "decode-0", 0)?;
    assert_ne!(
        child_pid,
        sup.id(),
        "the rank is the supervisor's child, not the supervisor"
    );
    // The child's agent logs its registration to stderr just after it tells stdout: wait
    // for that line to pass through before the kill, so the tail has something to show.
    let stderr = sup.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr"))?;
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("rank registered") {
                let _ = seen_tx.send(());
            }
        }
    });
    seen_rx.recv_timeout(Duration::from_secs(20))?;
    try_signal(child_pid, libc::SIGKILL)?;
    let status = sup.wait()?;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.code(),
        Some(128 + 9),
        "rootrank run exits 128+signal ({status:?}, {:?})",
        status.signal()
    );

    // The certificate is for the child's own incarnation (its agent's lease).
    let cert = wait_certificate(&ep, "decode-0", 0, &incarnation).await?;
    let c = &cert.value;
    assert_eq!(c["source"], "supervisor", "{c}");
    assert_eq!(c["reason"], "process_exit", "{c}");
    assert_eq!(c["exit"]["signal"], 9, "{c}");
    assert!(c["exit"]["code"].is_null(), "{c}");
    assert!(c["detail"].as_str().is_some_and(|d| d.contains("SIGKILL")), "{c}");
    assert_eq!(c["pid"], child_pid, "{c}");
    let tail: Vec<String> = serde_json::from_value(c["log_tail"].clone())?;
    assert!(
        tail.iter().any(|l| l.contains("rank registered")),
        "the child's stderr: {tail:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_is_forwarded_and_reported() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let mut sup = run_cmd(
        &ep,
        "prefill-1",
        0,
        1,
        &["--agent-grace-ms", "0"],
        &["sh", "-c", "echo ready; exec sleep 60"],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .spawn()?;
    let mut line = String::new();
    BufReader::new(sup.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?).read_line(&mut line)?;
    assert_eq!(line.trim(), "ready");
    // Registered on the child's behalf (grace 0): wait for the live key before the signal.
    eventually(Duration::from_secs(20), "the supervisor's registration", || async {
        list(&ep, &node::live_key("prefill-1", 0))
            .await
            .ok()
            .filter(|v| !v.is_empty())
    })
    .await?;
    try_signal(sup.id(), libc::SIGTERM)?;
    let status = sup.wait()?;
    assert_eq!(status.code(), Some(128 + 15), "{status:?}");
    let cert = only_certificate(&ep, "prefill-1", 0).await?;
    assert_eq!(cert.value["source"], "supervisor", "{:?}", cert);
    assert_eq!(cert.value["exit"]["signal"], 15, "{:?}", cert);
    assert_eq!(cert.value["reason"], "process_exit", "{:?}", cert);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_exit_is_a_shutdown() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let out = run_cmd(
        &ep,
        "prefill-2",
        0,
        1,
        &["--agent-grace-ms", "0"],
        &["sh", "-c", "sleep 0.2; exit 0"],
    )
    .stdin(Stdio::null())
    .output()?;
    assert_eq!(out.status.code(), Some(0));
    let cert = only_certificate(&ep, "prefill-2", 0).await?;
    assert_eq!(cert.value["reason"], "shutdown", "{:?}", cert);
    assert_eq!(cert.value["exit"]["code"], 0, "{:?}", cert);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_leaves_a_supervised_death_to_the_supervisor() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let watch = NodeWatch::start(&ep)?;
    let (mut sup, child_pid, incarnation) = run_rank_with_agent(&ep, "prefill-3", 0)?;
    watch.wait_watching("prefill-3", 0, child_pid).await?;
    try_signal(child_pid, libc::SIGKILL)?;
    let status = sup.wait()?;
    assert_eq!(status.code(), Some(137));
    let cert = wait_certificate(&ep, "prefill-3", 0, &incarnation).await?;
    // The supervisor's certificate (with the exit status and the tail) stands; the
    // watchdog's create-if-absent after its grace changed nothing.
    assert_eq!(cert.value["source"], "supervisor", "{:?}\n{}", cert, watch.log_text());
    assert_eq!(cert.value["exit"]["signal"], 9);
    // The watchdog gave up its turn once the supervisor exited: wait for its word on it.
    eventually(Duration::from_secs(20), "the watchdog's answer", || {
        let log = watch.log_text();
        async move { log.contains("already had a certificate").then_some(()) }
    })
    .await?;
    let cert = wait_certificate(&ep, "prefill-3", 0, &incarnation).await?;
    assert_eq!(cert.version, 1, "written once: {cert:?}");
    assert_eq!(cert.value["source"], "supervisor");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_before_any_registration_is_still_certified() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    // Dies long before the (default 3 s) agent grace: nothing ever registered it.
    let out = run_cmd(
        &ep,
        "prefill-4",
        0,
        1,
        &[],
        &["sh", "-c", "echo 'ImportError: no module named sglang' >&2; exit 4"],
    )
    .stdin(Stdio::null())
    .output()?;
    assert_eq!(out.status.code(), Some(4));
    let cert = only_certificate(&ep, "prefill-4", 0).await?;
    assert_eq!(cert.value["source"], "supervisor", "{cert:?}");
    assert_eq!(cert.value["exit"]["code"], 4, "{cert:?}");
    assert_eq!(
        cert.value["log_tail"][0], "ImportError: no module named sglang",
        "{cert:?}"
    );
    assert!(
        list(&ep, &node::live_key("prefill-4", 0)).await?.is_empty(),
        "no live record for a dead process"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_under_a_launcher_keeps_its_own_incarnation() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    // The rank is a grandchild (sh is the launcher, and not exec'ing it); its agent's live
    // record names the grandchild's pid. The supervisor must take that incarnation as the
    // rank's, not register over it once the grace is out.
    let script = format!("{BIN} rank --lease-ttl-ms 30000; echo 'launcher: rank died' >&2; exit 7");
    let mut sup = run_cmd(
        &ep,
        "prefill-5",
        0,
        1,
        &["--agent-grace-ms", "300"],
        &["sh", "-c", &script],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()?;
    let mut line = String::new();
    BufReader::new(sup.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?).read_line(&mut line)?;
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .map(str::to_string)
            .ok_or_else(|| anyhow::anyhow!("no {name} in {line:?}"))
    };
    let incarnation = field("incarnation=")?;
    let rank_pid: u32 = field("pid=")?.parse()?;
    let stderr = sup.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr"))?;
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("the rank process registered itself") {
                let _ = seen_tx.send(());
            }
        }
    });
    seen_rx.recv_timeout(Duration::from_secs(20))?;

    try_signal(rank_pid, libc::SIGKILL)?;
    let status = sup.wait()?;
    assert_eq!(status.code(), Some(7), "the launcher's status");
    let cert = only_certificate(&ep, "prefill-5", 0).await?;
    let c = &cert.value;
    assert_eq!(
        c["incarnation"],
        incarnation.as_str(),
        "the rank's own incarnation: {c}"
    );
    assert_eq!(c["pid"], rank_pid, "{c}");
    assert_eq!(c["source"], "supervisor", "{c}");
    assert_eq!(c["exit"]["code"], 7, "{c}");
    let tail: Vec<String> = serde_json::from_value(c["log_tail"].clone())?;
    assert_eq!(tail.last().map(String::as_str), Some("launcher: rank died"), "{c}");
    Ok(())
}

/// Create-if-absent does not shut out a rank whose supervisor registered for it first: the
/// supervisor's registration (`agent: rootrank-run/...`) names the rank's launcher, an
/// ancestor of the rank, so the rank's own agent takes the live key over, and the supervisor
/// hands liveness to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_agent_takes_the_live_key_over_from_its_supervisor() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    // The supervisor registers at once (no grace); the rank starts half a second later.
    let script = format!("sleep 0.5; {BIN} rank --lease-ttl-ms 30000; exit 7");
    let mut sup = run_cmd(
        &ep,
        "prefill-6",
        0,
        1,
        &["--agent-grace-ms", "0", "--lease-ttl-ms", "30000"],
        &["sh", "-c", &script],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()?;
    let stderr = sup.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr"))?;
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("registered on the rank process's behalf")
                || line.contains("handing liveness over")
                || line.contains("Two processes claim")
            {
                let _ = seen_tx.send(line);
            }
        }
    });
    let first = seen_rx.recv_timeout(Duration::from_secs(20))?;
    assert!(first.contains("on the rank process's behalf"), "{first}");
    let mut line = String::new();
    BufReader::new(sup.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?).read_line(&mut line)?;
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .map(str::to_string)
            .ok_or_else(|| anyhow::anyhow!("the rank did not register: {line:?}"))
    };
    let incarnation = field("incarnation=")?;
    let rank_pid: u32 = field("pid=")?.parse()?;
    let handed = seen_rx.recv_timeout(Duration::from_secs(20))?;
    assert!(handed.contains("handing liveness over"), "{handed}");
    let live = list(&ep, &node::live_key("prefill-6", 0)).await?;
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].value["pid"], rank_pid, "the rank's own record: {:?}", live[0]);
    assert!(
        live[0].value["agent"]
            .as_str()
            .is_some_and(|a| a.starts_with("rootrank-agent/")),
        "{:?}",
        live[0]
    );

    try_signal(rank_pid, libc::SIGKILL)?;
    assert_eq!(sup.wait()?.code(), Some(7));
    let cert = wait_certificate(&ep, "prefill-6", 0, &incarnation).await?;
    assert_eq!(cert.value["source"], "supervisor", "{cert:?}");
    assert_eq!(cert.value["pid"], rank_pid, "{cert:?}");
    Ok(())
}

/// A `rootrank run` process killed (and reaped) when the test ends, passed or failed, with
/// its children first: a SIGKILLed supervisor forwards nothing, and an orphaned child would
/// outlive the test holding whatever it inherited (a build lock's fd, say).
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        // Already reaped (the test waited for it): its pid may be another process's now.
        if matches!(self.0.try_wait(), Ok(Some(_))) {
            return;
        }
        for child in children_of(self.0.id()) {
            rootrank_testkit::signal(child, libc::SIGKILL);
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `rootrank run ... -- sh -c 'echo ready; exec sleep 60'` and waits for `ready` (the
/// child runs, so a metrics listener is bound by then). A grace longer than any test: the
/// supervisor only reads the live key, and never registers on the child's behalf. Its stderr
/// is gathered into the returned string.
fn run_sleeper(
    ep: &str,
    group: &str,
    extra: &[&str],
) -> anyhow::Result<(Reaped, std::sync::Arc<std::sync::Mutex<String>>)> {
    let mut args = vec!["--agent-grace-ms", "600000"];
    args.extend_from_slice(extra);
    let mut sup = Reaped(
        run_cmd(ep, group, 0, 1, &args, &["sh", "-c", "echo ready; exec sleep 60"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?,
    );
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let stderr = sup.0.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr"))?;
    let sink = std::sync::Arc::clone(&log);
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(mut l) = sink.lock() {
                l.push_str(&line);
                l.push('\n');
            }
        }
    });
    let mut line = String::new();
    BufReader::new(sup.0.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?).read_line(&mut line)?;
    anyhow::ensure!(line.trim() == "ready", "the child did not start: {line:?}");
    Ok((sup, log))
}

fn text_of(log: &std::sync::Mutex<String>) -> String {
    log.lock().map(|l| l.clone()).unwrap_or_default()
}

/// `--metrics-listen`: the supervisor serves `rootrank_unverified_pids_total`, at 0 until the
/// rank's live key names a process it cannot verify (a pid of a pid namespace not visible
/// from here), then 1: once for that incarnation, however often the supervisor looks. The
/// child inherits none of the server's sockets, and without the flag nothing listens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_live_record_the_supervisor_cannot_verify() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let (mut sup, log) = run_sleeper(&ep, "prefill-8", &["--metrics-listen", &addr])?;
    let sup_pid = sup.0.id();

    let text = scrape_metrics(&addr).await?;
    assert!(text.contains("\nrootrank_unverified_pids_total 0\n"), "{text}");
    let families: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
    assert_eq!(families, ["# TYPE rootrank_unverified_pids_total counter"], "{text}");
    promtool_check_metrics(&text)?;

    // The server is the supervisor's alone: the child holds no socket at all.
    assert_eq!(listening_tcp_ports(sup_pid), vec![port]);
    let children = children_of(sup_pid);
    assert_eq!(children.len(), 1, "{children:?}");
    let child_sockets: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", children[0]))?
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .map(|t| t.to_string_lossy().into_owned())
        .filter(|t| t.starts_with("socket:"))
        .collect();
    assert!(child_sockets.is_empty(), "the child inherited {child_sockets:?}");

    // Without the flag, nothing listens.
    let (mut plain, _) = run_sleeper(&ep, "prefill-7", &[])?;
    assert!(
        listening_tcp_ports(plain.0.id()).is_empty(),
        "{:?}",
        listening_tcp_ports(plain.0.id())
    );
    try_signal(plain.0.id(), libc::SIGTERM)?;
    assert_eq!(plain.0.wait()?.code(), Some(128 + 15));

    // A live record at the rank's key whose pid is in a pid namespace nothing here can see
    // (inode 1 is never a namespace's): the supervisor refuses to take it for its child.
    let mut c = node::client(&ep).await?;
    let lease = c.lease_grant(60, None).await?.id();
    let stranger = serde_json::json!({
        "v": 1, "group": "prefill-8", "rank": 0, "group_size": 1,
        "host": std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim(),
        "boot_id": std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?.trim(),
        "pid": 4242,
        "pid_ns": 1,
        "start_ticks": 12345,
    });
    c.put(
        node::live_key("prefill-8", 0),
        serde_json::to_vec(&stranger)?,
        Some(PutOptions::new().with_lease(lease)),
    )
    .await?;
    let text = eventually(Duration::from_secs(20), "rootrank_unverified_pids_total 1", || {
        let addr = addr.clone();
        async move {
            scrape_metrics(&addr)
                .await
                .ok()
                .filter(|t| t.contains("\nrootrank_unverified_pids_total 1\n"))
        }
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}; supervisor log:\n{}", text_of(&log)))?;
    promtool_check_metrics(&text)?;
    // The supervisor reads the key every 25 ms: the incarnation is still counted once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = scrape_metrics(&addr).await?;
    assert!(text.contains("\nrootrank_unverified_pids_total 1\n"), "{text}");
    let said = text_of(&log);
    assert!(said.contains("rootrank_unverified_pids_total=1"), "{said}");
    assert!(!said.contains("rootrank_unverified_pids_total=2"), "{said}");

    // Metrics serving changed nothing about the child: SIGTERM is forwarded, and the
    // supervisor exits as the child did.
    try_signal(sup_pid, libc::SIGTERM)?;
    let status = sup.0.wait()?;
    assert_eq!(status.code(), Some(128 + 15), "{status:?}\n{}", text_of(&log));
    Ok(())
}

/// A `--metrics-listen` address already taken is a start-up error naming it: `rootrank run`
/// then never starts its command, and `rootrank node-watch` does not start watching.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_metrics_address_is_a_startup_error() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let ep = etcd.endpoint();
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let dir = tempfile::tempdir()?;
    let marker = dir.path().join("started");
    let out = run_cmd(
        &ep,
        "prefill-8",
        0,
        1,
        &["--metrics-listen", &addr],
        &["sh", "-c", &format!("touch {}", marker.display())],
    )
    .stdin(Stdio::null())
    .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("rootrank: error: cannot serve metrics on {addr}")),
        "{stderr}"
    );
    assert!(!marker.exists(), "the command must not start");

    let out = std::process::Command::new(BIN)
        .args(["node-watch", "--etcd-endpoints", &ep])
        .env("ROOTRANK_METRICS_LISTEN", &addr)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("rootrank: error: cannot serve metrics on {addr}")),
        "{stderr}"
    );
    drop(taken);
    Ok(())
}
