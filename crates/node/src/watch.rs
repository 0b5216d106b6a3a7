//! `rootrank node-watch`: one per host. Learns the ranks of this host from their live
//! records, watches each process with a pidfd, and when one exits writes a `source:
//! watchdog` down certificate for its incarnation within milliseconds.
//!
//! A death is reported once per incarnation: incarnations that already have a certificate
//! (in etcd, or written by this process) are neither watched nor reported, and
//! `put_certificate` is create-if-absent on top of that, so a restarted watchdog or a
//! replayed watch cannot write twice.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rootrank_core::records::{DownSource, ExitInfo as CoreExit, RankDown, SCHEMA_VERSION};
use rootrank_core::{time, GroupId, Rank, Reason};
use rootrank_watchdog::{ExitObserved, KernelLog, PidWatch, ProcessExit, ProcessWatcher};
use tokio::sync::mpsc;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::certs::{CertWriter, Written};
use crate::host::{self, HostIdentity};
use crate::metrics::{self, NodeMetrics};
use crate::pidns::{self, Located};
use crate::sync::{self, IncarnationId, LiveKv, SyncMsg, WatchScope};
use crate::NodeError;
use rootrank_store::EtcdAccess;

/// How `rootrank node-watch` runs.
#[derive(Clone, Debug)]
pub struct NodeWatchConfig {
    /// etcd's endpoints and credentials ([`NodeWatchConfig::new`]: plain).
    pub etcd: EtcdAccess,
    pub prefix: String,
    /// How long certificates are kept (default 600 s, as the agent's records).
    pub retention: Duration,
    /// How long a rank under `rootrank run` is left to its supervisor, which knows the exit
    /// status and the stderr tail, before the watchdog reports it itself (default 2 s).
    pub supervisor_grace: Duration,
    /// This host; `None`: read it from /proc.
    pub host: Option<HostIdentity>,
    /// The kernel log device (`None`: /dev/kmsg; another path for a bind mount).
    pub kernel_log: Option<std::path::PathBuf>,
    /// Where to serve `GET /metrics` (`None`: nowhere, the default).
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// v3: the `py-spy` executable that reads a stalled rank's Python stack into its stall
    /// record (`None`: stacks are not captured).
    pub py_spy: Option<std::path::PathBuf>,
    /// What it watches: its host's ranks (default) or the whole fleet's `groups/`.
    pub watch_scope: WatchScope,
    /// v5: hold one lease for the host and move each rank it watches onto it (`None`, the
    /// default: every rank keeps its own lease). See `host_lease.rs`.
    pub host_lease_ttl: Option<Duration>,
}

impl NodeWatchConfig {
    pub fn new(endpoints: Vec<String>) -> Self {
        NodeWatchConfig {
            etcd: EtcdAccess::plain(endpoints),
            prefix: "/rootrank/v1".to_string(),
            retention: Duration::from_secs(600),
            supervisor_grace: Duration::from_secs(2),
            host: None,
            kernel_log: None,
            metrics_listen: None,
            py_spy: None,
            watch_scope: WatchScope::Host,
            host_lease_ttl: None,
        }
    }
}

type WatchKey = (GroupId, Rank);

/// One watched rank process.
#[derive(Clone, Debug)]
struct Watched {
    id: IncarnationId,
    /// The lease its live key rides on: the incarnation's, or a host lease (v5).
    lease: i64,
    pid: u32,
    registered_revision: i64,
    gpu: Option<String>,
    host: Option<String>,
    lease_ttl_ms: Option<u64>,
    group_size: u32,
    role: Option<String>,
    /// Added from the first snapshot: an exit found at once means the rank died while no
    /// watchdog was looking.
    at_start: bool,
    /// The `rootrank run` supervisor above the process (its parent or a few levels up),
    /// read when the watch starts: once the child is reaped, /proc no longer says.
    supervisor: Option<u32>,
}

/// A death ready to be written.
struct Report {
    down: RankDown,
    /// When the exit was noticed, to log how long reporting took.
    noticed_at: Instant,
}

