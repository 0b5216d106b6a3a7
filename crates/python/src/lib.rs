//! `rootrank._rootrank`: the Rust agent ([`rootrank_agent::Agent`]) as the Python class
//! `rootrank.Agent`.
//!
//! What this layer promises its host (an SGLang rank, a Python process it does not own):
//! - The agent's etcd work (keepalive, publishing) runs on the agent's own OS thread, which
//!   never touches the interpreter: a main thread that holds the GIL for minutes does not
//!   starve the keepalive.
//! - Calls that wait (`flush`, `shutdown`, `wait_registered`) release the GIL while they
//!   wait and are bounded by their timeout, of any size (`1e12`, `inf`, `nan` included).
//! - `record_failure` only validates and enqueues. Bad input raises `InvalidInput` (a
//!   `ValueError`) and enqueues nothing; a full queue drops and counts (`dropped`).
//! - Nothing mutates the process: no `setenv`, no global logger. The agent thread logs to
//!   stderr through a subscriber scoped to that thread (`ROOTRANK_LOG`, default `warn`).
//! - A Rust panic surfaces as a Python exception (PyO3's `PanicException`), never an abort.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use rootrank_agent::{Agent, AgentConfig, AgentError, AGENT_VERSION};
use rootrank_core::records::{truncate_utf8, MAX_LOG_LINE_BYTES, MAX_LOG_TAIL_LINES};
use rootrank_core::{GroupId, Origin, Peer};

const DEFAULT_PREFIX: &str = "/rootrank/v1";

/// Raises `rootrank.errors.<name>` (defined in Python so that it can derive from both
/// `RootrankError` and the matching builtin), or `fallback` if that module is missing.
fn error(py: Python<'_>, name: &str, message: String, fallback: fn(String) -> PyErr) -> PyErr {
    let class = py
        .import("rootrank.errors")
        .and_then(|m| m.getattr(name))
        .and_then(|c| c.call1((message.clone(),)));
    match class {
        Ok(instance) => PyErr::from_value(instance),
        Err(_) => fallback(message),
    }
}

fn invalid(py: Python<'_>, message: String) -> PyErr {
    error(py, "InvalidInput", message, PyValueError::new_err)
}

fn agent_error(py: Python<'_>, e: AgentError) -> PyErr {
    match e {
        AgentError::Invalid(_) | AgentError::Config(_) => invalid(py, e.to_string()),
        AgentError::Stopped => error(py, "AgentStopped", e.to_string(), PyRuntimeError::new_err),
        AgentError::QueueFull { .. } | AgentError::Thread(_) | AgentError::Etcd(_) => {
            error(py, "RootrankError", e.to_string(), PyRuntimeError::new_err)
        }
    }
}

