//! `rootrank run`: supervises one rank process.
//!
//! - Starts it with its identity and etcd endpoints in the environment (`ROOTRANK_GROUP`,
//!   `ROOTRANK_RANK`, `ROOTRANK_GROUP_SIZE`, `ROOTRANK_ETCD_ENDPOINTS`, `ROOTRANK_PREFIX`), so an
//!   embedded agent registers by itself.
//! - When no live key with the child's pid appears within a grace, registers liveness on its
//!   behalf (a [`rootrank_agent::Agent`] whose `pid` is the child's).
//! - Forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT to it; passes stdout through untouched and
//!   stderr through while keeping its last lines ([`rootrank_watchdog::LogTail`]).
//! - When it ends, writes a `source: supervisor` certificate for its incarnation with the
//!   exit status and the stderr tail (reason `shutdown` for exit code 0, else the watchdog
//!   classifier's), so the informative traceback reaches the verdict's `culprit.log_tail`.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rootrank_agent::{Agent, AgentConfig};
use rootrank_core::ids::{check_rank, reasons};
use rootrank_core::records::{DownSource, ExitInfo as CoreExit, RankDown, SCHEMA_VERSION};
use rootrank_core::{time, GroupId, Incarnation, Keys, Rank, RankLive, Reason};
use rootrank_watchdog::{CgroupOomProbe, ExitInfo, ExitObserved, KernelLog, LogTail, ProcessExit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{debug, info, info_span, warn, Instrument};

use crate::certs::{CertWriter, Etcd, Written};
use crate::metrics::{self, NodeMetrics};
use crate::pidns::Located;
use crate::NodeError;
use rootrank_store::EtcdAccess;

/// How `rootrank run` runs.
#[derive(Clone, Debug)]
pub struct SuperviseConfig {
    /// etcd's endpoints and credentials ([`SuperviseConfig::new`]: plain); the child gets
    /// them in its environment as `ROOTRANK_ETCD_*`.
    pub etcd: EtcdAccess,
    pub prefix: String,
    pub group: GroupId,
    pub rank: Rank,
    pub group_size: u32,
    /// Liveness lease TTL when the supervisor registers on the child's behalf.
    pub lease_ttl: Duration,
    /// How long the certificate is kept.
    pub retention: Duration,
    /// How long to wait for the child's own agent to register before registering for it.
    pub agent_grace: Duration,
    /// How long to keep trying to write the certificate after the child ended (the
    /// supervisor must exit eventually, even with etcd down).
    pub report_timeout: Duration,
    /// Lines of stderr kept for the certificate.
    pub tail_lines: usize,
    /// The program and its arguments.
    pub command: Vec<String>,
    /// Where to serve `GET /metrics` (`None`: nowhere, the default).
    pub metrics_listen: Option<std::net::SocketAddr>,
}

impl SuperviseConfig {
    pub fn new(
        endpoints: Vec<String>,
        group: &str,
        rank: u64,
        group_size: u64,
        command: Vec<String>,
    ) -> Result<Self, NodeError> {
        let group = GroupId::new(group)?;
        let (rank, group_size) = check_rank(rank, group_size)?;
        if command.is_empty() {
            return Err(NodeError::Config(
                "no command to run (rootrank run ... -- CMD ARGS...)".into(),
            ));
        }
        Ok(SuperviseConfig {
            etcd: EtcdAccess::plain(endpoints),
            prefix: "/rootrank/v1".to_string(),
            group,
            rank,
            group_size,
            lease_ttl: Duration::from_secs(5),
            retention: Duration::from_secs(600),
            agent_grace: Duration::from_secs(3),
            report_timeout: Duration::from_secs(30),
            tail_lines: rootrank_watchdog::logtail::DEFAULT_LINES,
            command,
            metrics_listen: None,
        })
    }
}

/// How the supervised process ended, and what was reported.
#[derive(Debug, Clone)]
pub struct SupervisedExit {
    pub exit: ExitInfo,
    /// The incarnation the certificate was written for.
    pub incarnation: Option<Incarnation>,
    /// Whether the certificate is in etcd (ours, or an earlier specific one).
    pub reported: bool,
    /// The status to exit with: the child's code, or 128 + its signal.
    pub code: u8,
}

/// The child's incarnation, once known.
#[derive(Clone, Debug)]
struct Known {
    incarnation: Incarnation,
    /// The rank process the record names: the child, or a descendant of it when the child
    /// is a launcher (a shell, torchrun...).
    pid: u32,
    registered_revision: i64,
    gpu: Option<String>,
    host: Option<String>,
    lease_ttl_ms: Option<u64>,
    group_size: Option<u32>,
    role: Option<String>,
}

struct Discovery {
    known: Option<Known>,
    /// Our agent, when we registered on the child's behalf.
    agent: Option<Agent>,
    /// Incarnations whose live record names a process we cannot verify (said once each).
    unverified: std::collections::HashSet<i64>,
    /// `rootrank_unverified_pids_total` (SPEC section 8): served with `--metrics-listen`,
    /// and carried in the log lines either way.
    unverified_pids: prometheus::IntCounter,
}

impl Discovery {
    fn new(unverified_pids: prometheus::IntCounter) -> Self {
        Discovery {
            known: None,
            agent: None,
            unverified: std::collections::HashSet::new(),
            unverified_pids,
        }
    }
}

type Shared = Arc<Mutex<Discovery>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, Discovery> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs the command to its end and reports it. Errors only when the command cannot be
/// started; a certificate that cannot be written is logged and said in the result.
pub async fn supervise(config: SuperviseConfig) -> Result<SupervisedExit, NodeError> {
    let span = info_span!("supervise", group = %config.group, rank = config.rank);
    supervise_inner(config).instrument(span).await
}

async fn supervise_inner(config: SuperviseConfig) -> Result<SupervisedExit, NodeError> {
    if config.etcd.endpoints.is_empty() {
        return Err(rootrank_store::StoreError::NoEndpoints.into());
    }
    // Handlers before the child exists, so a signal right after the spawn is forwarded
    // instead of killing the supervisor and orphaning the child unreported.
    let mut signals = Forwarded::install()?;
    // Bound before the spawn, so a taken address stops us before there is a child. The
    // server is a task of its own that nothing here waits for, and its sockets are
    // close-on-exec: the child never sees them.
    let metrics = NodeMetrics::new()?;
    let _metrics_server = metrics::serve_if(config.metrics_listen, &metrics).await?;
    // Opened before the spawn: only kernel events after it can be about the child.
    let kernel = KernelLog::open_or_unavailable();

    let program = config.command[0].clone();
    let mut cmd = rank_command(&config);
    let watched_since = Instant::now();
    let mut child = cmd.spawn().map_err(|source| NodeError::Spawn {
        program: program.clone(),
        source,
    })?;
    let Some(pid) = child.id() else {
        return Err(NodeError::Wait(std::io::Error::other(
            "child exited before its pid was read",
        )));
    };
    info!(pid, program, "rank process started");
    let cgroup = CgroupOomProbe::for_pid(pid);

    let tail = Arc::new(Mutex::new(LogTail::new(
        config.tail_lines,
        rootrank_core::records::MAX_LOG_LINE_BYTES,
    )));
    let stderr_task = child
        .stderr
        .take()
        .map(|s| tokio::spawn(pass_stderr(s, Arc::clone(&tail))));

    let shared: Shared = Arc::new(Mutex::new(Discovery::new(metrics.unverified_pids.clone())));
    let discovery = tokio::spawn(discover(config.clone(), pid, Arc::clone(&shared)).in_current_span());

    let status = signals.forward_until_exit(&mut child, pid).await?;
    let exit = ExitInfo::from(status);
    let noticed_at = Instant::now();
    info!(pid, %exit, "rank process ended");
    discovery.abort();

    // The stderr pipe closes when the child's last writer does; a grandchild holding it
    // must not keep the report waiting.
    if let Some(t) = stderr_task {
        let _ = tokio::time::timeout(Duration::from_millis(500), t).await;
    }
    let log_tail: Vec<String> = {
        let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
        t.finish();
        t.lines().map(str::to_string).collect()
    };

    let known = resolve_incarnation(&config, pid, &shared).await;
    let pe = ProcessExit {
        key: (),
        // The kernel names the rank process in its OOM lines (a grandchild under a launcher).
        pid: known.as_ref().map_or(pid, |k| k.pid),
        exit: Some(exit),
        observed: ExitObserved::Exited,
        watched_since,
        noticed_at,
        start_time: None,
        cgroup_oom: cgroup.as_ref().and_then(CgroupOomProbe::delta),
    };
    let gpu = known.as_ref().and_then(|k| k.gpu.clone());
    let c = rootrank_watchdog::diagnose(&pe, &kernel, gpu.as_deref()).await;
    let (reason, detail) = why_it_ended(exit, c, &log_tail)?;
    let code = exit_code(exit);

    let Some(known) = known else {
        warn!("no incarnation for the rank process (etcd unreachable?); no certificate written");
        drop_agent(&shared, false).await;
        return Ok(SupervisedExit {
            exit,
            incarnation: None,
            reported: false,
            code,
        });
    };
    let down = RankDown {
        v: SCHEMA_VERSION,
        group: config.group.clone(),
        rank: config.rank,
        incarnation: known.incarnation,
        reason,
        detail,
        source: DownSource::Supervisor,
        at: Some(time::format_ms(rootrank_store::unix_ms())),
        exit: Some(CoreExit {
            code: exit.code,
            signal: exit.signal,
        }),
        log_tail: Some(log_tail),
        host: known.host.clone(),
        pid: Some(known.pid),
        observed_revision: None,
        registered_revision: Some(known.registered_revision).filter(|r| *r > 0),
        lease_ttl_ms: known.lease_ttl_ms,
        group_size: known.group_size,
        role: known.role.clone(),
    };
    let reported = write_certificate(&config, &down).await;
    // Revoking our lease now (rather than letting it expire) removes the live key at once;
    // the agent's own `shutdown` certificate is refused since ours is already there. Without
    // a certificate we must not claim a clean shutdown: then the lease runs out instead.
    drop_agent(&shared, reported).await;
    Ok(SupervisedExit {
        exit,
        incarnation: Some(known.incarnation),
        reported,
        code,
    })
}

/// The rank's command: its argv, and where its agent finds etcd and who it is.
fn rank_command(config: &SuperviseConfig) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&config.command[0]);
    cmd.args(&config.command[1..])
        .env("ROOTRANK_GROUP", config.group.as_str())
        .env("ROOTRANK_RANK", config.rank.to_string())
        .env("ROOTRANK_GROUP_SIZE", config.group_size.to_string())
        .env("ROOTRANK_ETCD_ENDPOINTS", config.etcd.endpoints.join(","))
        .env("ROOTRANK_PREFIX", &config.prefix)
        .stdin(Stdio::inherit())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped());
    // The child's own agent (the SGLang plugin) connects as the supervisor does: same files.
    cmd.envs(config.etcd.files().to_env());
    cmd
}

