//! Memory cgroup OOM counters: a second, log-independent witness of an OOM
//! kill. The kernel bumps `oom_kill` in the victim's memory cgroup *before*
//! it sends SIGKILL, so reading the counter right after the pidfd fires is
//! never too early.
//!
//! cgroup v2: `<mount>/<path>/memory.events` (`oom N`, `oom_kill N`).
//! cgroup v1: `<memory mount>/<path>/memory.oom_control` (`oom_kill N`,
//! Linux ≥ 4.13). Everything here is best-effort: a missing file is `None`.

use std::path::{Path, PathBuf};

/// A process's cgroup memberships, from `/proc/PID/cgroup`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProcCgroup {
    /// The v2 (unified) path from the `0::/path` line.
    pub unified: Option<String>,
    /// The v1 path of the `memory` controller, when it is mounted as v1.
    pub memory_v1: Option<String>,
}

/// Parses `/proc/PID/cgroup`: v2 `0::/path`, v1 `4:memory:/path` or
/// `7:cpu,memory:/path`; other lines are ignored.
pub fn parse_proc_cgroup(content: &str) -> ProcCgroup {
    let mut out = ProcCgroup::default();
    for line in content.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if !path.starts_with('/') {
            continue;
        }
        if id == "0" && controllers.is_empty() {
            out.unified = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            out.memory_v1 = Some(path.to_string());
        }
    }
    out
}

/// Where cgroup hierarchies are mounted, from `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CgroupMounts {
    /// Mount point and mount root of the cgroup2 hierarchy.
    pub unified: Option<(PathBuf, String)>,
    /// Mount point and mount root of the v1 hierarchy holding `memory`.
    pub memory_v1: Option<(PathBuf, String)>,
}

/// Parses `/proc/self/mountinfo` for cgroup mounts. Line format:
/// `id parent major:minor root mountpoint opts [optional...] - fstype source superopts`.
pub fn parse_mountinfo(content: &str) -> CgroupMounts {
    let mut out = CgroupMounts::default();
    for line in content.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(mountpoint), Some(fstype)) = (left.get(3), left.get(4), right.first()) else {
            continue;
        };
        let entry = (PathBuf::from(unescape_mount(mountpoint)), unescape_mount(root));
        match *fstype {
            "cgroup2" if out.unified.is_none() => out.unified = Some(entry),
            "cgroup" if out.memory_v1.is_none() => {
                let superopts = right.get(2).copied().unwrap_or("");
                if superopts.split(',').any(|o| o == "memory") {
                    out.memory_v1 = Some(entry);
                }
            }
            _ => {}
        }
    }
    out
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' {
            if let Some(oct) = b.get(i + 1..i + 4) {
                if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                    let v = u32::from(oct[0] - b'0') * 64 + u32::from(oct[1] - b'0') * 8 + u32::from(oct[2] - b'0');
                    if let Ok(byte) = u8::try_from(v) {
                        out.push(byte);
                        i += 4;
                        continue;
                    }
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Which file holds the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterFile {
    /// v2 `memory.events`.
    MemoryEvents,
    /// v1 `memory.oom_control`.
    OomControl,
}

/// The counter file for a process's memory cgroup. v1 `memory` wins when
/// both appear: on hybrid hosts the memory controller lives there and the
/// unified hierarchy has no `memory.events`.
pub fn counter_file(cg: &ProcCgroup, mounts: &CgroupMounts) -> Option<(PathBuf, CounterFile)> {
    if let (Some(path), Some((mnt, root))) = (&cg.memory_v1, &mounts.memory_v1) {
        let dir = join_cgroup(mnt, root, path)?;
        return Some((dir.join("memory.oom_control"), CounterFile::OomControl));
    }
    if let (Some(path), Some((mnt, root))) = (&cg.unified, &mounts.unified) {
        let dir = join_cgroup(mnt, root, path)?;
        return Some((dir.join("memory.events"), CounterFile::MemoryEvents));
    }
    None
}

/// `mount` + (`path` relative to the mount's `root`). Without a cgroup
/// namespace a container's mount root is e.g. `/docker/abc` while paths in
/// `/proc/PID/cgroup` are absolute; a path outside the root is not visible.
fn join_cgroup(mount: &Path, root: &str, path: &str) -> Option<PathBuf> {
    let rel = if root == "/" {
        path
    } else {
        let rest = path.strip_prefix(root)?;
        if !(rest.is_empty() || rest.starts_with('/')) {
            return None;
        }
        rest
    };
    let rel = rel.trim_start_matches('/');
    if rel.split('/').any(|c| c == "..") {
        return None;
    }
    Some(if rel.is_empty() {
        mount.to_path_buf()
    } else {
        mount.join(rel)
    })
}

/// The OOM counters of one memory cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OomCounters {
    /// Times the cgroup hit its limit and invoked the OOM killer (v2 only).
    pub oom: Option<u64>,
    /// Processes in the cgroup (and descendants) killed by the OOM killer.
    pub oom_kill: u64,
}