/// Runs the watchdog until `shutdown` resolves.
pub async fn run(config: NodeWatchConfig, shutdown: impl Future<Output = ()>) -> Result<(), NodeError> {
    if config.etcd.endpoints.is_empty() {
        return Err(rootrank_store::StoreError::NoEndpoints.into());
    }
    // A refusal (TLS, auth, a role that cannot read the prefix or write a certificate) needs
    // an operator: stop now. An etcd that is only down is waited for, as ever.
    match rootrank_store::connect_checked(&config.etcd, &config.prefix).await {
        Err(e) if e.refusal().is_some() => return Err(e.into()),
        Err(e) => warn!(error = %e, "etcd is not answering yet; watching once it does"),
        Ok(_) => {}
    }
    let me = match config.host.clone().or_else(HostIdentity::current) {
        Some(h) => h,
        None => {
            return Err(NodeError::Config(
                "cannot read this host's name from /proc/sys/kernel/hostname".into(),
            ))
        }
    };
    // Bound before anything else starts: a taken address is a start-up error. The server is
    // a task of its own; the loop below never waits for it.
    let metrics = NodeMetrics::new()?;
    let watch_events = metrics.watch_events()?;
    let _metrics_server = metrics::serve_if(config.metrics_listen, &metrics).await?;
    info!(host = %me.hostname, boot_id = me.boot_id.as_deref().unwrap_or("-"), "node watchdog starting");
    // Said once, here, when the kernel log cannot be read; deaths are still reported, from
    // the cgroup counters and what the pidfd says.
    let kernel = Arc::new(match &config.kernel_log {
        None => KernelLog::open_or_unavailable(),
        Some(path) => KernelLog::open_path(path).unwrap_or_else(|e| {
            warn!(error = %e, path = %path.display(), "kernel log unavailable; continuing without it");
            KernelLog::unavailable()
        }),
    });

    let (sync_tx, mut sync_rx) = mpsc::unbounded_channel();
    let sync_task = tokio::spawn(sync::run(
        config.etcd.clone(),
        config.prefix.clone(),
        me.hostname.clone(),
        config.watch_scope,
        watch_events,
        sync_tx,
    ));

    let (report_tx, report_rx) = mpsc::unbounded_channel::<Report>();
    let (written_tx, mut written_rx) = mpsc::unbounded_channel::<IncarnationId>();
    let writer = tokio::spawn(write_reports(
        CertWriter::new(config.etcd.clone(), &config.prefix, config.retention),
        report_rx,
        written_tx,
    ));

    let (lease_tx, mut lease_rx) = mpsc::unbounded_channel();
    let lease_task = config
        .host_lease_ttl
        .map(|ttl| tokio::spawn(crate::host_lease::keep(config.etcd.clone(), ttl, lease_tx)));

    let (watcher, mut exits) = ProcessWatcher::<WatchKey>::new();
    let mut state = State {
        me,
        config,
        kernel,
        watcher,
        watched: HashMap::new(),
        certified: HashSet::new(),
        reported: HashSet::new(),
        loaded: false,
        report_tx,
        warned_no_pid: HashSet::new(),
        unverified: HashSet::new(),
        unverified_pids: metrics.unverified_pids.clone(),
        host_lease: None,
        on_host_lease: HashMap::new(),
        stopped_since: HashMap::new(),
    };
    // v5: a rank on the host lease that is stopped (SIGSTOP) keeps no lease of its own from
    // running out; checked every second (a read of /proc per watched rank).
    let mut frozen_check = tokio::time::interval(Duration::from_secs(1));
    frozen_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            // Deaths first: they are what this process is for.
            biased;
            Some(exit) = exits.recv() => state.on_exit(exit),
            Some(msg) = sync_rx.recv() => state.on_sync(msg),
            Some(id) = written_rx.recv() => state.on_written(id),
            Some(l) = lease_rx.recv() => state.on_host_lease(l),
            _ = frozen_check.tick(), if state.config.host_lease_ttl.is_some() => state.check_frozen(),
            () = &mut shutdown => break,
        }
    }
    info!(
        rootrank_unverified_pids_total = state.unverified_pids.get(),
        "node watchdog stopping"
    );
    sync_task.abort();
    writer.abort();
    if let Some(t) = lease_task {
        // Its lease then runs out: the ranks register again on their own (host_lease.rs).
        t.abort();
    }
    Ok(())
}

