//! The verdict rules (SPEC section 5) and the Verdict JSON.
//!
//! The candidates of a room are its `local` records and the deaths of ranks of the involved
//! groups no earlier than the death window before the room's first record (or the query) and
//! no later than the pending window after it (a rank that re-registered before the first
//! record is alive for the room).
//!
//! 1. The candidate with the lowest revision is the culprit, record or death: `abort` for a
//!    record, `abort_and_restart_group` for a death.
//! 2. Resolved is final: no candidate can later appear with a lower revision (revisions only
//!    grow, and a death keeps the revision it was first seen at), so a resolved verdict names
//!    the same (group, rank, incarnation) forever; a later certificate only refines its reason.
//! 3. Else, while a death could still show up: `pending` (`wait`).
//! 4. Else `unknown` (`abort`): the cause is outside the group.
//! 5. `cause` follows the culprit's `peer` (by group and rank, or by NIXL agent name) to that
//!    rank's own candidate for the room, up to 4 hops, never twice through one rank.
//! 6. `advice` is chosen by the root reason (the cause's, if any) and `repeat`.
//! 7. Victims (v3): a `peer_lost` death (the rank died because a peer of its collective
//!    vanished) is never the culprit while another candidate exists or could still show up
//!    (the pending window after the victim's death); only then is the first victim the
//!    culprit. A `peer_reported` record is never a candidate in its own group: with no
//!    candidate there, the verdict is the verdict of the peer's group for the room.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::ids::{GroupId, Incarnation, Rank, Reason, RoomId};
use crate::index::{Death, DeathEvidence, Index, RoomRecord};
use crate::records::{Origin, Peer};
use crate::time;

/// A verdict question, with the times the shell supplies.
#[derive(Clone, Debug)]
pub struct VerdictQuery {
    pub room: RoomId,
    /// Restrict to one group.
    pub group: Option<GroupId>,
    /// When the question was first asked (a long poll keeps its original time).
    pub asked_at_ms: i64,
    /// Now, for the pending window.
    pub now_ms: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Resolved,
    Pending,
    Unknown,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Resolved => "resolved",
            Status::Pending => "pending",
            Status::Unknown => "unknown",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Abort,
    AbortAndRestartGroup,
    Wait,
}

impl Action {
    /// The JSON name.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Abort => "abort",
            Action::AbortAndRestartGroup => "abort_and_restart_group",
            Action::Wait => "wait",
        }
    }
}

/// Where a verdict learned its culprit from (`culprit.source` in SPEC section 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CulpritSource {
    /// A rank's own room failure record.
    RoomRecord,
    /// A down certificate written by someone who knew why (agent, supervisor, watchdog).
    DownCertificate,
    /// Only the liveness lease ran out (or a coordinator certificate said so).
    LeaseExpired,
}

impl CulpritSource {
    /// The JSON and metric label name.
    pub fn as_str(self) -> &'static str {
        match self {
            CulpritSource::RoomRecord => "room_record",
            CulpritSource::DownCertificate => "down_certificate",
            CulpritSource::LeaseExpired => "lease_expired",
        }
    }
}

impl std::fmt::Display for CulpritSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a piece of a verdict's evidence is (`evidence[].kind` in SPEC section 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvidenceKind {
    RoomRecord,
    /// A specific down certificate.
    Down,
    LeaseExpired,
}

/// The rank that really failed the room.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Culprit {
    pub group: GroupId,
    pub rank: Rank,
    pub reason: Reason,
    pub detail: String,
    pub source: CulpritSource,
    pub at: String,
    pub host: Option<String>,
    pub pid: Option<u32>,
    pub incarnation: Option<Incarnation>,
    pub log_tail: Option<Vec<String>>,
    /// The transfer peer the culprit's record names (group and rank resolved from the NIXL
    /// agent name when the writer knew only that).
    pub peer: Option<PeerRef>,
    /// How many rooms this rank was the culprit of in the retention window (at least 1).
    pub repeat: u32,
}

/// A peer as a verdict shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerRef {
    pub group: Option<GroupId>,
    pub rank: Option<Rank>,
    pub agent: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    pub group: GroupId,
    pub rank: Rank,
    pub kind: EvidenceKind,
    pub origin: Option<Origin>,
    pub reason: Reason,
    pub at: String,
    pub revision: i64,
    /// v4: on a death that resolved a room no rank recorded anywhere (asked with `group=`):
    /// the culprit is inferred from the death alone, not read from a record of the room.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inferred_from_death: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub room: RoomId,
    pub status: Status,
    pub action: Action,
    pub culprit: Option<Culprit>,
    /// The culprit's own root cause, through its peer (rule 5).
    pub cause: Option<Culprit>,
    /// What to do, for an operator (rule 6).
    pub advice: Option<String>,
    pub evidence: Vec<Evidence>,
    /// Ranks of the involved groups that died as victims around the room (rule 7).
    pub victims: Vec<Victim>,
    pub groups: Vec<GroupId>,
    pub revision: i64,
    pub explain: String,
    /// Whether a scheduler may send the request elsewhere, and what to avoid (an addition to
    /// SPEC section 5: docs/contract.md, "Retry advice"). Absent in answers of older
    /// coordinators, hence the default.
    #[serde(default)]
    pub retry: Retry,
}

