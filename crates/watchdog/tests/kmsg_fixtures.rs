//! Kernel log parser against real-format lines from 4.x, 5.x and 6.x
//! kernels (dmesg, journal and raw /dev/kmsg forms), plus garbage.

use std::collections::BTreeMap;

use proptest::prelude::*;
use rootrank_watchdog::kmsg::{self, GpuXid, KernelEvent, OomKill};
use rootrank_watchdog::KernelLog;

const FIXTURE: &str = include_str!("fixtures/kmsg-mixed.txt");

fn s(v: &str) -> Option<String> {
    Some(v.to_string())
}

/// Expected events by 1-based line number; every other line must be None.
fn expected() -> BTreeMap<usize, KernelEvent> {
    let mut m = BTreeMap::new();
    // 4.15 host OOM: selection line, then the kill line.
    m.insert(
        7,
        KernelEvent::OomKill(OomKill {
            pid: 2211,
            comm: "python".into(),
            score: Some(951),
            kernel_time_us: Some(8_812_130_000),
            ..OomKill::default()
        }),
    );
    m.insert(
        8,
        KernelEvent::OomKill(OomKill {
            pid: 2211,
            comm: "python".into(),
            total_vm_kb: Some(78_123_456),
            anon_rss_kb: Some(61_234_564),
            file_rss_kb: Some(0),
            shmem_rss_kb: Some(0),
            kernel_time_us: Some(8_812_130_100),
            ..OomKill::default()
        }),
    );
    // 4.x memcg OOM.
    m.insert(
        10,
        KernelEvent::OomKill(OomKill {
            pid: 3301,
            comm: "python3".into(),
            memcg_oom: true,
            score: Some(1002),
            kernel_time_us: Some(9_001_000_001),
            ..OomKill::default()
        }),
    );
    m.insert(
        11,
        KernelEvent::OomKill(OomKill {
            pid: 3301,
            comm: "python3".into(),
            total_vm_kb: Some(2_345_678),
            anon_rss_kb: Some(1_048_576),
            file_rss_kb: Some(12_345),
            shmem_rss_kb: Some(0),
            kernel_time_us: Some(9_001_000_050),
            ..OomKill::default()
        }),
    );
    // Old Xid forms without pid/name.
    m.insert(
        13,
        KernelEvent::GpuXid(GpuXid {
            pci_bus_id: "0000:3b:00".into(),
            code: 31,
            pid: None,
            process_name: None,
            text: "Ch 00000018, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_34560000. Fault is of type FAULT_PDE ACCESS_TYPE_READ".into(),
            kernel_time_us: Some(3_333_000_001),
        }),
    );
    m.insert(
        14,
        KernelEvent::GpuXid(GpuXid {
            pci_bus_id: "0000:03:00".into(),
            code: 13,
            pid: None,
            process_name: None,
            text: "0001 00000000 0000a097 00001b0c 00000004 00000000".into(),
            kernel_time_us: Some(3_333_000_100),
        }),
    );
    // 5.15 global OOM: summary line, then the kill line.
    m.insert(
        18,
        KernelEvent::OomKill(OomKill {
            pid: 41234,
            comm: "python3".into(),
            constraint: s("CONSTRAINT_NONE"),
            task_memcg: s("/user.slice/user-1000.slice/session-3.scope"),
            uid: Some(1000),
            kernel_time_us: Some(123_456_789_012),
            ..OomKill::default()
        }),
    );
    m.insert(
        19,
        KernelEvent::OomKill(OomKill {
            pid: 41234,
            comm: "python3".into(),
            total_vm_kb: Some(123_456_789),
            anon_rss_kb: Some(98_765_432),
            file_rss_kb: Some(65_536),
            shmem_rss_kb: Some(0),
            uid: Some(1000),
            pgtables_kb: Some(192_512),
            oom_score_adj: Some(0),
            kernel_time_us: Some(123_456_789_100),
            ..OomKill::default()
        }),
    );
    m.insert(
        20,
        KernelEvent::GpuXid(GpuXid {
            pci_bus_id: "0000:3b:00".into(),
            code: 79,
            pid: Some(8123),
            process_name: s("python3"),
            text: "GPU has fallen off the bus".into(),
            kernel_time_us: Some(5_023_111_111),
        }),
    );
    // journalctl -k form.
    m.insert(
        24,
        KernelEvent::GpuXid(GpuXid {
            pci_bus_id: "0000:86:00".into(),
            code: 13,
            pid: Some(4455),
            process_name: s("python3"),
            text: "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address".into(),
            kernel_time_us: None,
        }),
    );
    // 6.8 /dev/kmsg records, memcg OOM in a Kubernetes pod.
    let pod = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice";
    m.insert(
        30,
        KernelEvent::OomKill(OomKill {
            pid: 51515,
            comm: "python3".into(),
            constraint: s("CONSTRAINT_MEMCG"),
            oom_memcg: s(pod),
            task_memcg: Some(format!("{pod}/cri-containerd-abc.scope")),
            memcg_oom: true,
            uid: Some(0),
            kernel_time_us: Some(98_765_432_101),
            ..OomKill::default()
        }),
    );
    m.insert(
        31,
        KernelEvent::OomKill(OomKill {
            pid: 51515,
            comm: "python3".into(),
            memcg_oom: true,
            total_vm_kb: Some(34_567_890),
            anon_rss_kb: Some(16_777_216),
            file_rss_kb: Some(20_480),
            shmem_rss_kb: Some(4096),
            uid: Some(0),
            pgtables_kb: Some(40_960),
            oom_score_adj: Some(-997),
            kernel_time_us: Some(98_765_432_150),
            ..OomKill::default()
        }),
    );
    m.insert(
        32,
        KernelEvent::GpuXid(GpuXid {
            pci_bus_id: "0000:ca:00".into(),
            code: 48,
            pid: None,
            process_name: None,
            text: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0".into(),
            kernel_time_us: Some(98_770_000_000),
        }),
    );
    m.insert(
        35,
        KernelEvent::GpuXid(GpuXid {
            pci_bus_id: "0000:5e:00".into(),
            code: 94,
            pid: Some(2922),
            process_name: s("pt_main_thread"),
            text: "Contained: SM (0x1). RST: No, D-RST: No".into(),
            kernel_time_us: Some(98_771_000_000),
        }),
    );
    // Captured on a 6.18 kernel from a real memcg OOM (tests/real_oom.rs).
    m.insert(
        39,
        KernelEvent::OomKill(OomKill {
            pid: 23950,
            comm: "tail".into(),
            constraint: s("CONSTRAINT_MEMCG"),
            oom_memcg: s("/rootrank-oom-test-23945"),
            task_memcg: s("/rootrank-oom-test-23945"),
            memcg_oom: true,
            uid: Some(0),
            kernel_time_us: Some(971_279_455),
            ..OomKill::default()
        }),
    );
    m.insert(
        40,
        KernelEvent::OomKill(OomKill {
            pid: 23950,
            comm: "tail".into(),
            memcg_oom: true,
            total_vm_kb: Some(68_156),
            anon_rss_kb: Some(65_280),
            file_rss_kb: Some(1568),
            shmem_rss_kb: Some(0),
            uid: Some(0),
            pgtables_kb: Some(172),
            oom_score_adj: Some(0),
            kernel_time_us: Some(971_279_495),
            ..OomKill::default()
        }),
    );
    m
}

