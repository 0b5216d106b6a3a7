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
    /// v3: alive (its lease is kept) but its loop is not advancing.
    Stalled,
}

/// v3: which stalled rank to look at. Every rank of a group waits in the next collective
/// once one wedges, and each writes its stall record the same `stall_after_ms` after its own
/// last progress: the first record by etcd revision is the rank that stopped first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StallRole {
    Suspect,
    Waiting,
}

/// v3: a stalled rank's stall record, as `GET /v1/groups/{group}` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct StallView {
    pub role: StallRole,
    pub stalled_ms: Option<u64>,
    pub in_flight: Option<Vec<crate::RoomId>>,
    pub revision: i64,
}

/// v3: one rank that keeps a group from being healthy (`GET /v1/health`).
#[derive(Clone, Debug, Serialize)]
pub struct UnhealthyRank {
    pub group: GroupId,
    pub rank: Rank,
    pub state: RankStateKind,
    /// Why, in a few words: the death's reason, `stalled`, or `never registered`.
    pub reason: String,
    pub since: Option<String>,
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
    /// v3, when `state` is `stalled`: when the loop last advanced, per the rank.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stalled_since: Option<String>,
    /// v3, when stalled and known (node-watch adds it): the stalled thread's stack.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stack: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stall: Option<StallView>,
    /// The death's reason when `state` is `down` or `shutdown`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<crate::Reason>,
}

/// One event of [`Index::catch_up`].
#[derive(Clone, Debug, PartialEq)]
pub enum CatchUpEvent {
    Rank {
        group: GroupId,
        rank: Rank,
        state: RankStateKind,
        reason: Option<crate::Reason>,
        /// `None` for a missing rank.
        incarnation: Option<Incarnation>,
        revision: i64,
    },
    Resolved {
        room: crate::RoomId,
        revision: i64,
    },
}

impl CatchUpEvent {
    pub fn revision(&self) -> i64 {
        match self {
            CatchUpEvent::Rank { revision, .. } | CatchUpEvent::Resolved { revision, .. } => *revision,
        }
    }

    /// Revision order; at one revision a rank's change before the rooms it resolved, then by
    /// key, so every replica at one revision replays the same sequence.
    fn order_key(&self) -> (i64, u8, Option<&GroupId>, u64) {
        match self {
            CatchUpEvent::Rank {
                group, rank, revision, ..
            } => (*revision, 0, Some(group), u64::from(*rank)),
            CatchUpEvent::Resolved { room, revision } => (*revision, 1, None, room.get()),
        }
    }
}

/// What [`Index::catch_up`] returns: the events, and the revision after which they are
/// complete (0 when nothing was dropped).
#[derive(Clone, Debug, PartialEq)]
pub struct CatchUp {
    pub events: Vec<CatchUpEvent>,
    pub floor: i64,
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
    /// v3: alive but not advancing (not counted in `live`).
    pub stalled: u32,
    pub role: Option<String>,
}

impl Index {
    /// One group's ranks (`GET /v1/groups/{group}`); `None` for a group never seen.
    pub fn group(&self, group: &GroupId) -> Option<GroupView> {
        if !self.groups.contains(group) {
            return None;
        }
        let known_max = self
            .ranks
            .range((group.clone(), 0)..=(group.clone(), Rank::MAX))
            .map(|((_, r), _)| r + 1)
            .chain(self.deaths_of(group).map(|((_, r, _), _)| r + 1))
            .max()
            .unwrap_or(0);
        let group_size = self
            .live_shape(group)
            .0
            .or(self.certified_shape(group).0)
            .unwrap_or(known_max)
            .max(known_max);
        let ranks = (0..group_size).map(|rank| self.rank_view(group, rank)).collect();
        Some(GroupView {
            group: group.clone(),
            group_size,
            ranks,
        })
    }

    /// The rank's newest `local` record that etcd still holds.
    fn last_failure(&self, group: &GroupId, rank: Rank) -> Option<LastFailure> {
        let (revision, room) = self.local_records.get(&(group.clone(), rank))?.last_key_value()?;
        let record = self
            .rooms
            .get(room)?
            .records
            .iter()
            .find(|r| &r.group == group && r.rank == rank)?;
        Some(LastFailure {
            room: *room,
            reason: record.reason.clone(),
            at: time::format_ms(record.at_ms),
            revision: *revision,
        })
    }