/// A scheduler's question before it re-sends a failed request: may it, and where not to.
/// Derived from the verdict alone (status, culprit, cause) and the endpoints the ranks
/// published, so replicas at one revision give the same advice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Retry {
    /// Resolved or unknown, and not aborted on purpose: the request itself did not fail, a
    /// rank (or something outside the groups) did. Pending is never safe: the culprit may
    /// still be a rank of the instance the scheduler would choose.
    pub safe: bool,
    /// The groups not to send it to: the root cause's, and the culprit's when the culprit
    /// died (its instance cannot serve until its group re-bootstraps). Empty when nothing is
    /// known to be broken.
    pub avoid: Vec<Avoid>,
    /// One sentence for the log.
    pub why: String,
}

/// A group a retry must not go to, with the addresses a router knows it by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Avoid {
    pub group: GroupId,
    /// The endpoints its ranks published (a prefill's bootstrap `host:port`), sorted.
    pub endpoints: Vec<String>,
    /// A rank of it died (not only failed a transfer): the whole instance is out until it
    /// re-bootstraps.
    pub dead: bool,
}

/// A rank that died because a peer of its collective vanished (rule 7).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Victim {
    pub group: GroupId,
    pub rank: Rank,
    pub reason: Reason,
}

/// The answer for schedulers in a hot path (`?view=compact`, ~200 bytes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompactVerdict {
    pub room: RoomId,
    pub status: Status,
    pub action: Action,
    pub culprit: Option<CompactCulprit>,
    pub cause: Option<CompactCause>,
    pub revision: i64,
    #[serde(default)]
    pub retry: CompactRetry,
}

/// [`Retry`] without its sentence.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompactRetry {
    pub safe: bool,
    pub avoid: Vec<Avoid>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompactCulprit {
    pub group: GroupId,
    pub rank: Rank,
    pub reason: Reason,
    pub source: CulpritSource,
    pub incarnation: Option<Incarnation>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompactCause {
    pub group: GroupId,
    pub rank: Rank,
    pub reason: Reason,
}

impl From<&Verdict> for CompactVerdict {
    fn from(v: &Verdict) -> Self {
        CompactVerdict {
            room: v.room,
            status: v.status,
            action: v.action,
            culprit: v.culprit.as_ref().map(|c| CompactCulprit {
                group: c.group.clone(),
                rank: c.rank,
                reason: c.reason.clone(),
                source: c.source,
                incarnation: c.incarnation,
            }),
            cause: v.cause.as_ref().map(|c| CompactCause {
                group: c.group.clone(),
                rank: c.rank,
                reason: c.reason.clone(),
            }),
            revision: v.revision,
            retry: CompactRetry {
                safe: v.retry.safe,
                avoid: v.retry.avoid.clone(),
            },
        }
    }
}

/// Which rule fired, before it is dressed up as JSON.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Decision {
    Record {
        idx: usize,
    },
    Death {
        key: (GroupId, Rank, Incarnation),
    },
    /// v4: the first candidate is a live key that vanished and is not certified yet: it may
    /// still be certified `lease_lost` (no death), so nothing is named until it is.
    Uncertified {
        key: (GroupId, Rank, Incarnation),
    },
    /// A victim died and the rank it lost may still show up (rule 7).
    VictimPending {
        remaining_ms: i64,
    },
    Pending {
        remaining_ms: i64,
    },
    Unknown,
    /// The room's records only report a peer's failure: the peer group's decision (rule 7).
    Peer {
        group: GroupId,
        inner: Box<Decision>,
    },
}

/// The facts a decision is made from, shared by the rule check and the JSON.
struct Scope<'a> {
    records: Vec<(usize, &'a RoomRecord)>,
    groups: BTreeSet<GroupId>,
    /// When the pending window opened on this replica's monotonic clock: the room's first
    /// record here, or the query when the scope has no record (only the countdown uses it).
    opened_ms: i64,
    first_revision: Option<i64>,
    pending_window_ms: i64,
    /// The revision of the room's pending-window end key, once etcd holds it.
    window_end: Option<i64>,
}

