//! `GET /v1/events` (SPEC v3 section 6): what changed, from a revision on, as server-sent
//! events: `rank` (a rank's state changed) and `resolved` (a room's verdict resolved).
//!
//! The sync loop appends each batch's events to one bounded ring ([`EventLog`]) while it
//! applies the batch; every reader walks the ring at its own pace. A reader that falls
//! behind the ring's oldest entry (it stopped reading: its socket is full) is cut off with a
//! last `error` event, never buffered for: memory is the ring, whatever the readers do.
//!
//! A replica knows the events from the revision it loaded its index at (its `floor`) on; a
//! `since` older than that answers 410 `compacted`, as SPEC says for etcd's compaction: the
//! client reloads with the GETs and resumes from the revision they reflect. A reload (after
//! a compaction) moves the floor and cuts every reader off for the same reason.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use rootrank_core::{CompactVerdict, GroupId, Index, Output, RankStateKind, VerdictQuery};
use serde::Serialize;

/// Events a replica keeps for readers to catch up on (~200 bytes each).
pub const RING_EVENTS: usize = 16_384;

/// One event, encoded once for every reader.
#[derive(Clone, Debug)]
pub struct Entry {
    seq: u64,
    pub revision: i64,
    /// The groups it concerns, for `?group=`.
    groups: Vec<GroupId>,
    pub data: Arc<str>,
}

#[derive(Debug, Default)]
struct Ring {
    entries: VecDeque<Entry>,
    /// The sequence number the next entry gets.
    next_seq: u64,
    /// Events from this revision on (exclusive) are all here or were here.
    floor: i64,
    /// Bumped by a reload: positions of an older epoch mean nothing any more.
    epoch: u64,
}

/// The ring of recent events, shared by the sync loop (writer) and the readers.
#[derive(Debug)]
pub struct EventLog {
    ring: Mutex<Ring>,
    capacity: usize,
}

impl Default for EventLog {
    fn default() -> Self {
        EventLog::new(RING_EVENTS)
    }
}

#[derive(Serialize)]
struct RankEvent<'a> {
    event: &'static str,
    revision: i64,
    group: &'a GroupId,
    rank: u32,
    state: RankStateKind,
    reason: Option<&'a str>,
    incarnation: String,
    role: Option<&'a str>,
    /// What the rank published in `RankLive.endpoints` (a prefill's bootstrap addresses).
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    endpoints: &'a [String],
}

#[derive(Serialize)]
struct ResolvedEvent<'a> {
    event: &'static str,
    revision: i64,
    groups: &'a [GroupId],
    verdict: CompactVerdict,
}

/// Where a reader is: the next sequence number it wants, in one epoch.
#[derive(Clone, Copy, Debug)]
pub struct Cursor {
    next: u64,
    epoch: u64,
}

/// What a reader gets from [`EventLog::read`].
#[derive(Debug)]
pub enum Read {
    /// Entries after the cursor (possibly none yet).
    Entries(Vec<Entry>),
    /// The reader fell behind the ring or a reload happened: it must resume from its last
    /// revision (which will answer 410 if that is gone too).
    CutOff(&'static str),
}

/// Why a stream cannot start.
#[derive(Debug, PartialEq, Eq)]
pub enum StartError {
    /// `since` is older than what this replica knows (its floor): reload with the GETs.
    Compacted { floor: i64 },
}

impl EventLog {
    pub fn new(capacity: usize) -> Self {
        EventLog {
            ring: Mutex::new(Ring::default()),
            capacity: capacity.max(1),
        }
    }

    /// A fresh index loaded at `revision`: no event before it can be served any more.
    pub fn reset(&self, revision: i64) {
        if let Ok(mut r) = self.ring.lock() {
            r.entries.clear();
            r.floor = revision;
            r.epoch += 1;
        }
    }

