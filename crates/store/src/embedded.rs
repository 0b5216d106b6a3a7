//! A private etcd process: `rootrank serve` without `--etcd-endpoints` on one machine, the
//! demo, and every test. It runs the `etcd` binary from PATH on loopback ports.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error("no etcd binary on PATH: install etcd (Debian: apt-get install etcd-server), or run `make deps`, or pass --etcd-endpoints")]
    NotFound,
    #[error("could not start etcd: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("etcd exited during start-up ({status}): {why}; its log is {log}")]
    Exited {
        status: String,
        /// The line of etcd's log that says why (see [`why_etcd_exited`]).
        why: String,
        log: String,
    },
    #[error("etcd did not answer on {url} within {secs} s; its log is {log}")]
    Timeout { url: String, secs: u64, log: String },
    #[error("data directory {dir}: {source}")]
    DataDir { dir: String, source: std::io::Error },
    #[error("a member of the etcd cluster exited during start-up four times, the last: {why}")]
    ClusterMemberExited { why: String },
}

/// Tunables for a private etcd.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// Fast elections (10 ms heartbeat, 100 ms election timeout): loopback only. The minimum
    /// lease TTL is then 150 ms, which tests use.
    pub fast: bool,
    /// Client and peer ports; 0 picks free ones.
    pub client_port: u16,
    pub peer_port: u16,
    /// Member name and `--initial-cluster` for a multi-member cluster (default: one member).
    pub name: String,
    pub initial_cluster: Option<String>,
    /// Wait until this member answers `/health` (a cluster member cannot before quorum).
    pub wait_healthy: bool,
    /// More etcd flags (e.g. `--quota-backend-bytes`).
    pub extra_args: Vec<String>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            fast: true,
            client_port: 0,
            peer_port: 0,
            name: "rootrank".to_string(),
            initial_cluster: None,
            wait_healthy: true,
            extra_args: Vec::new(),
        }
    }
}

/// A running etcd child process. Killed when dropped.
#[derive(Debug)]
pub struct EmbeddedEtcd {
    child: Option<Child>,
    data_dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    opts: EtcdOptions,
}

impl EmbeddedEtcd {
    /// Starts etcd with its data in `data_dir` and waits until it answers.
    pub fn start(data_dir: &Path, opts: &EtcdOptions) -> Result<Self, EmbeddedError> {
        std::fs::create_dir_all(data_dir).map_err(|e| EmbeddedError::DataDir {
            dir: data_dir.display().to_string(),
            source: e,
        })?;
        let client_port = if opts.client_port == 0 {
            free_port()?
        } else {
            opts.client_port
        };
        let peer_port = if opts.peer_port == 0 {
            free_port()?
        } else {
            opts.peer_port
        };
        let mut etcd = EmbeddedEtcd {
            child: None,
            data_dir: data_dir.to_path_buf(),
            client_port,
            peer_port,
            opts: opts.clone(),
        };
        etcd.spawn()?;
        Ok(etcd)
    }

