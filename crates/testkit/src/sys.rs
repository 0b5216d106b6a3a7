//! Small system helpers: ports, signals, `/proc` probes, paths.

use std::path::{Path, PathBuf};

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `rootrank` binary under test: `$ROOTRANK_BIN`, else next to the test executable
/// (`target/<profile>/rootrank`, tests live in `target/<profile>/deps/`).
pub fn rootrank_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ROOTRANK_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_default();
    profile_dir.join("rootrank")
}

/// A Python with the `rootrank` package installed: `$ROOTRANK_PYTHON`, else the cached SGLang
/// venv the Python tier installs the wheel into (`scripts/test-python.sh`, which `make test`
/// runs before the Rust tests). Checked: a test that needs it fails saying how to get it.
pub fn python_with_rootrank() -> anyhow::Result<PathBuf> {
    let python = match std::env::var_os("ROOTRANK_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => {
            let cache = std::env::var_os("ROOTRANK_CACHE_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/rootrank"));
            cache.join("sglang-0.5.23/bin/python")
        }
    };
    let ok = std::process::Command::new(&python)
        .args(["-c", "import rootrank"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        anyhow::bail!(
            "{} cannot import rootrank: run `make test-python` (it installs the wheel into the cached SGLang venv) or set ROOTRANK_PYTHON",
            python.display()
        );
    }
    Ok(python)
}

/// A loopback TCP port nobody listened on a moment ago.
pub fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Sends signal `sig` to `pid`, best effort (for clean-ups, where the process may be gone
/// already). Use [`try_signal`] when the test relies on the signal being delivered.
pub fn signal(pid: u32, sig: i32) {
    let _ = try_signal(pid, sig);
}

/// Sends signal `sig` to `pid`; an error when the process cannot be signalled (gone, or not
/// ours), so a test never goes on believing it killed something it did not.
pub fn try_signal(pid: u32, sig: i32) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: kill(2) touches no memory of ours.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Fails the calling test, loudly, when it does not run as root: a test that needs root must
/// not report ok without having run. `test` is its name (for `--skip`), `why` what root is
/// needed for.
#[track_caller]
pub fn require_root(test: &str, why: &str) {
    assert!(
        is_root(),
        "{test} needs root ({why}); run the tests as root, or leave this one out with `cargo test -- --skip {test}`"
    );
}

/// Whether `pid` is a live process (a zombie or a vanished pid is not).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Every process whose command line mentions `needle`, except ourselves, as `"PID: CMDLINE"`.
pub fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut out = Vec::new();
    let me = std::process::id().to_string();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !name.chars().all(|c| c.is_ascii_digit()) || name == me {
                continue;
            }
            if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                if cmd.contains(needle) {
                    out.push(format!("{name}: {cmd}"));
                }
            }
        }
    }
    out
}

/// The children of `pid` (of every thread of it).
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(c) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(c.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
            }
        }
    }
    out
}

/// The TCP ports `pid` listens on (IPv4 and IPv6): its socket fds matched against the
/// listening sockets of its network namespace.
pub fn listening_tcp_ports(pid: u32) -> Vec<u16> {
    let mut inodes = std::collections::HashSet::new();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                let t = target.to_string_lossy();
                if let Some(inode) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                    inodes.insert(inode.to_string());
                }
            }
        }
    }
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && f[3] == "0A" && inodes.contains(f[9]) {
                if let Some(port) = f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()) {
                    ports.push(port);
                }
            }
        }
    }
    ports
}

/// `promtool check metrics` on a text exposition: an error with promtool's complaints when
/// it does not pass (promtool must be installed; `make deps` installs it).
pub fn promtool_check_metrics(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot run promtool (make deps installs prometheus): {e}"))?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("promtool has no stdin"))?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "promtool check metrics failed: {}{}\nexposition:\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// libfaketime, from Debian's `faketime` (installed by `scripts/deps.sh`).
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// The environment that sets a child process's wall clock `offset_s` seconds off (as on a
/// host whose NTP is broken), through libfaketime: `SystemTime` moves, `Instant` does not
/// (`FAKETIME_DONT_FAKE_MONOTONIC`), so timers and timeouts behave. Checked: without the
/// library, a test fails saying how to get it instead of running with true clocks.
pub fn clock_skew_env(offset_s: i64) -> anyhow::Result<Vec<(String, String)>> {
    if !Path::new(LIBFAKETIME).exists() {
        anyhow::bail!("{LIBFAKETIME} is missing: run scripts/deps.sh (Debian package faketime)");
    }
    Ok(vec![
        ("LD_PRELOAD".into(), LIBFAKETIME.into()),
        ("FAKETIME".into(), format!("{offset_s:+}")),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
    ])
}