/// Seconds from Python into a `Duration`, for any float: negative and NaN mean zero,
/// anything too large for a `Duration` (`inf`, `1e30`) means "longer than any wait".
fn duration_from_secs(secs: f64) -> Duration {
    if secs.is_nan() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

/// The agent thread's log sink: stderr, filtered by `ROOTRANK_LOG` (default `warn`). One per
/// process, never installed globally.
fn log_dispatch() -> tracing::Dispatch {
    static DISPATCH: OnceLock<tracing::Dispatch> = OnceLock::new();
    DISPATCH
        .get_or_init(|| {
            let filter = std::env::var("ROOTRANK_LOG").unwrap_or_else(|_| "warn".to_string());
            let filter = tracing_subscriber::EnvFilter::try_new(&filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
            let subscriber = tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .with_env_filter(filter)
                .finish();
            tracing::Dispatch::new(subscriber)
        })
        .clone()
}

fn endpoints_from(py: Python<'_>, value: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    let raw: Vec<String> = match value {
        None => std::env::var("ROOTRANK_ETCD_ENDPOINTS")
            .unwrap_or_default()
            .split(',')
            .map(str::to_string)
            .collect(),
        Some(v) if v.is_instance_of::<PyString>() => v.extract::<String>()?.split(',').map(str::to_string).collect(),
        Some(v) => v.extract::<Vec<String>>().map_err(|_| {
            invalid(
                py,
                "etcd_endpoints must be a string (comma-separated) or a list of strings".into(),
            )
        })?,
    };
    let endpoints: Vec<String> = raw
        .into_iter()
        .map(|e| e.trim().to_string())
        .filter(|e| !e.is_empty())
        .collect();
    if endpoints.is_empty() {
        return Err(invalid(
            py,
            "no etcd endpoints: pass etcd_endpoints= or set ROOTRANK_ETCD_ENDPOINTS (e.g. http://etcd-0:2379)".into(),
        ));
    }
    Ok(endpoints)
}

/// etcd's credentials: each keyword argument, else its `ROOTRANK_ETCD_*` variable (SPEC
/// section 7), read and checked now (a missing file or a half pair raises ``ValueError``).
fn access_from(
    py: Python<'_>,
    endpoints: Vec<String>,
    cacert: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    user: Option<String>,
    password_file: Option<PathBuf>,
) -> PyResult<rootrank_agent::EtcdAccess> {
    let env = rootrank_agent::EtcdCredentialFiles::from_env();
    let files = rootrank_agent::EtcdCredentialFiles {
        cacert: cacert.or(env.cacert),
        cert: cert.or(env.cert),
        key: key.or(env.key),
        user: user.or(env.user),
        password_file: password_file.or(env.password_file),
    };
    rootrank_agent::EtcdAccess::new(endpoints, &files).map_err(|e| invalid(py, e.to_string()))
}

fn peer_from(py: Python<'_>, peer: Option<&Bound<'_, PyDict>>) -> PyResult<Option<Peer>> {
    let Some(d) = peer else { return Ok(None) };
    let text = |key: &str| -> PyResult<Option<String>> {
        match d.get_item(key)? {
            None => Ok(None),
            Some(v) if v.is_none() => Ok(None),
            Some(v) => v
                .extract::<String>()
                .map(Some)
                .map_err(|_| invalid(py, format!("peer[{key:?}] must be a string"))),
        }
    };
    let group = text("group")?;
    if let Some(g) = &group {
        GroupId::new(g).map_err(|e| invalid(py, format!("peer: {e}")))?;
    }
    let rank = match d.get_item("rank")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(
            v.extract::<u32>()
                .ok()
                .filter(|r| *r < 4096)
                .ok_or_else(|| invalid(py, "peer[\"rank\"] must be an integer in 0..4096".into()))?,
        ),
    };
    for key in d.keys() {
        let k: String = key.extract().unwrap_or_default();
        if !matches!(k.as_str(), "group" | "rank" | "agent" | "endpoint") {
            return Err(invalid(
                py,
                format!("peer has an unknown field {k:?} (expected group, rank, agent, endpoint)"),
            ));
        }
    }
    Ok(Some(Peer {
        group,
        rank,
        agent: text("agent")?,
        endpoint: text("endpoint")?,
    }))
}

/// The rank-side agent: registers this rank's liveness in etcd and publishes its room
/// failure records and down certificates, from a Rust thread that never needs the GIL.
///
/// ``Agent(group, rank, group_size, *, etcd_endpoints=None, prefix=None, lease_ttl_ms=5000,
/// role=None)``. ``etcd_endpoints`` (a comma-separated string or a list) and ``prefix``
/// default to ``ROOTRANK_ETCD_ENDPOINTS`` and ``ROOTRANK_PREFIX``. Registration happens in
/// the background and is retried while etcd is unreachable; the constructor never waits for
/// etcd. Use it as a context manager, or call :meth:`shutdown` on a clean exit.
#[pyclass(name = "Agent", module = "rootrank._rootrank", frozen)]
pub struct PyAgent {
    agent: Mutex<Option<Arc<Agent>>>,
    /// Outside the lock: `progress()` is one atomic add per scheduler iteration.
    progress: rootrank_agent::Progress,
    group: String,
    rank: u32,
    group_size: u32,
}

impl PyAgent {
    /// The agent, or `AgentStopped` after `shutdown`. The lock is held only to clone the Arc.
    fn live(&self, py: Python<'_>) -> PyResult<Arc<Agent>> {
        self.agent
            .lock()
            .ok()
            .and_then(|a| a.clone())
            .ok_or_else(|| agent_error(py, AgentError::Stopped))
    }

