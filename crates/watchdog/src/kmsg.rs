//! Pure parser for kernel log lines: the two kinds of kernel message that
//! explain why a rank died without the rank getting a say (the OOM killer and
//! NVIDIA Xid errors).
//!
//! Input may be a raw `/dev/kmsg` record (`"6,1234,5678901,-;message"` with
//! optional continuation lines that start with a space), a `dmesg` line
//! (`"[12345.678901] message"`), a journal line with a `kernel: ` prefix, or a
//! bare message. Anything that is not an OOM kill or an Xid yields `None`;
//! nothing here panics, whatever the bytes.

/// One parsed kernel event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelEvent {
    OomKill(OomKill),
    GpuXid(GpuXid),
}

impl KernelEvent {
    /// Kernel timestamp (µs since boot, printk clock) when the input carried one.
    pub fn kernel_time_us(&self) -> Option<u64> {
        match self {
            KernelEvent::OomKill(o) => o.kernel_time_us,
            KernelEvent::GpuXid(x) => x.kernel_time_us,
        }
    }
}

/// What the OOM killer said about one victim. A single kill is spread over
/// several lines (the `oom-kill:` summary, then `Killed process ...`), each
/// of which parses to an `OomKill` with the fields that line carries;
/// [`OomKill::merge_from`] combines them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OomKill {
    /// Thread-group id of the victim, in the kernel's (init) pid namespace.
    pub pid: u32,
    /// The victim's `comm` (at most 15 bytes in the kernel).
    pub comm: String,
    /// `CONSTRAINT_NONE`, `CONSTRAINT_MEMCG`, `CONSTRAINT_CPUSET`, ...
    pub constraint: Option<String>,
    /// The memory cgroup whose limit was hit (`oom_memcg=`), for memcg OOMs.
    pub oom_memcg: Option<String>,
    /// The victim's own memory cgroup (`task_memcg=`).
    pub task_memcg: Option<String>,
    /// True when the line said "Memory cgroup out of memory" (a cgroup
    /// limit, not the whole host, ran out).
    pub memcg_oom: bool,
    pub total_vm_kb: Option<u64>,
    pub anon_rss_kb: Option<u64>,
    pub file_rss_kb: Option<u64>,
    pub shmem_rss_kb: Option<u64>,
    pub pgtables_kb: Option<u64>,
    pub uid: Option<u32>,
    pub oom_score_adj: Option<i32>,
    /// Badness score from the old (≤ 5.0) "Kill process ... score N" line.
    pub score: Option<u64>,
    pub kernel_time_us: Option<u64>,
}

impl OomKill {
    /// Fills every field this record lacks from `other` (another line about
    /// the same kill). Fields already known are kept: the first line seen
    /// wins, which matters for rss (the reaper's later numbers are ~0).
    pub fn merge_from(&mut self, other: &OomKill) {
        fn fill<T: Clone>(dst: &mut Option<T>, src: &Option<T>) {
            if dst.is_none() {
                dst.clone_from(src);
            }
        }
        if self.comm.is_empty() {
            self.comm.clone_from(&other.comm);
        }
        fill(&mut self.constraint, &other.constraint);
        fill(&mut self.oom_memcg, &other.oom_memcg);
        fill(&mut self.task_memcg, &other.task_memcg);
        self.memcg_oom |= other.memcg_oom;
        fill(&mut self.total_vm_kb, &other.total_vm_kb);
        fill(&mut self.anon_rss_kb, &other.anon_rss_kb);
        fill(&mut self.file_rss_kb, &other.file_rss_kb);
        fill(&mut self.shmem_rss_kb, &other.shmem_rss_kb);
        fill(&mut self.pgtables_kb, &other.pgtables_kb);
        fill(&mut self.uid, &other.uid);
        fill(&mut self.oom_score_adj, &other.oom_score_adj);
        fill(&mut self.score, &other.score);
        fill(&mut self.kernel_time_us, &other.kernel_time_us);
    }
}

/// An NVIDIA driver Xid report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuXid {
    /// Normalized `dddd:bb:dd` (lowercase hex, no function), see
    /// [`normalize_pci_bus_id`]; the raw text lowercased if it did not parse.
    pub pci_bus_id: String,
    pub code: u32,
    /// The process the driver blamed, when it named one (drivers ≥ 470 or so
    /// print `pid=`; `'<unknown>'` becomes `None`).
    pub pid: Option<u32>,
    pub process_name: Option<String>,
    /// The driver's description, trailing period removed.
    pub text: String,
    pub kernel_time_us: Option<u64>,
}