    fn rank_view(&self, group: &GroupId, rank: Rank) -> RankView {
        let state = self.ranks.get(&(group.clone(), rank));
        let last_failure = self.last_failure(group, rank);
        // The newest death of this rank, if any.
        let newest_death = self
            .deaths_of(group)
            .filter(|((_, r, _), _)| *r == rank)
            .max_by_key(|(_, d)| d.revision);
        if let Some(live) = state.and_then(|s| s.live.as_ref()) {
            // A certificate for the live incarnation (a fatal error reported before the lease
            // runs out) marks it down; one for an older incarnation never does.
            let own = self.deaths.get(&(group.clone(), rank, live.incarnation));
            let stall = self
                .stalls
                .get(&(group.clone(), rank))
                .filter(|s| s.record.incarnation == live.incarnation && own.is_none());
            let (state, since) = match own {
                Some(d) if d.reason.is_shutdown() => (RankStateKind::Shutdown, d.at_ms),
                Some(d) => (RankStateKind::Down, d.at_ms),
                None if stall.is_some() => (RankStateKind::Stalled, live.registered_at_ms),
                None => (RankStateKind::Live, live.registered_at_ms),
            };
            let first_stall = self.first_stall(group);
            return RankView {
                rank,
                state,
                host: live.record.host.clone(),
                pid: live.record.pid,
                incarnation: Some(live.incarnation),
                since: Some(time::format_ms(since)),
                last_failure,
                stalled_since: stall.and_then(|s| s.record.since.clone()),
                stack: stall.and_then(|s| s.record.stack.clone()),
                stall: stall.map(|s| StallView {
                    role: if first_stall == Some(rank) {
                        StallRole::Suspect
                    } else {
                        StallRole::Waiting
                    },
                    stalled_ms: s.record.stalled_ms,
                    in_flight: s.record.in_flight.clone(),
                    revision: s.revision,
                }),
                reason: own.map(|d| d.reason.clone()),
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
                    stalled_since: None,
                    stack: None,
                    stall: None,
                    reason: Some(d.reason.clone()),
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
                stalled_since: None,
                stack: None,
                stall: None,
                reason: None,
            },
        }
    }

    /// All groups at a glance (`GET /v1/groups`).
    pub fn groups(&self) -> Vec<GroupSummary> {
        self.groups_page(None, usize::MAX).0
    }

