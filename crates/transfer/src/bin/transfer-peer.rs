//! A receiving rank for tests and manual checks: registers a DRAM region,
//! publishes its NIXL metadata and region descriptor as files, then reports
//! every notification it gets (verifying the bytes a `check:` one names).
//!
//! ```text
//! transfer-peer receive <dir> <name> <region-len> [max-secs]
//! transfer-peer load-only <nixl-dir>      # load NIXL from exactly <nixl-dir>, create an agent
//! ```
//!
//! Files written into `<dir>` (each by write-then-rename):
//! * `<name>.md` — agent metadata bytes;
//! * `<name>.region.json` — the [`RemoteRegion`] to write into;
//! * `<name>.log` — appended: one line per notification,
//!   `notif <from> <msg> ok|bad ...`.
//!
//! Notification protocol: `check:<offset>:<len>:<fnv1a64 hex>` makes the
//! receiver hash those bytes of its region; `quit` makes it exit 0.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rootrank_transfer::{NixlLibrary, TransferAgent, TransferError};

fn main() -> ExitCode {
    // SAFETY: first thing in main, before any thread exists.
    unsafe { rootrank_transfer::set_ucx_defaults_before_threads() };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("receive") if args.len() >= 4 => {
            let max_secs = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(120);
            match args[3].parse::<usize>() {
                Ok(len) => receive(Path::new(&args[1]), &args[2], len, max_secs),
                Err(e) => Err(format!("bad region length {:?}: {e}", args[3])),
            }
        }
        Some("load-only") if args.len() >= 2 => load_only(Path::new(&args[1])),
        _ => Err("usage: transfer-peer receive <dir> <name> <region-len> [max-secs] | \
                  transfer-peer load-only <nixl-dir>"
            .to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("transfer-peer: {msg}");
            ExitCode::from(2)
        }
    }
}

fn load_only(dir: &Path) -> Result<(), String> {
    let lib = NixlLibrary::load(Some(dir)).map_err(describe)?;
    let _agent = TransferAgent::new(&lib, "load-only").map_err(describe)?;
    println!("loaded {}", lib.capi_path().display());
    Ok(())
}

fn describe(e: TransferError) -> String {
    format!("[{}] {e}", e.reason())
}

/// Writes `bytes` to `dir/name` atomically (temp file, then rename).
pub fn publish(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), String> {
    let tmp: PathBuf = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes).map_err(|e| format!("write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(name)).map_err(|e| format!("rename {}: {e}", tmp.display()))
}

fn receive(dir: &Path, name: &str, len: usize, max_secs: u64) -> Result<(), String> {
    let lib = NixlLibrary::load(None).map_err(describe)?;
    let t0 = Instant::now();
    let mut agent = TransferAgent::new(&lib, name).map_err(describe)?;
    let agent_start = t0.elapsed();
    let region = agent.register_dram(len).map_err(describe)?;
    let desc = agent.region_descriptor(region).map_err(describe)?;
    let md = agent.local_metadata().map_err(describe)?;
    let desc_json = serde_json::to_vec(&desc).map_err(|e| e.to_string())?;
    publish(dir, &format!("{name}.region.json"), &desc_json)?;
    publish(dir, &format!("{name}.md"), &md)?;
    eprintln!(
        "transfer-peer {name}: agent up in {} ms, region {len} bytes, pid {}",
        agent_start.as_millis(),
        std::process::id()
    );

    let log_path = dir.join(format!("{name}.log"));
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| format!("open {}: {e}", log_path.display()))?;
    let deadline = Instant::now() + Duration::from_secs(max_secs);
    while Instant::now() < deadline {
        let notifs = agent.notifications().map_err(describe)?;
        if notifs.is_empty() {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        for (from, msg) in notifs {
            let text = String::from_utf8_lossy(&msg).into_owned();
            if text == "quit" {
                writeln!(log, "notif {from} quit ok").map_err(|e| e.to_string())?;
                return Ok(());
            }
            let verdict = match text.strip_prefix("check:") {
                Some(spec) => check(&agent.region_to_vec(region).map_err(describe)?, spec),
                None => "ok".to_string(),
            };
            writeln!(log, "notif {from} {text} {verdict}").map_err(|e| e.to_string())?;
            log.flush().map_err(|e| e.to_string())?;
        }
    }
    Err(format!("no quit notification within {max_secs} s"))
}

/// Verifies `offset:len:hash` against `bytes`; "ok" or "bad <why>".
fn check(bytes: &[u8], spec: &str) -> String {
    let parts: Vec<&str> = spec.split(':').collect();
    let [off, len, hash] = parts.as_slice() else {
        return format!("bad spec {spec}");
    };
    let (Ok(off), Ok(len), Ok(hash)) = (
        off.parse::<usize>(),
        len.parse::<usize>(),
        u64::from_str_radix(hash, 16),
    ) else {
        return format!("bad spec {spec}");
    };
    match bytes.get(off..off.saturating_add(len)) {
        Some(slice) => {
            let got = fnv1a64(slice);
            if got == hash {
                "ok".to_string()
            } else {
                format!("bad hash {got:016x}")
            }
        }
        None => format!("bad range {off}+{len} of {}", bytes.len()),
    }
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
