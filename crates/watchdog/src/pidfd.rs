//! Process exit watches on pidfds.
//!
//! A pidfd (Linux ≥ 5.3) refers to one process, not to a pid number, so once
//! opened it cannot be fooled by pid reuse, and it becomes readable the
//! moment the process exits — no polling of `/proc`, no SIGCHLD plumbing.
//! The only window for pid reuse is *before* the pidfd is opened; that is
//! what the `/proc/PID/stat` start time check covers.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc;

use crate::cgroup::{CgroupOomDelta, CgroupOomProbe};
use crate::error::WatchError;

/// How a process ended, as far as we can know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExitInfo {
    /// Exit code, when it exited normally.
    pub code: Option<i32>,
    /// Terminating signal, when a signal killed it.
    pub signal: Option<i32>,
}

impl ExitInfo {
    pub fn exited(code: i32) -> Self {
        ExitInfo {
            code: Some(code),
            signal: None,
        }
    }

    pub fn signaled(signal: i32) -> Self {
        ExitInfo {
            code: None,
            signal: Some(signal),
        }
    }
}

impl From<std::process::ExitStatus> for ExitInfo {
    fn from(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        ExitInfo {
            code: status.code(),
            signal: status.signal(),
        }
    }
}

/// The conventional name of a signal number, for human-readable details.
/// (`strsignal(3)` is not thread-safe and is localized.)
pub fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSTKFLT => "SIGSTKFLT",
        libc::SIGCHLD => "SIGCHLD",
        libc::SIGCONT => "SIGCONT",
        libc::SIGSTOP => "SIGSTOP",
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGTTIN => "SIGTTIN",
        libc::SIGTTOU => "SIGTTOU",
        libc::SIGURG => "SIGURG",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGVTALRM => "SIGVTALRM",
        libc::SIGPROF => "SIGPROF",
        libc::SIGWINCH => "SIGWINCH",
        libc::SIGIO => "SIGIO",
        libc::SIGPWR => "SIGPWR",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    })
}

impl fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.code, self.signal) {
            (_, Some(sig)) => match signal_name(sig) {
                Some(name) => write!(f, "killed by signal {sig} ({name})"),
                None => write!(f, "killed by signal {sig}"),
            },
            (Some(code), None) => write!(f, "exited with code {code}"),
            (None, None) => write!(f, "exited (status unknown)"),
        }
    }
}

/// Opens a pidfd; errors are mapped to what the operator can do.
fn pidfd_open(pid: u32) -> Result<OwnedFd, WatchError> {
    let raw = libc::pid_t::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or(WatchError::InvalidPid(pid))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::ESRCH) => WatchError::NoSuchProcess { pid },
            Some(libc::ENOSYS) => WatchError::Unsupported,
            Some(libc::EMFILE) | Some(libc::ENFILE) => WatchError::TooManyFiles { pid },
            Some(libc::EINVAL) => WatchError::InvalidPid(pid),
            _ => WatchError::Io { pid, source: err },
        });
    }
    let fd = i32::try_from(fd).map_err(|_| WatchError::Io {
        pid,
        source: io::Error::other("pidfd_open returned an out-of-range descriptor"),
    })?;
    // SAFETY: fd is a fresh descriptor returned by the kernel to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the pidfd is readable right now, i.e. the process has exited.
fn pidfd_ready_now(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & libc::POLLIN != 0
}

/// `waitid(P_PIDFD, ...)`; `None` when the process is not our child (ECHILD),
/// has not exited yet, or the kernel lacks P_PIDFD (< 5.4).
fn waitid_pidfd(fd: &OwnedFd, extra_flags: libc::c_int) -> Option<ExitInfo> {
    // SAFETY: an all-zero siginfo_t is a valid value for waitid to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let id = libc::id_t::try_from(fd.as_raw_fd()).ok()?;
    loop {
        // SAFETY: info is a valid, writable siginfo_t; fd is open.
        let r = unsafe {
            libc::waitid(
                libc::P_PIDFD,
                id,
                &mut info,
                libc::WEXITED | libc::WNOHANG | extra_flags,
            )
        };
        if r == 0 {
            break;
        }
        if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return None;
    }
    // SAFETY: waitid filled info for a child state change (or left it zero).
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if pid == 0 {
        return None; // WNOHANG and still running.
    }
    match info.si_code {
        libc::CLD_EXITED => Some(ExitInfo::exited(status)),
        libc::CLD_KILLED | libc::CLD_DUMPED => Some(ExitInfo::signaled(status)),
        _ => None,
    }
}