impl Index {
    fn scope(&self, room: RoomId, group: Option<&GroupId>, asked_at_ms: i64) -> Scope<'_> {
        let records: Vec<(usize, &RoomRecord)> = self
            .rooms
            .get(&room)
            .map(|e| {
                e.records
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| group.is_none_or(|g| &r.group == g))
                    .collect()
            })
            .unwrap_or_default();
        let groups: BTreeSet<GroupId> = match group {
            Some(g) => BTreeSet::from([g.clone()]),
            None => records.iter().map(|(_, r)| r.group.clone()).collect(),
        };
        let entry = self.rooms.get(&room);
        let (opened_ms, first_revision) = match (records.first(), entry) {
            (Some((_, r)), Some(e)) => (e.first_observed_ms, Some(r.revision)),
            _ => (asked_at_ms, None),
        };
        let window_end = first_revision.and_then(|_| self.window_ends.get(&crate::Window::Room(room)).copied());
        let slowest_ttl = groups
            .iter()
            .filter_map(|g| self.slowest_lease_ttl_ms(g, first_revision))
            .max()
            .unwrap_or(self.config.default_lease_ttl_ms);
        Scope {
            records,
            groups,
            opened_ms,
            first_revision,
            pending_window_ms: slowest_ttl + self.config.pending_grace_ms,
            window_end,
        }
    }

    /// Rule 3's pending window of a room: the slowest involved rank's lease TTL plus the grace.
    pub(crate) fn room_window_ms(&self, room: RoomId) -> i64 {
        self.scope(room, None, 0).pending_window_ms
    }

    /// Whether a death counts for a scope by the windows of section 5, all by revision: seen
    /// before the room's pending window ended (its end key), and its own death window not yet
    /// ended when the room's first record came (or, with no record, now). No host clock and
    /// no local deadline: a function of etcd state, the same on every replica.
    fn in_windows(&self, key: &(GroupId, Rank, Incarnation), d: &Death, scope: &Scope<'_>) -> bool {
        let before_end = scope.window_end.is_none_or(|end| d.revision < end);
        let fresh = match self.window_ends.get(&crate::Window::Death(key.0.clone(), key.1, key.2)) {
            None => true,
            Some(aged) => scope.first_revision.is_some_and(|first| first < *aged),
        };
        d.reason.may_be_culprit() && before_end && fresh
    }

    /// Deaths that count for a room under rule 2, in revision order.
    fn counted_deaths<'a>(&'a self, scope: &Scope<'_>) -> Vec<(&'a (GroupId, Rank, Incarnation), &'a Death)> {
        let mut out: Vec<_> = scope
            .groups
            .iter()
            .flat_map(|g| self.deaths_of(g))
            .filter(|(k, d)| self.in_windows(k, d, scope))
            .filter(|((g, rank, inc), _)| !self.reregistered_before(g, *rank, *inc, scope.first_revision))
            .collect();
        out.sort_by_key(|(_, d)| d.revision);
        out
    }

    pub(crate) fn deaths_of<'a>(
        &'a self,
        group: &GroupId,
    ) -> impl Iterator<Item = (&'a (GroupId, Rank, Incarnation), &'a Death)> + 'a {
        let lo = (group.clone(), 0, Incarnation::MIN);
        let hi = (group.clone(), Rank::MAX, Incarnation::MAX);
        self.deaths.range(lo..=hi)
    }

    /// "A rank that re-registered before the room's first record is alive for that room."
    fn reregistered_before(&self, group: &GroupId, rank: Rank, dead: Incarnation, first_revision: Option<i64>) -> bool {
        let Some(state) = self.ranks.get(&(group.clone(), rank)) else {
            return false;
        };
        let death_revision = self
            .deaths
            .get(&(group.clone(), rank, dead))
            .map_or(i64::MAX, |d| d.revision);
        // When the dead incarnation registered; if unknown, no later than its death showed.
        let dead_registered = state
            .registrations
            .iter()
            .find(|(i, _)| *i == dead)
            .map_or(death_revision, |(_, r)| *r);
        let before_first = |rev: i64| first_revision.is_none_or(|f| rev < f);
        // The current live incarnation is newer than any dead one by construction.
        let live_newer = state
            .live
            .as_ref()
            .is_some_and(|l| l.incarnation != dead && before_first(l.registered_revision));
        let other_newer = state
            .registrations
            .iter()
            .any(|(i, r)| *i != dead && before_first(*r) && (*r > dead_registered || *r >= death_revision));
        live_newer || other_newer
    }

    pub(crate) fn decide(&self, room: RoomId, group: Option<&GroupId>, asked_at_ms: i64, now_ms: i64) -> Decision {
        let scope = self.scope(room, group, asked_at_ms);
        let deaths = self.counted_deaths(&scope);
        self.decide_in(room, &scope, &deaths, asked_at_ms, now_ms, PEER_HOPS)
    }

    /// The rules, given the scope and the deaths that count for it (computed once: the
    /// verdict lists the same deaths as evidence). `hops` bounds how far rule 7 follows
    /// `peer_reported` records from group to group.
    fn decide_in(
        &self,
        room: RoomId,
        scope: &Scope<'_>,
        deaths: &[(&(GroupId, Rank, Incarnation), &Death)],
        asked_at_ms: i64,
        now_ms: i64,
        hops: usize,
    ) -> Decision {
        if let Some(d) = self.decide_candidates(scope, deaths, now_ms) {
            return d;
        }
        if hops > 0 {
            if let Some(group) = self.reported_peer(room, scope) {
                let peer_scope = self.scope(room, Some(&group), asked_at_ms);
                let peer_deaths = self.counted_deaths(&peer_scope);
                let inner = self.decide_in(room, &peer_scope, &peer_deaths, asked_at_ms, now_ms, hops - 1);
                return Decision::Peer {
                    group,
                    inner: Box::new(inner),
                };
            }
            if scope.records.iter().any(|(_, r)| r.origin == Origin::PeerReported) {
                // The peer is not known to rootrank: no rank of ours failed the room.
                return Decision::Unknown;
            }
        }
        let until = scope.opened_ms.saturating_add(scope.pending_window_ms);
        let remaining_ms = until.saturating_sub(now_ms).max(0);
        match (scope.first_revision, scope.window_end) {
            // A recorded room is final once etcd says its window ended; meanwhile the
            // countdown is this replica's (0 while the end key is on its way).
            (Some(_), Some(_)) => Decision::Unknown,
            (Some(_), None) => Decision::Pending { remaining_ms },
            // No record: the query's own window, on this replica's clock.
            (None, _) if now_ms <= until => Decision::Pending { remaining_ms },
            (None, _) => Decision::Unknown,
        }
    }

    /// Rules 1 and 7 over the candidates of one scope: the first candidate by revision that
    /// is not a victim; else, once etcd says the victim's window ended, the first victim.
    fn decide_candidates(
        &self,
        scope: &Scope<'_>,
        deaths: &[(&(GroupId, Rank, Incarnation), &Death)],
        now_ms: i64,
    ) -> Option<Decision> {
        let victim = deaths.iter().find(|(_, d)| d.victim);
        // Against a victim, a candidate counts if it came before it, or before the end key of
        // the window in which the rank it lost could still show up (after that the victim is
        // the answer, and stays it: rule 2).
        let settled = victim.and_then(|((g, r, i), _)| self.window_ends.get(&crate::Window::Victim(g.clone(), *r, *i)));
        let counts = |revision: i64| {
            victim.is_none_or(|(_, v)| revision < v.revision || settled.is_none_or(|end| revision < *end))
        };
        let record = scope
            .records
            .iter()
            .find(|(_, r)| r.origin == Origin::Local && counts(r.revision));
        let death = deaths.iter().find(|(_, d)| !d.victim && counts(d.revision));
        if let Some(d) = earliest(record.map(|(i, r)| (*i, *r)), death.map(|(k, d)| (*k, *d))) {
            return Some(match d {
                Decision::Death { key } if self.deaths.get(&key).is_some_and(|d| d.certified_revision == 0) => {
                    Decision::Uncertified { key }
                }
                d => d,
            });
        }
        let (key, v) = victim?;
        Some(match settled {
            Some(_) => Decision::Death { key: (*key).clone() },
            None => {
                let until = v.seen_ms.saturating_add(self.group_window_ms(&key.0));
                Decision::VictimPending {
                    remaining_ms: until.saturating_sub(now_ms).max(0),
                }
            }
        })
    }

    /// The group a room's `peer_reported` records point at (rule 7), outside the scope's own
    /// groups: the first such record whose peer is known.
    fn reported_peer(&self, room: RoomId, scope: &Scope<'_>) -> Option<GroupId> {
        scope
            .records
            .iter()
            .filter(|(_, r)| r.origin == Origin::PeerReported)
            .filter_map(|(_, r)| self.peer_group(room, r.peer.as_deref()?))
            .find(|g| !scope.groups.contains(g))
    }

    /// Every group the room's `peer_reported` records point at (for re-checking the room
    /// when a death lands there).
    pub(crate) fn reported_peer_groups(&self, room: RoomId) -> BTreeSet<GroupId> {
        let Some(entry) = self.rooms.get(&room) else {
            return BTreeSet::new();
        };
        entry
            .records
            .iter()
            .filter(|r| r.origin == Origin::PeerReported)
            .filter_map(|r| self.peer_group(room, r.peer.as_deref()?))
            .filter(|g| !entry.records.iter().any(|r| &r.group == g))
            .collect()
    }

    /// The group a record's peer belongs to: as named, else through its NIXL agent name, else
    /// through an endpoint a rank published. An endpoint several groups publish (the prefill
    /// instances of one bootstrap server under DP) picks the one group with records for the
    /// room; when that does not single one out, the peer is not known.
    fn peer_group(&self, room: RoomId, p: &Peer) -> Option<GroupId> {
        if let PeerRef { group: Some(g), .. } = self.peer_ref(p) {
            return Some(g);
        }
        let ranks = self.endpoints.get(p.endpoint.as_deref()?)?;
        let groups: BTreeSet<&GroupId> = ranks
            .iter()
            .filter(|(_, r)| p.rank.is_none_or(|want| *r == want))
            .map(|(g, _)| g)
            .collect();
        if groups.len() == 1 {
            return groups.into_iter().next().cloned();
        }
        let records = &self.rooms.get(&room)?.records;
        let mut with_records = groups.into_iter().filter(|g| records.iter().any(|r| &r.group == *g));
        match (with_records.next(), with_records.next()) {
            (Some(g), None) => Some(g.clone()),
            _ => None,
        }
    }

    /// Host and pid of a rank's incarnation: from its live record while we have it, else from
    /// its down certificate (which outlives the live record, and a coordinator restart).
    fn live_facts(
        &self,
        group: &GroupId,
        rank: Rank,
        inc: Option<Incarnation>,
    ) -> (Option<String>, Option<u32>, Option<Incarnation>) {
        let state = self.ranks.get(&(group.clone(), rank));
        let entry = state.and_then(|s| match inc {
            Some(i) => s.history.iter().rev().find(|h| h.incarnation == i),
            None => s.live.as_ref().or(s.history.last()),
        });
        if let Some(e) = entry {
            return (e.record.host.clone(), e.record.pid, Some(e.incarnation));
        }
        match inc.and_then(|i| self.deaths.get(&(group.clone(), rank, i))) {
            Some(d) => (d.host.clone(), d.pid, inc),
            None => (None, None, inc),
        }
    }

    /// Only the status of the answer, without building the verdict's strings, and in how many
    /// milliseconds it may change with no new event (a pending window ends): what a long poll
    /// checks when woken, and when it has to look again if nothing wakes it sooner.
    pub fn verdict_wait(&self, q: &VerdictQuery) -> (Status, Option<i64>) {
        let decision = self.decide(q.room, q.group.as_ref(), q.asked_at_ms, q.now_ms);
        let changes_in = match decision.last() {
            // Inclusive windows: the answer may change the millisecond after.
            // Past this replica's deadline, the end key is on its way and wakes the poll when
            // it lands; look again now and then in case etcd is slow to take it.
            Decision::Pending { remaining_ms } | Decision::VictimPending { remaining_ms } if *remaining_ms == 0 => {
                Some(250)
            }
            Decision::Pending { remaining_ms } | Decision::VictimPending { remaining_ms } => {
                Some(remaining_ms.saturating_add(1))
            }
            // Its certificate wakes the poll when it lands; look again now and then meanwhile.
            Decision::Uncertified { .. } => Some(1000),
            _ => None,
        };
        (decision.status_action().0, changes_in)
    }

    /// Answers a verdict question (SPEC section 5).
    pub fn verdict(&self, q: &VerdictQuery) -> Verdict {
        let scope = self.scope(q.room, q.group.as_ref(), q.asked_at_ms);
        let deaths = self.counted_deaths(&scope);
        let decision = self.decide_in(q.room, &scope, &deaths, q.asked_at_ms, q.now_ms, PEER_HOPS);
        let mut evidence = Vec::new();
        let mut victims = Vec::new();
        let mut groups: BTreeSet<GroupId> = scope.groups.clone();
        // No rank recorded the room anywhere: a death names the culprit by inference only.
        let unrecorded = self.rooms.get(&q.room).is_none_or(|e| e.records.is_empty());
        let inferred = unrecorded && matches!(decision.last(), Decision::Death { .. });
        self.gather(&scope, &deaths, inferred, &mut evidence, &mut victims);
        // Rule 7: the peer groups the answer came from are shown as evidence too.
        let mut d = &decision;
        while let Decision::Peer { group, inner } = d {
            let peer_scope = self.scope(q.room, Some(group), q.asked_at_ms);
            let peer_deaths = self.counted_deaths(&peer_scope);
            self.gather(&peer_scope, &peer_deaths, inferred, &mut evidence, &mut victims);
            groups.insert(group.clone());
            d = inner;
        }
        evidence.sort_by_key(|e| e.revision);
        evidence.dedup();
        victims.dedup();
        let culprit = decision.culprit(self, q.room);
        let cause = culprit.as_ref().and_then(|c| self.cause(q.room, &scope, c));
        let (status, action) = decision.status_action();
        let mut explain = explain(&decision, culprit.as_ref(), &scope, &victims, q.room);
        if inferred {
            explain = format!(
                "No rank recorded room {}: inferred from a death in the group around the query, not from a record of the room (a mistyped room gets this answer too). {explain}",
                q.room
            );
        }
        if culprit.is_none() {
            // v3: a wedged rank fails nothing and dies of nothing; say so while nothing else is known.
            explain.push_str(&self.stall_note(&groups));
        }
        let advice = culprit.as_ref().map(|c| crate::advice::advice(c, cause.as_ref()));
        let retry = self.retry(status, action, culprit.as_ref(), cause.as_ref());
        Verdict {
            room: q.room,
            status,
            action,
            culprit,
            cause,
            advice,
            evidence,
            victims,
            groups: groups.into_iter().collect(),
            revision: self.revision,
            explain,
            retry,
        }
    }

    /// The retry advice of a verdict (docs/contract.md, "Retry advice").
    fn retry(&self, status: Status, action: Action, culprit: Option<&Culprit>, cause: Option<&Culprit>) -> Retry {
        let (Status::Resolved, Some(c)) = (status, culprit) else {
            return match status {
                Status::Pending => Retry {
                    safe: false,
                    avoid: Vec::new(),
                    why: "Not yet: the culprit is not known and may be a rank of the instance a retry would go to; ask again with wait_ms.".into(),
                },
                _ => Retry {
                    safe: true,
                    avoid: Vec::new(),
                    why: "Safe to retry: no rank of the groups failed the room, so nothing known to avoid.".into(),
                },
            };
        };
        let root = cause.unwrap_or(c);
        if root.reason.as_str() == "aborted" {
            return Retry {
                safe: false,
                avoid: Vec::new(),
                why: "Do not retry: the request was aborted on purpose (client, router or the other side).".into(),
            };
        }
        let culprit_died = action == Action::AbortAndRestartGroup;
        let root_dead = root.source != CulpritSource::RoomRecord || (culprit_died && c.group == root.group);
        let mut avoid = vec![self.avoid(&root.group, root_dead)];
        if culprit_died && c.group != root.group {
            avoid.push(self.avoid(&c.group, true));
        }
        let names: Vec<String> = avoid
            .iter()
            .map(|a| format!("{}{}", a.group, if a.dead { " (a rank died)" } else { "" }))
            .collect();
        Retry {
            safe: true,
            why: format!(
                "Safe to retry elsewhere: {} rank {} failed the room ({}); avoid {}.",
                root.group,
                root.rank,
                root.reason,
                names.join(" and ")
            ),
            avoid,
        }
    }

    fn avoid(&self, group: &GroupId, dead: bool) -> Avoid {
        let endpoints: BTreeSet<&String> = self
            .ranks
            .range((group.clone(), 0)..=(group.clone(), Rank::MAX))
            .flat_map(|(_, state)| state.live.as_ref().or(state.history.last()))
            .flat_map(|entry| &entry.record.endpoints)
            .collect();
        Avoid {
            group: group.clone(),
            endpoints: endpoints.into_iter().cloned().collect(),
            dead,
        }
    }

    /// " prefill-0 rank 2 is stalled (alive, no progress for 12 s; stalled first: the suspect)."
    /// for each stalled rank of `groups`, or nothing.
    fn stall_note(&self, groups: &BTreeSet<GroupId>) -> String {
        let mut note = String::new();
        for g in groups {
            let suspect = self.first_stall(g);
            for ((_, rank), stall) in self.stalls.range((g.clone(), 0)..=(g.clone(), Rank::MAX)) {
                if !self.is_stalled(g, *rank) {
                    continue;
                }
                let for_s = stall
                    .record
                    .stalled_ms
                    .map(|ms| format!(", no progress for {} s", ms / 1000))
                    .unwrap_or_default();
                let role = if suspect == Some(*rank) {
                    "stalled first: the suspect"
                } else {
                    "waiting on the suspect"
                };
                note.push_str(&format!(" {g} rank {rank} is stalled (alive{for_s}; {role})."));
            }
        }
        note
    }

    /// A scope's records and counted deaths as evidence, and its victims (rule 7).
    fn gather(
        &self,
        scope: &Scope<'_>,
        deaths: &[(&(GroupId, Rank, Incarnation), &Death)],
        inferred: bool,
        evidence: &mut Vec<Evidence>,
        victims: &mut Vec<Victim>,
    ) {
        evidence.extend(scope.records.iter().map(|(_, r)| Evidence {
            group: r.group.clone(),
            rank: r.rank,
            kind: EvidenceKind::RoomRecord,
            origin: Some(r.origin),
            reason: r.reason.clone(),
            at: time::format_ms(r.at_ms),
            revision: r.revision,
            inferred_from_death: false,
        }));
        evidence.extend(deaths.iter().map(|((g, rank, _), d)| Evidence {
            group: g.clone(),
            rank: *rank,
            kind: death_evidence(d),
            origin: None,
            reason: d.reason.clone(),
            at: time::format_ms(d.at_ms),
            revision: d.revision,
            inferred_from_death: inferred,
        }));
        victims.extend(deaths.iter().filter(|(_, d)| d.victim).map(|((g, rank, _), d)| Victim {
            group: g.clone(),
            rank: *rank,
            reason: d.reason.clone(),
        }));
    }
}