#[test]
fn fixture_lines_parse_as_expected() {
    let want = expected();
    let mut seen = 0;
    for (i, line) in FIXTURE.lines().enumerate() {
        let n = i + 1;
        let got = kmsg::parse_line(line);
        assert_eq!(got.as_ref(), want.get(&n), "line {n}: {line}");
        if got.is_some() {
            seen += 1;
        }
    }
    assert_eq!(seen, want.len());
    assert!(FIXTURE.lines().count() > 30, "fixture should mix in unrelated lines");
}

#[test]
fn kmsg_record_read_includes_its_continuation_lines() {
    // One read() from /dev/kmsg returns the record and its dictionary.
    let lines: Vec<&str> = FIXTURE.lines().collect();
    let record = format!("{}\n{}\n{}\n", lines[31], lines[32], lines[33]);
    let got = kmsg::parse_line(&record);
    assert_eq!(got.as_ref(), expected().get(&32));
    assert_eq!(kmsg::parse_bytes(record.as_bytes()).as_ref(), expected().get(&32));
}

#[test]
fn window_merges_lines_of_one_kill_and_answers_queries() {
    let log = KernelLog::unavailable();
    let start = std::time::Instant::now();
    for line in FIXTURE.lines() {
        log.ingest(line);
    }
    // 4.15: score from the selection line, rss from the kill line.
    let o = log.oom_kill_for(2211).expect("oom for 2211");
    assert_eq!(o.score, Some(951));
    assert_eq!(o.anon_rss_kb, Some(61_234_564));
    // 6.8: memcg from the summary, rss from the kill line, one event.
    let o = log.oom_kill_for_since(51515, start).expect("oom for 51515");
    assert_eq!(o.constraint.as_deref(), Some("CONSTRAINT_MEMCG"));
    assert_eq!(o.anon_rss_kb, Some(16_777_216));
    assert!(o.memcg_oom);
    assert!(log.oom_kill_for(999).is_none());
    // Xid by the rank's bus id as nvidia-smi prints it.
    let x = log.xid_for("00000000:3B:00.0", start).expect("xid on 3b");
    assert_eq!(x.code, 79, "latest Xid on the GPU wins");
    assert!(log.xid_for("00000000:CA:00.0", start).is_some());
    assert!(log.xid_for("00000000:3C:00.0", start).is_none());
    assert!(log
        .xid_for(
            "0000:3b:00.0",
            std::time::Instant::now() + std::time::Duration::from_secs(1)
        )
        .is_none());
    // 10 OOM lines about 5 pids merge to 5 events; the 6 Xid lines stay 6.
    assert_eq!(log.len(), 5 + 6);
}