struct State {
    me: HostIdentity,
    config: NodeWatchConfig,
    kernel: Arc<KernelLog>,
    watcher: ProcessWatcher<WatchKey>,
    watched: HashMap<WatchKey, Watched>,
    /// Incarnations with a certificate in etcd.
    certified: HashSet<IncarnationId>,
    /// Incarnations this process reported (written or still being written).
    reported: HashSet<IncarnationId>,
    loaded: bool,
    report_tx: mpsc::UnboundedSender<Report>,
    warned_no_pid: HashSet<WatchKey>,
    /// Incarnations whose process could not be verified (said and counted once each).
    unverified: HashSet<IncarnationId>,
    /// `rootrank_unverified_pids_total` (SPEC section 8): served with `--metrics-listen`,
    /// and carried in the log lines either way.
    unverified_pids: prometheus::IntCounter,
    /// v5: the host lease held now, and its TTL (ms).
    host_lease: Option<(i64, u64)>,
    /// Reported deaths whose keys ride on a host lease: deleted from it once certified.
    on_host_lease: HashMap<IncarnationId, i64>,
    /// Ranks on the host lease whose process is stopped, since when (`None`: dealt with).
    stopped_since: HashMap<WatchKey, Option<Instant>>,
}

impl State {
    fn done(&self, id: &IncarnationId) -> bool {
        self.certified.contains(id) || self.reported.contains(id)
    }

    fn unwatch(&mut self, key: &WatchKey) {
        if self.watched.remove(key).is_some() {
            self.watcher.remove(key);
        }
    }

    fn on_sync(&mut self, msg: SyncMsg) {
        match msg {
            SyncMsg::Snapshot {
                lives,
                certified,
                stalls,
                revision,
            } => {
                let at_start = !self.loaded;
                self.loaded = true;
                self.certified = certified;
                // After a reload, drop watches whose incarnation is no longer live.
                let present: HashSet<IncarnationId> = lives
                    .iter()
                    .filter_map(|l| Some((l.group.clone(), l.rank, l.record.incarnation_on(l.lease).ok()?)))
                    .collect();
                let stale: Vec<WatchKey> = self
                    .watched
                    .iter()
                    .filter(|(_, w)| !present.contains(&w.id) || self.certified.contains(&w.id))
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in stale {
                    self.unwatch(&k);
                }
                self.unverified.retain(|u| present.contains(u));
                debug!(revision, "snapshot applied");
                for l in lives {
                    self.consider(l, at_start);
                }
                for s in stalls {
                    self.on_stall(s);
                }
            }
            SyncMsg::Live(l) => self.consider(*l, false),
            SyncMsg::Stall(s) => self.on_stall(*s),
            SyncMsg::LiveGone { group, rank } => {
                // Forgotten with its live key (bounded memory). Events come in revision order,
                // so the key that vanished held the incarnation seen last.
                self.unverified.retain(|u| !(u.0 == group && u.1 == rank));
                let key = (group, rank);
                if self.watched.contains_key(&key) {
                    // Lease expired or revoked: that incarnation is over either way (its
                    // death, if any, is the coordinator's or already ours).
                    self.unwatch(&key);
                }
            }
            SyncMsg::Certified(id) => {
                let key = (id.0.clone(), id.1);
                if self.watched.get(&key).is_some_and(|w| w.id == id) {
                    // The rank (e.g. its agent at a clean shutdown) or its supervisor said
                    // it first; nothing left for us to add.
                    self.unwatch(&key);
                }
                self.certified.insert(id);
            }
            SyncMsg::CertificateGone(id) => {
                self.certified.remove(&id);
                self.reported.remove(&id);
            }
        }
    }

    /// A rank of this host stalled: read its Python stack (py-spy, a short pause of the
    /// process) on a task of its own and add it to the same stall record.
    fn on_stall(&mut self, s: crate::sync::StallKv) {
        let Some(py_spy) = self.config.py_spy.clone() else {
            return;
        };
        let key = (s.record.group.clone(), s.record.rank);
        let Some(w) = self.watched.get(&key).filter(|w| w.id.2 == s.record.incarnation) else {
            return; // not a process of this host that node-watch verified
        };
        tokio::spawn(crate::stack::attach(py_spy, w.pid, s, self.config.etcd.clone()));
    }