impl GpuXid {
    /// Whether this Xid is about the GPU with `bus_id`, in any usual form.
    pub fn matches_bus_id(&self, bus_id: &str) -> bool {
        match normalize_pci_bus_id(bus_id) {
            Some(n) => n == self.pci_bus_id,
            None => false,
        }
    }
}

/// Parses one kernel log line or `/dev/kmsg` record. `None` for anything
/// that is not an OOM kill or an Xid, including continuation lines.
pub fn parse_line(input: &str) -> Option<KernelEvent> {
    let (ts, msg) = split_header(input)?;
    let mut event = parse_message(msg)?;
    match &mut event {
        KernelEvent::OomKill(o) => o.kernel_time_us = ts,
        KernelEvent::GpuXid(x) => x.kernel_time_us = ts,
    }
    Some(event)
}

/// [`parse_line`] for raw bytes (a `read()` from `/dev/kmsg`); invalid UTF-8
/// is replaced, never rejected.
pub fn parse_bytes(input: &[u8]) -> Option<KernelEvent> {
    parse_line(&String::from_utf8_lossy(input))
}

/// Splits the timestamp off a record or dmesg line. Returns `None` for a
/// continuation line (they carry `KEY=value` metadata, never a message).
fn split_header(input: &str) -> Option<(Option<u64>, &str)> {
    // A /dev/kmsg read returns the record plus its continuation lines; the
    // message is the first line only.
    let first = input.split('\n').next().unwrap_or("");
    if first.starts_with(' ') {
        return None;
    }
    let first = first.trim_end_matches('\r');
    if let Some(r) = split_kmsg_header(first) {
        return Some(r);
    }
    if let Some(r) = split_dmesg_header(first.trim_start()) {
        return Some(r);
    }
    // `dmesg -T`: "[Wed Dec  2 15:00:00 2026] message" (no usable stamp).
    if first.starts_with('[') {
        if let Some((_, msg)) = first.split_once("] ") {
            return Some((None, msg));
        }
    }
    // journalctl -k / syslog: "Dec 02 10:00:00 host kernel: message".
    if let Some(i) = first.find("kernel: ") {
        let rest = &first[i + "kernel: ".len()..];
        if let Some(r) = split_dmesg_header(rest.trim_start()) {
            return Some(r);
        }
        return Some((None, rest));
    }
    Some((None, first))
}

/// `prio,seq,timestamp_us,flags[,...];message`.
fn split_kmsg_header(line: &str) -> Option<(Option<u64>, &str)> {
    let (header, msg) = line.split_once(';')?;
    let mut fields = header.split(',');
    let prio = fields.next()?;
    let seq = fields.next()?;
    let ts = fields.next()?;
    if !is_digits(prio) || !is_digits(seq) || !is_digits(ts) {
        return None;
    }
    Some((ts.parse::<u64>().ok(), msg))
}

/// `[ 12345.678901] message`.
fn split_dmesg_header(line: &str) -> Option<(Option<u64>, &str)> {
    let rest = line.strip_prefix('[')?;
    let (stamp, msg) = rest.split_once(']')?;
    let (secs, frac) = stamp.trim().split_once('.')?;
    if !is_digits(secs) || !is_digits(frac) {
        return None;
    }
    let secs: u64 = secs.parse().ok()?;
    // dmesg prints 6 fractional digits; scale whatever is there to µs.
    let frac_digits: String = frac.chars().take(6).collect();
    let scale = 10u64.pow(6 - frac_digits.len() as u32);
    let micros = frac_digits.parse::<u64>().ok()?.checked_mul(scale)?;
    let ts = secs.checked_mul(1_000_000).and_then(|s| s.checked_add(micros));
    Some((ts, msg.strip_prefix(' ').unwrap_or(msg)))
}

fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

fn parse_message(msg: &str) -> Option<KernelEvent> {
    let msg = msg.trim();
    if let Some(x) = parse_xid(msg) {
        return Some(KernelEvent::GpuXid(x));
    }
    parse_oom(msg).map(KernelEvent::OomKill)
}

