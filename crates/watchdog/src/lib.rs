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
//! - [`mod@classify`]: pure verdict `(reason, detail)` from all of the above,
//!   OOM > Xid > exit status.
//! - [`logtail`]: [`LogTail`], the last lines of a supervised child's stderr.
//!
//! [`diagnose`] ties them together for one [`ProcessExit`].
//!
//! Linux only. Pids in kernel OOM lines are init-namespace pids, so
//! node-watch must share the host pid namespace.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
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

/// Whether classifying this exit should wait (at most [`OOM_LOG_GRACE`])
/// for the OOM killer's log line.
///
/// OOM kills are always SIGKILL, so a known exit code or another signal
/// needs no wait. And since Linux 4.13 every OOM kill (global or memcg)
/// bumps the victim's own memory cgroup `oom_kill` counter *before* the
/// SIGKILL, so a readable counter that did not move rules the OOM killer
/// out at once: a plain `kill -9` is then reported without the 20 ms wait.
pub fn oom_wait_needed(exit: Option<ExitInfo>, cgroup_oom: Option<&CgroupOomDelta>) -> bool {
    let exit_fits = match exit {
        None => true,
        Some(x) => x.signal == Some(libc::SIGKILL) || (x.signal.is_none() && x.code.is_none()),
    };
    exit_fits && cgroup_oom.is_none_or(CgroupOomDelta::killed)
}

/// Classifies one death with everything this host knows: the exit status,
/// the cgroup OOM counters carried in `exit`, the kernel log's OOM record
/// (waiting at most [`OOM_LOG_GRACE`] for it when [`oom_wait_needed`]) and
/// an Xid on `gpu_bus_id` since the watch started.
pub async fn diagnose<K>(exit: &ProcessExit<K>, kernel: &KernelLog, gpu_bus_id: Option<&str>) -> Classification {
    let since = exit.watched_since;
    let oom = if oom_wait_needed(exit.exit, exit.cgroup_oom.as_ref()) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_wait_needed_table() {
        let moved = CgroupOomDelta {
            file: "/x/memory.events".into(),
            oom: Some(1),
            oom_kill: 1,
        };
        let still = CgroupOomDelta {
            oom_kill: 0,
            oom: Some(0),
            ..moved.clone()
        };
        let kill9 = Some(ExitInfo::signaled(libc::SIGKILL));
        let cases = [
            (kill9, None, true),
            (kill9, Some(&moved), true),
            (kill9, Some(&still), false),
            (None, None, true),
            (None, Some(&still), false),
            (Some(ExitInfo::exited(3)), None, false),
            (Some(ExitInfo::signaled(libc::SIGSEGV)), Some(&moved), false),
            (
                Some(ExitInfo {
                    code: None,
                    signal: None,
                }),
                None,
                true,
            ),
        ];
        for (exit, cg, want) in cases {
            assert_eq!(oom_wait_needed(exit, cg), want, "{exit:?} {cg:?}");
        }
    }
}
