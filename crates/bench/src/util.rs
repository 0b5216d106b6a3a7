//! Shared pieces: latency distributions, /proc readings, machine facts, durations, and a
//! small HTTP GET that keeps its connection (the probes must not pay a TCP handshake each).

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// Quantiles (in percent) kept for every distribution: enough points to draw a CDF.
pub const QUANTILES: &[f64] = &[
    0.0, 1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 97.5, 99.0, 99.5, 99.9, 99.99, 100.0,
];

/// A latency distribution, in microseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Dist {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    /// (percent, microseconds) pairs at [`QUANTILES`].
    pub cdf: Vec<(f64, f64)>,
}

impl Dist {
    /// From raw samples in microseconds.
    pub fn from_us(mut samples: Vec<f64>) -> Dist {
        samples.retain(|v| v.is_finite());
        if samples.is_empty() {
            return Dist::default();
        }
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let at = |p: f64| {
            // Nearest rank: the smallest sample with at least p% of samples at or below it.
            // (less a hair, so 0.99 * 1000 = 990.0000000000001 is rank 990, not 991)
            let rank = ((p / 100.0) * n as f64 - 1e-9).ceil() as usize;
            samples[rank.clamp(1, n) - 1]
        };
        Dist {
            count: n as u64,
            mean_us: samples.iter().sum::<f64>() / n as f64,
            p50_us: at(50.0),
            p90_us: at(90.0),
            p99_us: at(99.0),
            p999_us: at(99.9),
            max_us: samples[n - 1],
            cdf: QUANTILES.iter().map(|&q| (q, at(q))).collect(),
        }
    }

    pub fn from_durations(samples: &[Duration]) -> Dist {
        Dist::from_us(samples.iter().map(|d| d.as_secs_f64() * 1e6).collect())
    }

    /// From points someone else computed (wrk's percentiles).
    pub fn from_cdf(count: u64, mean_us: f64, cdf: Vec<(f64, f64)>) -> Dist {
        let at = |p: f64| {
            cdf.iter()
                .find(|(q, _)| (*q - p).abs() < 1e-9)
                .map_or(f64::NAN, |(_, v)| *v)
        };
        Dist {
            count,
            mean_us,
            p50_us: at(50.0),
            p90_us: at(90.0),
            p99_us: at(99.0),
            p999_us: at(99.9),
            max_us: at(100.0),
            cdf,
        }
    }
}

/// CPU time (user + system) of a process, from /proc/PID/stat, in seconds.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("/proc/{pid}/stat"))?;
    // The command name may contain spaces and parentheses: fields start after the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("malformed /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3 of stat(5), so utime (14) and stime (15) are at 11 and 12.
    let utime: f64 = fields.get(11).context("no utime")?.parse()?;
    let stime: f64 = fields.get(12).context("no stime")?.parse()?;
    Ok((utime + stime) / clock_ticks())
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf only reads a constant of the running system.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// (VmRSS, VmHWM) of a process, in bytes.
pub fn rss_bytes(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        let kb: u64 = line
            .split_whitespace()
            .nth(1)
            .context("malformed status line")?
            .parse()?;
        Ok(kb * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// CPU seconds of several processes at one instant, to diff later.
#[derive(Clone, Debug)]
pub struct CpuMark {
    pub at: std::time::Instant,
    pub secs: Vec<f64>,
}

impl CpuMark {
    pub fn take(pids: &[u32]) -> CpuMark {
        CpuMark {
            at: std::time::Instant::now(),
            secs: pids.iter().map(|p| cpu_seconds(*p).unwrap_or(f64::NAN)).collect(),
        }
    }
    /// CPU seconds used by each process since `self`, and the wall time.
    pub fn since(&self, pids: &[u32]) -> (Vec<f64>, f64) {
        let now = CpuMark::take(pids);
        let used = now.secs.iter().zip(&self.secs).map(|(b, a)| b - a).collect();
        (used, now.at.duration_since(self.at).as_secs_f64())
    }
}

/// The machine's facts, for the results file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Machine {
    pub nproc: usize,
    pub mem_total_bytes: u64,
    pub kernel: String,
    pub cpu_model: String,
    pub hostname: String,
}

pub fn machine() -> Machine {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let meminfo = read("/proc/meminfo");
    let mem_kb: u64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let cpu_model = read("/proc/cpuinfo")
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    Machine {
        nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
        mem_total_bytes: mem_kb * 1024,
        kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
        cpu_model,
        hostname: read("/proc/sys/kernel/hostname").trim().to_string(),
    }
}

/// The git revision of `repo` and whether the tree had local changes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GitRev {
    pub revision: String,
    pub dirty: bool,
}

pub fn git_rev(repo: &Path) -> GitRev {
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(repo)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    GitRev {
        revision: run(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into()),
        dirty: run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty()),
    }
}

/// Parses `5s`, `500ms`, `2m` or a bare number of seconds.
pub fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let v: f64 = num.parse().with_context(|| format!("duration {s:?}"))?;
    let secs = match unit {
        "ms" => v / 1000.0,
        "s" => v,
        "m" => v * 60.0,
        _ => bail!("duration {s:?}: use ms, s or m"),
    };
    if !(secs.is_finite() && secs > 0.0) {
        bail!("duration {s:?} must be positive");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A free loopback port (racy, as every such helper; callers retry on bind errors).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(rootrank_store::embedded::free_port()?)
}

/// An HTTP client for loopback only, keeping connections between requests.
pub fn http_client(timeout: Duration) -> anyhow::Result<reqwest::Client> {
    Ok(rootrank_tls::http_client(None)?
        .timeout(timeout)
        .pool_max_idle_per_host(256)
        .no_proxy()
        .build()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dist_nearest_rank() {
        let d = Dist::from_us((1..=1000).map(f64::from).collect());
        assert_eq!(d.p50_us, 500.0);
        assert_eq!(d.p99_us, 990.0);
        assert_eq!(d.p999_us, 999.0);
        assert_eq!(d.max_us, 1000.0);
        assert_eq!(d.cdf.len(), QUANTILES.len());
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("5s").ok(), Some(Duration::from_secs(5)));
        assert_eq!(parse_duration("250ms").ok(), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("2").ok(), Some(Duration::from_secs(2)));
        assert!(parse_duration("x").is_err());
    }

    #[test]
    fn own_cpu_and_rss_read() {
        let pid = std::process::id();
        assert!(cpu_seconds(pid).is_ok_and(|c| c >= 0.0));
        assert!(rss_bytes(pid).is_ok_and(|(r, h)| r > 0 && h >= r));
    }
}
