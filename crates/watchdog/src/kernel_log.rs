//! `/dev/kmsg` reader keeping a bounded, queryable window of recent OOM and
//! Xid events.
//!
//! The reader is a plain OS thread blocked in `poll(2)` on `/dev/kmsg` and an
//! eventfd used to stop it. A thread (rather than a tokio task) means the log
//! is read even when the runtime is busy, and `KernelLog` can be built
//! outside any runtime.

use std::collections::VecDeque;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::error::KernelLogError;
use crate::kmsg::{self, GpuXid, KernelEvent, OomKill};

/// Where the kernel log lives.
pub const KMSG_PATH: &str = "/dev/kmsg";
/// At most this many events are kept.
pub const WINDOW_CAPACITY: usize = 4096;
/// Events older than this (by our monotonic clock, at receipt) are dropped.
pub const WINDOW_MAX_AGE: Duration = Duration::from_secs(120);
/// How long to wait for the OOM killer's line after the victim's pidfd
/// fired. The kernel sends SIGKILL *before* it prints "Killed process", so
/// the line can trail the death by a little; it is printed in the same
/// kernel call, so microseconds is typical and 20 ms is generous while still
/// reporting a death within milliseconds. [`KernelLog::wait_for_oom`] never
/// waits longer than this.
pub const OOM_LOG_GRACE: Duration = Duration::from_millis(20);
/// Lines about the same victim pid within this span are one kill (the
/// `oom-kill:` summary and the `Killed process` line).
const OOM_MERGE_SPAN: Duration = Duration::from_secs(5);
/// Largest kmsg record is CONSOLE_EXT_LOG_MAX (8 KiB); a smaller buffer
/// makes read() fail with EINVAL.
const READ_BUF: usize = 16 * 1024;

struct Stored {
    at: Instant,
    event: KernelEvent,
}

/// The bounded recent-events window. Separate from the reader so it can be
/// tested with small limits.
pub(crate) struct Window {
    events: VecDeque<Stored>,
    capacity: usize,
    max_age: Duration,
}

impl Window {
    pub(crate) fn new(capacity: usize, max_age: Duration) -> Self {
        Window {
            events: VecDeque::new(),
            capacity: capacity.max(1),
            max_age,
        }
    }

    fn prune(&mut self, now: Instant) {
        while self.events.len() > self.capacity {
            self.events.pop_front();
        }
        while let Some(front) = self.events.front() {
            if now.saturating_duration_since(front.at) > self.max_age {
                self.events.pop_front();
            } else {
                break;
            }
        }
    }

    pub(crate) fn push(&mut self, at: Instant, event: KernelEvent) {
        if let KernelEvent::OomKill(new) = &event {
            // Merge a later line about the same kill into the first one.
            for s in self.events.iter_mut().rev() {
                if at.saturating_duration_since(s.at) > OOM_MERGE_SPAN {
                    break;
                }
                if let KernelEvent::OomKill(old) = &mut s.event {
                    if old.pid == new.pid {
                        old.merge_from(new);
                        return;
                    }
                }
            }
        }
        self.events.push_back(Stored { at, event });
        self.prune(at);
    }

    pub(crate) fn oom_kill_for(&mut self, pid: u32, since: Option<Instant>) -> Option<OomKill> {
        self.prune(Instant::now());
        self.events.iter().rev().find_map(|s| match &s.event {
            KernelEvent::OomKill(o) if o.pid == pid && since.is_none_or(|t| s.at >= t) => Some(o.clone()),
            _ => None,
        })
    }

    pub(crate) fn xid_for(&mut self, bus_id: &str, since: Instant) -> Option<GpuXid> {
        self.prune(Instant::now());
        let want = kmsg::normalize_pci_bus_id(bus_id)?;
        self.events.iter().rev().find_map(|s| match &s.event {
            KernelEvent::GpuXid(x) if s.at >= since && x.pci_bus_id == want => Some(x.clone()),
            _ => None,
        })
    }