    fn consider(&mut self, l: LiveKv, at_start: bool) {
        let key = (l.group.clone(), l.rank);
        if !self.me.is_local(&l.record) {
            // A rank that moved to another host is no longer ours to watch.
            self.unwatch(&key);
            return;
        }
        let Ok(incarnation) = l.record.incarnation_on(l.lease) else {
            debug!(group = %l.group, rank = l.rank, "live key without a lease; not a rank incarnation");
            return;
        };
        let id = (l.group.clone(), l.rank, incarnation);
        if let Some(w) = self.watched.get_mut(&key).filter(|w| w.id == id) {
            // The same incarnation re-published its record, or moved to a host lease.
            w.lease = l.lease;
            self.adopt(&key);
            return;
        }
        if self.done(&id) {
            self.unwatch(&key);
            return;
        }
        let Some(record_pid) = l.record.pid else {
            if self.warned_no_pid.insert(key.clone()) {
                warn!(group = %l.group, rank = l.rank, "live record has no pid; cannot watch this rank");
            }
            return;
        };
        // The record's pid is the rank's own (a container's); act only on the process it maps
        // to here, verified by its start time.
        let (pid, start_ticks) = match pidns::locate(record_pid, l.record.pid_ns, l.record.start_ticks) {
            Located::Here { pid, start_ticks } => (pid, start_ticks),
            Located::Mapped { pid, start_ticks } => (pid, Some(start_ticks)),
            Located::Unverified(why) => {
                // Neither watched nor certified: if the rank is really gone, its lease runs
                // out and the coordinator persists that death.
                self.unwatch(&key);
                if self.unverified.insert(id.clone()) {
                    self.unverified_pids.inc();
                    warn!(
                        group = %l.group,
                        rank = l.rank,
                        pid = record_pid,
                        incarnation = %incarnation,
                        rootrank_unverified_pids_total = self.unverified_pids.get(),
                        "cannot verify this rank's process; not watching it: {why}"
                    );
                }
                return;
            }
        };
        let w = Watched {
            id,
            lease: l.lease,
            pid,
            registered_revision: l.mod_revision,
            gpu: l.record.gpu.clone(),
            host: l.record.host.clone(),
            lease_ttl_ms: l.record.lease_ttl_ms,
            group_size: l.record.group_size,
            role: l.record.role.clone(),
            at_start,
            supervisor: host::supervisor_of(pid),
        };
        // A new incarnation of the same rank replaces the watch on the old one.
        self.unwatch(&key);
        if start_ticks.is_none() && host::pid_reused_since(pid, l.record.started_at.as_deref()) {
            warn!(group = %l.group, rank = l.rank, pid, "pid now belongs to a process that started after the rank registered; the rank is gone");
            let exit = ProcessExit {
                key: key.clone(),
                pid,
                exit: None,
                observed: ExitObserved::PidReused,
                watched_since: Instant::now(),
                noticed_at: Instant::now(),
                start_time: None,
                cgroup_oom: None,
            };
            self.report(w, exit);
            return;
        }
        self.watched.insert(key.clone(), w);
        // With the record's start time, a pid now held by a younger process is reported as
        // the rank gone (it is a pid of our namespace, or was just verified in the rank's).
        let added = match start_ticks {
            Some(t) => self.watcher.add_with_start_time(key.clone(), pid, t),
            None => self.watcher.add(key.clone(), pid),
        };
        match added {
            Ok(()) => {
                info!(
                    group = %l.group,
                    rank = l.rank,
                    pid,
                    record_pid,
                    incarnation = %incarnation,
                    "watching {}/{} pid {pid} incarnation {incarnation}",
                    l.group,
                    l.rank
                );
                // Only a rank whose process is watched rides on the host lease: its death
                // is then certified here, in milliseconds.
                self.adopt(&key);
            }
            Err(e) => {
                self.watched.remove(&key);
                warn!(group = %l.group, rank = l.rank, pid, error = %e, "cannot watch this rank's process (node-watch needs the host pid namespace and permission to open pidfds)");
            }
        }
    }

