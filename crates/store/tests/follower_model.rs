//! The follower against an in-memory etcd that misbehaves the ways real etcd does (issue 28):
//! large revisions split into fragments, messages delayed, silence in the middle of a batch,
//! progress notifications answered at etcd's current revision ahead of the events still in the
//! stream (etcd-io/etcd#15220), a `created` answer that carries a revision whose events have
//! not arrived, broken streams, and compaction. A shell like `follow.rs` drives
//! [`Follower`] and keeps a copy of the keys.
//!
//! What must hold, whatever the faults: every `Apply { revision }` leaves the copy equal to
//! etcd's state at that revision (a revision counts only once all its events are applied, and
//! none is skipped), every watch resumes at the last applied revision + 1, and once the
//! faults stop the copy reaches etcd's last revision and is current.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rootrank_store::follower::{Action, Input, WatchMessage};
use rootrank_store::{Backoff, Follower, CATCH_UP_SILENT_LIMIT};

type Kv = BTreeMap<u8, u32>;

/// One write of a revision: a put (`Some`) or a delete of a key.
type Write = (u8, Option<u32>);

/// One watch response as the shell receives it: its summary and its events (by revision).
type Message = (WatchMessage, Vec<(i64, Write)>);

/// etcd: its revisions (1 is the empty store), what is compacted, and how it splits responses.
struct Etcd {
    /// `revisions[i]` holds revision `i + 2`'s writes.
    revisions: Vec<Vec<Write>>,
    compacted: i64,
}

impl Etcd {
    fn current(&self) -> i64 {
        self.revisions.len() as i64 + 1
    }
    fn state_at(&self, revision: i64) -> Kv {
        let mut kv = Kv::new();
        for (i, writes) in self.revisions.iter().enumerate() {
            if i as i64 + 2 > revision {
                break;
            }
            for (k, v) in writes {
                match v {
                    Some(v) => kv.insert(*k, *v),
                    None => kv.remove(k),
                };
            }
        }
        kv
    }
    /// The messages a watch from `from` receives, in order: `created` (at etcd's current
    /// revision), then each revision's events, a large one in fragments of `fragment_max`.
    fn stream(&self, from: i64, fragment_max: usize) -> Vec<Message> {
        let mut out = vec![(
            WatchMessage {
                created: true,
                header_revision: self.current(),
                ..WatchMessage::default()
            },
            Vec::new(),
        )];
        if from <= self.compacted {
            out.push((
                WatchMessage {
                    compact_revision: self.compacted,
                    header_revision: self.current(),
                    ..WatchMessage::default()
                },
                Vec::new(),
            ));
            return out;
        }
        for rev in from.max(2)..=self.current() {
            let writes = &self.revisions[(rev - 2) as usize];
            let chunks: Vec<&[Write]> = writes.chunks(fragment_max.max(1)).collect();
            for (i, chunk) in chunks.iter().enumerate() {
                out.push((
                    WatchMessage {
                        last_event_revision: Some(rev),
                        fragment: i + 1 < chunks.len(),
                        header_revision: self.current(),
                        ..WatchMessage::default()
                    },
                    chunk.iter().map(|w| (rev, *w)).collect(),
                ));
            }
        }
        out
    }
}

/// What the network and etcd do next, one step at a time.
#[derive(Clone, Debug)]
enum Fault {
    /// The next message arrives after this many ms.
    Deliver { after_ms: u64 },
    /// Nothing arrives for this long (blackholed etcd, a GC pause): the follower's deadlines run.
    Silence { ms: u64 },
    /// etcd answers a progress request at once, at its current revision, ahead of the events
    /// still in the stream.
    ProgressAhead,
    /// The stream breaks.
    Break,
    /// New writes land in etcd (they reach watches opened from now on, and the open one
    /// through a new stream only: the model keeps a stream's content fixed at its opening,
    /// then appends them when it is exhausted).
    Write(Vec<Write>),
    /// etcd compacts everything up to its current revision.
    Compact,
}

fn write() -> impl Strategy<Value = Write> {
    (0u8..24, prop::option::weighted(0.7, 0u32..1000))
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        6 => (0u64..400).prop_map(|after_ms| Fault::Deliver { after_ms }),
        2 => prop_oneof![Just(500u64), Just(2_500), Just(3_500), Just(31_000)].prop_map(|ms| Fault::Silence { ms }),
        2 => Just(Fault::ProgressAhead),
        1 => Just(Fault::Break),
        // A mass death: many deletes in one revision, and small revisions.
        2 => prop::collection::vec(write(), 1..60).prop_map(Fault::Write),
        1 => Just(Fault::Compact),
    ]
}

