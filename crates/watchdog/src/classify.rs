//! Pure cause-of-death classifier: evidence in, `(reason, detail)` out.
//!
//! Priority is OOM > Xid > exit status: an OOM kill arrives as SIGKILL and
//! a dead GPU makes the process exit with some error code, so the exit
//! status is the least specific witness and only speaks when nothing
//! better does.

use crate::cgroup::CgroupOomDelta;
use crate::kmsg::{GpuXid, OomKill};
use crate::pidfd::{ExitInfo, ExitObserved};

/// The reasons a down certificate can carry.
pub mod reason {
    /// The kernel (host or memory cgroup) OOM killer killed it.
    pub const OOM_HOST: &str = "oom_host";
    /// The NVIDIA driver reported an Xid on the rank's GPU.
    pub const GPU_XID: &str = "gpu_xid";
    /// It exited or was killed by a signal, for no reason we could see.
    pub const PROCESS_EXIT: &str = "process_exit";
}

/// Everything known about one death. Every field is optional.
#[derive(Debug, Clone, Copy, Default)]
pub struct Evidence<'a> {
    pub exit: Option<ExitInfo>,
    /// How the exit was observed; refines the "status unknown" wording.
    pub observed: Option<ExitObserved>,
    /// The kernel's OOM record for this pid.
    pub oom: Option<&'a OomKill>,
    /// The process's memory cgroup OOM counter change over the watch.
    pub cgroup_oom: Option<&'a CgroupOomDelta>,
    /// An Xid on the rank's GPU during the watch.
    pub xid: Option<&'a GpuXid>,
}

/// The verdict for a down certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classification {
    /// One of the [`reason`] constants.
    pub reason: &'static str,
    pub detail: String,
}

