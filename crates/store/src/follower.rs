//! How a follower keeps a copy of a prefix equal to etcd: the policy of the loop, without
//! its I/O. The coordinator (its index) and node-watch (the ranks of the fleet) run the same
//! [`Follower`] under one shell ([`crate::follow`]), so they connect, reload, re-create a
//! broken watch and notice a silent etcd the same way.
//!
//! ```text
//!  Connecting ──ok──► Loading ──loaded(rev)──► Opening ──opened──► Watching
//!      ▲  failed         │ failed                 │ failed, no       │ broken, canceled,
//!      └── Paused ◄──────┴────────────────────────┴─ answer in time ◄┘ silent
//!                 ▲                                                   │ compacted
//!                 └────────── Loading (a fresh snapshot, no pause) ◄──┘
//! ```
//!
//! - A watch is (re-)created from the last applied revision + 1, so nothing that happened
//!   while it was down is missed; only a compacted start revision needs a new snapshot.
//! - Every failure pauses with the shared [`Backoff`] (jittered, capped at 2 s); etcd's answer
//!   to a new watch (`created`) resets it.
//! - A watch etcd does not open within `open_timeout`, or that stays silent past
//!   [`crate::SILENT_LIMIT`] ([`Silence`]), is given up: a blackholed etcd gives no error.
//! - The follower is current only from a watch's `created` answer until that watch is lost;
//!   it says so with [`Action::Current`] and [`Action::Stale`], and a follower that serves
//!   answers (the coordinator) must refuse them while stale.
//!
//! A pure state machine: inputs and the time in, [`Action`]s out, [`Follower::poll_timeout`]
//! for the next deadline. No clock reads, no I/O; the model test drives it against an
//! in-memory etcd.

use std::time::{Duration, Instant};

use crate::{Backoff, Silence, SilenceAction};

/// What the shell must do now, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Connect to etcd; answer [`Input::Connected`] or [`Input::ConnectFailed`].
    Connect,
    /// Read the whole prefix at one revision into fresh state (the old one keeps serving until
    /// it is complete); answer [`Input::Loaded`] or [`Input::LoadFailed`].
    LoadSnapshot,
    /// Open a watch from this revision; answer [`Input::WatchOpened`] or
    /// [`Input::OpenFailed`] (or nothing, and the deadline gives it up).
    OpenWatch { from_revision: i64, restart: bool },
    /// Drop the watch stream (it is lost or given up).
    DropWatch,
    /// Apply the events received since the last `Apply` (a revision etcd split into
    /// fragments comes whole); the copy is then current to `revision`.
    Apply { revision: i64 },
    /// Ask etcd for a progress notification on the watch.
    RequestProgress,
    /// The copy is current again (etcd confirmed the new watch).
    Current,
    /// The copy is no longer current, and why: refuse to answer from it.
    Stale { why: String },
}

/// What happened, as the shell tells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    Connected,
    ConnectFailed(String),
    /// The snapshot is applied, at this revision.
    Loaded {
        revision: i64,
    },
    LoadFailed(String),
    WatchOpened,
    OpenFailed(String),
    /// One watch response, summarised.
    Message(WatchMessage),
    /// The stream ended or failed.
    StreamEnded(String),
    /// The shell finished applying a message's events.
    Applied,
}

/// What the follower needs to know of a watch response.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WatchMessage {
    /// etcd's answer to the watch's creation.
    pub created: bool,
    /// Non-zero: the start revision was compacted away; events were lost.
    pub compact_revision: i64,
    /// The watch was canceled, with etcd's reason.
    pub canceled: Option<String>,
    /// The highest `mod_revision` among the events, if any.
    pub last_event_revision: Option<i64>,
    /// More of this response follows (etcd split a large revision): nothing is applied
    /// until its last fragment.
    pub fragment: bool,
    /// The response header's revision (etcd's current revision for a progress notification).
    pub header_revision: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Connect,
    Load,
    Open,
}

#[derive(Clone, Debug)]
enum Phase {
    Connecting,
    Loading,
    Opening { deadline: Instant },
    Watching { silence: Silence },
    Paused { until: Instant, then: Step },
}

/// Where a follower is, for logs and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FollowerState {
    Connecting,
    Loading,
    Opening,
    Watching,
    Paused,
}

