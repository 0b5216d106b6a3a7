//! When a watch on etcd has gone silent. A blackholed etcd (packets dropped, no reset, no
//! error) leaves a watch stream open and quiet for ever, and its follower blind while it
//! believes itself current. Both followers (the coordinator's and node-watch's) ask etcd for a
//! progress notification every `every` and give the watch up when etcd has said nothing (no
//! event, no progress notification) for `limit`; they then re-create it from their last
//! revision + 1, on whichever endpoint answers.
//!
//! A pure state machine: the clock is passed in, the follower acts on what [`Silence::poll`]
//! returns and sleeps until [`Silence::poll_timeout`].

use std::time::{Duration, Instant};

/// What the follower does now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SilenceAction {
    /// Nothing until [`Silence::poll_timeout`].
    Wait,
    /// Ask etcd for a progress notification (`WatchClient::request_progress`).
    RequestProgress,
    /// etcd said nothing for the limit: give the watch up (and stop calling itself current).
    GiveUp,
}

/// The silence of one watch stream.
#[derive(Clone, Debug)]
pub struct Silence {
    every: Duration,
    limit: Duration,
    last_heard: Instant,
    next_request: Instant,
}

/// How often a follower asks etcd for progress.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// How long etcd may stay silent before a follower gives its watch up: the partition-detection
/// bound, plus up to one [`PROGRESS_EVERY`].
pub const SILENT_LIMIT: Duration = Duration::from_secs(3);

/// How long etcd may stay silent on a watch that has events still to send (its `created`
/// answer was ahead of the revision applied): etcd 3.4 reads and encodes a revision of
/// 16,000 deletes for seconds under read load, answering nothing meanwhile, and a watch given
/// up then starts the same work again, for ever.
pub const CATCH_UP_SILENT_LIMIT: Duration = Duration::from_secs(30);

impl Silence {
    /// A watch opened at `now` (its creation counts as hearing from etcd).
    pub fn new(now: Instant, every: Duration, limit: Duration) -> Self {
        Silence {
            every,
            limit,
            last_heard: now,
            next_request: now + every,
        }
    }

    /// The followers' bounds: [`PROGRESS_EVERY`], [`SILENT_LIMIT`].
    pub fn standard(now: Instant) -> Self {
        Silence::new(now, PROGRESS_EVERY, SILENT_LIMIT)
    }

    /// Changes how long etcd may stay silent (a watch catching up on a large backlog may
    /// take longer than [`SILENT_LIMIT`] to send its next message).
    pub fn set_limit(&mut self, limit: Duration) {
        self.limit = limit;
    }

    /// etcd said something on the watch (events, a progress notification).
    pub fn heard(&mut self, now: Instant) {
        self.last_heard = self.last_heard.max(now);
    }

    /// When [`Silence::poll`] next has something to do.
    pub fn poll_timeout(&self) -> Instant {
        self.next_request.min(self.last_heard + self.limit)
    }

    /// What to do at `now`. Called at [`Silence::poll_timeout`], it always moves on (a request
    /// schedules the next one; the limit gives up), so a follower never spins.
    pub fn poll(&mut self, now: Instant) -> SilenceAction {
        if now.saturating_duration_since(self.last_heard) >= self.limit {
            return SilenceAction::GiveUp;
        }
        if now >= self.next_request {
            self.next_request = now + self.every;
            return SilenceAction::RequestProgress;
        }
        SilenceAction::Wait
    }

    /// How long etcd has said nothing, at `now`.
    pub fn silent_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_heard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn asks_for_progress_every_interval_and_gives_up_after_the_limit() {
        let t0 = Instant::now();
        let mut s = Silence::new(t0, S, 3 * S);
        assert_eq!(s.poll_timeout(), t0 + S);
        assert_eq!(s.poll(t0 + S / 2), SilenceAction::Wait);
        assert_eq!(s.poll(t0 + S), SilenceAction::RequestProgress);
        assert_eq!(s.poll(t0 + S), SilenceAction::Wait, "one request per interval");
        assert_eq!(s.poll_timeout(), t0 + 2 * S);
        assert_eq!(s.poll(t0 + 2 * S), SilenceAction::RequestProgress);
        assert_eq!(s.poll(t0 + 3 * S), SilenceAction::GiveUp);
        assert_eq!(s.silent_for(t0 + 3 * S), 3 * S);
    }

    #[test]
    fn hearing_from_etcd_moves_the_limit() {
        let t0 = Instant::now();
        let mut s = Silence::new(t0, S, 3 * S);
        s.heard(t0 + 2 * S);
        assert_eq!(s.poll(t0 + 4 * S), SilenceAction::RequestProgress);
        assert_eq!(s.poll_timeout(), t0 + 5 * S);
        assert_eq!(s.poll(t0 + 5 * S), SilenceAction::GiveUp);
        // A late (older) observation never moves it back.
        s.heard(t0);
        assert_eq!(s.silent_for(t0 + 5 * S), 3 * S);
    }

    #[test]
    fn polling_at_each_timeout_always_makes_progress() {
        // Driven only by its own deadlines, with no word from etcd: some requests, then it
        // gives up, in a bounded number of steps (no spin at an instant).
        let t0 = Instant::now();
        let mut s = Silence::new(t0, S, Duration::from_millis(3500));
        let mut requests = 0;
        for _ in 0..10 {
            let at = s.poll_timeout();
            match s.poll(at) {
                SilenceAction::RequestProgress => requests += 1,
                SilenceAction::GiveUp => {
                    assert_eq!(requests, 3);
                    assert_eq!(at, t0 + Duration::from_millis(3500));
                    return;
                }
                SilenceAction::Wait => panic!("poll at its own timeout did nothing"),
            }
        }
        panic!("never gave up");
    }
}
