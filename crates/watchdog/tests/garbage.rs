//! Never-panic properties of the other pure parsers, and LogTail bounds.

use proptest::prelude::*;
use rootrank_watchdog::cgroup::{parse_mountinfo, parse_oom_counters, parse_proc_cgroup};
use rootrank_watchdog::pidfd::parse_stat_start_time;
use rootrank_watchdog::LogTail;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn host_file_parsers_never_panic(s in "[0-9a-z:/ ,()=\\\\\n.-]{0,300}", t in any::<String>()) {
        for input in [&s, &t] {
            let _ = parse_proc_cgroup(input);
            let _ = parse_mountinfo(input);
            let _ = parse_oom_counters(input);
            let _ = parse_stat_start_time(input);
        }
    }

    #[test]
    fn log_tail_stays_bounded(
        chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 0..40),
        max_lines in 1usize..8,
        max_bytes in 1usize..64,
    ) {
        let mut tail = LogTail::new(max_lines, max_bytes);
        for c in &chunks {
            tail.feed(c);
        }
        tail.finish();
        prop_assert!(tail.len() <= max_lines);
        for line in tail.lines() {
            prop_assert!(line.len() <= max_bytes, "{} > {}", line.len(), max_bytes);
            prop_assert!(!line.contains('\n'));
        }
    }
}

#[test]
fn log_tail_with_huge_caps_does_not_overflow() {
    let mut tail = LogTail::new(usize::MAX, usize::MAX);
    tail.feed(b"a\nb");
    tail.finish();
    assert_eq!(tail.lines().collect::<Vec<_>>(), ["a", "b"]);
}