/// How many groups rule 7 follows `peer_reported` records through (decode -> prefill is one).
const PEER_HOPS: usize = 4;

/// Rule 1 between a first record and a first death: the lower revision; a tie (one etcd
/// transaction could make one) goes to the record, which names the room.
fn earliest(
    record: Option<(usize, &RoomRecord)>,
    death: Option<(&(GroupId, Rank, Incarnation), &Death)>,
) -> Option<Decision> {
    match (record, death) {
        (Some((idx, r)), Some((_, d))) if r.revision <= d.revision => Some(Decision::Record { idx }),
        (Some((idx, _)), None) => Some(Decision::Record { idx }),
        (_, Some((key, _))) => Some(Decision::Death { key: key.clone() }),
        (None, None) => None,
    }
}

/// How many hops `cause` follows (SPEC rule 5).
const CAUSE_HOPS: usize = 4;

impl Index {
    /// Rule 5: the culprit's peer's own root cause for this room, followed up to 4 hops.
    fn cause(&self, room: RoomId, scope: &Scope<'_>, culprit: &Culprit) -> Option<Culprit> {
        let mut visited = BTreeSet::from([(culprit.group.clone(), culprit.rank)]);
        let mut peer = culprit.peer.clone();
        let mut cause = None;
        for _ in 0..CAUSE_HOPS {
            let Some(PeerRef {
                group: Some(group),
                rank: Some(rank),
                ..
            }) = peer
            else {
                break;
            };
            if !visited.insert((group.clone(), rank)) {
                break; // a loop: what we have is the cause
            }
            let Some(next) = self.candidate_of(room, &group, rank, scope) else {
                break;
            };
            peer = next.peer.clone();
            cause = Some(next);
        }
        cause
    }