    fn current(&self) -> Option<Arc<Agent>> {
        self.agent.lock().ok().and_then(|a| a.clone())
    }

    /// One of the agent's counters (kept after `shutdown`).
    fn count(&self, counter: fn(&rootrank_agent::AgentStats) -> &std::sync::atomic::AtomicU64) -> u64 {
        self.current()
            .map_or(0, |a| counter(a.stats()).load(std::sync::atomic::Ordering::Relaxed))
    }
}

#[pymethods]
impl PyAgent {
    #[new]
    #[pyo3(signature = (group, rank, group_size, *, etcd_endpoints=None, prefix=None, lease_ttl_ms=5000, role=None, retention_s=600.0, queue_capacity=10000, host=None, nixl_agent=None, gpu=None, endpoints=None, stall_after_ms=None, etcd_cacert=None, etcd_cert=None, etcd_key=None, etcd_user=None, etcd_password_file=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        group: &str,
        rank: i64,
        group_size: i64,
        etcd_endpoints: Option<&Bound<'_, PyAny>>,
        prefix: Option<String>,
        lease_ttl_ms: i64,
        role: Option<String>,
        retention_s: f64,
        queue_capacity: i64,
        host: Option<String>,
        nixl_agent: Option<String>,
        gpu: Option<String>,
        endpoints: Option<Vec<String>>,
        stall_after_ms: Option<i64>,
        etcd_cacert: Option<PathBuf>,
        etcd_cert: Option<PathBuf>,
        etcd_key: Option<PathBuf>,
        etcd_user: Option<String>,
        etcd_password_file: Option<PathBuf>,
    ) -> PyResult<Self> {
        let etcd = endpoints_from(py, etcd_endpoints)?;
        let access = access_from(
            py,
            etcd.clone(),
            etcd_cacert,
            etcd_cert,
            etcd_key,
            etcd_user,
            etcd_password_file,
        )?;
        let (rank_u, size_u) = match (u64::try_from(rank), u64::try_from(group_size)) {
            (Ok(r), Ok(s)) => (r, s),
            _ => {
                return Err(invalid(
                    py,
                    format!("rank {rank} and group_size {group_size} must be non-negative"),
                ))
            }
        };
        let mut config = AgentConfig::new(etcd, group, rank_u, size_u).map_err(|e| agent_error(py, e))?;
        config.etcd = access;
        config.prefix = prefix
            .or_else(|| std::env::var("ROOTRANK_PREFIX").ok().filter(|p| !p.is_empty()))
            .unwrap_or_else(|| DEFAULT_PREFIX.to_string());
        if !config.prefix.starts_with('/') || config.prefix.ends_with('/') {
            return Err(invalid(
                py,
                format!(
                    "prefix {:?} must start with '/' and not end with one (e.g. /rootrank/v1)",
                    config.prefix
                ),
            ));
        }
        if !(1000..=3_600_000).contains(&lease_ttl_ms) {
            return Err(invalid(
                py,
                format!("lease_ttl_ms {lease_ttl_ms} outside 1000..=3600000 (etcd grants leases in whole seconds)"),
            ));
        }
        config.lease_ttl = Duration::from_millis(lease_ttl_ms as u64);
        if let Some(r) = &role {
            if r != "prefill" && r != "decode" {
                return Err(invalid(
                    py,
                    format!("role {r:?} must be \"prefill\", \"decode\" or None"),
                ));
            }
        }
        config.role = role;
        let advertised = endpoints.unwrap_or_default();
        if advertised.len() > 64 || advertised.iter().any(|e| e.is_empty() || e.len() > 256) {
            return Err(invalid(
                py,
                "endpoints must be at most 64 non-empty \"host:port\" strings of at most 256 bytes".into(),
            ));
        }
        config.advertised = advertised;
        if !(retention_s.is_finite() && retention_s >= 1.0) {
            return Err(invalid(py, format!("retention_s {retention_s} must be at least 1")));
        }
        config.retention = duration_from_secs(retention_s);
        config.queue_capacity = usize::try_from(queue_capacity)
            .ok()
            .filter(|c| (1..=10_000_000).contains(c))
            .ok_or_else(|| invalid(py, format!("queue_capacity {queue_capacity} outside 1..=10000000")))?;
        if host.is_some() {
            config.host = host;
        }
        config.nixl_agent = nixl_agent;
        config.gpu = gpu;
        if let Some(ms) = stall_after_ms {
            if !(100..=86_400_000).contains(&ms) {
                return Err(invalid(py, format!("stall_after_ms {ms} outside 100..=86400000")));
            }
            config.stall_after = Duration::from_millis(ms as u64);
        }
        config.log = Some(log_dispatch());
        let (group, rank, group_size) = (config.group.to_string(), config.rank, config.group_size);
        let agent = Agent::start(config).map_err(|e| agent_error(py, e))?;
        Ok(PyAgent {
            progress: agent.progress_handle(),
            agent: Mutex::new(Some(Arc::new(agent))),
            group,
            rank,
            group_size,
        })
    }

    /// Records that this rank failed ``room`` (``origin="local"``, a root-cause candidate) or
    /// only saw the group's generic failure (``origin="propagated"``). Only validates and
    /// enqueues: never waits for etcd, never raises on etcd trouble. Returns ``False`` when
    /// the queue was full and the record was dropped (counted in :attr:`dropped`).
    /// Raises ``InvalidInput`` (a ``ValueError``) on a bad room, reason, origin or peer.
    #[pyo3(signature = (room, reason, detail="", *, origin="local", peer=None))]
    fn record_failure(
        &self,
        py: Python<'_>,
        room: &Bound<'_, PyAny>,
        reason: &str,
        detail: &str,
        origin: &str,
        peer: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<bool> {
        let room: u64 = room
            .extract::<u64>()
            .ok()
            .filter(|r| *r <= i64::MAX as u64)
            .ok_or_else(|| invalid(py, format!("room {room} must be an integer in 0..=2^63-1")))?;
        let origin = match origin {
            "local" => Origin::Local,
            "propagated" => Origin::Propagated,
            "peer_reported" => Origin::PeerReported,
            other => {
                return Err(invalid(
                    py,
                    format!("origin {other:?} must be \"local\", \"propagated\" or \"peer_reported\""),
                ))
            }
        };
        let peer = peer_from(py, peer)?;
        let agent = self.live(py)?;
        match agent.record_failure(room, origin, reason, detail, peer) {
            Ok(()) => Ok(true),
            Err(AgentError::QueueFull { .. }) => Ok(false),
            Err(e) => Err(agent_error(py, e)),
        }
    }

    /// Writes this incarnation's down certificate (``reason`` e.g. ``"python_exception"``),
    /// for a rank about to die of a fatal error. Enqueued; call :meth:`flush` to wait for it.
    /// ``log_tail`` keeps the last 100 lines (1 KiB each).
    #[pyo3(signature = (reason, detail="", *, log_tail=None))]
    fn record_down(
        &self,
        py: Python<'_>,
        reason: &str,
        detail: &str,
        log_tail: Option<&Bound<'_, PyList>>,
    ) -> PyResult<bool> {
        let tail = match log_tail {
            None => None,
            Some(lines) => {
                let mut out: Vec<String> = Vec::with_capacity(lines.len().min(MAX_LOG_TAIL_LINES));
                let skip = lines.len().saturating_sub(MAX_LOG_TAIL_LINES);
                for line in lines.iter().skip(skip) {
                    let mut s: String = line
                        .extract()
                        .map_err(|_| invalid(py, "log_tail must be a list of strings".into()))?;
                    truncate_utf8(&mut s, MAX_LOG_LINE_BYTES);
                    out.push(s);
                }
                Some(out)
            }
        };
        let agent = self.live(py)?;
        match agent.record_down(reason, detail, tail) {
            Ok(()) => Ok(true),
            Err(AgentError::QueueFull { .. }) => Ok(false),
            Err(e) => Err(agent_error(py, e)),
        }
    }

    /// Waits (without the GIL) up to ``timeout_s`` until everything enqueued so far is in
    /// etcd. Returns whether it was.
    #[pyo3(signature = (timeout_s=5.0))]
    fn flush(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        let agent = self.live(py)?;
        let timeout = duration_from_secs(timeout_s);
        Ok(py.detach(move || agent.flush(timeout)))
    }

    /// Waits (without the GIL) up to ``timeout_s`` for the first registration; returns the
    /// incarnation (the liveness lease id, a decimal string) or ``None``, at once when the
    /// registration is refused (see ``registration_error``).
    #[pyo3(signature = (timeout_s=5.0))]
    fn wait_registered(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Option<String>> {
        let agent = self.live(py)?;
        let timeout = duration_from_secs(timeout_s);
        Ok(py.detach(move || agent.wait_registered(timeout)).map(|i| i.to_string()))
    }

    /// A clean exit: writes a ``shutdown`` certificate, flushes the queue and revokes the
    /// liveness lease, waiting (without the GIL) at most ``timeout_s``. Returns whether it
    /// completed; afterwards recording raises ``AgentStopped``. Calling it again is harmless.
    #[pyo3(signature = (timeout_s=5.0))]
    fn shutdown(&self, py: Python<'_>, timeout_s: f64) -> bool {
        let Some(agent) = self.current() else { return false };
        let timeout = duration_from_secs(timeout_s);
        // The stopped agent stays in place for its counters.
        py.detach(move || agent.shutdown(timeout))
    }

    /// One iteration of the rank's loop (v3 stalls): call it once per scheduler iteration.
    /// One relaxed atomic add: no lock, no allocation, no GIL release. When the count stops
    /// moving for ``stall_after_ms`` (default 10000) the agent's own thread writes this rank's
    /// stall record; it deletes it when the count moves again. Never called: never stalled.
    fn progress(&self) {
        self.progress.tick();
    }

    /// The current incarnation (liveness lease id, decimal string), once registered.
    #[getter]
    fn incarnation(&self) -> Option<String> {
        self.current().and_then(|a| a.incarnation()).map(|i| i.to_string())
    }

    /// Why this rank is not registered while another live process holds its live key (two
    /// processes claim one group and rank: a configuration error), or ``None``. The agent
    /// keeps retrying quietly and registers once the holder is gone.
    #[getter]
    fn registration_error(&self) -> Option<String> {
        self.current().and_then(|a| a.registration_refused())
    }

    /// Why etcd refuses this agent, while it does (a TLS handshake it fails, a wrong user or
    /// password, a role without a key it writes), or ``None``. Logged once; the agent keeps
    /// retrying quietly, so fixing the credentials or role needs no restart.
    #[getter]
    fn etcd_error(&self) -> Option<String> {
        self.current().and_then(|a| a.etcd_refused())
    }

    /// Records dropped because the queue was full (etcd unreachable for long).
    #[getter]
    fn dropped(&self) -> u64 {
        self.count(|s| &s.dropped)
    }

    /// Records etcd refused for good (e.g. larger than its request limit), dropped so that
    /// the records behind them still go out.
    #[getter]
    fn rejected(&self) -> u64 {
        self.count(|s| &s.rejected)
    }

    /// Records and certificates written to etcd so far.
    #[getter]
    fn published(&self) -> u64 {
        self.count(|s| &s.published)
    }

    /// Whether :meth:`shutdown` was called.
    #[getter]
    fn stopped(&self) -> bool {
        self.current().is_none_or(|a| a.is_stopped())
    }

    #[getter]
    fn group(&self) -> &str {
        &self.group
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    #[getter]
    fn group_size(&self) -> u32 {
        self.group_size
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Leaving the ``with`` block shuts down cleanly (5 s at most), whatever was raised.
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.shutdown(py, 5.0);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "rootrank.Agent(group={:?}, rank={}, group_size={}, incarnation={:?})",
            self.group,
            self.rank,
            self.group_size,
            self.incarnation()
        )
    }
}

/// The native module. `rootrank/__init__.py` re-exports what users need.
/// ``"peer_lost"`` when a fatal traceback's exception says a peer of the rank's collective
/// vanished (gloo's "Connection closed by peer", NCCL's remote error, ...: a victim, SPEC rule
/// 7), else ``"python_exception"``. The same table `rootrank run` uses.
#[pyfunction]
fn classify_fatal(traceback: &str) -> &'static str {
    rootrank_core::fatal::classify_fatal(traceback)
}

