//! Real etcd processes on random loopback ports in temp dirs, real coordinator and rank
//! processes (the `rootrank` binary), and small HTTP helpers. Every process is killed when
//! its handle drops, so a failing test leaves nothing behind.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use rootrank_store::embedded::{EmbeddedEtcd, EtcdOptions};

use crate::{free_port, rootrank_bin};

/// A throwaway etcd.
pub struct Etcd {
    pub inner: EmbeddedEtcd,
    _dir: tempfile::TempDir,
}

impl Etcd {
    pub fn start() -> anyhow::Result<Etcd> {
        Etcd::start_with(&[])
    }
    /// With extra etcd flags (e.g. `--max-txn-ops 16`).
    pub fn start_with(extra_args: &[&str]) -> anyhow::Result<Etcd> {
        let dir = tempfile::tempdir()?;
        let opts = EtcdOptions {
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            ..EtcdOptions::default()
        };
        // Free-port races with parallel tests are possible: try a few times.
        let mut started = EmbeddedEtcd::start(dir.path(), &opts);
        for _ in 1..5 {
            if started.is_ok() {
                break;
            }
            started = EmbeddedEtcd::start(dir.path(), &opts);
        }
        let inner = started.map_err(|e| anyhow!("etcd would not start: {e}"))?;
        Ok(Etcd { inner, _dir: dir })
    }
    pub fn endpoint(&self) -> String {
        self.inner.endpoint()
    }
    pub fn kill(&mut self) {
        self.inner.kill()
    }
    pub fn restart(&mut self) -> anyhow::Result<()> {
        Ok(self.inner.restart()?)
    }
}

/// A throwaway etcd cluster of several members on loopback.
pub struct EtcdCluster {
    pub members: Vec<EmbeddedEtcd>,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    pub fn start(n: usize) -> anyhow::Result<EtcdCluster> {
        let dir = tempfile::tempdir()?;
        let members =
            rootrank_store::embedded::start_cluster(dir.path(), n, &EtcdOptions::default(), Duration::from_secs(30))?;
        Ok(EtcdCluster { members, _dir: dir })
    }

    /// All client endpoints, comma-separated (as `--etcd-endpoints` takes them).
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(EmbeddedEtcd::endpoint)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Kills a child and reaps it.
pub(crate) fn kill_child(c: &mut Child) {
    let _ = c.kill();
    let _ = c.wait();
}

/// A `rootrank serve` process.
pub struct Coordinator {
    child: Option<Child>,
    pub url: String,
    port: u16,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    _logdir: tempfile::TempDir,
}

impl Coordinator {
    /// Starts a coordinator against `endpoint` and waits until `/readyz` says 200.
    /// A free port can be taken by another test between the probe and the bind: then this
    /// coordinator exits at once, and it is started again on a new port (never does a test
    /// talk to another test's coordinator: ready means *this* child is listening).
    pub async fn start(endpoint: &str, extra: &[&str]) -> anyhow::Result<Coordinator> {
        Coordinator::start_with_env(endpoint, extra, &[]).await
    }