/// The follow loop's policy (see the module docs).
#[derive(Clone, Debug)]
pub struct Follower {
    phase: Phase,
    /// The last revision applied; `None` until a snapshot is loaded, and again after a
    /// compaction.
    revision: Option<i64>,
    backoff: Backoff,
    open_timeout: Duration,
    current: bool,
    watches_opened: u64,
    /// etcd's revision when the watch was created, while the events up to it are still to
    /// come: etcd may then be silent for longer (see [`crate::CATCH_UP_SILENT_LIMIT`]).
    catching_up_to: Option<i64>,
}

impl Follower {
    /// A follower that connects first; [`Follower::start`] gives its first action.
    pub fn new(backoff: Backoff, open_timeout: Duration) -> Self {
        Follower {
            phase: Phase::Connecting,
            revision: None,
            backoff,
            open_timeout,
            current: false,
            watches_opened: 0,
            catching_up_to: None,
        }
    }

    /// The follower's standard pacing: 50 ms to 2 s between attempts, a watch opened within
    /// the request timeout.
    pub fn standard() -> Self {
        Follower::new(
            Backoff::new(Duration::from_millis(50), Duration::from_secs(2)),
            crate::REQUEST_TIMEOUT,
        )
    }

    pub fn start(&mut self) -> Vec<Action> {
        self.phase = Phase::Connecting;
        vec![Action::Connect]
    }

    pub fn state(&self) -> FollowerState {
        match self.phase {
            Phase::Connecting => FollowerState::Connecting,
            Phase::Loading => FollowerState::Loading,
            Phase::Opening { .. } => FollowerState::Opening,
            Phase::Watching { .. } => FollowerState::Watching,
            Phase::Paused { .. } => FollowerState::Paused,
        }
    }

    /// The last revision applied (`None` before a snapshot, or when a new one is needed).
    pub fn revision(&self) -> Option<i64> {
        self.revision
    }

    /// Whether the copy is current (a watch etcd confirmed, not lost since).
    pub fn is_current(&self) -> bool {
        self.current
    }

