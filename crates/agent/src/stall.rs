//! When a rank's loop stops advancing (SPEC v3 `RankStall`): a deterministic state machine,
//! fed the host's progress count and a monotonic time in ms; the agent thread's shell reads
//! the clock, calls [`StallDetector::observe`] at [`StallDetector::poll_timeout`], and writes
//! or deletes the stall key as told.
//!
//! The host counts progress with one relaxed atomic add per loop iteration ([`crate::Agent::
//! progress`]); nothing here runs on the host's thread, so a host wedged holding the GIL is
//! still seen. Detection is armed by the first progress: a host that never counts is never
//! called stalled.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Milliseconds on the process's monotonic clock (one origin for the host's `progress()`
/// stamps and the stall watch's own reads).
pub fn monotonic_ms() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let origin = *ORIGIN.get_or_init(Instant::now);
    u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// What the shell must do after an observation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StallAction {
    /// Write the stall record: the loop last advanced at `since_ms` and has not for
    /// `stalled_ms` (both in the detector's clock).
    Stalled { since_ms: u64, stalled_ms: u64 },
    /// Delete the stall record: the loop advanced again.
    Resumed,
}

#[derive(Debug)]
pub struct StallDetector {
    stall_after_ms: u64,
    /// The count last seen and when it last changed; `None` until the first progress.
    last: Option<(u64, u64)>,
    stalled: bool,
}

impl StallDetector {
    pub fn new(stall_after: Duration) -> Self {
        StallDetector {
            stall_after_ms: u64::try_from(stall_after.as_millis()).unwrap_or(u64::MAX).max(1),
            last: None,
            stalled: false,
        }
    }

    pub fn is_stalled(&self) -> bool {
        self.stalled
    }

    /// Feeds the progress count, when the host last counted (`progressed_at_ms`, its own
    /// stamp: the stall is timed from there, not from when this watch noticed), at `now_ms`.
    pub fn observe(&mut self, count: u64, progressed_at_ms: u64, now_ms: u64) -> Option<StallAction> {
        match self.last {
            None if count == 0 => None,
            Some((seen, _)) if seen == count => {
                let (_, changed_at) = self.last?;
                let idle = now_ms.saturating_sub(changed_at);
                if !self.stalled && idle >= self.stall_after_ms {
                    self.stalled = true;
                    return Some(StallAction::Stalled {
                        since_ms: changed_at,
                        stalled_ms: idle,
                    });
                }
                None
            }
            _ => {
                self.last = Some((count, progressed_at_ms.min(now_ms)));
                if self.stalled {
                    self.stalled = false;
                    return Some(StallAction::Resumed);
                }
                None
            }
        }
    }

    /// When to observe next: a quarter of `stall_after` apart while advancing (a stall is
    /// reported at most that late), at the stall deadline exactly when it is near, and as
    /// often while stalled (a resumption is reported as late at most).
    pub fn poll_timeout(&self, now_ms: u64) -> u64 {
        let step = (self.stall_after_ms / 4).clamp(10, 1_000);
        match self.last {
            Some((_, changed_at)) if !self.stalled => {
                let deadline = changed_at.saturating_add(self.stall_after_ms);
                deadline.min(now_ms.saturating_add(step)).max(now_ms.saturating_add(1))
            }
            _ => now_ms.saturating_add(step),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn armed_by_the_first_progress_stalls_once_and_resumes() {
        let mut d = StallDetector::new(Duration::from_millis(1000));
        assert_eq!(d.observe(0, 0, 0), None);
        assert_eq!(d.observe(0, 50_000, 50_000), None, "never counted: never stalled");
        assert_eq!(d.observe(1, 50_000, 50_000), None);
        assert_eq!(d.observe(5, 50_400, 50_400), None);
        assert_eq!(d.poll_timeout(50_400), 50_650);
        assert_eq!(d.observe(5, 51_399, 51_399), None);
        assert_eq!(d.poll_timeout(51_399), 51_400, "the deadline exactly");
        assert_eq!(
            d.observe(5, 51_400, 51_400),
            Some(StallAction::Stalled {
                since_ms: 50_400,
                stalled_ms: 1000
            })
        );
        assert!(d.is_stalled());
        assert_eq!(d.observe(5, 60_000, 60_000), None, "said once");
        assert_eq!(d.observe(6, 60_100, 60_100), Some(StallAction::Resumed));
        assert!(!d.is_stalled());
        assert_eq!(d.observe(6, 61_099, 61_099), None);
        assert!(matches!(
            d.observe(6, 61_100, 61_100),
            Some(StallAction::Stalled { since_ms: 60_100, .. })
        ));
    }

    #[test]
    fn a_stall_is_timed_from_the_hosts_own_stamp_not_from_when_the_watch_looked() {
        // Two ranks stop 30 ms apart; the watch looks every 250 ms and sees both at once.
        let (mut a, mut b) = (
            StallDetector::new(Duration::from_millis(1000)),
            StallDetector::new(Duration::from_millis(1000)),
        );
        a.observe(7, 10_000, 10_100);
        b.observe(9, 10_030, 10_100);
        assert_eq!(a.poll_timeout(10_100), 10_350);
        assert_eq!(
            a.observe(7, 10_000, 11_000),
            Some(StallAction::Stalled {
                since_ms: 10_000,
                stalled_ms: 1000
            })
        );
        assert_eq!(b.observe(9, 10_030, 11_000), None);
        assert_eq!(b.poll_timeout(11_000), 11_030, "its own deadline, 30 ms later");
        assert!(matches!(
            b.observe(9, 10_030, 11_030),
            Some(StallAction::Stalled { since_ms: 10_030, .. })
        ));
    }

    #[test]
    fn a_counter_that_wraps_or_jumps_is_progress() {
        let mut d = StallDetector::new(Duration::from_millis(100));
        d.observe(u64::MAX, 0, 0);
        assert_eq!(d.observe(3, 500, 500), None);
        assert!(matches!(d.observe(3, 600, 600), Some(StallAction::Stalled { .. })));
    }
}
