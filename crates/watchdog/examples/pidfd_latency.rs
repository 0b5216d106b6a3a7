//! Measures the time from SIGKILL to `ProcessExit` for our own children and
//! for non-child processes.
//!
//! Run: `cargo run --release -p rootrank-watchdog --example pidfd_latency [N]`
//! (N kills of each kind, default 50).

use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rootrank_watchdog::ProcessWatcher;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn report(label: &str, mut noticed: Vec<Duration>, mut received: Vec<Duration>) {
    noticed.sort();
    received.sort();
    println!(
        "{label:>9}: n={} noticed p50={:?} p99={:?} max={:?} | received p50={:?} p99={:?} max={:?}",
        noticed.len(),
        percentile(&noticed, 0.50),
        percentile(&noticed, 0.99),
        noticed.last().copied().unwrap_or_default(),
        percentile(&received, 0.50),
        percentile(&received, 0.99),
        received.last().copied().unwrap_or_default(),
    );
}

/// `sleep 30` re-parented away from us (its parent shell exits at once).
fn spawn_non_child() -> Result<u32, Box<dyn Error>> {
    let mut sh = Command::new("sh")
        .args(["-c", "sleep 30 & echo $!"])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    let out = sh.stdout.take().ok_or("no stdout")?;
    BufReader::new(out).read_line(&mut line)?;
    sh.wait()?;
    Ok(line.trim().parse()?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let n: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(50);
    let (w, mut rx) = ProcessWatcher::new();

    let (mut noticed, mut received) = (Vec::new(), Vec::new());
    for i in 0..n {
        let mut child = Command::new("sleep").arg("30").spawn()?;
        w.add(i, child.id())?;
        tokio::time::sleep(Duration::from_millis(2)).await;
        let t0 = Instant::now();
        child.kill()?;
        let ev = rx.recv().await.ok_or("channel closed")?;
        received.push(t0.elapsed());
        noticed.push(ev.noticed_at.saturating_duration_since(t0));
        if ev.exit.and_then(|e| e.signal) != Some(9) {
            return Err(format!("child {i}: unexpected exit {:?}", ev.exit).into());
        }
        child.wait()?;
    }
    report("child", noticed, received);

    let (mut noticed, mut received) = (Vec::new(), Vec::new());
    for i in 0..n {
        let pid = spawn_non_child()?;
        w.add(n + i, pid)?;
        tokio::time::sleep(Duration::from_millis(2)).await;
        let t0 = Instant::now();
        // SAFETY: kill has no memory-safety preconditions.
        if unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        let ev = rx.recv().await.ok_or("channel closed")?;
        received.push(t0.elapsed());
        noticed.push(ev.noticed_at.saturating_duration_since(t0));
        if ev.exit.is_some() {
            return Err(format!("non-child {pid}: got a status {:?}", ev.exit).into());
        }
    }
    report("non-child", noticed, received);
    Ok(())
}