    /// One rank's earliest candidate for a room: its `local` record, or its death within the
    /// room's windows (the same rules as for the room's own groups).
    fn candidate_of(&self, room: RoomId, group: &GroupId, rank: Rank, scope: &Scope<'_>) -> Option<Culprit> {
        let record = self.rooms.get(&room).and_then(|e| {
            e.records
                .iter()
                .enumerate()
                .find(|(_, r)| &r.group == group && r.rank == rank && r.origin == Origin::Local)
        });
        let death = self
            .deaths_of(group)
            .filter(|(k, d)| k.1 == rank && self.in_windows(k, d, scope))
            .filter(|((g, r, inc), _)| !self.reregistered_before(g, *r, *inc, scope.first_revision))
            .min_by_key(|(_, d)| d.revision);
        earliest(record, death)?.culprit(self, room)
    }

    /// A record's peer as the verdict shows it: group and rank as written, or resolved from
    /// the NIXL agent name through the ranks' live records.
    fn peer_ref(&self, p: &Peer) -> PeerRef {
        let named = p.group.as_deref().and_then(|g| GroupId::new(g).ok());
        let (group, rank) = match (named, p.rank) {
            (Some(g), Some(r)) => (Some(g), Some(r)),
            (named, rank) => match p.agent.as_ref().and_then(|a| self.agents.get(a)) {
                Some((g, r)) => (Some(g.clone()), Some(*r)),
                None => (named, rank),
            },
        };
        PeerRef {
            group,
            rank,
            agent: p.agent.clone(),
        }
    }