    /// Encodes the events of one applied batch (`outputs` of the index, which has applied
    /// them) and appends them. Called by the sync loop with the index still at that batch.
    pub fn append(&self, index: &Index, outputs: &[Output], now_ms: i64) {
        let mut new = Vec::new();
        for o in outputs {
            match o {
                Output::RankChanged {
                    group,
                    rank,
                    state,
                    reason,
                    incarnation,
                    revision,
                } => {
                    let ev = RankEvent {
                        event: "rank",
                        revision: *revision,
                        group,
                        rank: *rank,
                        state: *state,
                        reason: reason.as_ref().map(|r| r.as_str()),
                        incarnation: incarnation.to_string(),
                        role: index.group_role(group),
                        endpoints: index.rank_endpoints(group, *rank, *incarnation),
                    };
                    if let Ok(data) = serde_json::to_string(&ev) {
                        new.push((*revision, vec![group.clone()], data));
                    }
                }
                Output::RoomResolved { room, revision, .. } => {
                    // Resolved is final (rule 2): the verdict now names the same culprit.
                    let v = index.verdict(&VerdictQuery {
                        room: *room,
                        group: None,
                        asked_at_ms: now_ms,
                        now_ms,
                    });
                    let ev = ResolvedEvent {
                        event: "resolved",
                        revision: *revision,
                        groups: &v.groups,
                        verdict: CompactVerdict::from(&v),
                    };
                    if let Ok(data) = serde_json::to_string(&ev) {
                        new.push((*revision, v.groups.clone(), data));
                    }
                }
                _ => {}
            }
        }
        if new.is_empty() {
            return;
        }
        let Ok(mut r) = self.ring.lock() else { return };
        for (revision, groups, data) in new {
            let seq = r.next_seq;
            r.next_seq += 1;
            r.entries.push_back(Entry {
                seq,
                revision,
                groups,
                data: data.into(),
            });
            if r.entries.len() > self.capacity {
                r.entries.pop_front();
            }
        }
    }

    /// Where a reader starting after revision `since` (or now, with `None`) begins.
    pub fn start(&self, since: Option<i64>) -> Result<(Cursor, i64), StartError> {
        let Ok(r) = self.ring.lock() else {
            return Err(StartError::Compacted { floor: i64::MAX });
        };
        let newest = r.entries.back().map_or(r.floor, |e| e.revision);
        match since {
            None => Ok((
                Cursor {
                    next: r.next_seq,
                    epoch: r.epoch,
                },
                newest,
            )),
            Some(s) if s < r.floor => Err(StartError::Compacted { floor: r.floor }),
            Some(s) => {
                // The ring dropped entries after `since`: it cannot be served from here.
                if r.entries.front().is_some_and(|e| e.revision <= s) || r.entries.len() < self.capacity {
                    let next = r.entries.iter().find(|e| e.revision > s).map_or(r.next_seq, |e| e.seq);
                    Ok((Cursor { next, epoch: r.epoch }, s.min(newest).max(r.floor)))
                } else {
                    Err(StartError::Compacted {
                        floor: r.entries.front().map_or(r.floor, |e| e.revision),
                    })
                }
            }
        }
    }

