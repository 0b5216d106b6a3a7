//! Time from SIGKILL of a rank to a resolved verdict, with the node watchdog and with the
//! lease alone, as distributions over many kills, on loopback with real processes.
//!
//! ```text
//! cargo build --release --bin rootrank
//! cargo run --release -p rootrank-node --example detection_bench -- [--kills 50] [--mode both|watchdog|lease]
//!     [--lease-ttl-ms 1000] [--etcd-dir /dev/shm]
//! ```
//!
//! Each kill: a fresh rank 1 registers (and, with the watchdog, is watched), the surviving
//! rank 0 records the room as `propagated`, a `wait_ms` long poll for the room's verdict is
//! started, then the clock starts just before `kill(2)` and stops when the long poll
//! returns resolved. Uses the `rootrank` binary next to this example (`$ROOTRANK_BIN`
//! overrides), etcd from PATH.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rootrank_store::embedded::{EmbeddedEtcd, EtcdOptions};
use rootrank_testkit::{eventually, get, rootrank_bin, Coordinator, Rank};

struct Args {
    kills: usize,
    mode: String,
    lease_ttl_ms: u64,
    /// Where etcd keeps its data. Default /dev/shm: on a shared machine, other jobs' disk
    /// traffic makes etcd's fsync the noisiest part of the path; `--etcd-dir /tmp` to
    /// include a disk.
    etcd_dir: std::path::PathBuf,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        kills: 50,
        mode: "both".into(),
        lease_ttl_ms: 1_000,
        etcd_dir: std::path::PathBuf::from(if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        }),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--kills" => a.kills = value()?.parse()?,
            "--mode" => a.mode = value()?,
            "--lease-ttl-ms" => a.lease_ttl_ms = value()?.parse()?,
            "--etcd-dir" => a.etcd_dir = value()?.into(),
            other => bail!(
                "unknown flag {other}; flags: --kills N --mode both|watchdog|lease --lease-ttl-ms N --etcd-dir DIR"
            ),
        }
    }
    if a.kills == 0 {
        bail!("--kills must be at least 1");
    }
    Ok(a)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() as f64 * p / 100.0).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[idx]
}

async fn measure(
    with_watchdog: bool,
    kills: usize,
    ttl_ms: u64,
    etcd_dir: &std::path::Path,
) -> anyhow::Result<Vec<f64>> {
    let etcd_data = tempfile::tempdir_in(etcd_dir)?;
    let etcd = EmbeddedEtcd::start(etcd_data.path(), &EtcdOptions::default())?;
    let ep = etcd.endpoint();
    let coord = Coordinator::start(&ep, &[]).await?;
    let logdir = tempfile::tempdir()?;
    let log_path = logdir.path().join("node-watch.log");
    let mut node_watch = if with_watchdog {
        let log = std::fs::File::create(&log_path)?;
        Some(
            Command::new(rootrank_bin())
                .args(["node-watch", "--etcd-endpoints", &ep])
                .env("ROOTRANK_LOG", "info")
                .env("NO_COLOR", "1")
                .stdout(log.try_clone()?)
                .stderr(log)
                .stdin(Stdio::null())
                .spawn()?,
        )
    } else {
        None
    };
    let group = "bench-0";
    let mut survivor = Rank::start(&ep, group, 0, 2, ttl_ms)?;
    let mut samples = Vec::with_capacity(kills);
    for i in 0..kills {
        let mut victim = Rank::start(&ep, group, 1, 2, ttl_ms)?;
        if with_watchdog {
            let needle = format!("watching {group}/1 pid {} ", victim.pid);
            eventually(Duration::from_secs(20), "node-watch to watch the victim", || {
                let found = std::fs::read_to_string(&log_path).unwrap_or_default().contains(&needle);
                async move { found.then_some(()) }
            })
            .await?;
        }
        let room = 1_000 + i as u64;
        survivor.fail(room, "propagated", "nixl_error", "NIXL KVSender Exception")?;
        survivor.flush()?;
        let url = format!("{}/v1/rooms/{room}/verdict?wait_ms=30000", coord.url);
        let poll = tokio::spawn(async move { get(&url).await });
        // Let the long poll reach the coordinator and park there.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t0 = Instant::now();
        rootrank_testkit::signal(victim.pid, libc::SIGKILL);
        let (status, v) = poll.await??;
        let dt = t0.elapsed().as_secs_f64() * 1000.0;
        if status != 200 || v["status"] != "resolved" || v["culprit"]["incarnation"] != victim.incarnation.as_str() {
            bail!("kill {i}: unexpected verdict {status} {v}");
        }
        samples.push(dt);
        victim.kill9(); // reap
    }
    if let Some(c) = node_watch.as_mut() {
        let _ = c.kill();
        let _ = c.wait();
        // The watchdog's own share: exit noticed (pidfd) to certificate in etcd.
        let own: Vec<f64> = std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                l.split("since_exit_us=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse::<f64>()
                    .ok()
            })
            .map(|us| us / 1000.0)
            .collect();
        if !own.is_empty() {
            report("  (exit noticed -> certificate written, node-watch's log)", own);
        }
    }
    Ok(samples)
}

fn report(name: &str, mut s: Vec<f64>) {
    s.sort_by(f64::total_cmp);
    let mean = s.iter().sum::<f64>() / s.len() as f64;
    println!(
        "{name:<9} n={:<4} p50={:>8.2} ms  p90={:>8.2} ms  p99={:>8.2} ms  min={:>8.2} ms  max={:>8.2} ms  mean={:>8.2} ms",
        s.len(),
        percentile(&s, 50.0),
        percentile(&s, 90.0),
        percentile(&s, 99.0),
        s[0],
        s[s.len() - 1],
        mean
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let a = args()?;
    println!(
        "SIGKILL -> resolved verdict (wait_ms long poll started before the kill), {} kills",
        a.kills
    );
    if a.mode == "both" || a.mode == "watchdog" {
        // A long TTL so only the watchdog can resolve the verdict.
        let s = measure(true, a.kills, 30_000, &a.etcd_dir).await?;
        report("watchdog", s);
    }
    if a.mode == "both" || a.mode == "lease" {
        let s = measure(false, a.kills, a.lease_ttl_ms, &a.etcd_dir).await?;
        report(&format!("lease {}s", a.lease_ttl_ms / 1000), s);
    }
    Ok(())
}