/// Classifies one death. Never fails: no evidence at all still yields a
/// `process_exit` with an explicit "status unknown".
pub fn classify(e: &Evidence<'_>) -> Classification {
    let cgroup_kill = e.cgroup_oom.filter(|d| d.killed());
    if let Some(o) = e.oom {
        let mut detail = format!("OOM killer killed pid {} ({})", o.pid, o.comm);
        let mut facts: Vec<String> = Vec::new();
        if let Some(kb) = o.anon_rss_kb {
            facts.push(format!("anon-rss {kb} kB"));
        }
        if let Some(kb) = o.total_vm_kb {
            facts.push(format!("total-vm {kb} kB"));
        }
        if let Some(c) = &o.constraint {
            facts.push(format!("constraint {c}"));
        } else if o.memcg_oom {
            facts.push("memory cgroup limit".to_string());
        }
        if let Some(m) = o.oom_memcg.as_ref().or(o.task_memcg.as_ref()) {
            facts.push(format!("memcg {m}"));
        }
        if let Some(d) = cgroup_kill {
            facts.push(format!("{} oom_kill +{}", d.file.display(), d.oom_kill));
        }
        if !facts.is_empty() {
            detail.push_str(": ");
            detail.push_str(&facts.join(", "));
        }
        return Classification {
            reason: reason::OOM_HOST,
            detail,
        };
    }
    if let Some(d) = cgroup_kill {
        let how = match e.exit {
            Some(x) => x.to_string(),
            None => "status unknown".to_string(),
        };
        return Classification {
            reason: reason::OOM_HOST,
            detail: format!(
                "memory cgroup OOM kill: {} oom_kill +{} while the process died ({how})",
                d.file.display(),
                d.oom_kill
            ),
        };
    }
    if let Some(x) = e.xid {
        let detail = if x.text.is_empty() {
            format!("Xid {} on {}", x.code, x.pci_bus_id)
        } else {
            format!("Xid {} on {}: {}", x.code, x.pci_bus_id, x.text)
        };
        return Classification {
            reason: reason::GPU_XID,
            detail,
        };
    }
    let detail = match e.exit {
        Some(x) if x.code.is_some() || x.signal.is_some() => x.to_string(),
        _ => match e.observed {
            Some(ExitObserved::AlreadyGone) => {
                "process was already gone when the watch started (status unknown)".to_string()
            }
            Some(ExitObserved::PidReused) => {
                "process exited before the watch started; its pid now belongs to another process (status unknown)"
                    .to_string()
            }
            _ => "process exited (status unknown: not our child)".to_string(),
        },
    };
    Classification {
        reason: reason::PROCESS_EXIT,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn oom_full() -> OomKill {
        OomKill {
            pid: 1234,
            comm: "python3".into(),
            constraint: Some("CONSTRAINT_MEMCG".into()),
            oom_memcg: Some("/kubepods/pod1".into()),
            memcg_oom: true,
            anon_rss_kb: Some(8_000_000),
            total_vm_kb: Some(9_000_000),
            ..OomKill::default()
        }
    }

    fn xid79() -> GpuXid {
        GpuXid {
            pci_bus_id: "0000:3b:00".into(),
            code: 79,
            pid: None,
            process_name: None,
            text: "GPU has fallen off the bus".into(),
            kernel_time_us: None,
        }
    }

    fn cg(n: u64) -> CgroupOomDelta {
        CgroupOomDelta {
            file: PathBuf::from("/sys/fs/cgroup/kubepods/pod1/memory.events"),
            oom: Some(n),
            oom_kill: n,
        }
    }

    #[test]
    fn table() {
        let oom = oom_full();
        let bare_oom = OomKill {
            pid: 5,
            comm: "x".into(),
            ..OomKill::default()
        };
        let xid = xid79();
        let xid_no_text = GpuXid {
            text: String::new(),
            ..xid79()
        };
        let cg1 = cg(1);
        let cg0 = cg(0);
        let kill9 = Some(ExitInfo::signaled(9));
        let cases: Vec<(&str, Evidence<'_>, &str, &str)> = vec![
            (
                "kernel oom beats everything",
                Evidence { exit: kill9, oom: Some(&oom), cgroup_oom: Some(&cg1), xid: Some(&xid), ..Evidence::default() },
                reason::OOM_HOST,
                "OOM killer killed pid 1234 (python3): anon-rss 8000000 kB, total-vm 9000000 kB, constraint CONSTRAINT_MEMCG, memcg /kubepods/pod1, /sys/fs/cgroup/kubepods/pod1/memory.events oom_kill +1",
            ),
            (
                "kernel oom with few fields",
                Evidence { oom: Some(&bare_oom), ..Evidence::default() },
                reason::OOM_HOST,
                "OOM killer killed pid 5 (x)",
            ),
            (
                "cgroup oom alone beats xid",
                Evidence { exit: kill9, cgroup_oom: Some(&cg1), xid: Some(&xid), ..Evidence::default() },
                reason::OOM_HOST,
                "memory cgroup OOM kill: /sys/fs/cgroup/kubepods/pod1/memory.events oom_kill +1 while the process died (killed by signal 9 (SIGKILL))",
            ),
            (
                "cgroup oom for a non-child",
                Evidence { cgroup_oom: Some(&cg1), ..Evidence::default() },
                reason::OOM_HOST,
                "memory cgroup OOM kill: /sys/fs/cgroup/kubepods/pod1/memory.events oom_kill +1 while the process died (status unknown)",
            ),
            (
                "unchanged cgroup counter is no evidence",
                Evidence { exit: Some(ExitInfo::exited(3)), cgroup_oom: Some(&cg0), ..Evidence::default() },
                reason::PROCESS_EXIT,
                "exited with code 3",
            ),
            (
                "xid beats exit status",
                Evidence { exit: Some(ExitInfo::exited(1)), xid: Some(&xid), ..Evidence::default() },
                reason::GPU_XID,
                "Xid 79 on 0000:3b:00: GPU has fallen off the bus",
            ),
            (
                "xid without text",
                Evidence { xid: Some(&xid_no_text), ..Evidence::default() },
                reason::GPU_XID,
                "Xid 79 on 0000:3b:00",
            ),
            ("exit code", Evidence { exit: Some(ExitInfo::exited(3)), ..Evidence::default() }, reason::PROCESS_EXIT, "exited with code 3"),
            ("exit code 0", Evidence { exit: Some(ExitInfo::exited(0)), ..Evidence::default() }, reason::PROCESS_EXIT, "exited with code 0"),
            ("sigkill", Evidence { exit: kill9, ..Evidence::default() }, reason::PROCESS_EXIT, "killed by signal 9 (SIGKILL)"),
            ("sigsegv", Evidence { exit: Some(ExitInfo::signaled(11)), ..Evidence::default() }, reason::PROCESS_EXIT, "killed by signal 11 (SIGSEGV)"),
            ("nothing known", Evidence::default(), reason::PROCESS_EXIT, "process exited (status unknown: not our child)"),
            (
                "empty exit info is unknown",
                Evidence { exit: Some(ExitInfo { code: None, signal: None }), observed: Some(ExitObserved::Exited), ..Evidence::default() },
                reason::PROCESS_EXIT,
                "process exited (status unknown: not our child)",
            ),
            (
                "already gone",
                Evidence { observed: Some(ExitObserved::AlreadyGone), ..Evidence::default() },
                reason::PROCESS_EXIT,
                "process was already gone when the watch started (status unknown)",
            ),
            (
                "pid reused",
                Evidence { observed: Some(ExitObserved::PidReused), ..Evidence::default() },
                reason::PROCESS_EXIT,
                "process exited before the watch started; its pid now belongs to another process (status unknown)",
            ),
        ];
        for (name, ev, want_reason, want_detail) in cases {
            let c = classify(&ev);
            assert_eq!(c.reason, want_reason, "{name}");
            assert_eq!(c.detail, want_detail, "{name}");
        }
    }
}