/// The shell: `follow.rs` with the in-memory etcd in place of the client.
struct Shell {
    f: Follower,
    now: Instant,
    copy: Kv,
    copy_revision: i64,
    /// Events of messages received since the last `Apply`.
    buffer: Vec<(i64, Write)>,
    /// The open watch's messages still to come.
    stream: Option<std::collections::VecDeque<Message>>,
    /// The watch's next revision to stream after its messages are exhausted.
    stream_next: i64,
    fragment_max: usize,
    opened_from: Vec<i64>,
    loads: u32,
}

impl Shell {
    fn run(&mut self, etcd: &Etcd, actions: Vec<Action>) -> Result<(), TestCaseError> {
        let mut queue: std::collections::VecDeque<Action> = actions.into();
        while let Some(a) = queue.pop_front() {
            let more = match a {
                Action::Connect => self.f.handle(Input::Connected, self.now),
                Action::LoadSnapshot => {
                    self.loads += 1;
                    self.copy = etcd.state_at(etcd.current());
                    self.copy_revision = etcd.current();
                    self.f.handle(
                        Input::Loaded {
                            revision: etcd.current(),
                        },
                        self.now,
                    )
                }
                Action::OpenWatch { from_revision, .. } => {
                    prop_assert_eq!(
                        from_revision,
                        self.copy_revision + 1,
                        "a watch resumes after what is applied"
                    );
                    self.opened_from.push(from_revision);
                    self.stream = Some(etcd.stream(from_revision, self.fragment_max).into());
                    self.stream_next = etcd.current() + 1;
                    self.f.handle(Input::WatchOpened, self.now)
                }
                Action::DropWatch => {
                    self.stream = None;
                    self.buffer.clear();
                    Vec::new()
                }
                Action::Apply { revision } => {
                    for (_, (k, v)) in self.buffer.drain(..) {
                        match v {
                            Some(v) => self.copy.insert(k, v),
                            None => self.copy.remove(&k),
                        };
                    }
                    self.copy_revision = revision;
                    prop_assert_eq!(
                        &self.copy,
                        &etcd.state_at(revision),
                        "the copy at revision {} is etcd's state at it",
                        revision
                    );
                    self.f.handle(Input::Applied, self.now)
                }
                Action::RequestProgress | Action::Current | Action::Stale { .. } => Vec::new(),
            };
            queue.extend(more);
        }
        Ok(())
    }

    /// Lets time pass to `until`, running the follower's deadlines on the way.
    fn wait(&mut self, etcd: &Etcd, until: Instant) -> Result<(), TestCaseError> {
        while let Some(t) = self.f.poll_timeout().filter(|t| *t <= until) {
            self.now = self.now.max(t);
            let a = self.f.handle_timeout(self.now);
            self.run(etcd, a)?;
        }
        self.now = self.now.max(until);
        Ok(())
    }

    /// The open watch's next message, if any (new revisions once its opening content is out).
    fn next_message(&mut self, etcd: &Etcd) -> Option<Message> {
        let stream = self.stream.as_mut()?;
        if stream.is_empty() && self.stream_next <= etcd.current() {
            let mut more: std::collections::VecDeque<_> = etcd.stream(self.stream_next, self.fragment_max).into();
            more.pop_front(); // not a second `created`
            stream.extend(more);
            self.stream_next = etcd.current() + 1;
        }
        stream.pop_front()
    }

