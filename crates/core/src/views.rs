//! Read-only views of the index for the HTTP API and the metrics: groups, ranks, recent
//! root causes. Like verdicts, they are functions of the index alone.

use serde::Serialize;

use crate::ids::{GroupId, Incarnation, Rank};
use crate::index::{Index, LastFailure, RootCause};
use crate::time;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RankStateKind {
    Live,
    Down,
    Missing,
    Shutdown,
}

#[derive(Clone, Debug, Serialize)]
pub struct RankView {
    pub rank: Rank,
    pub state: RankStateKind,
    pub host: Option<String>,
    pub pid: Option<u32>,
    pub incarnation: Option<Incarnation>,
    pub since: Option<String>,
    pub last_failure: Option<LastFailure>,
}

#[derive(Clone, Debug, Serialize)]
pub struct GroupView {
    pub group: GroupId,
    pub group_size: u32,
    pub ranks: Vec<RankView>,
}

#[derive(Clone, Debug, Serialize)]
pub struct GroupSummary {
    pub group: GroupId,
    pub group_size: u32,
    pub live: u32,
    pub down: u32,
    pub missing: u32,
    pub role: Option<String>,
}

impl Index {
    /// One group's ranks (`GET /v1/groups/{group}`); `None` for a group never seen.
    pub fn group(&self, group: &GroupId) -> Option<GroupView> {
        let info = self.groups.get(group)?;
        let known_max = self
            .ranks
            .range((group.clone(), 0)..=(group.clone(), Rank::MAX))
            .map(|((_, r), _)| r + 1)
            .chain(self.deaths_of(group).map(|((_, r, _), _)| r + 1))
            .max()
            .unwrap_or(0);
        let group_size = info.group_size.unwrap_or(known_max).max(known_max);
        let ranks = (0..group_size).map(|rank| self.rank_view(group, rank)).collect();
        Some(GroupView {
            group: group.clone(),
            group_size,
            ranks,
        })
    }

    fn rank_view(&self, group: &GroupId, rank: Rank) -> RankView {
        let state = self.ranks.get(&(group.clone(), rank));
        let last_failure = state.and_then(|s| s.last_failure.clone());
        // The newest death of this rank, if any.
        let newest_death = self
            .deaths_of(group)
            .filter(|((_, r, _), _)| *r == rank)
            .max_by_key(|(_, d)| d.revision);
        if let Some(live) = state.and_then(|s| s.live.as_ref()) {
            // A certificate for the live incarnation (a fatal error reported before the lease
            // runs out) marks it down; one for an older incarnation never does.
            let own = self.deaths.get(&(group.clone(), rank, live.incarnation));
            let (state, since) = match own {
                Some(d) if d.reason.is_shutdown() => (RankStateKind::Shutdown, d.at_ms),
                Some(d) => (RankStateKind::Down, d.at_ms),
                None => (RankStateKind::Live, live.registered_at_ms),
            };
            return RankView {
                rank,
                state,
                host: live.record.host.clone(),
                pid: live.record.pid,
                incarnation: Some(live.incarnation),
                since: Some(time::format_ms(since)),
                last_failure,
            };
        }
        match newest_death {
            Some(((_, _, inc), d)) => {
                let entry = state.and_then(|s| s.history.iter().find(|h| h.incarnation == *inc));
                RankView {
                    rank,
                    state: if d.reason.is_shutdown() {
                        RankStateKind::Shutdown
                    } else {
                        RankStateKind::Down
                    },
                    // The certificate names the process once the live record is gone.
                    host: entry.and_then(|e| e.record.host.clone()).or_else(|| d.host.clone()),
                    pid: entry.and_then(|e| e.record.pid).or(d.pid),
                    incarnation: Some(*inc),
                    since: Some(time::format_ms(d.at_ms)),
                    last_failure,
                }
            }
            None => RankView {
                rank,
                state: RankStateKind::Missing,
                host: None,
                pid: None,
                incarnation: None,
                since: None,
                last_failure,
            },
        }
    }

    /// All groups at a glance (`GET /v1/groups`).
    pub fn groups(&self) -> Vec<GroupSummary> {
        self.groups
            .iter()
            .filter_map(|(g, info)| {
                let view = self.group(g)?;
                let count = |k: RankStateKind| view.ranks.iter().filter(|r| r.state == k).count() as u32;
                Some(GroupSummary {
                    group: g.clone(),
                    group_size: view.group_size,
                    live: count(RankStateKind::Live),
                    down: count(RankStateKind::Down),
                    missing: count(RankStateKind::Missing),
                    role: info.role.clone(),
                })
            })
            .collect()
    }

    /// Ranks that are up (`true`) or down (`false`), for `rootrank_rank_up`. Ranks that shut
    /// down cleanly or never registered have no series: a drained group is not an outage.
    pub fn rank_liveness(&self) -> Vec<(GroupId, Rank, bool)> {
        let mut out = Vec::new();
        for g in self.groups.keys() {
            if let Some(view) = self.group(g) {
                for r in view.ranks {
                    match r.state {
                        RankStateKind::Live => out.push((g.clone(), r.rank, true)),
                        RankStateKind::Down => out.push((g.clone(), r.rank, false)),
                        RankStateKind::Shutdown | RankStateKind::Missing => {}
                    }
                }
            }
        }
        out
    }

    /// Recent root causes, newest first (`GET /v1/failures`). Derived from the rooms as they
    /// are now; a room whose records have expired is gone from the list too.
    pub fn recent_failures(&self, group: Option<&GroupId>, limit: usize) -> Vec<RootCause> {
        let mut list: Vec<RootCause> = self
            .root_causes
            .iter()
            .rev()
            .filter_map(|(_, room)| {
                // A resolved room's culprit does not depend on the time of the question.
                let v = self.verdict(&crate::VerdictQuery {
                    room: *room,
                    group: None,
                    asked_at_ms: 0,
                    now_ms: 0,
                });
                let c = v.culprit?;
                // The log's order key, from the culprit as it stands now (a room loaded from a
                // snapshot taken between a vanished key and its certificate may have been
                // placed by an earlier guess).
                let revision = self.log_revision(*room);
                Some(RootCause {
                    room: *room,
                    group: c.group,
                    rank: c.rank,
                    reason: c.reason,
                    source: c.source,
                    detail: c.detail,
                    at: c.at,
                    revision,
                    repeat: c.repeat,
                    cause: v.cause.map(|k| crate::CompactCause {
                        group: k.group,
                        rank: k.rank,
                        reason: k.reason,
                    }),
                    advice: v.advice,
                })
            })
            .filter(|c| group.is_none_or(|g| &c.group == g))
            .collect();
        list.sort_by(|a, b| b.revision.cmp(&a.revision).then(a.room.cmp(&b.room)));
        list.truncate(limit);
        list
    }

    /// Whether a group was ever seen (live record, death or room record).
    pub fn knows_group(&self, group: &GroupId) -> bool {
        self.groups.contains_key(group)
    }
}