    /// How often a rank failed in the retention window: the rooms it recorded a `local`
    /// failure for (a record culprit), or its deaths (a death culprit). At least 1.
    fn repeat_of(&self, group: &GroupId, rank: Rank, death: bool) -> u32 {
        let n = if death {
            self.deaths_of(group)
                .filter(|((_, r, _), d)| *r == rank && d.reason.may_be_culprit())
                .count() as u32
        } else {
            self.local_records
                .get(&(group.clone(), rank))
                .map_or(0, |r| u32::try_from(r.len()).unwrap_or(u32::MAX))
        };
        n.max(1)
    }
}

impl Decision {
    /// What the verdict says and asks for (rules 1, 3 and 4).
    fn status_action(&self) -> (Status, Action) {
        match self {
            Decision::Record { .. } => (Status::Resolved, Action::Abort),
            Decision::Death { .. } => (Status::Resolved, Action::AbortAndRestartGroup),
            Decision::Pending { .. } | Decision::VictimPending { .. } | Decision::Uncertified { .. } => {
                (Status::Pending, Action::Wait)
            }
            Decision::Unknown => (Status::Unknown, Action::Abort),
            Decision::Peer { inner, .. } => inner.status_action(),
        }
    }

    /// The decision that names the culprit, through the peer groups of rule 7.
    pub(crate) fn last(&self) -> &Decision {
        match self {
            Decision::Peer { inner, .. } => inner.last(),
            d => d,
        }
    }

