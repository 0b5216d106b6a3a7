//! The verdict rules (SPEC section 5) and the Verdict JSON.
//!
//! 1. A `local` room record: the one with the lowest revision is the culprit (`abort`).
//! 2. Else a death of a rank of an involved group, no earlier than the death window before
//!    the room's first record (or the query) and no later than the pending window after it;
//!    a rank that re-registered before the first record is alive for the room. The death
//!    with the lowest revision is the culprit (`abort_and_restart_group`).
//! 3. Else, while a death could still show up: `pending` (`wait`).
//! 4. Else `unknown` (`abort`): the cause is outside the group.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::ids::{GroupId, Incarnation, Rank, Reason, RoomId};
use crate::index::{Death, DeathEvidence, Index, RoomRecord};
use crate::records::Origin;
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Abort,
    AbortAndRestartGroup,
    Wait,
}

/// The rank that really failed the room.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Culprit {
    pub group: GroupId,
    pub rank: Rank,
    pub reason: Reason,
    pub detail: String,
    /// `room_record`, `down_certificate` or `lease_expired`.
    pub source: &'static str,
    pub at: String,
    pub host: Option<String>,
    pub pid: Option<u32>,
    pub incarnation: Option<Incarnation>,
    pub log_tail: Option<Vec<String>>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Evidence {
    pub group: GroupId,
    pub rank: Rank,
    /// `room_record`, `down` or `lease_expired`.
    pub kind: &'static str,
    pub origin: Option<Origin>,
    pub reason: Reason,
    pub at: String,
    pub revision: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub room: RoomId,
    pub status: Status,
    pub action: Action,
    pub culprit: Option<Culprit>,
    pub evidence: Vec<Evidence>,
    pub groups: Vec<GroupId>,
    pub revision: i64,
    pub explain: String,
}

/// Which rule fired, before it is dressed up as JSON.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Decision {
    Record { idx: usize },
    Death { key: (GroupId, Rank, Incarnation) },
    Pending { remaining_ms: i64 },
    Unknown,
}