/// Parses `memory.events` or `memory.oom_control` (`key value` lines).
/// `None` when there is no `oom_kill` line (v1 before 4.13).
pub fn parse_oom_counters(content: &str) -> Option<OomCounters> {
    let mut oom = None;
    let mut oom_kill = None;
    for line in content.lines() {
        let mut it = line.split_whitespace();
        let (Some(k), Some(v)) = (it.next(), it.next()) else {
            continue;
        };
        match k {
            "oom" => oom = v.parse().ok(),
            "oom_kill" => oom_kill = v.parse().ok(),
            _ => {}
        }
    }
    Some(OomCounters {
        oom,
        oom_kill: oom_kill?,
    })
}

/// How a cgroup's OOM counters moved over a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupOomDelta {
    /// The counter file read, for the certificate's detail.
    pub file: PathBuf,
    pub oom: Option<u64>,
    pub oom_kill: u64,
}

impl CgroupOomDelta {
    /// Whether an OOM kill happened in the cgroup during the watch.
    pub fn killed(&self) -> bool {
        self.oom_kill > 0
    }
}

/// Baseline OOM counters of a process's memory cgroup, taken when its
/// watch starts (the cgroup path must be read while the process lives).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupOomProbe {
    file: PathBuf,
    baseline: OomCounters,
}

impl CgroupOomProbe {
    /// Best-effort probe for `pid`; `None` when any part is unreadable
    /// (process gone, root cgroup without counters, no memory controller).
    pub fn for_pid(pid: u32) -> Option<Self> {
        let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let (file, _) = counter_file(&parse_proc_cgroup(&cg), &parse_mountinfo(&mounts))?;
        let probe = Self::from_file(&file);
        if probe.is_none() {
            tracing::debug!(pid, file = %file.display(), "no memory cgroup OOM counters for this process");
        }
        probe
    }

    /// Probe on a known counter file.
    pub fn from_file(file: &Path) -> Option<Self> {
        let baseline = parse_oom_counters(&std::fs::read_to_string(file).ok()?)?;
        Some(CgroupOomProbe {
            file: file.to_path_buf(),
            baseline,
        })
    }

    pub fn file(&self) -> &Path {
        &self.file
    }

    pub fn baseline(&self) -> OomCounters {
        self.baseline
    }

    /// Re-reads the counters; `None` if the file is gone (cgroup removed).
    /// A counter that went down (cgroup recreated) counts as no change.
    pub fn delta(&self) -> Option<CgroupOomDelta> {
        let now = parse_oom_counters(&std::fs::read_to_string(&self.file).ok()?)?;
        Some(CgroupOomDelta {
            file: self.file.clone(),
            oom: match (now.oom, self.baseline.oom) {
                (Some(n), Some(b)) => Some(n.saturating_sub(b)),
                _ => None,
            },
            oom_kill: now.oom_kill.saturating_sub(self.baseline.oom_kill),
        })
    }
}
