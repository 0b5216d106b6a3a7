//! The processes a benchmark runs: a private etcd, coordinators and ranks.
//!
//! Coordinators and ranks are this very binary (`rootrank-bench serve-coordinator`, `rootrank-bench
//! rank`), which embed `rootrank_coordinator::run` and `rootrank_agent::Agent`. So the suite never
//! depends on `cargo build --bin rootrank` having run first (the test of a separate crate cannot
//! rely on the workspace binary being built), and coordinator and ranks are always built with the
//! same profile as the load that drives them. They run the same library code as `rootrank serve`
//! (same runtime shape: 2 worker threads; same logging: info to stderr).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use rootrank_store::embedded::{EmbeddedEtcd, EtcdOptions};

/// Where the suite's binary is and where its scratch files go.
#[derive(Clone, Debug)]
pub struct Env {
    /// The `rootrank-bench` binary (re-executed for coordinators and ranks).
    pub exe: PathBuf,
    /// The repository root (git revision, NIXL cache, nixl_bench example).
    pub repo: PathBuf,
    /// Scratch directory (etcd data, logs).
    pub work: PathBuf,
}

impl Env {
    pub fn subdir(&self, name: &str) -> anyhow::Result<PathBuf> {
        let d = self.work.join(name);
        if d.exists() {
            std::fs::remove_dir_all(&d).with_context(|| format!("clearing {}", d.display()))?;
        }
        std::fs::create_dir_all(&d)?;
        Ok(d)
    }
}

/// Starts a private etcd in `dir` with extra flags; retried because free ports can race.
pub fn start_etcd(dir: &Path, extra_args: &[String]) -> anyhow::Result<EmbeddedEtcd> {
    start_etcd_with(
        dir,
        &EtcdOptions {
            extra_args: extra_args.to_vec(),
            ..EtcdOptions::default()
        },
    )
}

/// etcd's backend quota for a million records: they are ~0.5 GB in etcd's backend with
/// history, well over the 2 GiB default quota once compaction lags, so the quota is raised
/// as a production cluster would.
pub const LARGE_QUOTA_BYTES: u64 = 8 << 30;

/// [`start_etcd`] for a million records ([`LARGE_QUOTA_BYTES`]).
pub fn start_large_etcd(dir: &Path) -> anyhow::Result<EmbeddedEtcd> {
    start_etcd(dir, &["--quota-backend-bytes".into(), LARGE_QUOTA_BYTES.to_string()])
}

/// [`start_etcd`] with any options (e.g. etcd's production timing, `fast: false`).
pub fn start_etcd_with(dir: &Path, opts: &EtcdOptions) -> anyhow::Result<EmbeddedEtcd> {
    let mut started = EmbeddedEtcd::start(&dir.join("etcd0"), opts);
    for attempt in 1..5 {
        if started.is_ok() {
            break;
        }
        started = EmbeddedEtcd::start(&dir.join(format!("etcd{attempt}")), opts);
    }
    started.map_err(|e| anyhow!("etcd would not start: {e}"))
}

pub fn etcd_pid(etcd: &EmbeddedEtcd) -> anyhow::Result<u32> {
    etcd.pid().context("etcd is not running")
}

/// A coordinator child process. Killed on drop.
pub struct Coordinator {
    child: Child,
    pub url: String,
    pub pid: u32,
    /// From spawn to the first `/readyz` 200.
    pub start_to_ready: Duration,
    pub log: PathBuf,
}

impl Coordinator {
    /// Spawns a coordinator and waits (up to `ready_timeout`) until `/readyz` answers 200.
    pub async fn start(
        env: &Env,
        endpoint: &str,
        prefix: &str,
        ready_timeout: Duration,
    ) -> anyhow::Result<Coordinator> {
        Self::start_with(env, endpoint, prefix, ready_timeout, &[]).await
    }

    /// [`Coordinator::start`] with more arguments (`--snapshot-readers N`).
    pub async fn start_with(
        env: &Env,
        endpoint: &str,
        prefix: &str,
        ready_timeout: Duration,
        args: &[String],
    ) -> anyhow::Result<Coordinator> {
        Self::start_serving(env, endpoint, prefix, ready_timeout, args, None).await
    }

    /// A coordinator serving HTTPS (`args` carry `--tls-cert/--tls-key`), its readiness
    /// checked against the CA `cacert`.
    pub async fn start_https(
        env: &Env,
        endpoint: &str,
        prefix: &str,
        ready_timeout: Duration,
        args: &[String],
        cacert: &Path,
    ) -> anyhow::Result<Coordinator> {
        Self::start_serving(env, endpoint, prefix, ready_timeout, args, Some(cacert)).await
    }

