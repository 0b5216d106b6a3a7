//! cgroup parsing fixtures and the counter probe on files.

use std::path::{Path, PathBuf};

use rootrank_watchdog::cgroup::{
    counter_file, parse_mountinfo, parse_oom_counters, parse_proc_cgroup, CgroupMounts, CgroupOomProbe, CounterFile,
    OomCounters, ProcCgroup,
};

const V2_CGROUP: &str =
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-abc.scope\n";

/// systemd hybrid host (v1 controllers + unified for systemd).
const HYBRID_CGROUP: &str = "\
12:pids:/user.slice/user-1000.slice/session-3.scope
11:cpu,cpuacct:/user.slice
10:memory:/user.slice/user-1000.slice/session-3.scope
1:name=systemd:/user.slice/user-1000.slice/session-3.scope
0::/user.slice/user-1000.slice/session-3.scope
";

/// Pure v1 host like this sandbox.
const V1_CGROUP: &str = "\
9:name=systemd:/
4:memory:/process_api/449e2a77a568eee7511c0bbe4bba8a71
1:cpu:/
0::/
";

const V2_MOUNTINFO: &str = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

const HYBRID_MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
32 31 0:29 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
37 31 0:34 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:17 - cgroup cgroup rw,cpu,cpuacct
40 31 0:37 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:20 - cgroup cgroup rw,memory
";

/// A container without a cgroup namespace: the mount root is its own
/// cgroup while /proc/PID/cgroup shows the full path.
const DOCKER_MOUNTINFO: &str = "\
700 690 0:37 /docker/abc /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:20 - cgroup cgroup rw,memory
";

const MEMORY_EVENTS: &str = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
const OOM_CONTROL: &str = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n";

fn s(v: &str) -> Option<String> {
    Some(v.to_string())
}

#[test]
fn proc_cgroup_forms() {
    assert_eq!(
        parse_proc_cgroup(V2_CGROUP),
        ProcCgroup {
            unified: s(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-abc.scope"
            ),
            memory_v1: None,
        }
    );
    assert_eq!(
        parse_proc_cgroup(HYBRID_CGROUP),
        ProcCgroup {
            unified: s("/user.slice/user-1000.slice/session-3.scope"),
            memory_v1: s("/user.slice/user-1000.slice/session-3.scope"),
        }
    );
    assert_eq!(
        parse_proc_cgroup(V1_CGROUP).memory_v1.as_deref(),
        Some("/process_api/449e2a77a568eee7511c0bbe4bba8a71")
    );
    assert_eq!(
        parse_proc_cgroup("garbage\n::\n3:memory\n0::relative\n"),
        ProcCgroup::default()
    );
}

#[test]
fn mountinfo_forms() {
    assert_eq!(
        parse_mountinfo(V2_MOUNTINFO),
        CgroupMounts {
            unified: Some((PathBuf::from("/sys/fs/cgroup"), "/".into())),
            memory_v1: None,
        }
    );
    let m = parse_mountinfo(HYBRID_MOUNTINFO);
    assert_eq!(m.unified, Some((PathBuf::from("/sys/fs/cgroup/unified"), "/".into())));
    assert_eq!(m.memory_v1, Some((PathBuf::from("/sys/fs/cgroup/memory"), "/".into())));
    assert_eq!(parse_mountinfo("nonsense - \n - \n"), CgroupMounts::default());
    // Escaped space in a mount point.
    let m = parse_mountinfo("1 2 0:1 / /mnt/cg\\040two rw - cgroup2 cgroup2 rw\n");
    assert_eq!(m.unified, Some((PathBuf::from("/mnt/cg two"), "/".into())));
}