/// A watch on one process, readable (in tokio terms) once it exits.
pub struct PidWatch {
    pid: u32,
    fd: AsyncFd<OwnedFd>,
}

impl fmt::Debug for PidWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PidWatch")
            .field("pid", &self.pid)
            .field("fd", &self.fd.get_ref().as_raw_fd())
            .finish()
    }
}

impl PidWatch {
    /// Opens a pidfd for `pid` and registers it with the current tokio
    /// runtime. Outside any runtime this is [`WatchError::NoRuntime`]; a
    /// runtime built without `enable_io` makes tokio itself panic (tokio
    /// offers no way to check), so build it with `enable_all()`.
    pub fn open(pid: u32) -> Result<Self, WatchError> {
        let fd = pidfd_open(pid)?;
        Self::from_fd(pid, fd)
    }

    fn from_fd(pid: u32, fd: OwnedFd) -> Result<Self, WatchError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(WatchError::NoRuntime);
        }
        // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor stays open
        // and unchanged for the AsyncFd's whole life.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(|e| WatchError::Io {
            pid,
            source: e.into_parts().1,
        })?;
        Ok(PidWatch { pid, fd })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Resolves when the process has exited (pidfds turn readable then).
    pub async fn exited(&self) -> Result<(), WatchError> {
        // Readiness is never cleared: once exited, always exited.
        let _guard = self
            .fd
            .readable()
            .await
            .map_err(|source| WatchError::Io { pid: self.pid, source })?;
        Ok(())
    }

    /// Whether the process has exited, without waiting.
    pub fn has_exited(&self) -> bool {
        pidfd_ready_now(self.fd.get_ref())
    }

    /// The exit status, if the process is our child and has exited; `None`
    /// for a non-child. Uses `WNOWAIT`: the zombie stays for its owner
    /// (e.g. a `std::process::Child`) to reap, so this never steals a status.
    pub fn exit_status(&self) -> Option<ExitInfo> {
        waitid_pidfd(self.fd.get_ref(), libc::WNOWAIT)
    }

    /// Like [`PidWatch::exit_status`] but also reaps the child. Only for a
    /// caller that owns the child and holds no other handle that will wait.
    pub fn reap(&self) -> Option<ExitInfo> {
        waitid_pidfd(self.fd.get_ref(), 0)
    }
}

/// Field 22 (`starttime`, clock ticks since boot) of `/proc/PID/stat`. The
/// command name (field 2) may hold spaces and parentheses, so fields are
/// counted after its last `)`.
pub fn parse_stat_start_time(stat: &str) -> Option<u64> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    // after_comm starts at field 3 (state); starttime is field 22.
    after_comm.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// The start time of `pid` (see [`parse_stat_start_time`]). Together with
/// the pid it names one process for the life of the boot.
pub fn proc_start_time(pid: u32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat_start_time(&stat).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("/proc/{pid}/stat has no start time field"),
        )
    })
}

/// Verdict of the start-time check done when a watch is added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Identity {
    /// The pidfd refers to the expected process (or no expectation was
    /// given), whose start time is the one recorded.
    Confirmed { start_time: Option<u64> },
    /// The pid now belongs to a different process: the one we were asked
    /// about is gone.
    Reused { expected: u64, found: u64 },
    /// The process exited while we were checking; the watch reports it.
    ExitedMeanwhile,
}

/// Decides whether the pidfd we opened is the process the caller meant.
///
/// `observed` is the start time read from `/proc` *after* opening the
/// pidfd, and `alive_after_read` whether the pidfd was still not readable
/// after that read: if the process was alive then, the pid could not have
/// been recycled in between, so `observed` is our process's start time.
pub fn judge_identity(expected: Option<u64>, observed: Option<u64>, alive_after_read: bool) -> Identity {
    if !alive_after_read {
        return Identity::ExitedMeanwhile;
    }
    match (expected, observed) {
        (Some(e), Some(o)) if e != o => Identity::Reused { expected: e, found: o },
        _ => Identity::Confirmed { start_time: observed },
    }
}

/// How a [`ProcessExit`] was observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitObserved {
    /// The pidfd fired: the watched process exited.
    Exited,
    /// No process with that pid existed when the watch was added.
    AlreadyGone,
    /// The pid belonged to another process (different start time) when the
    /// watch was added: the expected one had already exited.
    PidReused,
}