    /// A certificate for `id` is in etcd (ours, or one written first): a dead rank on the host
    /// lease has its keys deleted from it, since no lease of its own runs out for it.
    fn on_written(&mut self, id: IncarnationId) {
        if let Some(lease) = self.on_host_lease.remove(&id) {
            self.release(id.clone(), lease);
        }
        self.certified.insert(id);
    }

    /// Deletes the keys of the rank incarnation `id` from the host lease `lease`, on a task.
    fn release(&self, id: IncarnationId, lease: i64) {
        tokio::spawn(crate::host_lease::release_logged(
            self.config.etcd.clone(),
            rootrank_core::Keys::new(&self.config.prefix),
            self.me.hostname.clone(),
            id,
            lease,
        ));
    }

    fn on_host_lease(&mut self, l: crate::host_lease::HostLease) {
        match l {
            crate::host_lease::HostLease::Granted { lease, ttl_ms } => {
                self.host_lease = Some((lease, ttl_ms));
                let keys: Vec<WatchKey> = self.watched.keys().cloned().collect();
                for k in keys {
                    self.adopt(&k);
                }
            }
            crate::host_lease::HostLease::Lost => self.host_lease = None,
        }
    }

    /// A rank process stopped (SIGSTOP, a tracer) for longer than the host lease's TTL has its
    /// live key deleted, as its own lease would have run out: the coordinator holds the vanished
    /// key (TTL + 3 s) and certifies it `lease_expired`, or `lease_lost` if it resumes and
    /// registers again meanwhile, exactly as with a lease per rank.
    fn check_frozen(&mut self) {
        let Some((host_lease, ttl_ms)) = self.host_lease else {
            self.stopped_since.clear();
            return;
        };
        let on_lease: Vec<(WatchKey, IncarnationId, u32)> = self
            .watched
            .iter()
            .filter(|(_, w)| w.lease == host_lease)
            .map(|(k, w)| (k.clone(), w.id.clone(), w.pid))
            .collect();
        self.stopped_since
            .retain(|k, _| on_lease.iter().any(|(o, _, _)| o == k));
        for (key, id, pid) in on_lease {
            if !host::is_stopped(pid) {
                self.stopped_since.remove(&key);
                continue;
            }
            let since = self
                .stopped_since
                .entry(key.clone())
                .or_insert_with(|| Some(Instant::now()));
            let Some(at) = *since else { continue };
            if at.elapsed() < Duration::from_millis(ttl_ms) {
                continue;
            }
            *since = None;
            warn!(group = %id.0, rank = id.1, pid, incarnation = %id.2, "rank process stopped for longer than the host lease's TTL; deleting its live key, as its own lease would have run out");
            self.release(id, host_lease);
        }
    }

    /// Moves a watched rank onto the host lease, if there is one and it is not on it yet.
    fn adopt(&mut self, key: &WatchKey) {
        let (Some(host_lease), Some(w)) = (self.host_lease, self.watched.get(key)) else {
            return;
        };
        if w.lease == host_lease.0 {
            return;
        }
        let (group, rank, from) = (w.id.0.clone(), w.id.1, w.lease);
        let etcd = self.config.etcd.clone();
        let keys = rootrank_core::Keys::new(&self.config.prefix);
        let host = self.me.hostname.clone();
        tokio::spawn(async move {
            let mut etcd = crate::certs::Etcd::new(etcd);
            let mut backoff = rootrank_store::Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
            for _ in 0..5 {
                match crate::host_lease::adopt(&mut etcd, &keys, &host, &group, rank, from, host_lease).await {
                    Ok(true) => {
                        info!(%group, rank, host_lease = host_lease.0, "rank moved to the host lease");
                        return;
                    }
                    Ok(false) => debug!(%group, rank, "rank's keys changed or moved meanwhile; reading again"),
                    Err(e) => debug!(%group, rank, error = %e, "could not move the rank to the host lease yet"),
                }
                tokio::time::sleep(backoff.next_pause()).await;
            }
        });
    }