fn parse_oom(msg: &str) -> Option<OomKill> {
    if let Some(summary) = msg.strip_prefix("oom-kill:") {
        return parse_oom_summary(summary);
    }
    let (rest, memcg_oom) = if let Some(r) = msg.strip_prefix("Memory cgroup out of memory: ") {
        (r, true)
    } else if let Some(r) = msg.strip_prefix("Out of memory") {
        // "Out of memory: ..." and "Out of memory (oom_kill_allocating_task): ...".
        let (_, r) = r.split_once(": ")?;
        (r, false)
    } else {
        (msg, false)
    };
    if let Some(r) = rest.strip_prefix("Killed process ") {
        let (pid, comm, tail) = pid_and_comm(r, " total-vm:")?;
        let mut o = OomKill {
            pid,
            comm,
            memcg_oom,
            ..OomKill::default()
        };
        // "total-vm:1kB, anon-rss:2kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:4kB oom_score_adj:0"
        for tok in tail.split(|c: char| c == ',' || c.is_whitespace()) {
            let Some((k, v)) = tok.split_once(':') else {
                continue;
            };
            let v = v.strip_suffix("kB").unwrap_or(v);
            match k {
                "total-vm" => o.total_vm_kb = v.parse().ok(),
                "anon-rss" => o.anon_rss_kb = v.parse().ok(),
                "file-rss" => o.file_rss_kb = v.parse().ok(),
                "shmem-rss" => o.shmem_rss_kb = v.parse().ok(),
                "pgtables" => o.pgtables_kb = v.parse().ok(),
                "UID" => o.uid = v.parse().ok(),
                "oom_score_adj" => o.oom_score_adj = v.parse().ok(),
                _ => {}
            }
        }
        return Some(o);
    }
    if let Some(r) = rest.strip_prefix("Kill process ") {
        // ≤ 5.0: "Kill process 1234 (python) score 999 or sacrifice child".
        let (pid, comm, tail) = pid_and_comm(r, " score ")?;
        let score = tail
            .trim_start()
            .strip_prefix("score ")
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok());
        return Some(OomKill {
            pid,
            comm,
            memcg_oom,
            score,
            ..OomKill::default()
        });
    }
    None
}

/// Parses `1234 (comm) tail`; `comm` may contain spaces and parentheses, so
/// it ends at the `)` right before `end_marker` when present, else at the
/// last `)`.
fn pid_and_comm<'a>(s: &'a str, end_marker: &str) -> Option<(u32, String, &'a str)> {
    let (pid, rest) = s.split_once(' ')?;
    let pid: u32 = pid.trim_end_matches(',').parse().ok()?;
    let rest = rest.strip_prefix('(')?;
    let close = match rest.find(end_marker) {
        Some(i) if rest[..i].ends_with(')') => i - 1,
        _ => rest.rfind(')')?,
    };
    let comm = rest[..close].to_string();
    Some((pid, comm, &rest[close + 1..]))
}

/// `constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/a,task_memcg=/a/b,task=python3,pid=1234,uid=0`
fn parse_oom_summary(s: &str) -> Option<OomKill> {
    let mut pairs: Vec<(&str, String)> = Vec::new();
    for tok in s.split(',') {
        if let Some((k, v)) = tok.split_once('=') {
            pairs.push((k, v.to_string()));
        } else if tok.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
            // A bare flag such as `global_oom`.
            pairs.push((tok, String::new()));
        } else if let Some(last) = pairs.last_mut() {
            // Node lists (`mems_allowed=0-1,3`) contain commas themselves.
            last.1.push(',');
            last.1.push_str(tok);
        }
    }
    let mut o = OomKill::default();
    let mut have_pid = false;
    for (k, v) in pairs {
        match k {
            "constraint" => o.constraint = Some(v),
            "oom_memcg" => o.oom_memcg = Some(v),
            "task_memcg" => o.task_memcg = Some(v),
            "task" => o.comm = v,
            "pid" => {
                o.pid = v.parse().ok()?;
                have_pid = true;
            }
            "uid" => o.uid = v.parse().ok(),
            _ => {}
        }
    }
    if o.constraint.as_deref() == Some("CONSTRAINT_MEMCG") {
        o.memcg_oom = true;
    }
    have_pid.then_some(o)
}

