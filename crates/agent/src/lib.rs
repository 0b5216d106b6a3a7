//! The rank-side agent, embedded in each rank process.
//!
//! It registers the rank's live key on a liveness lease and keeps it alive, publishes room
//! failure records and down certificates, and never blocks or crashes its host:
//!
//! - Every call from the host only validates and enqueues (a bounded queue; when it is full
//!   the record is dropped and counted, the host is never made to wait).
//! - All etcd work runs on the agent's own OS thread with its own runtime, so a host that
//!   saturates its threads (or holds a GIL) cannot starve the keepalive.
//! - Records ride on rotating retention leases ([`rootrank_store::RetentionLeases`]), never on
//!   the liveness lease, so they outlive a killed rank by the retention window.
//! - etcd errors are retried with backoff; a record stays at the head of the queue until it
//!   is written, so an etcd restart loses nothing that fit in the queue.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
pub mod exited;
mod own_key;
pub mod procfs;
pub mod script;
pub mod stall;
mod worker;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rootrank_core::ids::check_rank;
use rootrank_core::records::{truncate_utf8, MAX_DETAIL_BYTES};
use rootrank_core::{GroupId, IdError, Incarnation, Origin, Peer, Rank, Reason, RoomId};
use tokio::sync::{mpsc, oneshot};

pub use rootrank_store::{EtcdAccess, EtcdCredentialFiles};

/// The agent's version string, as published in RankLive.agent.
pub const AGENT_VERSION: &str = concat!("rootrank-agent/", env!("CARGO_PKG_VERSION"));

/// What went wrong, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Invalid(#[from] IdError),
    #[error("invalid agent config: {0}")]
    Config(String),
    #[error("the agent's queue is full ({capacity} records waiting for etcd): this record was dropped and counted; check etcd health")]
    QueueFull { capacity: usize },
    #[error("the agent has stopped; records can no longer be published")]
    Stopped,
    #[error("could not start the agent thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("etcd: {0}; check that etcd is reachable at the configured endpoints")]
    Etcd(String),
}

/// How an agent is set up. [`AgentConfig::new`] fills the defaults of SPEC section 4.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// etcd's endpoints and the credentials it asks for ([`AgentConfig::new`]: plain).
    pub etcd: EtcdAccess,
    pub prefix: String,
    pub group: GroupId,
    pub rank: Rank,
    pub group_size: u32,
    pub role: Option<String>,
    /// Liveness lease TTL (default 5 s), kept alive every TTL/3.
    pub lease_ttl: Duration,
    /// How long records outlive their writer (default 600 s).
    pub retention: Duration,
    /// Records waiting for etcd before new ones are dropped (default 10,000).
    pub queue_capacity: usize,
    /// The most queued records written in one etcd transaction (default and maximum
    /// [`rootrank_store::MAX_BATCH_RECORDS`]; 1 writes one record per request). Records are
    /// batched only when more than one waits, so a lone record is never delayed.
    pub max_batch: usize,
    /// The rank process's pid, as that process sees it (in its own pid namespace).
    pub pid: u32,
    /// The inode of `pid`'s pid namespace and its start time (SPEC section 4), so node-watch
    /// and the supervisor can map `pid` to their namespace and check it is the same process.
    /// [`AgentConfig::new`] reads them for this process; whoever sets `pid` to another
    /// process sets these for it too.
    pub pid_ns: Option<u64>,
    pub start_ticks: Option<u64>,
    /// Registers for another process (`rootrank run` for its child, whose pid is `pid`): the
    /// live record says so in `agent`, and that process's own agent, when it registers,
    /// takes the live key over instead of being refused as a second claimant.
    pub on_behalf: bool,
    pub host: Option<String>,
    pub nixl_agent: Option<String>,
    pub gpu: Option<String>,
    /// Addresses by which transfer peers know this rank or its instance (`RankLive.endpoints`,
    /// e.g. a prefill's bootstrap `host:port` as decode reaches it): a peer's record naming
    /// only that address leads to this rank's group.
    pub advertised: Vec<String>,
    /// v3: how long the host's loop may go without [`Agent::progress`] before the agent
    /// thread writes a `RankStall` record (default 10 s). Armed by the first progress.
    pub stall_after: Duration,
    /// Where the agent thread's logs go. `None` uses the process's global `tracing`
    /// subscriber; a host that has none of its own (a Python rank) passes one here, so the
    /// agent never installs a process-wide subscriber in someone else's process.
    pub log: Option<tracing::Dispatch>,
}