    /// At most `limit` groups in key order, those after `after` (`GET /v1/groups?limit=&after=`),
    /// and the group to ask `after` next when more remain. A cursor is a group id, not an
    /// offset, so groups that appear or go meanwhile never shift a page.
    pub fn groups_page(&self, after: Option<&GroupId>, limit: usize) -> (Vec<GroupSummary>, Option<GroupId>) {
        use std::ops::Bound;
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        let mut page: Vec<GroupSummary> = self
            .groups
            .range((from, Bound::Unbounded))
            .filter_map(|g| {
                let view = self.group(g)?;
                let count = |k: RankStateKind| view.ranks.iter().filter(|r| r.state == k).count() as u32;
                Some(GroupSummary {
                    group: g.clone(),
                    group_size: view.group_size,
                    live: count(RankStateKind::Live),
                    down: count(RankStateKind::Down),
                    missing: count(RankStateKind::Missing),
                    stalled: count(RankStateKind::Stalled),
                    role: self.group_role(g).map(str::to_string),
                })
            })
            .take(limit.saturating_add(1))
            .collect();
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|g| g.group.clone())
        } else {
            None
        };
        (page, next)
    }

    /// Ranks that are up (`true`) or down (`false`), for `rootrank_rank_up`. Ranks that shut
    /// down cleanly or never registered have no series: a drained group is not an outage.
    pub fn rank_liveness(&self) -> Vec<(GroupId, Rank, bool)> {
        let mut out = Vec::new();
        for g in &self.groups {
            if let Some(view) = self.group(g) {
                for r in view.ranks {
                    match r.state {
                        RankStateKind::Live | RankStateKind::Stalled => out.push((g.clone(), r.rank, true)),
                        RankStateKind::Down => out.push((g.clone(), r.rank, false)),
                        RankStateKind::Shutdown | RankStateKind::Missing => {}
                    }
                }
            }
        }
        out
    }

    /// Stalled ranks (`rootrank_rank_stalled`): 1 for each live rank with a stall record, 0
    /// for the other live ranks, so a resumed rank's series drops back to 0.
    pub fn rank_stalls(&self) -> Vec<(GroupId, Rank, bool)> {
        self.rank_liveness()
            .into_iter()
            .filter(|(_, _, up)| *up)
            .map(|(g, r, _)| {
                let stalled = self.is_stalled(&g, r);
                (g, r, stalled)
            })
            .collect()
    }

    pub(crate) fn is_stalled(&self, group: &GroupId, rank: Rank) -> bool {
        let key = (group.clone(), rank);
        let Some(live) = self.ranks.get(&key).and_then(|s| s.live.as_ref()) else {
            return false;
        };
        self.stalls
            .get(&key)
            .is_some_and(|s| s.record.incarnation == live.incarnation)
            && !self.deaths.contains_key(&(group.clone(), rank, live.incarnation))
    }

    /// The rank of `group` whose stall record came first (by create revision): the suspect.
    pub fn first_stall(&self, group: &GroupId) -> Option<Rank> {
        self.stalls
            .range((group.clone(), 0)..=(group.clone(), Rank::MAX))
            .filter(|((g, r), _)| self.is_stalled(g, *r))
            .min_by_key(|(_, s)| s.revision)
            .map(|((_, r), _)| *r)
    }

    /// v3 `GET /v1/health`: the ranks of `groups` that are down, missing, stalled or gone
    /// (shut down); empty when every rank of every named group is live and advancing. A group
    /// never seen, or seen with no registered rank, is one unhealthy entry (rank 0, missing):
    /// a probe must not pass on a typo, nor on a group nobody knows to be alive.
    pub fn unhealthy(&self, groups: &[GroupId]) -> Vec<UnhealthyRank> {
        let mut out = Vec::new();
        for g in groups {
            let Some(view) = self.group(g) else {
                out.push(UnhealthyRank {
                    group: g.clone(),
                    rank: 0,
                    state: RankStateKind::Missing,
                    reason: "group never registered".into(),
                    since: None,
                });
                continue;
            };
            if view.ranks.is_empty() {
                // Known only from room records (or certificates with no size): no rank of it is
                // known to be alive, so it is not healthy.
                out.push(UnhealthyRank {
                    group: g.clone(),
                    rank: 0,
                    state: RankStateKind::Missing,
                    reason: "no rank of the group is registered (only its room records name it)".into(),
                    since: None,
                });
                continue;
            }
            for r in view.ranks {
                let reason = match r.state {
                    RankStateKind::Live => continue,
                    RankStateKind::Stalled => match r.stall.as_ref().and_then(|s| s.stalled_ms) {
                        Some(ms) => format!("stalled (no progress for {} s)", ms / 1000),
                        None => "stalled".to_string(),
                    },
                    RankStateKind::Missing => "never registered".to_string(),
                    RankStateKind::Down | RankStateKind::Shutdown => {
                        r.reason.as_ref().map_or_else(|| "down".to_string(), |x| x.to_string())
                    }
                };
                out.push(UnhealthyRank {
                    group: g.clone(),
                    rank: r.rank,
                    state: r.state,
                    reason,
                    since: if r.state == RankStateKind::Stalled {
                        r.stalled_since.clone()
                    } else {
                        r.since.clone()
                    },
                });
            }
        }
        out
    }

    /// Recent root causes, newest first (`GET /v1/failures`). Derived from the rooms as they
    /// are now; a room whose records have expired is gone from the list too.
    pub fn recent_failures(&self, group: Option<&GroupId>, limit: usize) -> Vec<RootCause> {
        // Newest key first, and only as far as needed: a room's order key now can only be at
        // or below the one it was logged with (a death's revision only moves earlier, the
        // first record never changes), so once `limit` rooms are at or above the next key,
        // no older key can come before them (property-tested against the whole log).
        let newest_first = |a: &RootCause, b: &RootCause| b.revision.cmp(&a.revision).then(a.room.cmp(&b.room));
        let mut list: Vec<RootCause> = Vec::new();
        if limit == 0 {
            return list;
        }
        let mut keys = self.root_causes.iter().rev().peekable();
        while let Some((_, room)) = keys.next() {
            if let Some(c) = self
                .root_cause_of(*room)
                .filter(|c| group.is_none_or(|g| &c.group == g))
            {
                list.push(c);
            }
            if list.len() >= limit {
                // The page so far, in its final order: its last entry is the one to beat.
                list.sort_by(newest_first);
                list.truncate(limit);
                if keys.peek().is_none_or(|(next, _)| *next < list[limit - 1].revision) {
                    break;
                }
            }
        }
        list.sort_by(newest_first);
        list
    }

    /// One logged room's root cause, derived from the room as it is now.
    fn root_cause_of(&self, room: crate::RoomId) -> Option<RootCause> {
        // A resolved room's culprit does not depend on the time of the question.
        let v = self.verdict(&crate::VerdictQuery {
            room,
            group: None,
            asked_at_ms: 0,
            now_ms: 0,
        });
        let c = v.culprit?;
        // The log's order key, from the culprit as it stands now (a room loaded from a
        // snapshot taken between a vanished key and its certificate may have been
        // placed by an earlier guess).
        let revision = self.log_revision(room);
        Some(RootCause {
            room,
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
    }

    /// v3 `GET /v1/events` for a reader that resumes from before this index was loaded (a
    /// restarted or reloaded replica has no history, only state): every rank's state as
    /// `GET /v1/groups/{g}` shows it, and every resolved room this index holds, as events in
    /// revision order, at most `max` of them. A down, shutdown or stalled rank is stamped with
    /// the revision that last changed it (a certificate refines a death's reason), a resolved
    /// room with the revision at which it had both its first record and its culprit (where a
    /// watching replica resolved it), so a reader gets only what it has not seen. A live or
    /// missing rank, whose last change etcd no longer shows (a stall that ended, a key
    /// deleted unseen), and a room resolved on a victim, with the index's revision: sent
    /// again, harmless (resolved is final). What does not fit in `max` is dropped from the
    /// oldest end, and
    /// `floor` says from which revision on the rest is complete.
    pub fn catch_up(&self, max: usize) -> CatchUp {
        let at = self.revision;
        let mut events = Vec::new();
        for g in &self.groups {
            let Some(view) = self.group(g) else { continue };
            for r in view.ranks {
                let revision = match r.state {
                    RankStateKind::Live | RankStateKind::Missing => at,
                    RankStateKind::Stalled => r.stall.as_ref().map_or(at, |s| s.revision),
                    RankStateKind::Down | RankStateKind::Shutdown => r
                        .incarnation
                        .and_then(|inc| self.deaths.get(&(g.clone(), r.rank, inc)))
                        .map_or(at, |d| d.changed_revision),
                };
                events.push(CatchUpEvent::Rank {
                    group: g.clone(),
                    rank: r.rank,
                    state: r.state,
                    reason: r.reason,
                    incarnation: r.incarnation,
                    revision,
                });
            }
        }
        events.extend(self.rooms.iter().filter_map(|(room, e)| {
            let revision = e.root_cause_revision.filter(|_| e.resolved)?;
            // A room resolved on a victim resolved at some event after its window: when, etcd
            // state does not say, so it is sent again at the index's revision.
            let revision = if e.resolved_by_victim { at } else { revision };
            Some(CatchUpEvent::Resolved { room: *room, revision })
        }));
        events.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
        let mut floor = 0;
        if events.len() > max {
            let dropped: Vec<CatchUpEvent> = events.drain(..events.len() - max).collect();
            floor = dropped.iter().map(CatchUpEvent::revision).max().unwrap_or(0);
        }
        CatchUp { events, floor }
    }

    /// The endpoints (`RankLive.endpoints`) an incarnation of a rank published, for events
    /// whose readers know their peers only by address (a decode's prefill bootstrap address).
    pub fn rank_endpoints(&self, group: &GroupId, rank: Rank, incarnation: Incarnation) -> &[String] {
        self.ranks
            .get(&(group.clone(), rank))
            .and_then(|s| s.history.iter().find(|h| h.incarnation == incarnation))
            .map_or(&[], |h| h.record.endpoints.as_slice())
    }

    /// The NIXL agent name an incarnation published in its live record, if any.
    pub fn rank_nixl_agent(&self, group: &GroupId, rank: Rank, incarnation: Incarnation) -> Option<&str> {
        self.ranks
            .get(&(group.clone(), rank))
            .and_then(|s| s.history.iter().find(|h| h.incarnation == incarnation))
            .and_then(|h| h.record.nixl_agent.as_deref())
    }

    /// v4: whether an incarnation's death was on record as a down certificate at revision
    /// `as_of` (`None`: no death known). A vanished live key alone is not: after an etcd
    /// stall it may still turn out `lease_lost` (the process lived on), so a consumer that
    /// acts on a death waits for `true` (the events stream sends the rank again when its
    /// certificate lands). `as_of` is the revision an event speaks for: a vanish and its
    /// `lease_lost` certificate may arrive in one watch batch (a replica catching up after a
    /// stall, the other replica's certificate already written), and the vanish's event must
    /// not say "certified" of what was only certified later, and not as that death.
    pub fn death_certified(&self, group: &GroupId, rank: Rank, incarnation: Incarnation, as_of: i64) -> Option<bool> {
        self.deaths
            .get(&(group.clone(), rank, incarnation))
            .map(|d| d.has_certificate && d.certified_revision > 0 && d.certified_revision <= as_of)
    }

    /// The role its ranks registered with (`prefill`, `decode`), when they said.
    pub fn group_role(&self, group: &GroupId) -> Option<&str> {
        self.live_shape(group).1.or_else(|| self.certified_shape(group).1)
    }

    /// The group's size as its ranks declared it (live records, else certificates), when any
    /// did: a record of a rank outside it names no rank of the group.
    pub(crate) fn declared_size(&self, group: &GroupId) -> Option<u32> {
        self.live_shape(group).0.or_else(|| self.certified_shape(group).0)
    }

    /// The same from the newest death (by revision) whose certificate says, for a group with
    /// no live rank: what etcd still holds of it, not what this replica remembers.
    fn certified_shape(&self, group: &GroupId) -> (Option<u32>, Option<&str>) {
        let mut deaths: Vec<_> = self.deaths_of(group).collect();
        deaths.sort_by_key(|((_, rank, inc), d)| (std::cmp::Reverse(d.revision), *rank, *inc));
        let size = deaths.iter().find_map(|(_, d)| d.group_size);
        let role = deaths.iter().find_map(|(_, d)| d.role.as_deref());
        (size, role)
    }

    /// `group_size` of the group's newest live incarnation (by registration revision) and the
    /// role of the newest that names one: a function of the live records etcd holds now, so a
    /// replica that watched and one that loaded agree when ranks disagree (a misconfigured
    /// restart). `None`s when no rank is live (then its certificates say).
    fn live_shape(&self, group: &GroupId) -> (Option<u32>, Option<&str>) {
        let mut size: Option<(i64, u32)> = None;
        let mut role: Option<(i64, &str)> = None;
        for (_, state) in self.ranks.range((group.clone(), 0)..=(group.clone(), Rank::MAX)) {
            let Some(live) = &state.live else { continue };
            let at = live.registered_revision;
            if size.is_none_or(|(r, _)| at > r) {
                size = Some((at, live.record.group_size));
            }
            if let Some(name) = live.record.role.as_deref() {
                if role.is_none_or(|(r, _)| at > r) {
                    role = Some((at, name));
                }
            }
        }
        (size.map(|(_, s)| s), role.map(|(_, r)| r))
    }

    /// Whether a group was ever seen (live record, death or room record).
    pub fn knows_group(&self, group: &GroupId) -> bool {
        self.groups.contains(group)
    }
}