    fn on_exit(&mut self, exit: ProcessExit<WatchKey>) {
        // Only the watch currently held for the key may report (a replaced one is stale).
        if self.watched.get(&exit.key).is_none_or(|w| w.pid != exit.pid) {
            return;
        }
        if let Some(w) = self.watched.remove(&exit.key) {
            self.report(w, exit);
        }
    }

    fn report(&mut self, w: Watched, exit: ProcessExit<WatchKey>) {
        if self.done(&w.id) {
            return;
        }
        self.reported.insert(w.id.clone());
        if w.lease != w.id.2.lease_id() {
            self.on_host_lease.insert(w.id.clone(), w.lease);
        }
        let kernel = Arc::clone(&self.kernel);
        let tx = self.report_tx.clone();
        let grace = self.config.supervisor_grace;
        let supervisor = w.supervisor.filter(|_| exit.observed == ExitObserved::Exited);
        let span = info_span!("death", group = %w.id.0, rank = w.id.1, incarnation = %w.id.2, pid = w.pid);
        tokio::spawn(
            async move {
                let c = rootrank_watchdog::diagnose(&exit, &kernel, w.gpu.as_deref()).await;
                let detail = if w.at_start && exit.observed == ExitObserved::AlreadyGone {
                    "process was already gone when the watchdog started (status unknown)".to_string()
                } else {
                    c.detail
                };
                if let Some(sup) = supervisor {
                    wait_for_supervisor(sup, grace).await;
                }
                let Ok(reason) = Reason::new(c.reason) else {
                    return;
                };
                let down = RankDown {
                    v: SCHEMA_VERSION,
                    group: w.id.0.clone(),
                    rank: w.id.1,
                    incarnation: w.id.2,
                    reason,
                    detail,
                    source: DownSource::Watchdog,
                    at: Some(time::format_ms(rootrank_store::unix_ms())),
                    exit: exit.exit.map(|x| CoreExit {
                        code: x.code,
                        signal: x.signal,
                    }),
                    log_tail: None,
                    host: w.host.clone(),
                    pid: Some(w.pid),
                    observed_revision: None,
                    registered_revision: Some(w.registered_revision).filter(|r| *r > 0),
                    lease_ttl_ms: w.lease_ttl_ms,
                    group_size: Some(w.group_size),
                    role: w.role.clone(),
                };
                let _ = tx.send(Report {
                    down,
                    noticed_at: exit.noticed_at,
                });
            }
            .instrument(span),
        );
    }
}

/// Gives a `rootrank run` supervisor the first word on its child's death, until it exits or
/// `grace` passes. Its certificate then stands and ours is a create-if-absent no-op.
async fn wait_for_supervisor(pid: u32, grace: Duration) {
    match PidWatch::open(pid) {
        Ok(w) => {
            if tokio::time::timeout(grace, w.exited()).await.is_err() {
                debug!(supervisor = pid, "supervisor still running after the grace; reporting");
            }
        }
        Err(e) => debug!(supervisor = pid, error = %e, "supervisor already gone"),
    }
}

/// Writes reports in order, each until etcd takes it (a death seen while etcd is down is
/// written when it is back), and says which incarnations are now certified.
async fn write_reports(
    mut writer: CertWriter,
    mut rx: mpsc::UnboundedReceiver<Report>,
    written: mpsc::UnboundedSender<IncarnationId>,
) {
    writer.warm_up().await;
    while let Some(Report { down, noticed_at }) = rx.recv().await {
        let span = info_span!("certificate", group = %down.group, rank = down.rank, incarnation = %down.incarnation);
        let outcome = writer.write(&down, None).instrument(span.clone()).await;
        span.in_scope(|| match outcome {
            Written::Yes => info!(
                reason = %down.reason,
                detail = %down.detail,
                pid = down.pid.unwrap_or(0),
                since_exit_us = noticed_at.elapsed().as_micros() as u64,
                "down certificate written"
            ),
            Written::AlreadyThere => info!("incarnation already had a certificate; kept it"),
            Written::GaveUp => warn!("down certificate not written"),
            Written::Rejected => warn!("etcd rejected the down certificate"),
        });
        let _ = written.send((down.group.clone(), down.rank, down.incarnation));
    }
}