/// Fragments that steer random input into the parsers' deeper branches.
fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("NVRM: Xid (".to_string()),
        Just("PCI:".to_string()),
        Just("): ".to_string()),
        Just("pid=".to_string()),
        Just("name=".to_string()),
        Just("'<unknown>'".to_string()),
        Just("Out of memory: ".to_string()),
        Just("Memory cgroup out of memory: ".to_string()),
        Just("Killed process ".to_string()),
        Just("Kill process ".to_string()),
        Just(" total-vm:".to_string()),
        Just(" score ".to_string()),
        Just("oom-kill:".to_string()),
        Just("constraint=".to_string()),
        Just("kernel: ".to_string()),
        Just("6,1,2,-;".to_string()),
        Just("[ 1.5] ".to_string()),
        Just("kB, ".to_string()),
        "[0-9]{1,25}".prop_map(|s| s),
        "[ (),:;=.\\[\\]\n\\\\a-f]{0,4}".prop_map(|s| s),
        any::<char>().prop_map(|c| c.to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_strings_never_panic(s in any::<String>()) {
        let _ = kmsg::parse_line(&s);
        let _ = kmsg::normalize_pci_bus_id(&s);
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = kmsg::parse_bytes(&b);
    }

    #[test]
    fn structured_garbage_never_panics(parts in proptest::collection::vec(fragment(), 0..24)) {
        let s: String = parts.concat();
        let _ = kmsg::parse_line(&s);
        let _ = kmsg::pci_bus_ids_match(&s, "0000:3b:00");
        let log = KernelLog::unavailable();
        log.ingest(&s);
        let _ = log.oom_kill_for(1);
    }
}
