//! Host-facing half of rootrank's node watchdog (`rootrank node-watch`):
//! notice within milliseconds that a rank process on this host died, and
//! say why. No etcd here; the glue that picks the processes and writes the
//! down certificate calls this API.
//!
//! Parts:
//! - [`pidfd`]: [`PidWatch`] (one pidfd, readable when the process exits,
//!   exit status for our own children) and [`ProcessWatcher`] (many watches
//!   by key, each death sent as a [`ProcessExit`] on a channel; pid reuse
//!   checked with the `/proc/PID/stat` start time).
//! - [`kmsg`]: pure parser of kernel log lines into [`KernelEvent`]s (OOM
//!   kills, NVIDIA Xid errors) and PCI bus id matching.
//! - [`kernel_log`]: [`KernelLog`], a background `/dev/kmsg` reader keeping
//!   a bounded window of recent events to query by pid or GPU.
//! - [`cgroup`]: memory cgroup `oom_kill` counters, a witness of OOM kills
//!   that needs no kernel log access.
//! - [`classify`]: pure verdict `(reason, detail)` from all of the above,
//!   OOM > Xid > exit status.
//! - [`logtail`]: [`LogTail`], the last lines of a supervised child's stderr.
//!
//! [`diagnose`] ties them together for one [`ProcessExit`].
//!
//! Linux only. Pids in kernel OOM lines are init-namespace pids, so
//! node-watch must share the host pid namespace.

pub mod cgroup;
pub mod classify;
pub mod error;
pub mod kernel_log;
pub mod kmsg;
pub mod logtail;
pub mod pidfd;

pub use cgroup::{CgroupOomDelta, CgroupOomProbe, OomCounters};
pub use classify::{classify, reason, Classification, Evidence};
pub use error::{KernelLogError, WatchError};
pub use kernel_log::{KernelLog, KernelLogStats, OOM_LOG_GRACE};
pub use kmsg::{normalize_pci_bus_id, pci_bus_ids_match, GpuXid, KernelEvent, OomKill};
pub use logtail::LogTail;
pub use pidfd::{ExitInfo, ExitObserved, PidWatch, ProcessExit, ProcessWatcher};

/// Whether an exit could be the OOM killer's work, i.e. worth waiting
/// [`OOM_LOG_GRACE`] for its log line: it is always SIGKILL, so only a
/// SIGKILL or an unknown status qualifies.
pub fn exit_may_be_oom(exit: Option<ExitInfo>) -> bool {
    match exit {
        None => true,
        Some(x) => x.signal == Some(libc::SIGKILL) || (x.signal.is_none() && x.code.is_none()),
    }
}

/// Classifies one death with everything this host knows: the exit status,
/// the cgroup OOM counters carried in `exit`, the kernel log's OOM record
/// (waiting at most [`OOM_LOG_GRACE`] for it when the exit could be an OOM
/// kill) and an Xid on `gpu_bus_id` since the watch started.
pub async fn diagnose<K>(
    exit: &ProcessExit<K>,
    kernel: &KernelLog,
    gpu_bus_id: Option<&str>,
) -> Classification {
    let since = exit.watched_since;
    let oom = if exit_may_be_oom(exit.exit) {
        kernel.wait_for_oom(exit.pid, since, OOM_LOG_GRACE).await
    } else {
        kernel.oom_kill_for_since(exit.pid, since)
    };
    let xid = gpu_bus_id.and_then(|b| kernel.xid_for(b, since));
    let c = classify(&Evidence {
        exit: exit.exit,
        observed: Some(exit.observed),
        oom: oom.as_ref(),
        cgroup_oom: exit.cgroup_oom.as_ref(),
        xid: xid.as_ref(),
    });
    tracing::info!(pid = exit.pid, reason = c.reason, detail = %c.detail, "process death classified");
    c
}