/// The signals the supervisor passes on to its rank.
struct Forwarded {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
}

impl Forwarded {
    fn install() -> Result<Self, NodeError> {
        Ok(Forwarded {
            int: install(libc::SIGINT)?,
            term: install(libc::SIGTERM)?,
            hup: install(libc::SIGHUP)?,
            quit: install(libc::SIGQUIT)?,
        })
    }

    /// Waits for the child to end, passing every signal on to it meanwhile.
    async fn forward_until_exit(
        &mut self,
        child: &mut tokio::process::Child,
        pid: u32,
    ) -> Result<std::process::ExitStatus, NodeError> {
        loop {
            let sig = tokio::select! {
                st = child.wait() => return st.map_err(NodeError::Wait),
                _ = self.int.recv() => libc::SIGINT,
                _ = self.term.recv() => libc::SIGTERM,
                _ = self.hup.recv() => libc::SIGHUP,
                _ = self.quit.recv() => libc::SIGQUIT,
            };
            debug!(pid, signal = sig, "forwarding signal to the rank process");
            // SAFETY: kill(2) on our own child's pid, which stays ours (unreaped) until wait()
            // above returns.
            unsafe {
                libc::kill(pid as i32, sig);
            }
        }
    }
}

/// The certificate's reason and detail: a clean exit, a victim (its last words say a peer
/// vanished), or what the host says killed it.
fn why_it_ended(
    exit: ExitInfo,
    c: rootrank_watchdog::Classification,
    log_tail: &[String],
) -> Result<(Reason, String), NodeError> {
    Ok(if exit.code == Some(0) {
        (Reason::well_known(reasons::SHUTDOWN), "exited with code 0".to_string())
    } else if c.reason == rootrank_watchdog::reason::PROCESS_EXIT
        && rootrank_core::fatal::is_peer_lost(&log_tail.join("\n"))
    {
        // Nothing outside the process killed it, and its last words say a peer of its
        // collective vanished: a victim (rule 7), whatever its exit status.
        let last = rootrank_core::fatal::exception_line(&log_tail.join("\n")).to_string();
        (Reason::well_known(reasons::PEER_LOST), format!("{last} ({})", c.detail))
    } else {
        (Reason::new(c.reason)?, c.detail)
    })
}