    fn spawn(&mut self) -> Result<(), EmbeddedError> {
        let bin = which("etcd").ok_or(EmbeddedError::NotFound)?;
        let log_path = self.data_dir.join("etcd.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| EmbeddedError::DataDir {
                dir: log_path.display().to_string(),
                source: e,
            })?;
        let log2 = log.try_clone().map_err(EmbeddedError::Spawn)?;
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(bin);
        let initial_cluster = self
            .opts
            .initial_cluster
            .clone()
            .unwrap_or_else(|| format!("{}={peer}", self.opts.name));
        cmd.arg("--name")
            .arg(&self.opts.name)
            .arg("--data-dir")
            .arg(self.data_dir.join("member-data"))
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(initial_cluster)
            .arg("--log-level")
            .arg("warn")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        if self.opts.fast {
            cmd.args(["--heartbeat-interval", "10", "--election-timeout", "100"]);
        }
        cmd.args(&self.opts.extra_args);
        // A private etcd must not outlive whoever started it, even if that process is
        // SIGKILLed (a test harness, a killed `rootrank serve`).
        // SAFETY: prctl(2) is async-signal-safe and touches no memory of the parent.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        self.child = Some(cmd.spawn().map_err(EmbeddedError::Spawn)?);
        if !self.opts.wait_healthy {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = format!("127.0.0.1:{}", self.client_port);
        loop {
            if let Some(e) = self.exited() {
                self.child = None;
                return Err(e);
            }
            if health_ok(&addr) {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.kill();
                return Err(EmbeddedError::Timeout {
                    url: client,
                    secs: 20,
                    log: log_path.display().to_string(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    pub fn peer_port(&self) -> u16 {
        self.peer_port
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// [`EmbeddedError::Exited`] once the process exited (a port another process took
    /// between the probe and etcd's bind, a full disk); None while it runs or after
    /// [`EmbeddedEtcd::kill`].
    pub fn exited(&mut self) -> Option<EmbeddedError> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        let log_path = self.data_dir.join("etcd.log");
        Some(EmbeddedError::Exited {
            status: status.to_string(),
            why: why_etcd_exited(&std::fs::read_to_string(&log_path).unwrap_or_default()),
            log: log_path.display().to_string(),
        })
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// SIGKILLs etcd (tests: "etcd killed").
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same ports and data.
    pub fn restart(&mut self) -> Result<(), EmbeddedError> {
        self.kill();
        self.spawn()
    }
}

impl Drop for EmbeddedEtcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The line of an exited etcd's log that says why, so the error says it too: the log lives
/// in a data directory that a test or a bench removes, and a full disk ("create wal error: no
/// space left on device") or a bad flag must not read as a bare "exit status: 2".
/// etcd 3.4 logs with capnslog (`… C | etcdserver: …` before its `panic:`) or zap (JSON with
/// `"level":"fatal"`); flag errors go to stderr as plain text before the usage.
pub fn why_etcd_exited(log: &str) -> String {
    const MARKERS: [&str; 7] = [
        " C | ",
        " E | ",
        "\"level\":\"fatal\"",
        "\"level\":\"panic\"",
        "\"level\":\"error\"",
        "panic: ",
        "flag provided but not defined",
    ];
    let lines = || log.lines().map(str::trim_end).filter(|l| !l.is_empty());
    let line = lines()
        .find(|l| MARKERS.iter().any(|m| l.contains(m)))
        .or_else(|| lines().find(|l| l.to_ascii_lowercase().contains("error")))
        .or_else(|| lines().rfind(|l| !l.starts_with(char::is_whitespace)));
    match line {
        Some(l) if l.chars().count() > 300 => format!("{}…", l.chars().take(300).collect::<String>()),
        Some(l) => l.to_string(),
        None => "its log is empty".to_string(),
    }
}

/// Starts an `n`-member cluster on free loopback ports, member `i` named `m{i}` with its data
/// in `dir/m{i}`, each with `base`'s other options, and waits until every member has a
/// leader (up to `within`).
pub fn start_cluster(
    dir: &Path,
    n: usize,
    base: &EtcdOptions,
    within: Duration,
) -> Result<Vec<EmbeddedEtcd>, EmbeddedError> {
    // The ports are probed free, then bound by etcd: another process can take one in between
    // (parallel tests), and that member exits at once. The whole cluster starts again on new
    // ports then, a few times: a member cannot join under another name later.
    let mut last = None;
    for attempt in 0..4 {
        match start_cluster_once(&dir.join(format!("try{attempt}")), n, base, within) {
            Ok(members) => return Ok(members),
            Err(ClusterStart::MemberExited(e)) => last = Some(e.to_string()),
            Err(ClusterStart::Failed(e)) => return Err(e),
        }
    }
    Err(EmbeddedError::ClusterMemberExited {
        why: last.unwrap_or_default(),
    })
}

enum ClusterStart {
    MemberExited(EmbeddedError),
    Failed(EmbeddedError),
}

fn start_cluster_once(
    dir: &Path,
    n: usize,
    base: &EtcdOptions,
    within: Duration,
) -> Result<Vec<EmbeddedEtcd>, ClusterStart> {
    let ports: Vec<(u16, u16)> = (0..n)
        .map(|_| Ok((free_port()?, free_port()?)))
        .collect::<Result<_, EmbeddedError>>()
        .map_err(ClusterStart::Failed)?;
    let initial = ports
        .iter()
        .enumerate()
        .map(|(i, (_, p))| format!("m{i}=http://127.0.0.1:{p}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut members = Vec::new();
    for (i, (c, p)) in ports.iter().enumerate() {
        let opts = EtcdOptions {
            client_port: *c,
            peer_port: *p,
            name: format!("m{i}"),
            initial_cluster: Some(initial.clone()),
            // A member cannot answer before quorum: the whole cluster is waited for below.
            wait_healthy: false,
            ..base.clone()
        };
        members.push(EmbeddedEtcd::start(&dir.join(format!("m{i}")), &opts).map_err(ClusterStart::Failed)?);
    }
    let deadline = Instant::now() + within;
    while !members
        .iter()
        .all(|m| health_ok(&format!("127.0.0.1:{}", m.client_port())))
    {
        if let Some(e) = members.iter_mut().find_map(EmbeddedEtcd::exited) {
            return Err(ClusterStart::MemberExited(e));
        }
        if Instant::now() > deadline {
            return Err(ClusterStart::Failed(EmbeddedError::Timeout {
                url: members.iter().map(EmbeddedEtcd::endpoint).collect::<Vec<_>>().join(","),
                secs: within.as_secs(),
                log: dir.display().to_string(),
            }));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(members)
}

/// etcd answers `/health` with `{"health":"true"}` once it has a leader.
pub fn health_ok(addr: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(
        &match addr.parse() {
            Ok(a) => a,
            Err(_) => return false,
        },
        Duration::from_millis(200),
    ) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .is_err()
    {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.contains("\"health\":\"true\"")
}

pub fn free_port() -> Result<u16, EmbeddedError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(EmbeddedError::Spawn)?;
    l.local_addr().map(|a| a.port()).map_err(EmbeddedError::Spawn)
}

/// Finds an executable on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| {
        use std::os::unix::fs::PermissionsExt;
        p.metadata()
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    })
}

#[cfg(test)]
mod tests {
    use super::why_etcd_exited;

    #[test]
    fn the_critical_line_of_a_capnslog_panic_is_the_reason() {
        // etcd 3.4 from Debian on a full disk, as logged (stack trace shortened).
        let log = "[WARNING] Deprecated '--logger=capnslog' flag is set; use '--logger=zap' flag instead\n\
                   2026-12-03 14:33:49.300935 C | etcdserver: create wal error: no space left on device\n\
                   panic: create wal error: no space left on device\n\n\
                   goroutine 1 [running]:\n\
                   \tgithub.com/coreos/pkg/capnslog/pkg_logger.go:83 +0xbb\n\
                   main.main()\n";
        assert_eq!(
            why_etcd_exited(log),
            "2026-12-03 14:33:49.300935 C | etcdserver: create wal error: no space left on device"
        );
    }

    #[test]
    fn a_zap_fatal_line_and_a_bad_flag_are_the_reason() {
        let zap = "{\"level\":\"warn\",\"msg\":\"slow\"}\n{\"level\":\"fatal\",\"msg\":\"listener failed\",\"error\":\"address already in use\"}\n";
        assert!(why_etcd_exited(zap).contains("address already in use"));
        let flag = "flag provided but not defined: -no-such-flag\nUsage:\n\n  etcd [flags]\n";
        assert_eq!(why_etcd_exited(flag), "flag provided but not defined: -no-such-flag");
    }

    #[test]
    fn without_a_marker_the_last_unindented_line_and_an_empty_log_says_so() {
        assert_eq!(
            why_etcd_exited("starting\nsomething odd happened\n  detail\n"),
            "something odd happened"
        );
        assert_eq!(why_etcd_exited(""), "its log is empty");
        let long = "x".repeat(1000);
        assert_eq!(why_etcd_exited(&long).chars().count(), 301);
    }
}