/// The facts a decision is made from, shared by the rule check and the JSON.
struct Scope<'a> {
    records: Vec<(usize, &'a RoomRecord)>,
    groups: BTreeSet<GroupId>,
    t0_ms: i64,
    first_revision: Option<i64>,
    pending_window_ms: i64,
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
        let (t0_ms, first_revision) = match records.first() {
            Some((_, r)) => (r.at_ms, Some(r.revision)),
            None => (asked_at_ms, None),
        };
        let slowest_ttl = groups
            .iter()
            .filter_map(|g| self.groups.get(g).and_then(|i| i.max_lease_ttl_ms))
            .max()
            .unwrap_or(self.config.default_lease_ttl_ms);
        Scope {
            records,
            groups,
            t0_ms,
            first_revision,
            pending_window_ms: slowest_ttl + self.config.pending_grace_ms,
        }
    }

    /// Deaths that count for a room under rule 2, in revision order.
    fn counted_deaths<'a>(&'a self, scope: &Scope<'_>) -> Vec<(&'a (GroupId, Rank, Incarnation), &'a Death)> {
        let lo = scope.t0_ms - self.config.death_window_ms;
        let hi = scope.t0_ms + scope.pending_window_ms;
        let mut out: Vec<_> = scope
            .groups
            .iter()
            .flat_map(|g| self.deaths_of(g))
            .filter(|(_, d)| !d.reason.is_shutdown() && d.at_ms >= lo && d.at_ms <= hi)
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
        self.decide_in(&scope, &deaths, now_ms)
    }

    /// The rules, given the scope and the deaths that count for it (computed once: the
    /// verdict lists the same deaths as evidence).
    fn decide_in(
        &self,
        scope: &Scope<'_>,
        deaths: &[(&(GroupId, Rank, Incarnation), &Death)],
        now_ms: i64,
    ) -> Decision {
        // Records are sorted by revision, so the first local one is the earliest root cause.
        if let Some((idx, _)) = scope.records.iter().find(|(_, r)| r.origin == Origin::Local) {
            return Decision::Record { idx: *idx };
        }
        if let Some((key, _)) = deaths.first() {
            return Decision::Death { key: (*key).clone() };
        }
        let until = scope.t0_ms + scope.pending_window_ms;
        if now_ms < until {
            Decision::Pending {
                remaining_ms: until - now_ms,
            }
        } else {
            Decision::Unknown
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

    /// Answers a verdict question (SPEC section 5).
    pub fn verdict(&self, q: &VerdictQuery) -> Verdict {
        let scope = self.scope(q.room, q.group.as_ref(), q.asked_at_ms);
        let deaths = self.counted_deaths(&scope);
        let decision = self.decide_in(&scope, &deaths, q.now_ms);
        let mut evidence: Vec<Evidence> = scope
            .records
            .iter()
            .map(|(_, r)| Evidence {
                group: r.group.clone(),
                rank: r.rank,
                kind: "room_record",
                origin: Some(r.origin),
                reason: r.reason.clone(),
                at: time::format_ms(r.at_ms),
                revision: r.revision,
            })
            .collect();
        evidence.extend(deaths.iter().map(|((g, rank, _), d)| Evidence {
            group: g.clone(),
            rank: *rank,
            kind: death_kind(d),
            origin: None,
            reason: d.reason.clone(),
            at: time::format_ms(d.at_ms),
            revision: d.revision,
        }));
        evidence.sort_by_key(|e| e.revision);
        let culprit = decision.culprit(self, q.room);
        let (status, action) = match &decision {
            Decision::Record { .. } => (Status::Resolved, Action::Abort),
            Decision::Death { .. } => (Status::Resolved, Action::AbortAndRestartGroup),
            Decision::Pending { .. } => (Status::Pending, Action::Wait),
            Decision::Unknown => (Status::Unknown, Action::Abort),
        };
        let explain = explain(&decision, culprit.as_ref(), &scope, q.room);
        Verdict {
            room: q.room,
            status,
            action,
            culprit,
            evidence,
            groups: scope.groups.into_iter().collect(),
            revision: self.revision,
            explain,
        }
    }
}

impl Decision {
    /// Who and why, without building the culprit's strings.
    pub(crate) fn summary(&self, index: &Index, room: RoomId) -> Option<(GroupId, Rank, Reason, &'static str)> {
        match self {
            Decision::Record { idx } => {
                let r = index.rooms.get(&room)?.records.get(*idx)?;
                Some((r.group.clone(), r.rank, r.reason.clone(), "room_record"))
            }
            Decision::Death { key } => {
                let d = index.deaths.get(key)?;
                let source = if death_kind(d) == "down" {
                    "down_certificate"
                } else {
                    "lease_expired"
                };
                Some((key.0.clone(), key.1, d.reason.clone(), source))
            }
            Decision::Pending { .. } | Decision::Unknown => None,
        }
    }

    pub(crate) fn culprit(&self, index: &Index, room: RoomId) -> Option<Culprit> {
        match self {
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
                    source: "room_record",
                    at: time::format_ms(r.at_ms),
                    host,
                    pid,
                    incarnation,
                    log_tail: None,
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
                    source: if death_kind(d) == "down" {
                        "down_certificate"
                    } else {
                        "lease_expired"
                    },
                    at: time::format_ms(d.at_ms),
                    host,
                    pid,
                    incarnation: Some(*inc),
                    log_tail: d.log_tail.clone(),
                })
            }
            Decision::Pending { .. } | Decision::Unknown => None,
        }
    }
}

fn death_kind(d: &Death) -> &'static str {
    match d.evidence {
        DeathEvidence::Certificate => "down",
        DeathEvidence::Vanished | DeathEvidence::CoordinatorCertificate => "lease_expired",
    }
}

fn explain(decision: &Decision, culprit: Option<&Culprit>, scope: &Scope<'_>, room: RoomId) -> String {
    let others = scope
        .records
        .iter()
        .filter(|(_, r)| r.origin == Origin::Propagated)
        .count();
    let groups: Vec<&str> = scope.groups.iter().map(GroupId::as_str).collect();
    let groups = if groups.is_empty() {
        "any group".to_string()
    } else {
        groups.join(", ")
    };
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
        (Decision::Pending { remaining_ms }, _) => format!(
            "No rank of {groups} has reported a cause for room {room} yet; a death could still show up for {:.1} s. Wait (ask again with wait_ms).",
            *remaining_ms as f64 / 1000.0
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