    /// Who and why, without building the culprit's strings.
    pub(crate) fn summary(&self, index: &Index, room: RoomId) -> Option<(GroupId, Rank, Reason, CulpritSource)> {
        match self.last() {
            Decision::Record { idx } => {
                let r = index.rooms.get(&room)?.records.get(*idx)?;
                Some((r.group.clone(), r.rank, r.reason.clone(), CulpritSource::RoomRecord))
            }
            Decision::Death { key } => {
                let d = index.deaths.get(key)?;
                Some((key.0.clone(), key.1, d.reason.clone(), death_source(d)))
            }
            _ => None,
        }
    }

    pub(crate) fn culprit(&self, index: &Index, room: RoomId) -> Option<Culprit> {
        match self.last() {
            Decision::Record { idx } => {
                let r = index.rooms.get(&room)?.records.get(*idx)?;
                let (host, pid, incarnation) = index.live_facts(&r.group, r.rank, r.incarnation);
                let peer = r.peer.as_ref().map(|p| {
                    let mut s = String::new();
                    if let (Some(g), Some(rk)) = (&p.group, p.rank) {
                        s.push_str(&format!("{g} rank {rk}"));
                    }
                    if let Some(a) = &p.agent {
                        s.push_str(&format!("{}agent {a}", if s.is_empty() { "" } else { ", " }));
                    }
                    s
                });
                let own = r.detail.as_deref().unwrap_or("");
                let detail = match peer {
                    Some(p) if !p.is_empty() && !own.contains(&p) => format!("{own} (peer: {p})"),
                    _ => own.to_string(),
                };
                Some(Culprit {
                    group: r.group.clone(),
                    rank: r.rank,
                    reason: r.reason.clone(),
                    detail,
                    source: CulpritSource::RoomRecord,
                    at: time::format_ms(r.at_ms),
                    host,
                    pid,
                    incarnation,
                    log_tail: None,
                    peer: r.peer.as_deref().map(|p| index.peer_ref(p)),
                    repeat: index.repeat_of(&r.group, r.rank, false),
                })
            }
            Decision::Death { key } => {
                let d = index.deaths.get(key)?;
                let (group, rank, inc) = key;
                let (host, pid, _) = index.live_facts(group, *rank, Some(*inc));
                // The certificate names the process when the live record is long gone.
                let (host, pid) = (d.host.clone().or(host), d.pid.or(pid));
                Some(Culprit {
                    group: group.clone(),
                    rank: *rank,
                    reason: d.reason.clone(),
                    detail: d.detail.clone(),
                    source: death_source(d),
                    at: time::format_ms(d.at_ms),
                    host,
                    pid,
                    incarnation: Some(*inc),
                    log_tail: d.log_tail.clone(),
                    peer: None,
                    repeat: index.repeat_of(group, *rank, true),
                })
            }
            _ => None,
        }
    }
}