impl AgentConfig {
    pub fn new(endpoints: Vec<String>, group: &str, rank: u64, group_size: u64) -> Result<Self, AgentError> {
        let group = GroupId::new(group)?;
        let (rank, group_size) = check_rank(rank, group_size)?;
        Ok(AgentConfig {
            etcd: EtcdAccess::plain(endpoints),
            prefix: "/rootrank/v1".to_string(),
            group,
            rank,
            group_size,
            role: None,
            lease_ttl: Duration::from_secs(5),
            retention: Duration::from_secs(600),
            queue_capacity: 10_000,
            max_batch: rootrank_store::MAX_BATCH_RECORDS,
            pid: std::process::id(),
            pid_ns: procfs::pid_ns(None),
            start_ticks: procfs::start_ticks(None),
            on_behalf: false,
            host: read_trimmed("/proc/sys/kernel/hostname"),
            nixl_agent: None,
            gpu: None,
            advertised: Vec::new(),
            stall_after: Duration::from_secs(10),
            log: None,
        })
    }

    fn check(&self) -> Result<(), AgentError> {
        if self.etcd.endpoints.is_empty() {
            return Err(AgentError::Config(
                "no etcd endpoints (set ROOTRANK_ETCD_ENDPOINTS)".into(),
            ));
        }
        if self.lease_ttl < Duration::from_secs(1) || self.lease_ttl > Duration::from_secs(3600) {
            return Err(AgentError::Config(format!(
                "lease_ttl {:?} outside 1 s..=1 h (etcd grants leases in whole seconds)",
                self.lease_ttl
            )));
        }
        if self.retention < Duration::from_secs(1) {
            return Err(AgentError::Config("retention must be at least 1 s".into()));
        }
        if self.max_batch == 0 || self.max_batch > rootrank_store::MAX_BATCH_RECORDS {
            return Err(AgentError::Config(format!(
                "max_batch {} outside 1..={}",
                self.max_batch,
                rootrank_store::MAX_BATCH_RECORDS
            )));
        }
        if self.stall_after < Duration::from_millis(100) || self.stall_after > Duration::from_secs(86_400) {
            return Err(AgentError::Config(format!(
                "stall_after {:?} outside 100 ms..=24 h",
                self.stall_after
            )));
        }
        if self.queue_capacity == 0 {
            return Err(AgentError::Config("queue_capacity must be at least 1".into()));
        }
        Ok(())
    }
}

pub(crate) fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// One room failure, validated, waiting for etcd.
#[derive(Debug)]
pub(crate) struct PendingFailure {
    pub room: RoomId,
    pub origin: Origin,
    pub reason: Reason,
    pub detail: String,
    pub peer: Option<Peer>,
    pub at_ms: i64,
}

#[derive(Debug)]
pub(crate) enum Command {
    Failure(PendingFailure),
    Down {
        reason: Reason,
        detail: String,
        log_tail: Option<Vec<String>>,
        at_ms: i64,
    },
    /// A key to keep on the liveness lease (re-put after every re-registration).
    Attach {
        suffix: String,
        value: Vec<u8>,
    },
    Flush(oneshot::Sender<()>),
    Shutdown {
        clean: bool,
        done: oneshot::Sender<()>,
    },
}

/// Counters the host can read (and export).
#[derive(Debug, Default)]
pub struct AgentStats {
    pub published: AtomicU64,
    /// Dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Dropped because etcd refused them for good (or they could not be encoded).
    pub rejected: AtomicU64,
    /// Record writes retried (etcd down, slow or refusing).
    pub retries: std::sync::Arc<AtomicU64>,
    pub registrations: AtomicU64,
    /// Registration attempts that failed and are retried (etcd down, or refusing writes).
    pub registration_retries: AtomicU64,
}

