//! `GET /v1/events` (SPEC v3 section 6): what changed, from a revision on, as server-sent
//! events: `rank` (a rank's state changed) and `resolved` (a room's verdict resolved).
//!
//! The sync loop appends each batch's events to one bounded ring ([`EventLog`]) while it
//! applies the batch; every reader walks the ring at its own pace. A reader that falls
//! behind the ring's oldest entry (it stopped reading: its socket is full) is cut off with a
//! last `error` event, never buffered for: memory is the ring, whatever the readers do.
//!
//! A replica that (re)loads its index from etcd has state, not history: it starts the ring
//! with the index's catch-up ([`Index::catch_up`]: every rank's state, every resolved room,
//! each at the revision that made it so), so a reader resuming from an older revision, after
//! a coordinator restart or on another replica, misses nothing it had not seen (a rank's
//! intermediate states are folded into its current one). A `since` older than what the ring
//! still holds (it overflowed) answers 410 `compacted`: the client reloads with the GETs and
//! resumes from the revision they reflect. A reload cuts every reader off; each resumes from
//! its last revision in the new ring.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use rootrank_core::{
    CatchUpEvent, CompactVerdict, GroupId, Incarnation, Index, Output, Rank, RankStateKind, Reason, RoomId,
    VerdictQuery,
};
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
    /// Every event after this revision is here (or folded into the catch-up); a `since`
    /// below it is 410. Raised as the ring drops its oldest entries.
    floor: i64,
    /// The revision the index was loaded at: where a reader starting "now" on an idle
    /// replica begins.
    loaded_at: i64,
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
    /// `null` for a missing rank (in a catch-up).
    incarnation: Option<String>,
    role: Option<&'a str>,
    /// What the rank published in `RankLive.endpoints` (a prefill's bootstrap addresses).
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    endpoints: &'a [String],
    /// The rank's NIXL agent name (`RankLive.nixl_agent`): how a prefill knows its transfer
    /// peer (SGLang's prefill keys a room's decode destinations by it).
    #[serde(skip_serializing_if = "Option::is_none")]
    agent: Option<&'a str>,
    /// v4, for `down` and `shutdown`: whether a certificate records the death. `false` for a
    /// vanished live key alone (after an etcd stall it may turn out `lease_lost`); the rank is
    /// sent again, `true`, when its certificate lands.
    #[serde(skip_serializing_if = "Option::is_none")]
    certified: Option<bool>,
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

    /// A fresh index (loaded or reloaded from etcd): the ring restarts with its catch-up,
    /// and readers of the old ring are cut off (they resume from their last revision).
    pub fn reset(&self, index: &Index, now_ms: i64) {
        let catch_up = index.catch_up(self.capacity);
        let encoded: Vec<(i64, Vec<GroupId>, String)> = catch_up
            .events
            .iter()
            .filter_map(|e| match e {
                CatchUpEvent::Rank {
                    group,
                    rank,
                    state,
                    reason,
                    incarnation,
                    revision,
                } => encode_rank(index, group, *rank, *state, reason.as_ref(), *incarnation, *revision),
                CatchUpEvent::Resolved { room, revision } => encode_resolved(index, *room, *revision, now_ms),
            })
            .collect();
        let Ok(mut r) = self.ring.lock() else { return };
        r.entries.clear();
        r.floor = catch_up.floor;
        r.loaded_at = index.revision();
        r.epoch += 1;
        for (revision, groups, data) in encoded {
            push(&mut r, self.capacity, revision, groups, data);
        }
    }

    /// Encodes the events of one applied batch (`outputs` of the index, which has applied
    /// them) and appends them. Called by the sync loop with the index still at that batch.
    pub fn append(&self, index: &Index, outputs: &[Output], now_ms: i64) {
        let new: Vec<(i64, Vec<GroupId>, String)> = outputs
            .iter()
            .filter_map(|o| match o {
                Output::RankChanged {
                    group,
                    rank,
                    state,
                    reason,
                    incarnation,
                    revision,
                } => encode_rank(
                    index,
                    group,
                    *rank,
                    *state,
                    reason.as_ref(),
                    Some(*incarnation),
                    *revision,
                ),
                Output::RoomResolved { room, revision, .. } => encode_resolved(index, *room, *revision, now_ms),
                _ => None,
            })
            .collect();
        if new.is_empty() {
            return;
        }
        let Ok(mut r) = self.ring.lock() else { return };
        for (revision, groups, data) in new {
            push(&mut r, self.capacity, revision, groups, data);
        }
    }

    /// Where a reader starting after revision `since` (or now, with `None`) begins.
    pub fn start(&self, since: Option<i64>) -> Result<(Cursor, i64), StartError> {
        let Ok(r) = self.ring.lock() else {
            return Err(StartError::Compacted { floor: i64::MAX });
        };
        let newest = r.entries.back().map_or(r.loaded_at, |e| e.revision).max(r.loaded_at);
        let epoch = r.epoch;
        match since {
            None => Ok((
                Cursor {
                    next: r.next_seq,
                    epoch,
                },
                newest,
            )),
            Some(s) if s < r.floor => Err(StartError::Compacted { floor: r.floor }),
            Some(s) => {
                let next = r.entries.iter().find(|e| e.revision > s).map_or(r.next_seq, |e| e.seq);
                Ok((Cursor { next, epoch }, s.min(newest)))
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
        for e in r.entries.range(skip.min(r.entries.len())..) {
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

/// Appends one entry, dropping the oldest past `capacity` (and raising the floor past it).
fn push(r: &mut Ring, capacity: usize, revision: i64, groups: Vec<GroupId>, data: String) {
    let seq = r.next_seq;
    r.next_seq += 1;
    r.entries.push_back(Entry {
        seq,
        revision,
        groups,
        data: data.into(),
    });
    while r.entries.len() > capacity {
        if let Some(old) = r.entries.pop_front() {
            r.floor = r.floor.max(old.revision);
        }
    }
}

fn encode_rank(
    index: &Index,
    group: &GroupId,
    rank: Rank,
    state: RankStateKind,
    reason: Option<&Reason>,
    incarnation: Option<Incarnation>,
    revision: i64,
) -> Option<(i64, Vec<GroupId>, String)> {
    let ev = RankEvent {
        event: "rank",
        revision,
        group,
        rank,
        state,
        reason: reason.map(|r| r.as_str()),
        incarnation: incarnation.map(|i| i.to_string()),
        role: index.group_role(group),
        endpoints: incarnation.map_or(&[], |i| index.rank_endpoints(group, rank, i)),
        agent: incarnation.and_then(|i| index.rank_nixl_agent(group, rank, i)),
        certified: match state {
            RankStateKind::Down | RankStateKind::Shutdown => {
                incarnation.and_then(|i| index.death_certified(group, rank, i, revision))
            }
            _ => None,
        },
    };
    let data = serde_json::to_string(&ev).ok()?;
    Some((revision, vec![group.clone()], data))
}

fn encode_resolved(index: &Index, room: RoomId, revision: i64, now_ms: i64) -> Option<(i64, Vec<GroupId>, String)> {
    // Resolved is final (rule 2): the verdict names the same culprit whenever it is asked.
    let v = index.verdict(&VerdictQuery {
        room,
        group: None,
        asked_at_ms: now_ms,
        now_ms,
    });
    let ev = ResolvedEvent {
        event: "resolved",
        revision,
        groups: &v.groups,
        verdict: CompactVerdict::from(&v),
    };
    let data = serde_json::to_string(&ev).ok()?;
    Some((revision, v.groups.clone(), data))
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

/// A comment line this often on an idle stream, so proxies and clients see it alive.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// The SSE response for one reader: first an `id:` with the revision it starts after (so a
/// client that reconnects before any event resumes from there), then the events. Each
/// wake-up writes what is new as one body chunk (`id:` and `data:` lines per event, the
/// JSON encoded once for every reader): with a thousand readers, a chunk per event would be a
/// frame and a write per event per reader.
pub fn stream(shared: Arc<crate::Shared>, cursor: Cursor, start_revision: i64, group: Option<GroupId>) -> Response {
    shared.metrics.events_readers.inc();
    let guard = ReaderGuard(shared.metrics.events_readers.clone());
    let revisions = shared.revision_tx.subscribe();
    let hello = Bytes::from(format!(
        ": rootrank events after revision {start_revision}\nid: {start_revision}\n\n"
    ));
    struct St {
        shared: Arc<crate::Shared>,
        cursor: Cursor,
        group: Option<GroupId>,
        revisions: tokio::sync::watch::Receiver<i64>,
        hello: Option<Bytes>,
        done: bool,
        _guard: ReaderGuard,
    }
    let st = St {
        shared,
        cursor,
        group,
        revisions,
        hello: Some(hello),
        done: false,
        _guard: guard,
    };
    let s = futures_util::stream::unfold(st, |mut st| async move {
        if let Some(h) = st.hello.take() {
            return Some((Ok::<_, Infallible>(h), st));
        }
        loop {
            if st.done {
                return None;
            }
            st.revisions.mark_unchanged();
            match st.shared.events.read(&mut st.cursor, st.group.as_ref(), BATCH) {
                Read::CutOff(why) => {
                    st.done = true;
                    let body = serde_json::json!({"event": "error", "code": "cut_off", "message": why});
                    return Some((Ok(Bytes::from(format!("event: error\ndata: {body}\n\n"))), st));
                }
                Read::Entries(entries) if !entries.is_empty() => {
                    let mut chunk = String::with_capacity(entries.iter().map(|e| e.data.len() + 32).sum());
                    for e in &entries {
                        // The data is compact JSON: no line breaks to split over `data:` lines.
                        let _ = write!(chunk, "id: {}\ndata: {}\n\n", e.revision, e.data);
                    }
                    return Some((Ok(Bytes::from(chunk)), st));
                }
                Read::Entries(_) => {
                    // Nothing new: sleep until the sync loop applies the next batch.
                    match tokio::time::timeout(KEEP_ALIVE, st.revisions.changed()).await {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) => return None,
                        Err(_) => return Some((Ok(Bytes::from_static(b":\n\n")), st)),
                    }
                }
            }
        }
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(s),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push_n(log: &EventLog, revisions: impl IntoIterator<Item = i64>) {
        if let Ok(mut r) = log.ring.lock() {
            for (i, revision) in revisions.into_iter().enumerate() {
                let group = GroupId::new(if revision % 2 == 0 { "a" } else { "b" }).unwrap();
                push(&mut r, log.capacity, revision, vec![group], format!("{i}"));
            }
        }
    }

    fn log_with(n: usize, cap: usize) -> EventLog {
        let log = EventLog::new(cap);
        log.reset(&Index::new(Default::default()), 0);
        push_n(&log, (0..n as i64).map(|i| 11 + i));
        log
    }

    fn revs(read: Read) -> Vec<i64> {
        match read {
            Read::Entries(e) => e.iter().map(|e| e.revision).collect(),
            Read::CutOff(w) => panic!("cut off: {w}"),
        }
    }

    #[test]
    fn resumes_after_since_and_filters_by_group() {
        let log = log_with(6, 100);
        let (mut c, from) = log.start(Some(13)).unwrap();
        assert_eq!(from, 13);
        assert_eq!(revs(log.read(&mut c, None, 100)), vec![14, 15, 16]);
        assert_eq!(revs(log.read(&mut c, None, 100)), Vec::<i64>::new());
        let (mut c, _) = log.start(Some(10)).unwrap();
        assert_eq!(
            revs(log.read(&mut c, Some(&GroupId::new("b").unwrap()), 100)),
            vec![11, 13, 15]
        );
        // Nothing was dropped: any older revision is served from the start.
        let (mut c, _) = log.start(Some(0)).unwrap();
        assert_eq!(revs(log.read(&mut c, None, 100)).len(), 6);
        let (mut c, _) = log.start(None).unwrap();
        assert_eq!(revs(log.read(&mut c, None, 100)), Vec::<i64>::new());
    }

    #[test]
    fn a_reader_behind_the_ring_is_cut_off_and_a_since_the_ring_dropped_is_compacted() {
        let log = log_with(3, 4);
        let (mut slow, _) = log.start(Some(10)).unwrap();
        assert_eq!(revs(log.read(&mut slow, None, 1)), vec![11]);
        push_n(&log, 20..26);
        assert!(matches!(log.read(&mut slow, None, 100), Read::CutOff(_)));
        // 11, 12, 13, 20, 21 were dropped: after 21 the ring is whole.
        assert_eq!(log.start(Some(12)).unwrap_err(), StartError::Compacted { floor: 21 });
        let (mut c, _) = log.start(Some(21)).unwrap();
        assert_eq!(revs(log.read(&mut c, None, 100)), vec![22, 23, 24, 25]);
        let (mut c, _) = log.start(Some(23)).unwrap();
        assert_eq!(revs(log.read(&mut c, None, 100)), vec![24, 25]);
        log.reset(&Index::new(Default::default()), 0);
        assert!(matches!(log.read(&mut c, None, 100), Read::CutOff(_)));
    }
}