/// Writes the rank's certificate within the report timeout; whether etcd has one for it.
async fn write_certificate(config: &SuperviseConfig, down: &RankDown) -> bool {
    let inc = down.incarnation;
    let mut writer = CertWriter::new(config.etcd.clone(), &config.prefix, config.retention);
    let written = writer
        .write(down, Some(rootrank_store::deadline_after(config.report_timeout)))
        .await;
    match written {
        Written::Yes => info!(incarnation = %inc, reason = %down.reason, "down certificate written"),
        Written::AlreadyThere => info!(incarnation = %inc, "the rank's incarnation already had a certificate; kept it"),
        Written::GaveUp => warn!(incarnation = %inc, "etcd unreachable: down certificate not written"),
        Written::Rejected => warn!(incarnation = %inc, "etcd rejected the down certificate"),
    }
    matches!(written, Written::Yes | Written::AlreadyThere)
}

fn install(sig: i32) -> Result<tokio::signal::unix::Signal, NodeError> {
    signal(SignalKind::from_raw(sig)).map_err(|source| NodeError::Signal { signal: sig, source })
}

/// The status `rootrank run` exits with, as a shell reports it.
pub fn exit_code(exit: ExitInfo) -> u8 {
    match (exit.code, exit.signal) {
        (Some(c), _) => u8::try_from(c.clamp(0, 255)).unwrap_or(255),
        (None, Some(s)) => u8::try_from((128 + s).clamp(0, 255)).unwrap_or(255),
        (None, None) => 255,
    }
}