/// `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.`
/// and the older `NVRM: Xid (PCI:0000:3b:00): 31, Ch 00000018, intr 10000000. ...`.
fn parse_xid(msg: &str) -> Option<GpuXid> {
    let start = msg.find("NVRM: Xid (")?;
    let rest = &msg[start + "NVRM: Xid (".len()..];
    let (bus_raw, rest) = rest.split_once("):")?;
    let bus_raw = bus_raw.trim();
    let pci_bus_id = normalize_pci_bus_id(bus_raw).unwrap_or_else(|| {
        let b = strip_prefix_ignore_case(bus_raw, "PCI:").unwrap_or(bus_raw);
        b.to_ascii_lowercase()
    });
    let rest = rest.trim_start();
    let code_end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    let code: u32 = rest[..code_end].parse().ok()?;
    let mut rest = rest[code_end..].trim_start_matches(',').trim_start();
    let mut pid = None;
    let mut process_name = None;
    if let Some(r) = rest.strip_prefix("pid=") {
        let (v, r) = r.split_once(',').unwrap_or((r, ""));
        pid = v.trim().trim_matches('\'').parse().ok();
        rest = r.trim_start();
        if let Some(r) = rest.strip_prefix("name=") {
            let (v, r) = r.split_once(", ").unwrap_or((r, ""));
            let v = v.trim().trim_end_matches(',');
            if !v.is_empty() && v != "<unknown>" {
                process_name = Some(v.to_string());
            }
            rest = r.trim_start();
        }
    }
    let text = rest.trim().trim_end_matches('.').trim_end().to_string();
    Some(GpuXid {
        pci_bus_id,
        code,
        pid,
        process_name,
        text,
        kernel_time_us: None,
    })
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    if head.eq_ignore_ascii_case(prefix) {
        s.get(prefix.len()..)
    } else {
        None
    }
}

/// Normalizes a PCI bus id to the `dddd:bb:dd` form the NVIDIA driver uses
/// in Xid lines: lowercase hex, 4-digit domain, no function. Accepts
/// nvidia-smi's `00000000:3B:00.0`, sysfs' `0000:3b:00.0`, the Xid's own
/// `0000:3b:00` or `PCI:0000:3b:00`, and a domain-less `3b:00.0`.
pub fn normalize_pci_bus_id(id: &str) -> Option<String> {
    let id = id.trim();
    let id = strip_prefix_ignore_case(id, "PCI:").unwrap_or(id);
    let parts: Vec<&str> = id.split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [d, b, df] => (Some(*d), *b, *df),
        [b, df] => (None, *b, *df),
        _ => return None,
    };
    let domain = match domain {
        Some(d) => hex_u32(d, 8)?,
        None => 0,
    };
    let bus = hex_u32(bus, 2)?;
    let (dev, func) = match devfn.split_once('.') {
        Some((d, f)) => (d, Some(f)),
        None => (devfn, None),
    };
    let dev = hex_u32(dev, 2)?;
    if dev > 0x1f {
        return None;
    }
    if let Some(f) = func {
        if hex_u32(f, 1)? > 7 {
            return None;
        }
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}"))
}