/// What a death is as evidence, and as a culprit's source: the one mapping of the two.
fn death_evidence(d: &Death) -> EvidenceKind {
    match d.evidence {
        DeathEvidence::Certificate => EvidenceKind::Down,
        DeathEvidence::Vanished | DeathEvidence::CoordinatorCertificate => EvidenceKind::LeaseExpired,
    }
}

fn death_source(d: &Death) -> CulpritSource {
    match death_evidence(d) {
        EvidenceKind::Down => CulpritSource::DownCertificate,
        EvidenceKind::LeaseExpired | EvidenceKind::RoomRecord => CulpritSource::LeaseExpired,
    }
}

fn explain(
    decision: &Decision,
    culprit: Option<&Culprit>,
    scope: &Scope<'_>,
    victims: &[Victim],
    room: RoomId,
) -> String {
    let mut d = decision;
    let mut peer_group = None;
    while let Decision::Peer { group, inner } = d {
        peer_group = Some(group);
        d = inner;
    }
    let groups = match peer_group {
        Some(g) => g.to_string(),
        None if scope.groups.is_empty() => "any group".to_string(),
        None => scope.groups.iter().map(GroupId::as_str).collect::<Vec<_>>().join(", "),
    };
    let mut text = explain_decision(d, culprit, scope, &groups, room);
    if !victims.is_empty() {
        let who: Vec<String> = victims.iter().map(|v| format!("{} rank {}", v.group, v.rank)).collect();
        text.push_str(&format!(" Victims (died because a peer vanished): {}.", who.join(", ")));
    }
    // Rule 7: what the room's own ranks were told by their transfer peer.
    let told = scope.records.iter().find(|(_, r)| r.origin == Origin::PeerReported);
    if let Some((_, r)) = told {
        let via = match decision {
            Decision::Peer { group, .. } => format!(", which is {group}"),
            _ => ", which rootrank does not know".to_string(),
        };
        text = format!(
            "{} rank {} was told by its transfer peer{via} that the peer failed room {room} ({}). {text}",
            r.group,
            r.rank,
            one_line(r.detail.as_deref().unwrap_or(""))
        );
    }
    text
}

fn explain_decision(
    decision: &Decision,
    culprit: Option<&Culprit>,
    scope: &Scope<'_>,
    groups: &str,
    room: RoomId,
) -> String {
    let others = scope
        .records
        .iter()
        .filter(|(_, r)| r.origin == Origin::Propagated)
        .count();
    match (decision, culprit) {
        (Decision::Record { .. }, Some(c)) => format!(
            "{} rank {} failed room {room} first: {} ({}); {others} other rank(s) only saw the generic error. Abort the request.",
            c.group, c.rank, c.reason, one_line(&c.detail)
        ),
        (Decision::Death { .. }, Some(c)) => format!(
            "{} rank {}{} died ({}, {}): {}. Abort the request and restart the group.",
            c.group,
            c.rank,
            c.pid.map(|p| format!(" (pid {p}{})", c.host.as_deref().map(|h| format!(" on {h}")).unwrap_or_default())).unwrap_or_default(),
            c.reason,
            c.source,
            one_line(&c.detail)
        ),
        (Decision::Uncertified { key }, _) => format!(
            "{} rank {}'s live key vanished (its lease ran out or was revoked) and its death is not certified yet: a coordinator certifies it at once, or, after etcd was silent, once it knows whether the process lived on (then it is lease_lost, no death). Wait (ask again with wait_ms).",
            key.0, key.1
        ),
        // The window's length, not what is left of it: the countdown is this replica's own
        // clock, and replicas at one revision answer byte for byte the same.
        (Decision::VictimPending { .. }, _) => format!(
            "A rank of {groups} died because a peer of its collective vanished; the rank it lost can still show up within {:.1} s of that death. Wait (ask again with wait_ms).",
            scope.pending_window_ms as f64 / 1000.0
        ),
        (Decision::Pending { .. }, _) if scope.first_revision.is_some() => format!(
            "No rank of {groups} has reported a cause for room {room} yet; a death could still show up within {:.1} s of its first record. Wait (ask again with wait_ms).",
            scope.pending_window_ms as f64 / 1000.0
        ),
        (Decision::Pending { .. }, _) => format!(
            "No rank of {groups} has reported a cause for room {room} yet; a death could still show up within {:.1} s of this question. Wait (ask again with wait_ms).",
            scope.pending_window_ms as f64 / 1000.0
        ),
        _ => format!(
            "No rank of {groups} failed room {room}: the cause is outside the group (decode side, network, router). Abort the request."
        ),
    }
}

fn one_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or("").trim();
    if line.len() > 200 {
        let mut end = 200;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &line[..end])
    } else {
        line.to_string()
    }
}
