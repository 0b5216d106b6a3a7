//! What a live record says about its process, from `/proc` (SPEC section 4): the pid
//! namespace (`pid_ns`) its `pid` belongs to and its start time (`start_ticks`), so whoever
//! acts on the pid can map it to its own namespace and check it is still the same process.
//! Every read is `None` when `/proc` does not say (never a panic in the host).

/// The inode in a namespace link's target, `pid:[4026531836]`.
pub fn parse_ns_link(target: &str) -> Option<u64> {
    target.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// Field `n` (1-based, `n >= 3`) of a `/proc/PID/stat` line. The command name (field 2) may
/// hold spaces and parentheses, so fields are counted after its last `)`.
fn stat_field(stat: &str, n: usize) -> Option<&str> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    after_comm.split_whitespace().nth(n.checked_sub(3)?)
}

/// Field 22 (`starttime`, clock ticks after boot) of a `/proc/PID/stat` line: the same in
/// every pid namespace, so it tells one process from a later one with the same pid.
pub fn parse_start_ticks(stat: &str) -> Option<u64> {
    stat_field(stat, 22)?.parse().ok()
}

/// Field 4 (`ppid`) of a `/proc/PID/stat` line.
pub fn parse_ppid(stat: &str) -> Option<u32> {
    stat_field(stat, 4)?.parse().ok()
}

/// `/proc/{pid}` or `/proc/self`.
fn proc_dir(pid: Option<u32>) -> String {
    match pid {
        Some(p) => format!("/proc/{p}"),
        None => "/proc/self".to_string(),
    }
}

/// The inode of the pid namespace of `pid` (`None`: this process), as `/proc` shows it.
pub fn pid_ns(pid: Option<u32>) -> Option<u64> {
    let target = std::fs::read_link(format!("{}/ns/pid", proc_dir(pid))).ok()?;
    parse_ns_link(target.to_str()?)
}

/// The start time of `pid` (`None`: this process) in clock ticks after boot.
pub fn start_ticks(pid: Option<u32>) -> Option<u64> {
    parse_start_ticks(&std::fs::read_to_string(format!("{}/stat", proc_dir(pid))).ok()?)
}

/// The parent of `pid`, as this process's `/proc` shows it.
pub fn parent_of(pid: u32) -> Option<u32> {
    parse_ppid(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_links() {
        assert_eq!(parse_ns_link("pid:[4026531836]"), Some(4_026_531_836));
        assert_eq!(parse_ns_link("net:[4026531836]"), None);
        assert_eq!(parse_ns_link("pid:[]"), None);
        assert_eq!(parse_ns_link("pid:[12"), None);
    }

    #[test]
    fn stat_fields_after_a_command_with_spaces_and_parentheses() {
        // A comm of "a) (b c)" shifts naive whitespace splitting by three fields.
        let stat = "4242 (a) (b c)) S 17 4242 4242 0 -1 4194560 120 0 0 0 3 1 0 0 20 0 1 0 987654 \
                    10000 200 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(parse_start_ticks(stat), Some(987_654));
        assert_eq!(parse_ppid(stat), Some(17));
        assert_eq!(parse_start_ticks("4242 (x) S 1 2"), None, "truncated line");
        assert_eq!(parse_start_ticks("no comm at all"), None);
    }

    #[test]
    fn own_process_reads() {
        let me = std::process::id();
        assert!(pid_ns(None).is_some());
        assert_eq!(pid_ns(None), pid_ns(Some(me)));
        assert!(start_ticks(None).is_some());
        assert_eq!(start_ticks(None), start_ticks(Some(me)));
        assert!(parent_of(me).is_some());
        assert_eq!(pid_ns(Some(u32::MAX)), None, "no such process");
    }
}