/// One watched process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessExit<K> {
    pub key: K,
    pub pid: u32,
    /// Code or signal for our own children; `None` for any other process.
    pub exit: Option<ExitInfo>,
    pub observed: ExitObserved,
    /// When the watch was added: kernel events before this are not about
    /// this process.
    pub watched_since: Instant,
    /// When the exit was noticed.
    pub noticed_at: Instant,
    /// `/proc/PID/stat` start time recorded at add time, when readable.
    pub start_time: Option<u64>,
    /// Change of the process's memory cgroup OOM counters over the watch,
    /// when the cgroup could be read at add and at exit.
    pub cgroup_oom: Option<CgroupOomDelta>,
}

struct Entry {
    pid: u32,
    generation: u64,
    task: tokio::task::AbortHandle,
}

type Entries<K> = Arc<Mutex<HashMap<K, Entry>>>;

fn lock<K>(m: &Mutex<HashMap<K, Entry>>) -> MutexGuard<'_, HashMap<K, Entry>> {
    // Map operations are single inserts/removes; a poisoned map is usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Watches many processes, keyed by a caller-chosen key (e.g. the rank),
/// and sends one [`ProcessExit`] per added watch (unless it was removed
/// first) on an unbounded channel — unbounded so a slow consumer can never
/// make the watchdog miss a death; it holds at most one message per watch.
pub struct ProcessWatcher<K> {
    entries: Entries<K>,
    tx: mpsc::UnboundedSender<ProcessExit<K>>,
    next_generation: AtomicU64,
}

impl<K> fmt::Debug for ProcessWatcher<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessWatcher")
            .field("watches", &lock(&self.entries).len())
            .finish()
    }
}