async fn pass_stderr(mut from: tokio::process::ChildStderr, tail: Arc<Mutex<LogTail>>) {
    let mut out = tokio::io::stderr();
    let mut buf = vec![0u8; 8192];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let chunk = &buf[..n];
                if let Ok(mut t) = tail.lock() {
                    t.feed(chunk);
                }
                // Our stderr going away must not stop the tail being kept.
                let _ = out.write_all(chunk).await;
                let _ = out.flush().await;
            }
        }
    }
}

/// What the live record at the rank's key says about `child`.
enum Lookup {
    /// It names `child` or one of its descendants (mapped to our pid namespace).
    Found(Known),
    /// No record, etcd unreachable, or another process's record (an earlier incarnation's).
    NotOurs,
    /// Its process cannot be verified from here (SPEC section 4): never taken as the child's.
    Unverified { lease: i64, why: String },
}

/// The live record at the rank's key, if it names `child` or one of its descendants. The
/// record's pid is the rank's own (a container's): it is mapped to our namespace and checked
/// by its start time first.
async fn lookup(etcd: &mut Etcd, key: &str, child: u32) -> Lookup {
    let Some(kv) = read_live(etcd, key).await else {
        return Lookup::NotOurs;
    };
    let Ok(live) = RankLive::parse(kv.value()) else {
        return Lookup::NotOurs;
    };
    let Some(record_pid) = live.pid else {
        return Lookup::NotOurs;
    };
    let pid = match crate::pidns::locate(record_pid, live.pid_ns, live.start_ticks) {
        Located::Here { pid, start_ticks } => {
            // A younger process at that pid is not the one that registered. (A pid with no
            // process left is still matched: it may be our child, just reaped.)
            let now = rootrank_agent::procfs::start_ticks(Some(pid));
            if start_ticks.is_some() && now.is_some() && now != start_ticks {
                return Lookup::NotOurs;
            }
            pid
        }
        Located::Mapped { pid, .. } => pid,
        Located::Unverified(why) => return Lookup::Unverified { lease: kv.lease(), why },
    };
    if !crate::host::is_self_or_descendant(pid, child) {
        return Lookup::NotOurs; // an earlier incarnation's record, or a stranger's
    }
    let Ok(incarnation) = live.incarnation_on(kv.lease()) else {
        return Lookup::NotOurs;
    };
    Lookup::Found(Known {
        incarnation,
        pid,
        registered_revision: kv.mod_revision(),
        gpu: live.gpu,
        host: live.host,
        lease_ttl_ms: live.lease_ttl_ms,
        group_size: Some(live.group_size),
        role: live.role,
    })
}