#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub stats: AgentStats,
    pub incarnation: AtomicI64,
    /// The lease the live key rides on now: the incarnation's own, or its host's once
    /// `node-watch --host-lease-ttl-ms` moved it there (v5). Stall records and attachments
    /// go on this one.
    pub liveness_lease: AtomicI64,
    pub registered: (Mutex<bool>, Condvar),
    /// Why the live key could not be created (another incarnation holds it), while that
    /// lasts; `None` once registered.
    pub refused: Mutex<Option<String>>,
    /// Why etcd refuses this agent (TLS, auth, a role without a key it writes), while it does.
    pub etcd_refused: Mutex<Option<String>>,
    /// A clean shutdown was asked for: ends the wait for a first connection to etcd (the
    /// queue is only read once connected, and a refused agent may never connect).
    pub shutdown_asked: tokio::sync::Notify,
    /// The host's loop iterations ([`Agent::progress`]), read by the stall watch.
    pub progress: AtomicU64,
    /// When the last one happened ([`stall::monotonic_ms`]): the stall watch wakes only every
    /// quarter of `stall_after`, and the order of a group's stall records must be the order
    /// in which its ranks stopped, to the millisecond, not to the watch's step.
    pub progress_at_ms: AtomicU64,
    /// Set by a clean shutdown before it revokes the lease: the liveness loop must not take
    /// the revoked lease for a lost one and register a new incarnation on the way out.
    pub stopping: AtomicBool,
}

impl Shared {
    pub(crate) fn set_refused(&self, why: Option<String>) {
        let refused = why.is_some();
        if let Ok(mut r) = self.refused.lock() {
            *r = why;
        }
        if refused {
            // A host waiting for the registration learns at once that it will not come soon.
            let (lock, cv) = &self.registered;
            if let Ok(_g) = lock.lock() {
                cv.notify_all();
            }
        }
    }

    pub(crate) fn is_refused(&self) -> bool {
        self.refused.lock().is_ok_and(|r| r.is_some()) || self.etcd_refused.lock().is_ok_and(|r| r.is_some())
    }

    /// Records that etcd refuses us (`Some`) or took a request again (`None`); wakes a host
    /// waiting for the registration. True when this is news (the caller says it once).
    pub(crate) fn set_etcd_refused(&self, why: Option<String>) -> bool {
        let Ok(mut r) = self.etcd_refused.lock() else {
            return false;
        };
        if *r == why {
            return false;
        }
        *r = why;
        drop(r);
        let (lock, cv) = &self.registered;
        if let Ok(_g) = lock.lock() {
            cv.notify_all();
        }
        true
    }

    pub(crate) fn set_incarnation(&self, lease: i64) {
        self.set_refused(None);
        self.incarnation.store(lease, Ordering::SeqCst);
        self.liveness_lease.store(lease, Ordering::SeqCst);
        self.stats.registrations.fetch_add(1, Ordering::Relaxed);
        let (lock, cv) = &self.registered;
        if let Ok(mut g) = lock.lock() {
            *g = true;
            cv.notify_all();
        }
    }
}

/// Counts the host loop's iterations for the stall watch: see [`Agent::progress`].
#[derive(Clone, Debug)]
pub struct Progress(Arc<Shared>);

impl Progress {
    #[inline]
    pub fn tick(&self) {
        self.0.progress.fetch_add(1, Ordering::Relaxed);
        self.0.progress_at_ms.store(stall::monotonic_ms(), Ordering::Relaxed);
    }
}

/// The embedded agent. See the crate docs.
///
/// Every method takes `&self`, so one agent can be shared by threads (the Python binding
/// keeps it behind an `Arc`); none of them blocks longer than the timeout it is given.
pub struct Agent {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    capacity: usize,
    /// Set once a stop was sent; the thread then drains the queue and ends on its own.
    stopped: AtomicBool,
}