impl<K> ProcessWatcher<K>
where
    K: Clone + Eq + Hash + fmt::Debug + Send + Sync + 'static,
{
    /// A watcher and the receiving end of its exit channel.
    pub fn new() -> (Self, mpsc::UnboundedReceiver<ProcessExit<K>>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            ProcessWatcher {
                entries: Arc::new(Mutex::new(HashMap::new())),
                tx,
                next_generation: AtomicU64::new(0),
            },
            rx,
        )
    }

    /// Watches `pid` under `key`, replacing (silently dropping) any earlier
    /// watch under the same key. Must be called inside a tokio runtime.
    ///
    /// A pid that no longer exists is reported at once as
    /// [`ExitObserved::AlreadyGone`] rather than refused: for a watchdog,
    /// "not running" is the news.
    pub fn add(&self, key: K, pid: u32) -> Result<(), WatchError> {
        self.add_inner(key, pid, None)
    }

    /// Like [`ProcessWatcher::add`], checking that the process is the one
    /// that had `expected_start_time` (its `/proc/PID/stat` field 22, e.g.
    /// registered by the rank itself). If the pid now belongs to another
    /// process, the expected one is reported exited
    /// ([`ExitObserved::PidReused`]) instead of watching a stranger.
    pub fn add_with_start_time(&self, key: K, pid: u32, expected_start_time: u64) -> Result<(), WatchError> {
        self.add_inner(key, pid, Some(expected_start_time))
    }

    fn add_inner(&self, key: K, pid: u32, expected: Option<u64>) -> Result<(), WatchError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| WatchError::NoRuntime)?;
        let watched_since = Instant::now();
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let fd = match pidfd_open(pid) {
            Ok(fd) => fd,
            Err(WatchError::NoSuchProcess { .. }) => {
                tracing::info!(?key, pid, "process to watch does not exist; reporting it exited");
                self.report_now(key, pid, ExitObserved::AlreadyGone, watched_since, None);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        // Read identity and cgroup counters after the pidfd pins the process.
        let observed = proc_start_time(pid).ok();
        let cgroup = CgroupOomProbe::for_pid(pid);
        let alive = !pidfd_ready_now(&fd);
        let start_time = match judge_identity(expected, observed, alive) {
            Identity::Reused { expected, found } => {
                tracing::warn!(
                    ?key,
                    pid,
                    expected,
                    found,
                    "pid was reused by another process; reporting the expected one exited"
                );
                self.report_now(key, pid, ExitObserved::PidReused, watched_since, Some(found));
                return Ok(());
            }
            Identity::Confirmed { start_time } => start_time,
            Identity::ExitedMeanwhile => observed,
        };
        let watch = PidWatch::from_fd(pid, fd)?;

        // Hold the lock across spawn + insert so the task cannot look for
        // its entry before it is there.
        let mut map = lock(&self.entries);
        let entries = Arc::clone(&self.entries);
        let tx = self.tx.clone();
        let task_key = key.clone();
        let task = handle.spawn(async move {
            let result = watch.exited().await;
            let noticed_at = Instant::now();
            if let Err(e) = &result {
                tracing::error!(key = ?task_key, pid, error = %e, "waiting for the process failed; reporting it exited");
            }
            let exit = watch.exit_status();
            let cgroup_oom = cgroup.as_ref().and_then(CgroupOomProbe::delta);
            let mut map = lock(&entries);
            // Only the current watch under this key may report; a removed or
            // replaced one stays silent.
            if map.get(&task_key).map(|e| e.generation) != Some(generation) {
                return;
            }
            map.remove(&task_key);
            let _ = tx.send(ProcessExit {
                key: task_key,
                pid,
                exit,
                observed: ExitObserved::Exited,
                watched_since,
                noticed_at,
                start_time,
                cgroup_oom,
            });
        });
        if let Some(old) = map.insert(
            key,
            Entry {
                pid,
                generation,
                task: task.abort_handle(),
            },
        ) {
            old.task.abort();
        }
        Ok(())
    }

    fn report_now(&self, key: K, pid: u32, observed: ExitObserved, watched_since: Instant, start_time: Option<u64>) {
        if let Some(old) = lock(&self.entries).remove(&key) {
            old.task.abort();
        }
        let _ = self.tx.send(ProcessExit {
            key,
            pid,
            exit: None,
            observed,
            watched_since,
            noticed_at: Instant::now(),
            start_time,
            cgroup_oom: None,
        });
    }

    /// Stops watching `key`; no exit will be reported for it afterwards.
    /// Returns whether it was watched.
    pub fn remove(&self, key: &K) -> bool {
        match lock(&self.entries).remove(key) {
            Some(e) => {
                e.task.abort();
                true
            }
            None => false,
        }
    }

    /// The keys and pids currently watched.
    pub fn watched(&self) -> Vec<(K, u32)> {
        lock(&self.entries).iter().map(|(k, e)| (k.clone(), e.pid)).collect()
    }

    pub fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<K> Drop for ProcessWatcher<K> {
    fn drop(&mut self) {
        for (_, e) in lock(&self.entries).drain() {
            e.task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_is_field_22_even_with_odd_comm() {
        let fields_after_comm: Vec<String> = (3..=52).map(|i| i.to_string()).collect();
        let stat = format!("1234 (we ird) (x)) {}", fields_after_comm.join(" "));
        assert_eq!(parse_stat_start_time(&stat), Some(22));
        assert_eq!(parse_stat_start_time("1234 (x) S 1 2"), None);
        assert_eq!(parse_stat_start_time(""), None);
    }

    #[test]
    fn own_start_time_is_readable_and_stable() {
        let me = std::process::id();
        let a = proc_start_time(me).expect("own stat readable");
        let b = proc_start_time(me).expect("own stat readable");
        assert_eq!(a, b);
    }

    #[test]
    fn identity_verdicts() {
        assert_eq!(
            judge_identity(Some(100), Some(100), true),
            Identity::Confirmed { start_time: Some(100) }
        );
        assert_eq!(
            judge_identity(Some(100), Some(250), true),
            Identity::Reused {
                expected: 100,
                found: 250
            }
        );
        // No expectation: record what we saw.
        assert_eq!(
            judge_identity(None, Some(7), true),
            Identity::Confirmed { start_time: Some(7) }
        );
        // /proc unreadable (hidepid): cannot disprove, so watch.
        assert_eq!(
            judge_identity(Some(100), None, true),
            Identity::Confirmed { start_time: None }
        );
        // Died during the check: the stat we read may be a successor's, so
        // it proves nothing; the watch reports the exit.
        assert_eq!(judge_identity(Some(100), Some(250), false), Identity::ExitedMeanwhile);
    }

    #[test]
    fn exit_info_display() {
        assert_eq!(ExitInfo::exited(3).to_string(), "exited with code 3");
        assert_eq!(ExitInfo::signaled(9).to_string(), "killed by signal 9 (SIGKILL)");
        assert_eq!(ExitInfo::signaled(77).to_string(), "killed by signal 77");
    }

    #[test]
    fn exit_info_from_exit_status() {
        use std::os::unix::process::ExitStatusExt;
        let st = std::process::ExitStatus::from_raw(3 << 8);
        assert_eq!(ExitInfo::from(st), ExitInfo::exited(3));
        let st = std::process::ExitStatus::from_raw(libc::SIGKILL);
        assert_eq!(ExitInfo::from(st), ExitInfo::signaled(9));
    }
}