#[test]
fn counter_file_resolution() {
    let v2 = counter_file(&parse_proc_cgroup(V2_CGROUP), &parse_mountinfo(V2_MOUNTINFO));
    assert_eq!(
        v2,
        Some((
            PathBuf::from("/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-abc.scope/memory.events"),
            CounterFile::MemoryEvents
        ))
    );
    // Hybrid: memory lives in v1.
    let hy = counter_file(&parse_proc_cgroup(HYBRID_CGROUP), &parse_mountinfo(HYBRID_MOUNTINFO));
    assert_eq!(
        hy,
        Some((
            PathBuf::from("/sys/fs/cgroup/memory/user.slice/user-1000.slice/session-3.scope/memory.oom_control"),
            CounterFile::OomControl
        ))
    );
    // Docker without cgroupns: strip the mount root.
    let cg = parse_proc_cgroup("5:memory:/docker/abc/worker\n");
    assert_eq!(
        counter_file(&cg, &parse_mountinfo(DOCKER_MOUNTINFO)),
        Some((
            PathBuf::from("/sys/fs/cgroup/memory/worker/memory.oom_control"),
            CounterFile::OomControl
        ))
    );
    // A cgroup outside the mount root is not visible.
    let cg = parse_proc_cgroup("5:memory:/docker/abcdef\n");
    assert_eq!(counter_file(&cg, &parse_mountinfo(DOCKER_MOUNTINFO)), None);
    // Root cgroup: the mount point itself (no counters there on v2; the
    // probe then finds no file and gives None).
    let cg = parse_proc_cgroup("0::/\n");
    assert_eq!(
        counter_file(&cg, &parse_mountinfo(V2_MOUNTINFO)),
        Some((PathBuf::from("/sys/fs/cgroup/memory.events"), CounterFile::MemoryEvents))
    );
    // No mounts known.
    assert_eq!(counter_file(&cg, &CgroupMounts::default()), None);
}

#[test]
fn counter_parsing() {
    assert_eq!(
        parse_oom_counters(MEMORY_EVENTS),
        Some(OomCounters {
            oom: Some(3),
            oom_kill: 2
        })
    );
    assert_eq!(
        parse_oom_counters(OOM_CONTROL),
        Some(OomCounters { oom: None, oom_kill: 5 })
    );
    // v1 before 4.13 has no oom_kill line.
    assert_eq!(parse_oom_counters("oom_kill_disable 0\nunder_oom 0\n"), None);
    assert_eq!(parse_oom_counters(""), None);
    assert_eq!(parse_oom_counters("oom_kill lots\n"), None);
}

#[test]
fn probe_reports_increase_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("memory.events");
    std::fs::write(&file, MEMORY_EVENTS).expect("write");
    let probe = CgroupOomProbe::from_file(&file).expect("probe");
    assert_eq!(probe.file(), file.as_path());
    assert_eq!(probe.baseline().oom_kill, 2);
    let d = probe.delta().expect("readable");
    assert!(!d.killed());
    std::fs::write(&file, "oom 4\noom_kill 3\n").expect("write");
    let d = probe.delta().expect("readable");
    assert!(d.killed());
    assert_eq!((d.oom, d.oom_kill), (Some(1), 1));
    // Counters reset (cgroup recreated): no change, not an underflow.
    std::fs::write(&file, "oom 0\noom_kill 0\n").expect("write");
    assert_eq!(probe.delta().map(|d| d.oom_kill), Some(0));
    // Cgroup gone: unknown.
    std::fs::remove_file(&file).expect("rm");
    assert_eq!(probe.delta(), None);
    assert!(CgroupOomProbe::from_file(Path::new("/nonexistent/memory.events")).is_none());
}

#[test]
fn probe_for_this_process_matches_resolution() {
    let me = std::process::id();
    let cg = std::fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let resolved = counter_file(&parse_proc_cgroup(&cg), &parse_mountinfo(&mounts));
    let probe = CgroupOomProbe::for_pid(me);
    match resolved {
        Some((file, _)) if file.exists() => {
            let probe = probe.expect("counter file exists, so the probe must work");
            assert_eq!(probe.file(), file.as_path());
            assert!(probe.delta().is_some());
        }
        _ => assert!(probe.is_none()),
    }
    assert!(CgroupOomProbe::for_pid(u32::MAX).is_none());
}
