//! Facts about this host that decide which ranks are ours and whether a pid is still the
//! process a live record names.

use rootrank_core::RankLive;

/// Who this host is, as rank agents write it into their live records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/hostname`, the same source the agent uses for `RankLive.host`.
    pub hostname: String,
    /// `/proc/sys/kernel/random/boot_id`: a record from before a reboot names pids of a
    /// boot that is gone, so it must not be matched against this boot's processes.
    pub boot_id: Option<String>,
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

impl HostIdentity {
    /// This host's identity; `None` when the hostname cannot be read (then no record
    /// could be matched anyway).
    pub fn current() -> Option<HostIdentity> {
        Some(HostIdentity {
            hostname: read_trimmed("/proc/sys/kernel/hostname")?,
            boot_id: read_trimmed("/proc/sys/kernel/random/boot_id"),
        })
    }

    /// Whether `live` names a process of this host and this boot. Records without a boot id
    /// (older or foreign agents) are matched by host alone.
    pub fn is_local(&self, live: &RankLive) -> bool {
        if live.host.as_deref() != Some(self.hostname.as_str()) {
            return false;
        }
        match (&live.boot_id, &self.boot_id) {
            (Some(theirs), Some(ours)) => theirs == ours,
            _ => true,
        }
    }
}

/// When `pid` started, in Unix milliseconds (boot time + `/proc/PID/stat` start time).
/// Coarse (btime has whole seconds), which is enough to tell a process that started after a
/// record was written from the one that wrote it.
pub(crate) fn process_start_unix_ms(pid: u32) -> Option<i64> {
    let ticks = rootrank_watchdog::pidfd::proc_start_time(pid).ok()?;
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let btime: i64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz <= 0 {
        return None;
    }
    let ticks = i64::try_from(ticks).ok()?;
    Some(btime * 1000 + ticks * 1000 / hz)
}

/// How much later than its record's `started_at` a process may seem to have started and
/// still be the one that wrote it (btime is rounded and the wall clock may have moved).
const START_SLACK_MS: i64 = 5_000;

/// Whether `pid` now belongs to a process that started after the record that names it was
/// written: the rank died and its pid was reused. `false` when anything is unknown.
pub(crate) fn pid_reused_since(pid: u32, record_started_at: Option<&str>) -> bool {
    let Some(started) = record_started_at.and_then(rootrank_core::time::parse_ms) else {
        return false;
    };
    match process_start_unix_ms(pid) {
        Some(proc_start) => proc_start > started + START_SLACK_MS,
        None => false,
    }
}

/// The parent of `pid`, from `/proc/PID/stat`.
pub(crate) fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state, ppid, ...
    let (_, after) = stat.rsplit_once(')')?;
    after.split_whitespace().nth(1)?.parse().ok()
}

/// Whether `pid` is stopped (state `T`: SIGSTOP; `t`: stopped by a tracer).
pub(crate) fn is_stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    stat.rsplit_once(')')
        .and_then(|(_, after)| after.split_whitespace().next())
        .is_some_and(|state| state == "T" || state == "t")
}

/// How far up the process tree to look: ranks are often started through a shell or a
/// launcher, so the rank process may be a grandchild of its supervisor.
const MAX_ANCESTRY: usize = 8;

/// Whether `pid` is `ancestor` or one of its descendants (a few levels down).
pub(crate) fn is_self_or_descendant(pid: u32, ancestor: u32) -> bool {
    let mut p = pid;
    for _ in 0..=MAX_ANCESTRY {
        if p == ancestor {
            return true;
        }
        match parent_of(p) {
            Some(pp) if pp > 1 && pp != p => p = pp,
            _ => return false,
        }
    }
    false
}

fn is_supervisor(pid: u32) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let mut args = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty());
    let Some(argv0) = args.next() else {
        return false;
    };
    let name = argv0.rsplit(|b| *b == b'/').next().unwrap_or(argv0);
    // `rootrank [global flags] run ...`: the first non-flag argument is the subcommand.
    name.starts_with(b"rootrank") && args.find(|a| !a.starts_with(b"-")) == Some(b"run".as_slice())
}

/// The pid of the `rootrank run` supervisor above `pid` (its parent, or a few levels up),
/// if there is one. Such a rank's death is the supervisor's to report first: it knows the
/// exit status and the stderr tail, and the first specific certificate wins.
pub(crate) fn supervisor_of(pid: u32) -> Option<u32> {
    let mut p = pid;
    for _ in 0..MAX_ANCESTRY {
        let pp = parent_of(p)?;
        if pp <= 1 || pp == p {
            return None;
        }
        if is_supervisor(pp) {
            return Some(pp);
        }
        p = pp;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(host: Option<&str>, boot: Option<&str>) -> RankLive {
        let mut r = RankLive::parse(br#"{"v":1,"group":"g","rank":0,"group_size":1}"#).expect("valid record");
        r.host = host.map(str::to_string);
        r.boot_id = boot.map(str::to_string);
        r
    }

    #[test]
    fn locality_by_host_and_boot() {
        let me = HostIdentity {
            hostname: "h1".into(),
            boot_id: Some("b1".into()),
        };
        assert!(me.is_local(&live(Some("h1"), Some("b1"))));
        assert!(me.is_local(&live(Some("h1"), None)));
        assert!(
            !me.is_local(&live(Some("h1"), Some("b0"))),
            "record from an earlier boot"
        );
        assert!(!me.is_local(&live(Some("h2"), Some("b1"))));
        assert!(!me.is_local(&live(None, None)));
    }

    #[test]
    fn own_process_is_not_reused_and_not_supervised() {
        let me = std::process::id();
        let start = process_start_unix_ms(me).expect("own start time");
        let before = rootrank_core::time::format_ms(start - 60_000);
        let after = rootrank_core::time::format_ms(start + 60_000);
        assert!(pid_reused_since(me, Some(&before)), "started a minute after the record");
        assert!(!pid_reused_since(me, Some(&after)));
        assert!(!pid_reused_since(me, None));
        assert_eq!(supervisor_of(me), None);
        assert!(is_self_or_descendant(me, me));
        let parent = parent_of(me).expect("a parent");
        assert!(is_self_or_descendant(me, parent));
        assert!(!is_self_or_descendant(parent, me));
    }
}