async fn read_live(etcd: &mut Etcd, key: &str) -> Option<rootrank_store::etcd_client::KeyValue> {
    let client = etcd.client().await.ok()?;
    let resp = tokio::time::timeout(Duration::from_secs(1), client.get(key, None))
        .await
        .ok()?
        .ok()?;
    resp.kvs().first().cloned()
}

/// [`lookup`], saying once per incarnation (and counting, `rootrank_unverified_pids_total`)
/// a record whose process cannot be verified.
async fn lookup_noting(etcd: &mut Etcd, key: &str, child: u32, shared: &Shared) -> Option<Known> {
    match lookup(etcd, key, child).await {
        Lookup::Found(k) => Some(k),
        Lookup::NotOurs => None,
        Lookup::Unverified { lease, why } => {
            let mut d = lock(shared);
            if d.unverified.insert(lease) {
                d.unverified_pids.inc();
                warn!(
                    incarnation = lease,
                    rootrank_unverified_pids_total = d.unverified_pids.get(),
                    "cannot verify the process of the rank's live record; not taking it for the child: {why}"
                );
            }
            None
        }
    }
}

/// Waits `agent_grace` for the child's own agent to register; registers for it otherwise,
/// and hands over to the child's agent if it registers later after all.
async fn discover(config: SuperviseConfig, pid: u32, shared: Shared) {
    let key = Keys::new(&config.prefix).live(&config.group, config.rank);
    let mut etcd = Etcd::new(config.etcd.clone());
    let deadline = rootrank_store::deadline_after(config.agent_grace);
    loop {
        if let Some(k) = lookup_noting(&mut etcd, &key, pid, &shared).await {
            info!(incarnation = %k.incarnation, rank_pid = k.pid, "the rank process registered itself");
            lock(&shared).known = Some(k);
            return;
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    info!(
        grace_ms = config.agent_grace.as_millis() as u64,
        "no agent registered for the rank process; registering liveness on its behalf"
    );
    let Some(ours) = register_for_child(&config, pid, &shared, &mut etcd, &key, None).await else {
        return;
    };
    let our_incarnation = ours.incarnation;
    lock(&shared).known = Some(ours);
    // A slow-starting agent in the child registers late and takes the live key over. Its
    // incarnation is then the rank's: stop ours cleanly (a `shutdown` certificate, so our
    // replaced incarnation is never taken for a death).
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let Some(k) = lookup_noting(&mut etcd, &key, pid, &shared).await else {
            continue;
        };
        if k.incarnation == our_incarnation {
            continue;
        }
        info!(incarnation = %k.incarnation, "the rank process's own agent registered; handing liveness over to it");
        let agent = {
            let mut d = lock(&shared);
            d.known = Some(k);
            d.agent.take()
        };
        if let Some(agent) = agent {
            let _ = tokio::task::spawn_blocking(move || agent.shutdown(Duration::from_secs(5))).await;
        }
        return;
    }
}

/// Starts our agent with the child's pid (if not started yet) and waits for its
/// incarnation, up to `limit` (`None`: as long as it takes; the caller may abort us).
async fn register_for_child(
    config: &SuperviseConfig,
    pid: u32,
    shared: &Shared,
    etcd: &mut Etcd,
    key: &str,
    limit: Option<Instant>,
) -> Option<Known> {
    {
        let mut d = lock(shared);
        if d.agent.is_none() {
            let agent = AgentConfig::new(
                config.etcd.endpoints.clone(),
                config.group.as_str(),
                u64::from(config.rank),
                u64::from(config.group_size),
            )
            .map(|mut c| {
                c.etcd = config.etcd.clone();
                c.prefix = config.prefix.clone();
                c.lease_ttl = config.lease_ttl;
                c.retention = config.retention;
                // The child as this supervisor sees it: its pid, namespace and start time,
                // so node-watch can verify it, and the child's own agent takes over.
                c.pid = pid;
                c.pid_ns = rootrank_agent::procfs::pid_ns(Some(pid));
                c.start_ticks = rootrank_agent::procfs::start_ticks(Some(pid));
                c.on_behalf = true;
                c
            })
            .and_then(Agent::start);
            match agent {
                Ok(a) => d.agent = Some(a),
                Err(e) => {
                    warn!(error = %e, "could not start an agent for the rank process");
                    return None;
                }
            }
        }
    }
    let incarnation = loop {
        let (registered, refused) = {
            let d = lock(shared);
            let a = d.agent.as_ref();
            (
                a.and_then(Agent::incarnation),
                a.is_some_and(|a| a.registration_refused().is_some()),
            )
        };
        if let Some(i) = registered {
            break i;
        }
        if refused {
            // The key is held: by the rank's own agent (it registered after our grace, as
            // we started ours), or by a stranger, which our agent reported.
            if let Some(k) = lookup_noting(etcd, key, pid, shared).await {
                info!(incarnation = %k.incarnation, "the rank process registered itself first; not registering on its behalf");
                drop_agent(shared, true).await;
                return Some(k);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if limit.is_some_and(|l| Instant::now() >= l) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    info!(%incarnation, "registered on the rank process's behalf");
    // The registration revision, for the verdict's "re-registered before" rule.
    let found = match lookup(etcd, key, pid).await {
        Lookup::Found(k) if k.incarnation == incarnation => Some(k),
        _ => None,
    };
    Some(Known {
        incarnation,
        pid,
        registered_revision: found.as_ref().map_or(0, |k| k.registered_revision),
        gpu: None,
        lease_ttl_ms: found.as_ref().and_then(|k| k.lease_ttl_ms),
        group_size: found.as_ref().and_then(|k| k.group_size),
        role: found.as_ref().and_then(|k| k.role.clone()),
        host: found.and_then(|k| k.host),
    })
}

/// The incarnation to certify: the live key as it is now (its agent may have re-registered),
/// else the last one seen, else our agent's, else a fresh one for a process that died
/// before anything registered (a certificate needs an incarnation).
async fn resolve_incarnation(config: &SuperviseConfig, pid: u32, shared: &Shared) -> Option<Known> {
    let key = Keys::new(&config.prefix).live(&config.group, config.rank);
    let mut etcd = Etcd::new(config.etcd.clone());
    let (before, have_agent) = {
        let d = lock(shared);
        (d.known.clone(), d.agent.is_some())
    };
    // Unverified now is no news: the rank may have taken its pid namespace along.
    if let Lookup::Found(now) = lookup(&mut etcd, &key, pid).await {
        return Some(now);
    }
    if before.is_some() {
        return before;
    }
    let limit = rootrank_store::deadline_after(config.report_timeout);
    if have_agent {
        return register_for_child(config, pid, shared, &mut etcd, &key, Some(limit)).await;
    }
    mint_incarnation(config, pid, &mut etcd, limit).await
}

/// An incarnation for a process that is already dead: a lease that never carries a live
/// key. Writing a live record for a dead pid would only make a node watchdog report it too
/// (without the exit status and the tail), and race this certificate.
async fn mint_incarnation(config: &SuperviseConfig, pid: u32, etcd: &mut Etcd, limit: Instant) -> Option<Known> {
    let ttl = config.lease_ttl.as_secs().max(1) as i64;
    let mut backoff = rootrank_store::Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
    loop {
        if let Ok(c) = etcd.client().await {
            if let Ok(resp) = c.lease_grant(ttl, None).await {
                let revision = resp.header().map_or(0, |h| h.revision());
                let incarnation = Incarnation::new(resp.id()).ok()?;
                info!(%incarnation, "the rank process ended before anything registered it; certifying a fresh incarnation");
                return Some(Known {
                    incarnation,
                    pid,
                    registered_revision: revision,
                    gpu: None,
                    host: crate::HostIdentity::current().map(|h| h.hostname),
                    // Nothing registered: no live record to say.
                    lease_ttl_ms: None,
                    group_size: None,
                    role: None,
                });
            }
        }
        let pause = backoff.next_pause();
        if rootrank_store::deadline_after(pause) > limit {
            return None;
        }
        tokio::time::sleep(pause).await;
    }
}

/// Stops our agent, if any: a clean stop (revoking the lease) when the death is certified.
async fn drop_agent(shared: &Shared, clean: bool) {
    let Some(agent) = lock(shared).agent.take() else {
        return;
    };
    // Both block briefly on the agent's thread: keep that off the runtime's workers.
    let _ = tokio::task::spawn_blocking(move || {
        if clean {
            agent.shutdown(Duration::from_secs(5));
        } else {
            drop(agent);
        }
    })
    .await;
}
