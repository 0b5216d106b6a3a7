//! Time from SIGKILL of a rank to a resolved verdict, with the node watchdog and with the
//! lease alone, as distributions over many kills, on loopback with real processes.
//!
//! ```text
//! cargo build --release --bin rootrank
//! cargo run --release -p rootrank-node --example detection_bench -- [--kills 50] [--mode both|watchdog|lease] [--lease-ttl-ms 1000]
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
use rootrank_testkit::{eventually, get, rootrank_bin, Coordinator, Etcd, Rank};

struct Args {
    kills: usize,
    mode: String,
    lease_ttl_ms: u64,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        kills: 50,
        mode: "both".into(),
        lease_ttl_ms: 1_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--kills" => a.kills = value()?.parse()?,
            "--mode" => a.mode = value()?,
            "--lease-ttl-ms" => a.lease_ttl_ms = value()?.parse()?,
            other => bail!("unknown flag {other}; flags: --kills N --mode both|watchdog|lease --lease-ttl-ms N"),
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

async fn measure(with_watchdog: bool, kills: usize, ttl_ms: u64) -> anyhow::Result<Vec<f64>> {
    let etcd = Etcd::start()?;
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
        let s = measure(true, a.kills, 30_000).await?;
        report("watchdog", s);
    }
    if a.mode == "both" || a.mode == "lease" {
        let s = measure(false, a.kills, a.lease_ttl_ms).await?;
        report(&format!("lease {}s", a.lease_ttl_ms / 1000), s);
    }
    Ok(())
}
