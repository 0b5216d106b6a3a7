//! Typed errors. Each message says what went wrong and what the operator
//! can do about it, because node-watch logs them once and carries on.

use std::io;
use std::path::PathBuf;

/// Why the kernel log could not be watched. The watchdog still works
/// without it (see [`crate::KernelLog::unavailable`]); it just cannot name
/// OOM kills from the log or Xid errors.
#[derive(Debug, thiserror::Error)]
pub enum KernelLogError {
    #[error(
        "cannot read {path}: permission denied; run node-watch as root or with CAP_SYSLOG \
         (check sysctl kernel.dmesg_restrict); until then OOM kills are only seen through \
         cgroup counters and GPU Xid errors are not seen at all"
    )]
    PermissionDenied { path: PathBuf },
    #[error(
        "{path} does not exist; in a container, mount the host's /dev/kmsg (read-only) into it; \
         until then OOM kills are only seen through cgroup counters and GPU Xid errors are not seen"
    )]
    NotFound { path: PathBuf },
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("cannot seek {path} to its end (is it really /dev/kmsg?): {source}")]
    Seek { path: PathBuf, source: io::Error },
    #[error("cannot start the kernel log reader: {source}; the host may be out of threads or file descriptors")]
    Reader { source: io::Error },
}

/// Why a process could not be watched.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("pid {0} is not a valid process id (must be 1..=2147483647)")]
    InvalidPid(u32),
    #[error(
        "pidfd_open is not available on this kernel: Linux 5.3 or newer is required \
         (5.4+ for exit statuses); upgrade the kernel or run node-watch on a newer host"
    )]
    Unsupported,
    #[error(
        "cannot watch pid {pid}: out of file descriptors; raise the open-files limit \
         (ulimit -n / LimitNOFILE=) of node-watch"
    )]
    TooManyFiles { pid: u32 },
    #[error("cannot watch pid {pid}: no process with that id exists")]
    NoSuchProcess { pid: u32 },
    #[error(
        "process watches need a tokio runtime with I/O enabled; call this from inside \
         #[tokio::main] or Runtime::block_on"
    )]
    NoRuntime,
    #[error("cannot watch pid {pid}: {source}")]
    Io { pid: u32, source: io::Error },
}