    fn deliver(&mut self, etcd: &Etcd) -> Result<bool, TestCaseError> {
        let Some((m, events)) = self.next_message(etcd) else {
            return Ok(false);
        };
        self.buffer.extend(events);
        let a = self.f.handle(Input::Message(m), self.now);
        self.run(etcd, a)?;
        Ok(true)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_copy_is_etcds_state_at_every_applied_revision_and_catches_up(
        initial in prop::collection::vec(prop::collection::vec(write(), 1..40), 0..6),
        faults in prop::collection::vec(fault(), 0..80),
        fragment_max in 1usize..16,
        seed in any::<u64>(),
    ) {
        let mut etcd = Etcd { revisions: initial, compacted: 0 };
        let start = Instant::now();
        let mut s = Shell {
            f: Follower::new(Backoff::with_seed(Duration::from_millis(50), Duration::from_secs(2), seed), Duration::from_secs(5)),
            now: start,
            copy: Kv::new(),
            copy_revision: 0,
            buffer: Vec::new(),
            stream: None,
            stream_next: 0,
            fragment_max,
            opened_from: Vec::new(),
            loads: 0,
        };
        let a = s.f.start();
        s.run(&etcd, a)?;
        for fault in faults {
            match fault {
                Fault::Deliver { after_ms } => {
                    let until = s.now + Duration::from_millis(after_ms);
                    s.wait(&etcd, until)?;
                    s.deliver(&etcd)?;
                }
                Fault::Silence { ms } => {
                    let until = s.now + Duration::from_millis(ms);
                    s.wait(&etcd, until)?;
                }
                Fault::ProgressAhead => {
                    if s.stream.is_some() {
                        let m = WatchMessage { header_revision: etcd.current(), ..WatchMessage::default() };
                        let a = s.f.handle(Input::Message(m), s.now);
                        s.run(&etcd, a)?;
                    }
                }
                Fault::Break => {
                    if s.stream.is_some() {
                        let a = s.f.handle(Input::StreamEnded("broken".into()), s.now);
                        s.run(&etcd, a)?;
                    }
                }
                Fault::Write(writes) => etcd.revisions.push(writes),
                Fault::Compact => etcd.compacted = etcd.current(),
            }
        }
        // The faults stop: etcd answers promptly from now on.
        let mut steps = 0;
        while !(s.f.is_current() && s.copy_revision == etcd.current() && s.next_message_is_none(&etcd)) {
            steps += 1;
            prop_assert!(steps < 100_000, "no progress: {:?} at {} of {}", s.f.state(), s.copy_revision, etcd.current());
            if !s.deliver(&etcd)? {
                // Nothing to deliver: the follower is paused or waits on a deadline.
                let next = s.f.poll_timeout().unwrap_or(s.now + Duration::from_millis(100));
                let until = next.min(s.now + CATCH_UP_SILENT_LIMIT);
                s.wait(&etcd, until.max(s.now + Duration::from_millis(1)))?;
            }
        }
        prop_assert_eq!(&s.copy, &etcd.state_at(etcd.current()));
    }
}

impl Shell {
    fn next_message_is_none(&mut self, etcd: &Etcd) -> bool {
        self.stream.as_ref().is_some_and(|q| q.is_empty()) && self.stream_next > etcd.current()
    }
}

/// The case the issue found, spelled out: a watch opened before a mass delete is told etcd's
/// revision in its `created` answer and by a progress notification before the delete's
/// fragments arrive, one by one and slowly; a stream that breaks in the middle resumes at the
/// revision before the delete, and nothing is skipped.
#[test]
fn a_mass_delete_in_fragments_behind_an_early_progress_notification_is_applied_whole() {
    let mut etcd = Etcd {
        revisions: vec![(0..24u8).map(|k| (k, Some(k as u32))).collect()],
        compacted: 0,
    };
    let mut s = Shell {
        f: Follower::new(
            Backoff::with_seed(Duration::from_millis(50), Duration::from_secs(2), 1),
            Duration::from_secs(5),
        ),
        now: Instant::now(),
        copy: Kv::new(),
        copy_revision: 0,
        buffer: Vec::new(),
        stream: None,
        stream_next: 0,
        fragment_max: 5,
        opened_from: Vec::new(),
        loads: 0,
    };
    let a = s.f.start();
    s.run(&etcd, a).unwrap();
    assert_eq!(s.copy_revision, 2);
    // The lease is revoked: revision 3 deletes all 24 keys.
    etcd.revisions.push((0..24u8).map(|k| (k, None)).collect());
    s.deliver(&etcd).unwrap(); // created, at revision 2
    let progress = WatchMessage {
        header_revision: 3,
        ..WatchMessage::default()
    };
    let a = s.f.handle(Input::Message(progress), s.now);
    s.run(&etcd, a).unwrap();
    assert_eq!(s.copy_revision, 2, "a progress notification applies nothing");
    // Two fragments, two seconds apart each (under read load), then the stream breaks.
    for _ in 0..2 {
        let until = s.now + Duration::from_secs(2);
        s.wait(&etcd, until).unwrap();
        s.deliver(&etcd).unwrap();
    }
    assert_eq!(s.copy_revision, 2, "half a revision is not applied");
    let a = s.f.handle(Input::StreamEnded("reset".into()), s.now);
    s.run(&etcd, a).unwrap();
    let until = s.now + Duration::from_secs(3);
    s.wait(&etcd, until).unwrap();
    assert_eq!(s.opened_from.last(), Some(&3), "resumes at the delete's revision");
    while s.deliver(&etcd).unwrap() {}
    assert_eq!(s.copy_revision, 3);
    assert!(s.copy.is_empty(), "{:?}", s.copy);
}