    fn len(&self) -> usize {
        self.events.len()
    }
}

struct Shared {
    window: Mutex<Window>,
    /// Woken whenever an event is stored, for [`KernelLog::wait_for_oom`].
    notify: Notify,
    records: AtomicU64,
    events: AtomicU64,
    overwritten: AtomicU64,
}

/// Counters of the reader, for health reporting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelLogStats {
    /// Records (or ingested lines) seen.
    pub records: u64,
    /// Of those, OOM/Xid events.
    pub events: u64,
    /// Times the kernel overwrote records before we read them (EPIPE).
    pub overwritten: u64,
}

impl Shared {
    fn new() -> Self {
        Shared {
            window: Mutex::new(Window::new(WINDOW_CAPACITY, WINDOW_MAX_AGE)),
            notify: Notify::new(),
            records: AtomicU64::new(0),
            events: AtomicU64::new(0),
            overwritten: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Window> {
        // A panic while holding the lock cannot leave the window invalid
        // (every mutation is a single push/pop), so poisoning is ignored.
        self.window.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn ingest(&self, bytes: &[u8]) -> bool {
        self.records.fetch_add(1, Ordering::Relaxed);
        let Some(event) = kmsg::parse_bytes(bytes) else {
            return false;
        };
        self.events.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(?event, "kernel event");
        self.lock().push(Instant::now(), event);
        self.notify.notify_waiters();
        true
    }
}

struct Reader {
    stop: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

/// Recent kernel OOM/Xid events, fed by a background reader of `/dev/kmsg`.
///
/// Only events logged after [`KernelLog::open`] count (it seeks to the end),
/// so a death is never blamed on an old OOM. Pids are those of the kernel's
/// initial pid namespace: node-watch must run in the host pid namespace
/// (`hostPID: true` in Kubernetes) for [`KernelLog::oom_kill_for`] to match.
pub struct KernelLog {
    shared: Arc<Shared>,
    reader: Option<Reader>,
}

impl KernelLog {
    /// Opens `/dev/kmsg` and starts the reader thread.
    pub fn open() -> Result<Self, KernelLogError> {
        Self::open_path(Path::new(KMSG_PATH))
    }

    /// Like [`KernelLog::open`] for a kmsg device at another path (a
    /// bind mount). The file must support `lseek(SEEK_END)`.
    pub fn open_path(path: &Path) -> Result<Self, KernelLogError> {
        let fd = open_kmsg(path)?;
        // SAFETY: eventfd has no memory-safety preconditions.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(KernelLogError::Reader {
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: efd is a fresh descriptor that nothing else owns.
        let stop = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let shared = Arc::new(Shared::new());
        let thread = {
            let shared = Arc::clone(&shared);
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("rootrank-kmsg".into())
                .spawn(move || reader_loop(&fd, &stop, &shared))
                .map_err(|source| KernelLogError::Reader { source })?
        };
        tracing::info!(path = %path.display(), "watching the kernel log for OOM kills and GPU Xid errors");
        Ok(KernelLog {
            shared,
            reader: Some(Reader {
                stop,
                thread: Some(thread),
            }),
        })
    }

    /// A log that never has events, for hosts where `/dev/kmsg` cannot be
    /// read: every query answers `None`, so classification falls back to
    /// cgroup counters and exit statuses.
    pub fn unavailable() -> Self {
        KernelLog {
            shared: Arc::new(Shared::new()),
            reader: None,
        }
    }

    /// [`KernelLog::open`], or — after logging the error once — an
    /// [`KernelLog::unavailable`] log, so the watchdog goes on either way.
    pub fn open_or_unavailable() -> Self {
        match Self::open() {
            Ok(log) => log,
            Err(e) => {
                tracing::warn!(error = %e, "kernel log unavailable; continuing without it");
                Self::unavailable()
            }
        }
    }

    /// Whether a reader is running (false for [`KernelLog::unavailable`]).
    pub fn is_available(&self) -> bool {
        self.reader.is_some()
    }

    /// Feeds one record or line by hand (replaying a saved log, tests).
    /// Returns whether it was an OOM/Xid event.
    pub fn ingest(&self, line: &str) -> bool {
        self.shared.ingest(line.as_bytes())
    }

    /// Reader counters so far.
    pub fn stats(&self) -> KernelLogStats {
        KernelLogStats {
            records: self.shared.records.load(Ordering::Relaxed),
            events: self.shared.events.load(Ordering::Relaxed),
            overwritten: self.shared.overwritten.load(Ordering::Relaxed),
        }
    }

    /// Number of events currently in the window.
    pub fn len(&self) -> usize {
        self.shared.lock().len()
    }

    /// Whether the window holds no events.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most recent OOM kill of `pid` in the window.
    pub fn oom_kill_for(&self, pid: u32) -> Option<OomKill> {
        self.shared.lock().oom_kill_for(pid, None)
    }

    /// The most recent OOM kill of `pid` received at or after `since`; use the
    /// time the watch started so an old kill of a reused pid is not blamed.
    pub fn oom_kill_for_since(&self, pid: u32, since: Instant) -> Option<OomKill> {
        self.shared.lock().oom_kill_for(pid, Some(since))
    }

    /// The most recent Xid for the GPU `bus_id` (any usual form, see
    /// [`kmsg::normalize_pci_bus_id`]) received at or after `since`.
    pub fn xid_for(&self, bus_id: &str, since: Instant) -> Option<GpuXid> {
        self.shared.lock().xid_for(bus_id, since)
    }

    /// Waits up to `timeout` (capped at [`OOM_LOG_GRACE`]) for an OOM kill
    /// of `pid` received at or after `since`. Returns at once when it is
    /// already there, or when the log is unavailable. Must run on a tokio
    /// runtime with the time driver enabled (it uses `tokio::time`).
    pub async fn wait_for_oom(&self, pid: u32, since: Instant, timeout: Duration) -> Option<OomKill> {
        if !self.is_available() {
            return self.oom_kill_for_since(pid, since);
        }
        let deadline = tokio::time::Instant::now() + timeout.min(OOM_LOG_GRACE);
        loop {
            // Register interest before looking, so an event stored between
            // the look and the await still wakes us.
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(o) = self.oom_kill_for_since(pid, since) {
                return Some(o);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.oom_kill_for_since(pid, since);
            }
        }
    }
}

impl Drop for KernelLog {
    fn drop(&mut self) {
        if let Some(reader) = &mut self.reader {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to our eventfd.
            let _ = unsafe {
                libc::write(
                    reader.stop.as_raw_fd(),
                    (&one as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
            if let Some(t) = reader.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn open_kmsg(path: &Path) -> Result<OwnedFd, KernelLogError> {
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| KernelLogError::Open {
        path: path.to_path_buf(),
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })?;
    // SAFETY: c_path is a valid NUL-terminated string for the call.
    let fd = unsafe { libc::open(c_path.as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        let path: PathBuf = path.to_path_buf();
        return Err(match err.raw_os_error() {
            Some(libc::EACCES) | Some(libc::EPERM) => KernelLogError::PermissionDenied { path },
            Some(libc::ENOENT) | Some(libc::ENXIO) | Some(libc::ENODEV) => KernelLogError::NotFound { path },
            _ => KernelLogError::Open { path, source: err },
        });
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // Start at the end: only deaths from now on are ours to explain.
    // SAFETY: lseek on an owned, open descriptor.
    if unsafe { libc::lseek(fd.as_raw_fd(), 0, libc::SEEK_END) } < 0 {
        return Err(KernelLogError::Seek {
            path: path.to_path_buf(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(fd)
}

fn reader_loop(fd: &OwnedFd, stop: &OwnedFd, shared: &Shared) {
    let mut buf = vec![0u8; READ_BUF];
    let mut idle_wakeups: u32 = 0;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of two pollfd for the call's duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(error = %err, "poll on the kernel log failed; no more kernel events will be seen");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents & libc::POLLNVAL != 0 {
            tracing::error!("kernel log descriptor became invalid; no more kernel events will be seen");
            return;
        }
        let mut progressed = false;
        // Drain every record available now; each read() returns one record.
        loop {
            // SAFETY: buf is valid for buf.len() writable bytes.
            let r = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if r > 0 {
                progressed = true;
                let len = usize::try_from(r).unwrap_or(0).min(buf.len());
                shared.ingest(&buf[..len]);
                continue;
            }
            if r == 0 {
                break;
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EAGAIN) => break,
                Some(libc::EINTR) => continue,
                Some(libc::EPIPE) => {
                    // The ring buffer overwrote records we had not read yet;
                    // the next read resumes at the oldest one still there.
                    let n = shared.overwritten.fetch_add(1, Ordering::Relaxed) + 1;
                    progressed = true;
                    tracing::debug!(
                        overwritten = n,
                        "kernel log records were overwritten before we read them"
                    );
                    continue;
                }
                _ => {
                    tracing::error!(error = %err, "reading the kernel log failed; no more kernel events will be seen");
                    return;
                }
            }
        }
        // Guard against a descriptor that keeps polling ready without ever
        // yielding data, which would otherwise spin a core.
        if progressed {
            idle_wakeups = 0;
        } else {
            idle_wakeups = idle_wakeups.saturating_add(1);
            if idle_wakeups > 3 {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom_line(pid: u32) -> KernelEvent {
        kmsg::parse_line(&format!(
            "Out of memory: Killed process {pid} (p) total-vm:1kB, anon-rss:2kB, file-rss:0kB, shmem-rss:0kB"
        ))
        .expect("fixture parses")
    }

    #[test]
    fn window_is_bounded_by_count() {
        let mut w = Window::new(3, Duration::from_secs(120));
        let t = Instant::now();
        for pid in 1..=5 {
            w.push(t, oom_line(pid));
        }
        assert_eq!(w.len(), 3);
        assert!(w.oom_kill_for(1, None).is_none());
        assert!(w.oom_kill_for(5, None).is_some());
    }

    #[test]
    fn window_is_bounded_by_age() {
        let mut w = Window::new(100, Duration::from_millis(0));
        let old = Instant::now()
            .checked_sub(Duration::from_secs(1))
            .unwrap_or_else(Instant::now);
        w.push(old, oom_line(7));
        assert!(w.oom_kill_for(7, None).is_none());
    }

    #[test]
    fn summary_and_killed_lines_merge_into_one_event() {
        let mut w = Window::new(100, Duration::from_secs(120));
        let t = Instant::now();
        let summary = kmsg::parse_line("oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/k,task_memcg=/k,task=p,pid=9,uid=0").expect("parses");
        w.push(t, summary);
        w.push(t, oom_line(9));
        assert_eq!(w.len(), 1);
        let o = w.oom_kill_for(9, Some(t)).expect("merged event");
        assert_eq!(o.constraint.as_deref(), Some("CONSTRAINT_MEMCG"));
        assert_eq!(o.anon_rss_kb, Some(2));
        let later = t + Duration::from_secs(1);
        assert!(w.oom_kill_for(9, Some(later)).is_none());
    }

    #[test]
    fn xid_query_filters_by_bus_and_time() {
        let mut w = Window::new(100, Duration::from_secs(120));
        let t = Instant::now();
        let x = kmsg::parse_line("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=p, GPU has fallen off the bus.")
            .expect("parses");
        w.push(t, x);
        assert!(w.xid_for("00000000:3B:00.0", t).is_some());
        assert!(w.xid_for("0000:3c:00.0", t).is_none());
        assert!(w.xid_for("garbage", t).is_none());
        assert!(w.xid_for("0000:3b:00", t + Duration::from_secs(1)).is_none());
    }
}