impl Agent {
    /// Starts the agent's thread and returns at once; registration happens in the
    /// background (and is retried while etcd is unreachable).
    pub fn start(config: AgentConfig) -> Result<Agent, AgentError> {
        config.check()?;
        let (tx, rx) = mpsc::channel(config.queue_capacity);
        let shared = Arc::new(Shared::default());
        let capacity = config.queue_capacity;
        let worker_shared = shared.clone();
        // Detached: the thread ends by itself once a stop command is processed (or the
        // queue's sender is gone); nothing ever waits to join it.
        std::thread::Builder::new()
            .name(format!("rootrank-agent-{}-{}", config.group, config.rank))
            .spawn(move || worker::run(config, rx, worker_shared))
            .map_err(AgentError::Thread)?;
        Ok(Agent {
            tx,
            shared,
            capacity,
            stopped: AtomicBool::new(false),
        })
    }

    /// Records that this rank failed `room` (or, with `Origin::Propagated`, that it only saw
    /// the group's generic failure). Only validates and enqueues: never waits for etcd.
    pub fn record_failure(
        &self,
        room: u64,
        origin: Origin,
        reason: &str,
        detail: &str,
        peer: Option<Peer>,
    ) -> Result<(), AgentError> {
        let room = RoomId::new(room)?;
        let reason = Reason::new(reason)?;
        let mut detail = detail.to_string();
        truncate_utf8(&mut detail, MAX_DETAIL_BYTES);
        let pending = PendingFailure {
            room,
            origin,
            reason,
            detail,
            peer,
            at_ms: rootrank_store::unix_ms(),
        };
        self.enqueue(Command::Failure(pending))
    }

    /// Writes a down certificate for this incarnation (a fatal error the host is about to
    /// die of). Enqueued ahead of nothing: call [`Agent::flush`] to wait for it.
    pub fn record_down(&self, reason: &str, detail: &str, log_tail: Option<Vec<String>>) -> Result<(), AgentError> {
        let reason = Reason::new(reason)?;
        let mut detail = detail.to_string();
        truncate_utf8(&mut detail, MAX_DETAIL_BYTES);
        self.enqueue(Command::Down {
            reason,
            detail,
            log_tail,
            at_ms: rootrank_store::unix_ms(),
        })
    }

    /// Keeps `value` at `{prefix}/groups/{group}/ranks/{rank}/{suffix}` on the liveness lease,
    /// so it vanishes with the rank (the transfer agent's NIXL metadata).
    pub fn attach_to_liveness(&self, suffix: &str, value: Vec<u8>) -> Result<(), AgentError> {
        if suffix.is_empty() || !suffix.bytes().all(|c| c.is_ascii_lowercase() || c == b'_') {
            return Err(AgentError::Config(format!(
                "invalid liveness key suffix {suffix:?}: [a-z_]+"
            )));
        }
        self.enqueue(Command::Attach {
            suffix: suffix.to_string(),
            value,
        })
    }