    /// When [`Follower::handle_timeout`] next has something to do; `None` while waiting on the
    /// shell (connecting, loading).
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Connecting | Phase::Loading => None,
            Phase::Opening { deadline } => Some(*deadline),
            Phase::Watching { silence } => Some(silence.poll_timeout()),
            Phase::Paused { until, .. } => Some(*until),
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) -> Vec<Action> {
        match &mut self.phase {
            Phase::Connecting | Phase::Loading => Vec::new(),
            Phase::Opening { deadline } if now >= *deadline => {
                let why = format!("etcd did not open a watch within {:?}", self.open_timeout);
                self.lost(now, why, Vec::new())
            }
            Phase::Opening { .. } => Vec::new(),
            Phase::Watching { silence } => match silence.poll(now) {
                SilenceAction::Wait => Vec::new(),
                SilenceAction::RequestProgress => vec![Action::RequestProgress],
                SilenceAction::GiveUp => {
                    let why = format!("etcd said nothing for {:?} (partitioned?)", crate::SILENT_LIMIT);
                    self.lost(now, why, vec![Action::DropWatch])
                }
            },
            Phase::Paused { until, then } if now >= *until => {
                let then = *then;
                self.step(then, now)
            }
            Phase::Paused { .. } => Vec::new(),
        }
    }

    pub fn handle(&mut self, input: Input, now: Instant) -> Vec<Action> {
        match (&mut self.phase, input) {
            (Phase::Connecting, Input::Connected) => match self.revision {
                None => self.step(Step::Load, now),
                Some(_) => self.step(Step::Open, now),
            },
            (Phase::Connecting, Input::ConnectFailed(_)) => {
                self.pause(now, Step::Connect);
                Vec::new()
            }
            (Phase::Loading, Input::Loaded { revision }) => {
                self.revision = Some(revision);
                self.step(Step::Open, now)
            }
            (Phase::Loading, Input::LoadFailed(_)) => {
                self.pause(now, Step::Load);
                Vec::new()
            }
            (Phase::Opening { .. }, Input::WatchOpened) => {
                self.phase = Phase::Watching {
                    silence: Silence::standard(now),
                };
                Vec::new()
            }
            (Phase::Opening { .. }, Input::OpenFailed(why)) => self.lost(now, why, Vec::new()),
            (Phase::Watching { silence }, Input::Message(m)) => {
                silence.heard(now);
                self.on_message(m, now)
            }
            // The shell applied a message: the time that took was etcd talking, not silence
            // (100,000 deaths in one revision take seconds to apply).
            (Phase::Watching { silence }, Input::Applied) => {
                silence.heard(now);
                Vec::new()
            }
            (Phase::Watching { .. }, Input::StreamEnded(why)) => self.lost(now, why, vec![Action::DropWatch]),
            // An answer the follower no longer waits for (a late one, or a message from a
            // watch already given up): nothing to do.
            _ => Vec::new(),
        }
    }

    fn on_message(&mut self, m: WatchMessage, now: Instant) -> Vec<Action> {
        if m.compact_revision > 0 {
            // Events between our revision and the compaction are gone: only a new snapshot
            // can say what happened meanwhile. No pause: etcd answered.
            self.revision = None;
            let why = format!(
                "the watch's start revision was compacted (etcd compacted to {}); reloading from a snapshot",
                m.compact_revision
            );
            let mut actions = vec![Action::DropWatch, self.stale(why)];
            actions.extend(self.step(Step::Load, now));
            return actions;
        }
        if let Some(reason) = m.canceled {
            return self.lost(now, format!("watch canceled: {reason}"), vec![Action::DropWatch]);
        }
        let mut actions = Vec::new();
        let before = self.revision.unwrap_or(0);
        // Only events move the revision a new watch resumes from. A message without events
        // never does: the watch's `created` answer carries etcd's current revision while the
        // events up to it may still be on their way, and etcd 3.4 answers a requested
        // progress notification with its current revision at once, ahead of events still in
        // the stream (etcd-io/etcd#15220). Resuming past either would skip those events for
        // good (a mass lease expiry: thousands of deaths in one revision).
        if m.created && m.header_revision > before {
            self.catching_up_to = Some(m.header_revision);
        }
        // A progress notification only says etcd is there (the message was heard).
        if let Some(last) = m.last_event_revision.filter(|_| !m.fragment) {
            let revision = last.max(before);
            self.revision = Some(revision);
            actions.push(Action::Apply { revision });
        }
        if self.catching_up_to.is_some_and(|to| self.revision.unwrap_or(0) >= to) {
            self.catching_up_to = None;
        }
        if let Phase::Watching { silence } = &mut self.phase {
            silence.set_limit(match self.catching_up_to {
                Some(_) => crate::CATCH_UP_SILENT_LIMIT,
                None => crate::SILENT_LIMIT,
            });
        }
        if m.created {
            self.backoff.reset();
            if !self.current {
                self.current = true;
                actions.push(Action::Current);
            }
        }
        actions
    }

    /// The watch is lost: stale, then a pause before opening a new one.
    fn lost(&mut self, now: Instant, why: String, mut actions: Vec<Action>) -> Vec<Action> {
        actions.push(self.stale(why));
        self.pause(now, Step::Open);
        actions
    }

    fn stale(&mut self, why: String) -> Action {
        self.current = false;
        Action::Stale { why }
    }

    /// Waits a backoff pause before `then` (the shell already said why it failed).
    fn pause(&mut self, now: Instant, then: Step) {
        self.phase = Phase::Paused {
            until: now + self.backoff.next_pause(),
            then,
        };
    }

    fn step(&mut self, step: Step, now: Instant) -> Vec<Action> {
        match step {
            Step::Connect => {
                self.phase = Phase::Connecting;
                vec![Action::Connect]
            }
            Step::Load => {
                self.phase = Phase::Loading;
                vec![Action::LoadSnapshot]
            }
            Step::Open => match self.revision {
                None => self.step(Step::Load, now),
                Some(revision) => {
                    self.catching_up_to = None;
                    self.phase = Phase::Opening {
                        deadline: now + self.open_timeout,
                    };
                    let restart = self.watches_opened > 0;
                    self.watches_opened += 1;
                    vec![Action::OpenWatch {
                        from_revision: revision + 1,
                        restart,
                    }]
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: Duration = Duration::from_secs(5);

    fn follower() -> Follower {
        Follower::new(
            Backoff::with_seed(Duration::from_millis(50), Duration::from_secs(2), 7),
            OPEN,
        )
    }

    fn created(rev: i64) -> Input {
        Input::Message(WatchMessage {
            created: true,
            header_revision: rev,
            ..WatchMessage::default()
        })
    }

    fn events(last: i64) -> Input {
        Input::Message(WatchMessage {
            last_event_revision: Some(last),
            header_revision: last,
            ..WatchMessage::default()
        })
    }

    /// Runs timeouts until the follower asks for something other than a progress request.
    fn run_timeouts(f: &mut Follower, now: &mut Instant) -> Vec<Action> {
        for _ in 0..100 {
            let Some(at) = f.poll_timeout() else { return Vec::new() };
            *now = at.max(*now);
            let actions = f.handle_timeout(*now);
            if !actions.is_empty() && actions != vec![Action::RequestProgress] {
                return actions;
            }
        }
        panic!("the follower never moved on");
    }

    /// A follower brought to Watching at `rev`.
    fn watching(now: Instant, rev: i64) -> Follower {
        let mut f = follower();
        assert_eq!(f.start(), vec![Action::Connect]);
        assert_eq!(f.handle(Input::Connected, now), vec![Action::LoadSnapshot]);
        assert_eq!(
            f.handle(Input::Loaded { revision: rev }, now),
            vec![Action::OpenWatch {
                from_revision: rev + 1,
                restart: false
            }]
        );
        assert!(f.handle(Input::WatchOpened, now).is_empty());
        assert!(!f.is_current(), "current only once etcd confirms the watch");
        assert_eq!(f.handle(created(rev), now), vec![Action::Current]);
        f
    }

    #[test]
    fn connects_loads_then_watches_from_the_next_revision() {
        let now = Instant::now();
        let mut f = watching(now, 10);
        assert_eq!(f.state(), FollowerState::Watching);
        assert_eq!(f.handle(events(12), now), vec![Action::Apply { revision: 12 }]);
        assert_eq!(f.revision(), Some(12));
        // A progress notification never moves the revision: etcd 3.4 answers it ahead of
        // events still in the stream.
        let progress = Input::Message(WatchMessage {
            header_revision: 15,
            ..WatchMessage::default()
        });
        assert!(f.handle(progress, now).is_empty());
        assert_eq!(f.revision(), Some(12));
    }

    #[test]
    fn a_revision_split_into_fragments_is_applied_once_whole() {
        let now = Instant::now();
        let mut f = watching(now, 10);
        let fragment = Input::Message(WatchMessage {
            last_event_revision: Some(11),
            header_revision: 11,
            fragment: true,
            ..WatchMessage::default()
        });
        assert!(f.handle(fragment.clone(), now).is_empty());
        assert!(f.handle(fragment, now).is_empty());
        assert_eq!(f.revision(), Some(10), "not applied before its last fragment");
        assert_eq!(f.handle(events(11), now), vec![Action::Apply { revision: 11 }]);
    }

    #[test]
    fn a_watch_lost_mid_batch_resumes_after_the_last_event_applied_never_after_an_empty_message() {
        let mut now = Instant::now();
        let mut f = follower();
        f.start();
        f.handle(Input::Connected, now);
        f.handle(Input::Loaded { revision: 10 }, now);
        f.handle(Input::WatchOpened, now);
        // etcd is at 500 when the watch is created; the events 11..=500 are still to come.
        f.handle(created(500), now);
        assert_eq!(f.revision(), Some(10), "the created answer moves nothing");
        assert_eq!(f.handle(events(120), now), vec![Action::Apply { revision: 120 }]);
        // A requested progress notification ahead of the events in flight (etcd 3.4).
        let progress = Input::Message(WatchMessage {
            header_revision: 500,
            ..WatchMessage::default()
        });
        assert!(f.handle(progress, now).is_empty());
        f.handle(Input::StreamEnded("reset".into()), now);
        assert_eq!(
            run_timeouts(&mut f, &mut now),
            vec![Action::OpenWatch {
                from_revision: 121,
                restart: true
            }]
        );
    }

    #[test]
    fn applying_a_long_batch_is_not_silence() {
        let start = Instant::now();
        let mut f = watching(start, 10);
        f.handle(events(11), start);
        // Applying took 10 s; etcd sent the whole batch meanwhile.
        let after = start + Duration::from_secs(10);
        assert!(f.handle(Input::Applied, after).is_empty());
        let actions = f.handle_timeout(after);
        assert!(
            !actions.iter().any(|a| matches!(a, Action::Stale { .. })),
            "{actions:?}"
        );
        assert!(f.is_current());
    }

    #[test]
    fn a_broken_watch_is_stale_at_once_and_reopened_from_the_last_revision_after_a_pause() {
        let mut now = Instant::now();
        let mut f = watching(now, 10);
        f.handle(events(20), now);
        let actions = f.handle(Input::StreamEnded("reset".into()), now);
        assert_eq!(actions, vec![Action::DropWatch, Action::Stale { why: "reset".into() }]);
        assert!(!f.is_current());
        assert_eq!(f.state(), FollowerState::Paused);
        let before = now;
        assert_eq!(
            run_timeouts(&mut f, &mut now),
            vec![Action::OpenWatch {
                from_revision: 21,
                restart: true
            }]
        );
        assert!(now > before, "a pause before the new watch");
        f.handle(Input::WatchOpened, now);
        assert_eq!(f.handle(created(20), now), vec![Action::Current]);
    }

    #[test]
    fn a_compacted_start_revision_reloads_at_once() {
        let now = Instant::now();
        let mut f = watching(now, 10);
        f.handle(Input::StreamEnded("member down".into()), now);
        let mut t = now;
        run_timeouts(&mut f, &mut t);
        f.handle(Input::WatchOpened, t);
        let compacted = Input::Message(WatchMessage {
            compact_revision: 50,
            ..WatchMessage::default()
        });
        let actions = f.handle(compacted, t);
        assert_eq!(actions[0], Action::DropWatch);
        assert!(matches!(&actions[1], Action::Stale { why } if why.contains("compacted")));
        assert_eq!(actions[2], Action::LoadSnapshot);
        assert_eq!(f.revision(), None);
        assert_eq!(
            f.handle(Input::Loaded { revision: 60 }, t),
            vec![Action::OpenWatch {
                from_revision: 61,
                restart: true
            }]
        );
    }

    #[test]
    fn a_silent_etcd_gets_progress_requests_then_the_watch_is_given_up() {
        let start = Instant::now();
        let mut f = watching(start, 10);
        let mut requests = 0;
        let now = loop {
            let now = f.poll_timeout().expect("watching has a deadline");
            let actions = f.handle_timeout(now);
            if actions == vec![Action::RequestProgress] {
                requests += 1;
                continue;
            }
            if actions.is_empty() {
                continue;
            }
            assert_eq!(actions[0], Action::DropWatch);
            assert!(matches!(&actions[1], Action::Stale { why } if why.contains("said nothing")));
            break now;
        };
        assert_eq!(now - start, crate::SILENT_LIMIT);
        assert_eq!(requests, 2, "one progress request a second until the limit");
    }

    #[test]
    fn hearing_from_etcd_keeps_the_watch() {
        let start = Instant::now();
        let mut f = watching(start, 10);
        for s in 1..=20 {
            let now = start + Duration::from_millis(900 * s);
            f.handle(events(10 + s as i64), now);
            let actions = f.handle_timeout(now);
            assert!(!actions.iter().any(|a| matches!(a, Action::Stale { .. })));
        }
        assert!(f.is_current());
    }

    #[test]
    fn a_watch_etcd_does_not_open_in_time_is_given_up() {
        let now = Instant::now();
        let mut f = watching(now, 10);
        f.handle(Input::StreamEnded("x".into()), now);
        let mut t = now;
        run_timeouts(&mut f, &mut t);
        assert_eq!(f.state(), FollowerState::Opening);
        let actions = run_timeouts(&mut f, &mut t);
        assert!(matches!(&actions[0], Action::Stale { why } if why.contains("did not open")));
        assert_eq!(f.state(), FollowerState::Paused);
        // The answer that comes too late changes nothing.
        assert!(f.handle(Input::WatchOpened, t).is_empty());
        assert_eq!(f.state(), FollowerState::Paused);
    }

    #[test]
    fn failures_back_off_up_to_the_cap_and_etcds_answer_resets_it() {
        let start = Instant::now();
        let mut f = follower();
        f.start();
        let mut now = start;
        let mut pauses = Vec::new();
        for _ in 0..8 {
            assert!(f.handle(Input::ConnectFailed("refused".into()), now).is_empty());
            let before = now;
            assert_eq!(run_timeouts(&mut f, &mut now), vec![Action::Connect]);
            pauses.push(now - before);
        }
        assert!(pauses
            .windows(2)
            .all(|w| w[1] >= w[0] || w[1] >= Duration::from_secs(2)));
        assert!(pauses.iter().all(|p| *p <= Duration::from_millis(2500)), "{pauses:?}");
        f.handle(Input::Connected, now);
        f.handle(Input::Loaded { revision: 1 }, now);
        f.handle(Input::WatchOpened, now);
        f.handle(created(1), now);
        f.handle(Input::StreamEnded("x".into()), now);
        let before = now;
        run_timeouts(&mut f, &mut now);
        assert!(now - before < Duration::from_millis(100), "reset by the created answer");
    }

    #[test]
    fn a_failed_snapshot_is_retried_without_reconnecting() {
        let mut now = Instant::now();
        let mut f = follower();
        f.start();
        f.handle(Input::Connected, now);
        assert!(f.handle(Input::LoadFailed("timeout".into()), now).is_empty());
        assert_eq!(run_timeouts(&mut f, &mut now), vec![Action::LoadSnapshot]);
    }
}
