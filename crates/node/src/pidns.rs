//! A live record's `pid` is the pid as the rank sees it, in its own pid namespace (a rank in
//! a container with the host's network has the node's hostname but pids of its own). Before
//! node-watch or the supervisor acts on it, it is mapped to this process's namespace and its
//! start time checked (SPEC section 4); what cannot be verified is never acted on.

use rootrank_agent::procfs;

/// Where a live record's process is, as this process can act on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Located {
    /// The record's pid is a pid of this namespace (or the record predates `pid_ns`): act on
    /// it here, checking `start_ticks` when the record has them. A pid of our own namespace
    /// with no process, or with a younger one, is the rank's process gone.
    Here { pid: u32, start_ticks: Option<u64> },
    /// Found in the rank's namespace, at `pid` here, with the record's start time.
    Mapped { pid: u32, start_ticks: u64 },
    /// The record's process cannot be verified from here: act on nothing.
    Unverified(String),
}

/// Maps `pid` of namespace `pid_ns` (inode) to this process's namespace, verified by
/// `start_ticks` (the same in every namespace).
pub(crate) fn locate(pid: u32, pid_ns: Option<u64>, start_ticks: Option<u64>) -> Located {
    let Some(ns) = pid_ns else {
        return Located::Here { pid, start_ticks };
    };
    match procfs::pid_ns(None) {
        Some(ours) if ours == ns => return Located::Here { pid, start_ticks },
        Some(_) => {}
        None => return Located::Unverified("this process's own pid namespace is unreadable".into()),
    }
    let Some(expected) = start_ticks else {
        return Located::Unverified(format!(
            "pid {pid} is in pid namespace {ns}, not ours, and the record has no start_ticks to check it by"
        ));
    };
    match find_in_namespace(ns, pid) {
        Some(here) => match procfs::start_ticks(Some(here)) {
            Some(t) if t == expected => Located::Mapped {
                pid: here,
                start_ticks: expected,
            },
            found => Located::Unverified(format!(
                "pid {pid} of pid namespace {ns} is pid {here} here, but it started at tick {} and the rank at tick {expected}",
                found.map_or("?".to_string(), |t| t.to_string())
            )),
        },
        None => Located::Unverified(format!(
            "no process with pid {pid} in pid namespace {ns} is visible from here (node-watch needs the host pid namespace, e.g. hostPID: true)"
        )),
    }
}

/// The pids of the `NSpid:` line of a `/proc/PID/status`: outermost (the namespace of that
/// `/proc` mount) first, innermost (the process's own) last.
pub(crate) fn parse_nspid(status: &str) -> Option<Vec<u32>> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let pids: Option<Vec<u32>> = line.split_whitespace().map(|p| p.parse().ok()).collect();
    pids.filter(|p| !p.is_empty())
}

/// The pid, in this `/proc`, of the process of namespace `ns` whose own (innermost) pid is
/// `inner`.
fn find_in_namespace(ns: u64, inner: u32) -> Option<u32> {
    let dir = std::fs::read_dir("/proc").ok()?;
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| procfs::pid_ns(Some(p)) == Some(ns))
        .find(|&p| {
            std::fs::read_to_string(format!("/proc/{p}/status"))
                .ok()
                .and_then(|s| parse_nspid(&s))
                .and_then(|v| v.last().copied())
                == Some(inner)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nspid_lines() {
        let status = "Name:\tpython3\nTgid:\t81234\nNgid:\t0\nPid:\t81234\nPPid:\t81200\n\
                      NSpid:\t81234\t57\t2\nNSpgid:\t81200\t56\t1\n";
        assert_eq!(parse_nspid(status), Some(vec![81234, 57, 2]));
        assert_eq!(
            parse_nspid("NSpid:\t4321\n"),
            Some(vec![4321]),
            "host namespace: one entry"
        );
        assert_eq!(parse_nspid("Pid:\t1\n"), None, "kernels before 4.1 have no NSpid");
        assert_eq!(parse_nspid("NSpid:\t12\tx\n"), None);
        assert_eq!(parse_nspid("NSpid:\n"), None);
    }

    #[test]
    fn own_namespace_and_legacy_records_stay_here() {
        let me = std::process::id();
        let ticks = procfs::start_ticks(None);
        assert_eq!(
            locate(me, procfs::pid_ns(None), ticks),
            Located::Here {
                pid: me,
                start_ticks: ticks
            }
        );
        assert_eq!(
            locate(me, None, None),
            Located::Here {
                pid: me,
                start_ticks: None
            }
        );
    }

    #[test]
    fn a_namespace_nobody_is_in_is_unverified() {
        // No live process has pid namespace inode 1.
        assert!(matches!(locate(1, Some(1), Some(5)), Located::Unverified(_)));
        assert!(matches!(locate(1, Some(1), None), Located::Unverified(_)));
    }
}