    /// The entries after `cursor` for `group` (all with `None`), at most `max` of them.
    pub fn read(&self, cursor: &mut Cursor, group: Option<&GroupId>, max: usize) -> Read {
        let Ok(r) = self.ring.lock() else {
            return Read::CutOff("the coordinator's event log is unavailable");
        };
        if r.epoch != cursor.epoch {
            return Read::CutOff("the coordinator reloaded its index from etcd; resume from your last revision");
        }
        let front = r.entries.front().map_or(r.next_seq, |e| e.seq);
        if cursor.next < front {
            return Read::CutOff("this reader fell behind the coordinator's event log; resume from your last revision");
        }
        let skip = usize::try_from(cursor.next - front).unwrap_or(usize::MAX);
        let mut out = Vec::new();
        for e in r.entries.iter().skip(skip) {
            cursor.next = e.seq + 1;
            if group.is_none_or(|g| e.groups.contains(g)) {
                out.push(e.clone());
                if out.len() >= max {
                    break;
                }
            }
        }
        Read::Entries(out)
    }
}

/// Counts a reader in `rootrank_events_readers` for as long as its stream lives.
struct ReaderGuard(prometheus::IntGauge);

impl Drop for ReaderGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Entries handed to the socket per wake-up: a reader catching up yields in slices.
const BATCH: usize = 256;

/// The SSE response for one reader: first an `id:` with the revision it starts after (so a
/// client that reconnects before any event resumes from there), then the events.
pub fn stream(
    shared: Arc<crate::Shared>,
    cursor: Cursor,
    start_revision: i64,
    group: Option<GroupId>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
    shared.metrics.events_readers.inc();
    let guard = ReaderGuard(shared.metrics.events_readers.clone());
    let revisions = shared.revision_tx.subscribe();
    let hello = SseEvent::default()
        .id(start_revision.to_string())
        .comment(format!("rootrank events after revision {start_revision}"));
    struct St {
        shared: Arc<crate::Shared>,
        cursor: Cursor,
        group: Option<GroupId>,
        revisions: tokio::sync::watch::Receiver<i64>,
        pending: VecDeque<SseEvent>,
        hello: Option<SseEvent>,
        done: bool,
        _guard: ReaderGuard,
    }
    let st = St {
        shared,
        cursor,
        group,
        revisions,
        pending: VecDeque::new(),
        hello: Some(hello),
        done: false,
        _guard: guard,
    };
    let s = futures_util::stream::unfold(st, |mut st| async move {
        if let Some(h) = st.hello.take() {
            return Some((Ok(h), st));
        }
        loop {
            if let Some(ev) = st.pending.pop_front() {
                return Some((Ok(ev), st));
            }
            if st.done {
                return None;
            }
            st.revisions.mark_unchanged();
            match st.shared.events.read(&mut st.cursor, st.group.as_ref(), BATCH) {
                Read::CutOff(why) => {
                    st.done = true;
                    let body = serde_json::json!({"event": "error", "code": "cut_off", "message": why});
                    st.pending
                        .push_back(SseEvent::default().event("error").data(body.to_string()));
                }
                Read::Entries(entries) if !entries.is_empty() => {
                    st.pending.extend(
                        entries
                            .into_iter()
                            .map(|e| SseEvent::default().id(e.revision.to_string()).data(&*e.data)),
                    );
                }
                Read::Entries(_) => {
                    // Nothing new: sleep until the sync loop applies the next batch.
                    if st.revisions.changed().await.is_err() {
                        return None;
                    }
                }
            }
        }
    });
    Sse::new(s).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_with(n: usize, cap: usize) -> EventLog {
        let log = EventLog::new(cap);
        log.reset(10);
        if let Ok(mut r) = log.ring.lock() {
            for i in 0..n {
                let seq = r.next_seq;
                r.next_seq += 1;
                r.entries.push_back(Entry {
                    seq,
                    revision: 11 + i as i64,
                    groups: vec![GroupId::new(if i % 2 == 0 { "a" } else { "b" }).unwrap()],
                    data: format!("{i}").into(),
                });
                if r.entries.len() > cap {
                    r.entries.pop_front();
                }
            }
        }
        log
    }

    fn revs(read: Read) -> Vec<i64> {
        match read {
            Read::Entries(e) => e.iter().map(|e| e.revision).collect(),
            Read::CutOff(w) => panic!("cut off: {w}"),
        }
    }

    #[test]
    fn resumes_after_since_filters_by_group_and_answers_compacted_below_the_floor() {
        let log = log_with(6, 100);
        let (mut c, from) = log.start(Some(13)).unwrap();
        assert_eq!(from, 13);
        assert_eq!(revs(log.read(&mut c, None, 100)), vec![14, 15, 16]);
        assert_eq!(revs(log.read(&mut c, None, 100)), Vec::<i64>::new());
        let (mut c, _) = log.start(Some(10)).unwrap();
        assert_eq!(
            revs(log.read(&mut c, Some(&GroupId::new("b").unwrap()), 100)),
            vec![12, 14, 16]
        );
        assert_eq!(log.start(Some(9)).unwrap_err(), StartError::Compacted { floor: 10 });
        let (mut c, _) = log.start(None).unwrap();
        assert_eq!(revs(log.read(&mut c, None, 100)), Vec::<i64>::new());
    }

    #[test]
    fn a_reader_behind_the_ring_is_cut_off_and_a_since_the_ring_dropped_is_compacted() {
        let log = log_with(3, 4);
        let (mut slow, _) = log.start(Some(10)).unwrap();
        assert_eq!(revs(log.read(&mut slow, None, 1)), vec![11]);
        if let Ok(mut r) = log.ring.lock() {
            for i in 0..6 {
                let seq = r.next_seq;
                r.next_seq += 1;
                r.entries.push_back(Entry {
                    seq,
                    revision: 20 + i,
                    groups: vec![],
                    data: "x".into(),
                });
                if r.entries.len() > 4 {
                    r.entries.pop_front();
                }
            }
        }
        assert!(matches!(log.read(&mut slow, None, 100), Read::CutOff(_)));
        assert_eq!(log.start(Some(12)).unwrap_err(), StartError::Compacted { floor: 22 });
        let (mut c, _) = log.start(Some(23)).unwrap();
        assert_eq!(revs(log.read(&mut c, None, 100)), vec![24, 25]);
        log.reset(30);
        assert!(matches!(log.read(&mut c, None, 100), Read::CutOff(_)));
    }
}
