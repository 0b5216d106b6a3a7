//! Part 7: keepalives at fleet scale. How many ranks one etcd core carries when each rank's
//! liveness lease is kept alive every TTL/3, at the agents' 5 s TTL and at 30 s: leases are
//! granted and kept alive as agents do, and etcd's own CPU over a window gives its cores per
//! lease, hence leases per core. etcd runs with its production timing (100 ms heartbeat,
//! 1 s election timeout), one member, on this machine's disk.

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use rootrank_store::embedded::EtcdOptions;
use serde_json::{json, Value};

use crate::procs::{self, Env};
use crate::state::{self, KeepAlives};
use crate::util::CpuMark;

#[derive(Clone, Debug)]
pub struct KeepaliveCfg {
    /// (lease TTL in seconds, leases kept alive).
    pub variants: Vec<(i64, usize)>,
    /// Measured window, at least two keepalive intervals.
    pub min_window: Duration,
}

impl KeepaliveCfg {
    pub fn full() -> Self {
        KeepaliveCfg {
            // Sized for roughly the same keepalive rate (~4,000/s) at both TTLs, so the CPU
            // per keepalive is measured under the same load.
            variants: vec![(5, 6_000), (30, 36_000)],
            min_window: Duration::from_secs(10),
        }
    }
    pub fn smoke() -> Self {
        KeepaliveCfg {
            variants: vec![(5, 50)],
            min_window: Duration::from_secs(1),
        }
    }
}

pub async fn run(env: &Env, cfg: &KeepaliveCfg) -> anyhow::Result<Value> {
    let mut out = Vec::new();
    for (i, &(ttl_s, leases)) in cfg.variants.iter().enumerate() {
        let dir = env.subdir(&format!("keepalive-{i}"))?;
        let etcd = procs::start_etcd_with(
            &dir,
            &EtcdOptions {
                fast: false,
                ..EtcdOptions::default()
            },
        )?;
        let etcd_pid = procs::etcd_pid(&etcd)?;
        let clients = state::clients(&etcd.endpoint(), 8).await?;
        let interval = Duration::from_millis(ttl_s as u64 * 1000 / 3);
        // Granted in chunks, each kept alive at once, so early leases never lapse meanwhile.
        let mut keepalives = Vec::new();
        let mut granted = 0;
        while granted < leases {
            let chunk = (leases - granted).min(2_000);
            let got = state::grant_leases(&clients, chunk, ttl_s, 64)
                .await
                .with_context(|| format!("granting leases ({granted} so far)"))?;
            granted += chunk;
            keepalives.push(KeepAlives::start(&clients, &got, interval, Duration::from_secs(3600)));
        }
        // One interval for every lease's first renewal to land, then the window.
        tokio::time::sleep(interval).await;
        let sent = |k: &[KeepAlives]| k.iter().map(|k| k.sent.load(Ordering::Relaxed)).sum::<u64>();
        let before = sent(&keepalives);
        let pids = [etcd_pid, std::process::id()];
        let mark = CpuMark::take(&pids);
        tokio::time::sleep(cfg.min_window.max(interval * 2)).await;
        let (cpu, wall) = mark.since(&pids);
        let n = sent(&keepalives) - before;
        let (mut failed, mut expired) = (0, 0);
        for k in keepalives {
            failed += k.failed.load(Ordering::Relaxed);
            expired += k.expired.load(Ordering::Relaxed);
            k.stop();
        }
        drop(etcd);
        let etcd_cores = cpu[0] / wall;
        out.push(json!({
            "lease_ttl_s": ttl_s,
            "keepalive_interval_ms": interval.as_millis() as u64,
            "leases": leases,
            "window_s": wall,
            "keepalives": n,
            "keepalives_per_s": n as f64 / wall,
            "keepalives_needed_per_s": leases as f64 / interval.as_secs_f64(),
            "etcd_cores": etcd_cores,
            "etcd_us_per_keepalive": if n > 0 { cpu[0] * 1e6 / n as f64 } else { f64::NAN },
            "client_cores": cpu[1] / wall,
            "ranks_per_etcd_core": if etcd_cores > 0.0 { leases as f64 / etcd_cores } else { f64::NAN },
            "failed": failed,
            "expired": expired,
        }));
    }
    Ok(json!({
        "setup": {
            "etcd": "etcd 3.4 (Debian), one member, --heartbeat-interval 100 --election-timeout 1000 (its defaults), data on the local disk",
            "how": "leases granted in chunks of 2,000 (64 in flight) and each kept alive every TTL/3 by its own task over 8 shared connections, as agents do; etcd CPU from /proc over a window of at least two intervals after every lease renewed once; ranks per etcd core = leases / etcd cores used",
        },
        "variants": out,
    }))
}