    async fn start_serving(
        env: &Env,
        endpoint: &str,
        prefix: &str,
        ready_timeout: Duration,
        args: &[String],
        https_ca: Option<&Path>,
    ) -> anyhow::Result<Coordinator> {
        let mut last_err = None;
        for attempt in 0..3 {
            let port = crate::util::free_port()?;
            let log = env.work.join(format!("coordinator-{port}.log"));
            let logf = std::fs::File::create(&log)?;
            let started = Instant::now();
            let child = Command::new(&env.exe)
                .args(["serve-coordinator", "--etcd-endpoints", endpoint, "--prefix", prefix])
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(args)
                .env(
                    "ROOTRANK_LOG",
                    std::env::var("ROOTRANK_LOG").unwrap_or_else(|_| "info".into()),
                )
                .stdin(Stdio::null())
                .stdout(logf.try_clone()?)
                .stderr(logf)
                .spawn()
                .with_context(|| format!("spawning {}", env.exe.display()))?;
            let pid = child.id();
            let scheme = if https_ca.is_some() { "https" } else { "http" };
            let mut c = Coordinator {
                child,
                url: format!("{scheme}://127.0.0.1:{port}"),
                pid,
                start_to_ready: Duration::ZERO,
                log,
            };
            let http = rootrank_tls::http_client(https_ca)?
                .timeout(Duration::from_secs(2))
                .build()?;
            let deadline = started + ready_timeout;
            loop {
                if let Ok(Some(st)) = c.child.try_wait() {
                    last_err = Some(anyhow!("coordinator exited ({st}); log {}", c.log.display()));
                    break;
                }
                if let Ok(r) = http.get(format!("{}/readyz", c.url)).send().await {
                    if r.status().as_u16() == 200 {
                        c.start_to_ready = started.elapsed();
                        return Ok(c);
                    }
                }
                if Instant::now() > deadline {
                    bail!(
                        "coordinator not ready within {ready_timeout:?}; log {}",
                        c.log.display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tracing::debug!(attempt, "coordinator start failed; retrying on another port");
        }
        Err(last_err.unwrap_or_else(|| anyhow!("coordinator would not start")))
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A rank child process with an embedded agent, driven over stdin. Killed on drop.
pub struct RankProc {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    pub pid: u32,
}

impl RankProc {
    /// Spawns the rank; [`RankProc::wait_registered`] reads its first line.
    pub fn spawn(
        env: &Env,
        endpoint: &str,
        group: &str,
        rank: u32,
        size: u32,
        ttl_ms: u64,
    ) -> anyhow::Result<RankProc> {
        let mut child = Command::new(&env.exe)
            .args(["rank", "--etcd-endpoints", endpoint, "--group", group])
            .args(["--rank", &rank.to_string(), "--group-size", &size.to_string()])
            .args(["--lease-ttl-ms", &ttl_ms.to_string()])
            .env("ROOTRANK_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("spawning {}", env.exe.display()))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        Ok(RankProc {
            pid: child.id(),
            child: Some(child),
            stdin,
            stdout,
        })
    }

    /// Blocks until the rank says it registered (its first line).
    pub fn wait_registered(&mut self) -> anyhow::Result<()> {
        let line = self.read_line()?;
        if !line.starts_with("registered ") {
            bail!("rank did not register: {line:?}");
        }
        Ok(())
    }

    fn read_line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("rank process closed its stdout");
        }
        Ok(line.trim_end().to_string())
    }

    /// Reports a room failure and waits until it is in etcd.
    pub fn fail(&mut self, room: u64, origin: &str, reason: &str) -> anyhow::Result<()> {
        let stdin = self.stdin.as_mut().context("rank stdin closed")?;
        writeln!(stdin, "fail {room} {origin} {reason} rootrank-bench\nflush")?;
        stdin.flush()?;
        for want in ["ok", "flushed"] {
            let r = self.read_line()?;
            if r != want {
                bail!("rank fail: {r}");
            }
        }
        Ok(())
    }

    /// SIGKILL, as the OOM killer would, and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RankProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `rootrank-bench serve-coordinator`: the coordinator, as `rootrank serve` runs it.
pub fn serve_coordinator(
    endpoints: Vec<String>,
    listen: std::net::SocketAddr,
    prefix: String,
    snapshot_readers: usize,
    tls: Option<(PathBuf, PathBuf)>,
    auth_token_file: Option<PathBuf>,
) -> anyhow::Result<()> {
    init_tracing();
    let mut config = rootrank_coordinator::CoordinatorConfig::new(endpoints, listen);
    config.index.prefix = prefix;
    config.snapshot_readers = snapshot_readers;
    config.tls = tls
        .map(|(cert, key)| rootrank_tls::server_config(&cert, &key))
        .transpose()?;
    config.auth_token = auth_token_file
        .map(|p| rootrank_tls::AuthToken::from_file(&p))
        .transpose()?;
    // The same runtime shape as `rootrank serve` (src/cmd/mod.rs): 2 worker threads.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(rootrank_coordinator::run(config, async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    }))?;
    Ok(())
}

/// `rootrank-bench rank`: a rank with an embedded agent, driven over stdin by the same line
/// protocol as `rootrank rank` ([`rootrank_agent::script`]).
pub fn rank_main(endpoints: Vec<String>, group: &str, rank: u64, size: u64, ttl_ms: u64) -> anyhow::Result<()> {
    init_tracing();
    let mut config = rootrank_agent::AgentConfig::new(endpoints, group, rank, size)?;
    config.lease_ttl = Duration::from_millis(ttl_ms);
    let agent = rootrank_agent::Agent::start(config)?;
    rootrank_agent::script::drive(&agent, std::io::stdin().lock(), std::io::stdout().lock())?;
    Ok(())
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("ROOTRANK_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .compact()
        .try_init();
}