    fn enqueue(&self, cmd: Command) -> Result<(), AgentError> {
        if self.stopped.load(Ordering::Relaxed) {
            return Err(AgentError::Stopped);
        }
        match self.tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.shared.stats.dropped.fetch_add(1, Ordering::Relaxed);
                Err(AgentError::QueueFull {
                    capacity: self.capacity,
                })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(AgentError::Stopped),
        }
    }

    /// One iteration of the host's loop (v3 stalls): one relaxed atomic add, no lock, no
    /// allocation, callable with the GIL held. The agent thread writes a `RankStall` record
    /// when the count stops moving for `stall_after`, and deletes it when it moves again.
    #[inline]
    pub fn progress(&self) {
        self.shared.progress.fetch_add(1, Ordering::Relaxed);
        self.shared
            .progress_at_ms
            .store(stall::monotonic_ms(), Ordering::Relaxed);
    }

    /// A handle for [`Agent::progress`] that needs no reference to the agent (a host that
    /// keeps the agent behind a lock counts its iterations without taking it).
    pub fn progress_handle(&self) -> Progress {
        Progress(self.shared.clone())
    }

    /// The current incarnation (the liveness lease id), once registered.
    pub fn incarnation(&self) -> Option<Incarnation> {
        Incarnation::new(self.shared.incarnation.load(Ordering::SeqCst)).ok()
    }

    /// Why this rank is not registered, while another incarnation holds its live key (two
    /// processes claim one (group, rank)): the agent keeps retrying quietly and registers
    /// once the holder is gone. `None` otherwise.
    pub fn registration_refused(&self) -> Option<String> {
        self.shared.refused.lock().ok().and_then(|r| r.clone())
    }

    /// Why etcd refuses this agent, while it does: a TLS handshake it fails, a wrong user or
    /// password, or a role without a key it must write (SPEC section 7). `None` otherwise.
    pub fn etcd_refused(&self) -> Option<String> {
        self.shared.etcd_refused.lock().ok().and_then(|r| r.clone())
    }

    /// Waits up to `timeout` for the first registration; returns `None` early when the
    /// registration is refused (see [`Agent::registration_refused`]) or etcd refuses the
    /// agent (see [`Agent::etcd_refused`]).
    pub fn wait_registered(&self, timeout: Duration) -> Option<Incarnation> {
        let (lock, cv) = &self.shared.registered;
        let guard = lock.lock().ok()?;
        let _unused = cv
            .wait_timeout_while(guard, timeout, |r| !*r && !self.shared.is_refused())
            .ok()?;
        self.incarnation()
    }

    /// Waits up to `timeout` until everything enqueued so far is in etcd.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (done_tx, done_rx) = oneshot::channel();
        // Flush waits behind the queue on purpose; blocking_send would block the host, so the
        // wait is bounded by `timeout` below.
        if self.tx.try_send(Command::Flush(done_tx)).is_err() {
            return false;
        }
        wait_oneshot(done_rx, timeout)
    }

    pub fn stats(&self) -> &AgentStats {
        &self.shared.stats
    }

    /// A clean exit: writes a `shutdown` certificate, flushes, revokes the liveness lease.
    /// Bounded by `timeout` (any size); returns whether it completed. Only the first stop
    /// counts: later calls return false at once.
    pub fn shutdown(&self, timeout: Duration) -> bool {
        self.stop(true, timeout)
    }

    /// Whether a stop (shutdown or drop) was already sent.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    fn stop(&self, clean: bool, timeout: Duration) -> bool {
        if self.stopped.swap(true, Ordering::SeqCst) {
            return false;
        }
        let (done_tx, done_rx) = oneshot::channel();
        let sent = self.tx.try_send(Command::Shutdown { clean, done: done_tx }).is_ok();
        if clean {
            self.shared.shutdown_asked.notify_one();
        }
        // Otherwise the thread is left to finish on its own: the host must not hang.
        sent && wait_oneshot(done_rx, timeout)
    }
}

impl Drop for Agent {
    /// Never blocks the host: dropped without [`Agent::shutdown`], the agent is told to stop
    /// after what is already queued (no shutdown certificate: the lease runs out on its own,
    /// so the rank reads as dead, not as cleanly gone). The thread finishes writing the queue
    /// in the background for as long as the process lives.
    fn drop(&mut self) {
        if !self.stopped.swap(true, Ordering::SeqCst) {
            let (done, _) = oneshot::channel();
            let _ = self.tx.try_send(Command::Shutdown { clean: false, done });
        }
    }
}

/// Waits for `rx` until `timeout` (any size: [`rootrank_store::deadline_after`] saturates).
fn wait_oneshot(mut rx: oneshot::Receiver<()>, timeout: Duration) -> bool {
    let deadline = rootrank_store::deadline_after(timeout);
    loop {
        match rx.try_recv() {
            Ok(()) => return true,
            Err(oneshot::error::TryRecvError::Closed) => return false,
            Err(oneshot::error::TryRecvError::Empty) => {}
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