    /// With more environment (e.g. [`crate::clock_skew_env`]: a host whose clock is off).
    pub async fn start_with_env(
        endpoint: &str,
        extra: &[&str],
        env: &[(String, String)],
    ) -> anyhow::Result<Coordinator> {
        let mut last = None;
        for _ in 0..5 {
            let port = free_port()?;
            let logdir = tempfile::tempdir()?;
            let mut args = vec![
                "serve".to_string(),
                "--etcd-endpoints".into(),
                endpoint.to_string(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
            ];
            args.extend(extra.iter().map(|s| s.to_string()));
            let mut c = Coordinator {
                child: None,
                url: format!("http://127.0.0.1:{port}"),
                port,
                args,
                env: env.to_vec(),
                log: logdir.path().join("coordinator.log"),
                _logdir: logdir,
            };
            match c.spawn().await {
                Ok(()) => return Ok(c),
                Err(e) if c.exited() => last = Some(e), // lost the port race: try another
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("coordinator did not start")))
    }

    /// Whether the child has exited.
    fn exited(&mut self) -> bool {
        self.child.as_mut().is_none_or(|c| matches!(c.try_wait(), Ok(Some(_))))
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = Command::new(rootrank_bin())
            .args(&self.args)
            .envs(self.env.iter().cloned())
            .env("ROOTRANK_LOG", "info,rootrank_coordinator=debug,rootrank_store=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {}", rootrank_bin().display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok((200, _)) = get(&format!("{}/readyz", self.url)).await {
                // Someone answers on the port: make sure it is this child.
                if !self.exited() && self.log_text().contains("coordinator listening") {
                    return Ok(());
                }
            }
            if self.exited() {
                bail!("coordinator exited before it was ready; log:\n{}", self.log_text());
            }
            if Instant::now() > deadline {
                bail!("coordinator not ready in 20 s; log:\n{}", self.log_text());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }
    /// Kills and starts it again on the same port.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn().await
    }
    /// GET a path on this coordinator: (status, JSON or text as a JSON string).
    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, serde_json::Value)> {
        get(&format!("{}{}", self.url, path)).await
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `rootrank rank` process: a real rank with an embedded agent, driven over stdin.
pub struct Rank {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    pub pid: u32,
    pub incarnation: String,
}

impl Rank {
    pub fn start(endpoint: &str, group: &str, rank: u32, size: u32, lease_ttl_ms: u64) -> anyhow::Result<Rank> {
        Rank::start_with(endpoint, group, rank, size, lease_ttl_ms, &[])
    }

    /// With more `rootrank rank` flags (e.g. etcd credentials).
    pub fn start_with(
        endpoint: &str,
        group: &str,
        rank: u32,
        size: u32,
        lease_ttl_ms: u64,
        extra: &[String],
    ) -> anyhow::Result<Rank> {
        Rank::start_with_env(endpoint, group, rank, size, lease_ttl_ms, extra, &[])
    }

    /// With more flags and environment (e.g. [`crate::clock_skew_env`]).
    pub fn start_with_env(
        endpoint: &str,
        group: &str,
        rank: u32,
        size: u32,
        lease_ttl_ms: u64,
        extra: &[String],
        env: &[(String, String)],
    ) -> anyhow::Result<Rank> {
        let mut child = Command::new(rootrank_bin())
            .args([
                "rank",
                "--etcd-endpoints",
                endpoint,
                "--group",
                group,
                "--rank",
                &rank.to_string(),
                "--group-size",
                &size.to_string(),
            ])
            .args(["--lease-ttl-ms", &lease_ttl_ms.to_string()])
            .args(extra)
            .envs(env.iter().cloned())
            .env("ROOTRANK_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?);
        let mut r = Rank {
            pid: child.id(),
            child: Some(child),
            stdin,
            stdout,
            incarnation: String::new(),
        };
        let line = r.read_line()?;
        let inc = line
            .strip_prefix("registered incarnation=")
            .and_then(|s| s.split_whitespace().next())
            .ok_or_else(|| anyhow!("rank did not register: {line:?}"))?;
        r.incarnation = inc.to_string();
        Ok(r)
    }

    fn read_line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("rank process closed its stdout");
        }
        Ok(line.trim_end().to_string())
    }

    /// Sends one command and returns the rank's one-line reply.
    pub fn send(&mut self, cmd: &str) -> anyhow::Result<String> {
        let stdin = self.stdin.as_mut().ok_or_else(|| anyhow!("rank stdin closed"))?;
        writeln!(stdin, "{cmd}")?;
        stdin.flush()?;
        self.read_line()
    }

    /// `fail ROOM ORIGIN REASON DETAIL` then flush: returns once it is in etcd.
    pub fn fail(&mut self, room: u64, origin: &str, reason: &str, detail: &str) -> anyhow::Result<()> {
        let r = self.send(&format!("fail {room} {origin} {reason} {detail}"))?;
        if r != "ok" {
            bail!("fail: {r}");
        }
        Ok(())
    }

    pub fn flush(&mut self) -> anyhow::Result<()> {
        let r = self.send("flush")?;
        if r != "flushed" {
            bail!("flush: {r}");
        }
        Ok(())
    }

    /// SIGKILL, as the OOM killer would.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }

    /// Clean exit (`exit`), waiting for it.
    pub fn exit(&mut self) -> anyhow::Result<String> {
        let r = self.send("exit")?;
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
        Ok(r)
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// GET a URL: (status, body as JSON, or as a JSON string when it is not JSON).
pub async fn get(url: &str) -> anyhow::Result<(u16, serde_json::Value)> {
    let client = rootrank_tls::http_client(None)?
        .timeout(Duration::from_secs(40))
        .build()?;
    let resp = client.get(url).send().await?;
    let status = resp.status().as_u16();
    let text = resp.text().await?;
    let body = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    Ok((status, body))
}

/// The events `GET {url}/v1/events?since=SINCE` streams within `within`: each SSE `data:`
/// line, parsed.
pub async fn events_within(url: &str, since: i64, within: Duration) -> anyhow::Result<Vec<serde_json::Value>> {
    let client = rootrank_tls::http_client(None)?.build()?;
    let mut resp = client.get(format!("{url}/v1/events?since={since}")).send().await?;
    if !resp.status().is_success() {
        bail!(
            "/v1/events answered {}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        );
    }
    let deadline = tokio::time::Instant::now() + within;
    let mut text = Vec::new();
    while let Ok(chunk) = tokio::time::timeout_at(deadline, resp.chunk()).await {
        match chunk? {
            Some(c) => text.extend_from_slice(&c),
            None => break,
        }
    }
    String::from_utf8_lossy(&text)
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| serde_json::from_str(d.trim()).with_context(|| format!("an event that is not JSON: {d}")))
        .collect()
}

/// `GET http://ADDR/metrics`: the text exposition, an error unless it is a 200 in the
/// Prometheus text format.
pub async fn scrape_metrics(addr: &str) -> anyhow::Result<String> {
    let client = rootrank_tls::http_client(None)?
        .timeout(Duration::from_secs(10))
        .build()?;
    let resp = client.get(format!("http://{addr}/metrics")).send().await?;
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = resp.text().await?;
    anyhow::ensure!(status == 200, "GET /metrics on {addr}: {status}: {text}");
    anyhow::ensure!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "GET /metrics on {addr}: content-type {content_type:?}"
    );
    Ok(text)
}

/// Polls `f` every 10 ms until it returns `Some`, or fails after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One room's verdict as two replicas give it at one revision (pinned with `min_revision`),
/// once `done` holds for it; fails if they differ there. `query` is the verdict's query
/// string after `?` (e.g. `group=g`).
async fn ask_verdict(c: &Coordinator, room: u64, query: &str) -> Option<serde_json::Value> {
    match c.get(&format!("/v1/rooms/{room}/verdict?{query}")).await {
        Ok((200, v)) => Some(v),
        _ => None,
    }
}

pub async fn agreed_verdict(
    replicas: [&Coordinator; 2],
    room: u64,
    query: &str,
    timeout: Duration,
    done: fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let (a, b) = eventually(
        timeout,
        &format!("room {room} settled alike on both replicas"),
        || async {
            let rev_a = ask_verdict(replicas[0], room, query).await?["revision"].as_i64()?;
            let rev_b = ask_verdict(replicas[1], room, query).await?["revision"].as_i64()?;
            let q = format!("{query}&min_revision={}", rev_a.max(rev_b));
            let a = ask_verdict(replicas[0], room, &q).await?;
            let b = ask_verdict(replicas[1], room, &q).await?;
            (a["revision"] == b["revision"] && done(&a)).then_some((a, b))
        },
    )
    .await?;
    if a != b {
        bail!("replicas differ at revision {}:\n{a}\n{b}", a["revision"]);
    }
    Ok(a)
}