/// ``certify_exited(pid, *, exit_code=None, signal=None, detail="", rooms=None,
/// etcd_endpoints=None, prefix=None, timeout_s=2.0)``: for the parent of a rank process that
/// exited (SGLang's launcher), writes the down certificate (`process_exit`, source
/// `supervisor`, with the exit status) of every rank whose live record names ``pid`` in this
/// pid namespace, host and boot, then a `propagated` record of each of ``rooms`` (the rooms
/// the parent had in flight on it, at most 4,096) for each such rank.
/// Returns ``[(group, rank), ...]`` certified. Waits at most ``timeout_s`` (the GIL released);
/// raises ``RootrankError`` when etcd does not take it in time.
#[pyfunction]
#[pyo3(signature = (pid, *, exit_code=None, signal=None, detail="", rooms=None, etcd_endpoints=None, prefix=None, timeout_s=2.0, etcd_cacert=None, etcd_cert=None, etcd_key=None, etcd_user=None, etcd_password_file=None))]
#[allow(clippy::too_many_arguments)]
fn certify_exited(
    py: Python<'_>,
    pid: i64,
    exit_code: Option<i32>,
    signal: Option<i32>,
    detail: &str,
    rooms: Option<Vec<i128>>,
    etcd_endpoints: Option<&Bound<'_, PyAny>>,
    prefix: Option<String>,
    timeout_s: f64,
    etcd_cacert: Option<PathBuf>,
    etcd_cert: Option<PathBuf>,
    etcd_key: Option<PathBuf>,
    etcd_user: Option<String>,
    etcd_password_file: Option<PathBuf>,
) -> PyResult<Vec<(String, u32)>> {
    let rooms = rooms
        .unwrap_or_default()
        .into_iter()
        .map(|room| {
            u64::try_from(room)
                .ok()
                .and_then(|r| rootrank_core::RoomId::new(r).ok())
                .ok_or_else(|| invalid(py, format!("room {room} is not a bootstrap room (0 <= room < 2^63)")))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let pid = u32::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| invalid(py, format!("pid {pid} is not a process id")))?;
    let endpoints = endpoints_from(py, etcd_endpoints)?;
    let access = access_from(
        py,
        endpoints,
        etcd_cacert,
        etcd_cert,
        etcd_key,
        etcd_user,
        etcd_password_file,
    )?;
    let prefix = prefix
        .or_else(|| std::env::var("ROOTRANK_PREFIX").ok().filter(|p| !p.is_empty()))
        .unwrap_or_else(|| DEFAULT_PREFIX.to_string());
    if !prefix.starts_with('/') || prefix.ends_with('/') {
        return Err(invalid(
            py,
            format!("prefix {prefix:?} must start with '/' and not end with one (e.g. /rootrank/v1)"),
        ));
    }
    let mut text = detail.to_string();
    rootrank_core::records::truncate_utf8(&mut text, rootrank_core::records::MAX_DETAIL_BYTES);
    let exited = rootrank_agent::exited::ExitedProcess {
        pid,
        code: exit_code,
        signal,
        detail: text,
        rooms,
    };
    let timeout = duration_from_secs(timeout_s).min(Duration::from_secs(60));
    let dispatch = log_dispatch();
    py.detach(move || {
        tracing::dispatcher::with_default(&dispatch, || {
            rootrank_agent::exited::certify_exited(access, &prefix, &exited, timeout)
        })
    })
    .map(|ranks| ranks.into_iter().map(|(g, r)| (g.to_string(), r)).collect())
    .map_err(|e| agent_error(py, e))
}

/// The `rootrank` command (`serve`, `why`, `status`, `watch`, `node-watch`, `run`, the same
/// code as the binary's, without the NIXL subcommands) for the package's console script:
/// runs one command line (`argv[0]` is the program name) in this process, the GIL released,
/// and returns its exit code. Only ever called by `rootrank.cli.main`, in a process of its own.
#[pyfunction]
fn cli(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(move || rootrank::main(argv))
}

#[pymodule]
fn _rootrank(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAgent>()?;
    m.add_function(wrap_pyfunction!(classify_fatal, m)?)?;
    m.add_function(wrap_pyfunction!(certify_exited, m)?)?;
    m.add_function(wrap_pyfunction!(cli, m)?)?;
    m.add("AGENT_VERSION", AGENT_VERSION)?;
    Ok(())
}