/// Whether two PCI bus ids name the same device, in any of the forms
/// [`normalize_pci_bus_id`] accepts. Unparseable ids never match.
pub fn pci_bus_ids_match(a: &str, b: &str) -> bool {
    match (normalize_pci_bus_id(a), normalize_pci_bus_id(b)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

fn hex_u32(s: &str, max_len: usize) -> Option<u32> {
    if s.is_empty() || s.len() > max_len || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom(line: &str) -> OomKill {
        match parse_line(line) {
            Some(KernelEvent::OomKill(o)) => o,
            other => panic!("expected OomKill from {line:?}, got {other:?}"),
        }
    }

    fn xid(line: &str) -> GpuXid {
        match parse_line(line) {
            Some(KernelEvent::GpuXid(x)) => x,
            other => panic!("expected GpuXid from {line:?}, got {other:?}"),
        }
    }

    #[test]
    fn kmsg_record_with_continuation_lines() {
        let rec = "3,2031,987654321,-;Out of memory: Killed process 4242 (python3) total-vm:1000kB, anon-rss:900kB, file-rss:10kB, shmem-rss:0kB, UID:1000 pgtables:40kB oom_score_adj:0\n SUBSYSTEM=memory\n";
        let o = oom(rec);
        assert_eq!(o.pid, 4242);
        assert_eq!(o.comm, "python3");
        assert_eq!(o.kernel_time_us, Some(987_654_321));
        assert_eq!(o.anon_rss_kb, Some(900));
        assert_eq!(o.uid, Some(1000));
        assert_eq!(o.pgtables_kb, Some(40));
        assert_eq!(o.oom_score_adj, Some(0));
        assert!(!o.memcg_oom);
        assert_eq!(parse_line(" SUBSYSTEM=pci"), None);
        assert_eq!(parse_line(" DEVICE=+pci:0000:3b:00.0"), None);
    }

    #[test]
    fn dmesg_human_timestamps() {
        let o = oom("[Wed Dec  2 15:00:00 2026] Out of memory: Killed process 8 (p) total-vm:1kB, anon-rss:2kB");
        assert_eq!((o.pid, o.kernel_time_us), (8, None));
    }

    #[test]
    fn comm_with_spaces_and_parens() {
        let o = oom("[1.5] Out of memory: Killed process 7 (a (b) c) total-vm:1kB, anon-rss:2kB");
        assert_eq!(o.comm, "a (b) c");
        assert_eq!(o.anon_rss_kb, Some(2));
        assert_eq!(o.kernel_time_us, Some(1_500_000));
    }

    #[test]
    fn summary_with_node_list_commas() {
        let o = oom("oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,3,global_oom,task_memcg=/user.slice,task=vllm,pid=99,uid=0");
        assert_eq!(o.pid, 99);
        assert_eq!(o.comm, "vllm");
        assert_eq!(o.constraint.as_deref(), Some("CONSTRAINT_NONE"));
        assert_eq!(o.task_memcg.as_deref(), Some("/user.slice"));
        assert_eq!(o.oom_memcg, None);
        assert!(!o.memcg_oom);
    }

    #[test]
    fn merge_keeps_first_seen_fields() {
        let mut a = oom("oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/k,task_memcg=/k/r,task=python3,pid=5,uid=0");
        let b = oom("Memory cgroup out of memory: Killed process 5 (python3) total-vm:10kB, anon-rss:8kB, file-rss:0kB, shmem-rss:0kB");
        a.merge_from(&b);
        assert_eq!(a.anon_rss_kb, Some(8));
        assert_eq!(a.oom_memcg.as_deref(), Some("/k"));
        assert!(a.memcg_oom);
    }

    #[test]
    fn xid_forms() {
        let x = xid("NVRM: Xid (PCI:0000:3B:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.");
        assert_eq!(x.pci_bus_id, "0000:3b:00");
        assert_eq!(x.code, 79);
        assert_eq!(x.pid, None);
        assert_eq!(x.process_name, None);
        assert_eq!(x.text, "GPU has fallen off the bus");
        let x = xid("NVRM: Xid (0000:03:00): 13, 0001 00000000 0000a097 00001b0c 00000004 00000000");
        assert_eq!(x.pci_bus_id, "0000:03:00");
        assert_eq!(x.code, 13);
        assert_eq!(x.pid, None);
        assert_eq!(parse_line("NVRM: Xid (PCI:0000:3b:00): notanumber, whatever"), None);
    }

    #[test]
    fn bus_id_forms() {
        for id in [
            "00000000:3B:00.0",
            "0000:3b:00.0",
            "0000:3b:00",
            "PCI:0000:3b:00",
            "3b:00.0",
            " 0000:3B:00.0 ",
        ] {
            assert_eq!(normalize_pci_bus_id(id).as_deref(), Some("0000:3b:00"), "{id}");
        }
        assert!(pci_bus_ids_match("00000000:3B:00.0", "0000:3b:00"));
        assert!(!pci_bus_ids_match("00000000:3B:00.0", "0000:3c:00"));
        assert!(!pci_bus_ids_match("garbage", "garbage"));
        for bad in ["", ":", "0000:3b", "0000:3b:20.0", "0000:3b:00.8", "x:y:z", "+1:2:3"] {
            assert_eq!(normalize_pci_bus_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn unrelated_lines_are_none() {
        for l in [
            "",
            ";",
            "6,1,2,-;",
            "[    0.000000] Linux version 6.1.0",
            "oom_reaper: reaped process 4242 (python3), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB",
            "python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
            "Killed process abc (x)",
            "oom-kill:constraint=CONSTRAINT_NONE,task=x",
            "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.154.05",
        ] {
            assert_eq!(parse_line(l), None, "{l:?}");
        }
    }
}
