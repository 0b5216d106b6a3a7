//! WRITE latency (p50/p99) and throughput between two processes over real
//! NIXL (UCX backend, DRAM to DRAM), for 4 KiB, 64 KiB, 1 MiB and 16 MiB.
//!
//! ```text
//! cargo run --release -p rootrank-transfer --example nixl_bench [-- --no-notify] [--scale F]
//! ```
//!
//! The process re-executes itself as the receiver; metadata and the region
//! descriptor go through files in a temp dir. Each WRITE is timed from post
//! to completion (`TransferStats::elapsed`); by default every WRITE carries a
//! notification, as a KV-cache transfer does.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use rootrank_transfer::{NixlLibrary, RemoteRegion, TransferAgent, TransferError};

const SIZES: &[(usize, &str, usize)] = &[
    (4 << 10, "4 KiB", 5000),
    (64 << 10, "64 KiB", 2000),
    (1 << 20, "1 MiB", 500),
    (16 << 20, "16 MiB", 60),
];
const MAX: usize = 16 << 20;
const TIMEOUT: Duration = Duration::from_secs(10);

fn main() -> ExitCode {
    // SAFETY: first thing in main, before any thread exists.
    unsafe { rootrank_transfer::set_ucx_defaults_before_threads() };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().map(String::as_str) == Some("--receiver") {
        match args.get(1) {
            Some(dir) => receiver(Path::new(dir)),
            None => Err("--receiver needs a directory".to_string()),
        }
    } else {
        let notify = !args.iter().any(|a| a == "--no-notify");
        let scale = args
            .iter()
            .position(|a| a == "--scale")
            .and_then(|i| args.get(i + 1))
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(1.0);
        sender(notify, scale)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nixl_bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn err(e: TransferError) -> String {
    format!("[{}] {e}", e.reason())
}

fn publish(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), String> {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, dir.join(name)).map_err(|e| e.to_string())
}

fn receiver(dir: &Path) -> Result<(), String> {
    let lib = NixlLibrary::load(None).map_err(err)?;
    let mut agent = TransferAgent::new(&lib, "bench-decode").map_err(err)?;
    let region = agent.register_dram(MAX).map_err(err)?;
    let desc = agent.region_descriptor(region).map_err(err)?;
    publish(
        dir,
        "region.json",
        &serde_json::to_vec(&desc).map_err(|e| e.to_string())?,
    )?;
    publish(dir, "md", &agent.local_metadata().map_err(err)?)?;
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut count = 0u64;
    while Instant::now() < deadline {
        for (_, msg) in agent.notifications().map_err(err)? {
            if msg == b"quit" {
                eprintln!("receiver: {count} notifications");
                return Ok(());
            }
            count += 1;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    Err("receiver: no quit within 600 s".to_string())
}

fn wait_file(path: &Path, child: &mut std::process::Child) -> Result<Vec<u8>, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.is_file() {
        if let Ok(Some(st)) = child.try_wait() {
            return Err(format!("receiver exited early: {st}"));
        }
        if Instant::now() > deadline {
            return Err(format!("{} never appeared", path.display()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::fs::read(path).map_err(|e| e.to_string())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn sender(notify: bool, scale: f64) -> Result<(), String> {
    let lib = NixlLibrary::load(None).map_err(err)?;
    let dir = std::env::temp_dir().join(format!("nixl_bench.{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let exe: PathBuf = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .arg("--receiver")
        .arg(&dir)
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawn receiver: {e}"))?;
    let result = run(&lib, &dir, &mut child, notify, scale);
    if result.is_err() {
        let _ = child.kill();
    }
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run(lib: &NixlLibrary, dir: &Path, child: &mut std::process::Child, notify: bool, scale: f64) -> Result<(), String> {
    let t0 = Instant::now();
    let mut agent = TransferAgent::new(lib, "bench-prefill").map_err(err)?;
    let agent_start = t0.elapsed();
    let src = agent.register_dram(MAX).map_err(err)?;
    let pattern: Vec<u8> = (0..MAX).map(|i| (i % 251) as u8).collect();
    agent.write_region(src, 0, &pattern).map_err(err)?;
    let desc: RemoteRegion =
        serde_json::from_slice(&wait_file(&dir.join("region.json"), child)?).map_err(|e| e.to_string())?;
    let md = wait_file(&dir.join("md"), child)?;
    let t1 = Instant::now();
    let peer = agent.load_peer(&md).map_err(err)?;
    let load_time = t1.elapsed();
    let t2 = Instant::now();
    agent
        .write(&peer, src, 0, &desc, 0, 4096, b"first", TIMEOUT)
        .map_err(err)?;
    let first_write = t2.elapsed();

    println!(
        "NIXL {} | UCX_TLS={} | notification per WRITE: {}",
        lib.capi_path().display(),
        std::env::var("UCX_TLS").unwrap_or_default(),
        if notify { "yes" } else { "no" }
    );
    println!(
        "agent start {:.1} ms, load_peer {:.2} ms, first 4 KiB WRITE (connects) {:.2} ms",
        agent_start.as_secs_f64() * 1e3,
        load_time.as_secs_f64() * 1e3,
        first_write.as_secs_f64() * 1e3
    );
    println!(
        "{:>8} {:>7} {:>10} {:>10} {:>10} {:>12}",
        "block", "iters", "p50 us", "p99 us", "mean us", "MiB/s"
    );
    for &(size, label, iters) in SIZES {
        let iters = ((iters as f64 * scale).round() as usize).max(10);
        let notif: &[u8] = if notify { b"kv" } else { b"" };
        for _ in 0..(iters / 10).max(3) {
            agent
                .write(&peer, src, 0, &desc, 0, size, notif, TIMEOUT)
                .map_err(err)?;
        }
        let mut lat = Vec::with_capacity(iters);
        let wall = Instant::now();
        for _ in 0..iters {
            let s = agent
                .write(&peer, src, 0, &desc, 0, size, notif, TIMEOUT)
                .map_err(err)?;
            lat.push(s.elapsed);
        }
        let wall = wall.elapsed();
        lat.sort();
        let mean = lat.iter().sum::<Duration>() / lat.len() as u32;
        let mibs = (size * iters) as f64 / (1 << 20) as f64 / wall.as_secs_f64();
        println!(
            "{:>8} {:>7} {:>10.1} {:>10.1} {:>10.1} {:>12.1}",
            label,
            iters,
            percentile(&lat, 0.50).as_secs_f64() * 1e6,
            percentile(&lat, 0.99).as_secs_f64() * 1e6,
            mean.as_secs_f64() * 1e6,
            mibs
        );
    }
    agent.write(&peer, src, 0, &desc, 0, 1, b"quit", TIMEOUT).map_err(err)?;
    Ok(())
}
