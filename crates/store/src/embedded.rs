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
    #[error("etcd exited during start-up ({status}); its log is {log}")]
    Exited { status: String, log: String },
    #[error("etcd did not answer on {url} within {secs} s; its log is {log}")]
    Timeout { url: String, secs: u64, log: String },
    #[error("data directory {dir}: {source}")]
    DataDir { dir: String, source: std::io::Error },
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
    /// More etcd flags, appended after rootrank's own (benchmarks raise
    /// `--quota-backend-bytes` to hold a million records).
    pub extra_args: Vec<String>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            fast: true,
            client_port: 0,
            peer_port: 0,
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
    fast: bool,
    extra_args: Vec<String>,
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
            fast: opts.fast,
            extra_args: opts.extra_args.clone(),
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
        cmd.arg("--name")
            .arg("rootrank")
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
            .arg(format!("rootrank={peer}"))
            .arg("--log-level")
            .arg("warn")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        if self.fast {
            cmd.args(["--heartbeat-interval", "10", "--election-timeout", "100"]);
        }
        cmd.args(&self.extra_args);
        let mut child = cmd.spawn().map_err(EmbeddedError::Spawn)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = format!("127.0.0.1:{}", self.client_port);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(EmbeddedError::Exited {
                    status: status.to_string(),
                    log: log_path.display().to_string(),
                });
            }
            if health_ok(&addr) {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(EmbeddedError::Timeout {
                    url: client,
                    secs: 20,
                    log: log_path.display().to_string(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
        Ok(())
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

/// etcd answers `/health` with `{"health":"true"}` once it has a leader.
fn health_ok(addr: &str) -> bool {
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

fn free_port() -> Result<u16, EmbeddedError> {
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
