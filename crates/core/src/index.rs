//! The index: rootrank's state machine.
//!
//! Raw etcd events go in ([`Event`], each with its revision and the time the shell observed
//! it); the index decodes them, keeps what verdicts need, and returns [`Output`]s for the
//! shell to act on (metrics, a certificate to persist, a bad record to log). Queries
//! ([`Index::verdict`] and friends) read it. No I/O, no clock: the shell passes times in.
//!
//! Invariants:
//! - The index at revision N is a function of the etcd state at N (plus, for one revision
//!   window, live-key deletions the coordinator has not yet persisted as certificates).
//!   Loading a snapshot at N or applying the history up to N gives the same verdicts.
//! - A room record is never a culprit unless its origin is `local`; a `shutdown` death is
//!   never a culprit; a certificate for an old incarnation never marks a newer one down.
//! - Malformed values are skipped and reported as [`Output::Invalid`]; nothing panics.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use serde::Serialize;

use crate::ids::{reasons, GroupId, Incarnation, Rank, Reason, RoomId};
use crate::keys::{KeyKind, Keys};
use crate::records::{DownSource, ExitInfo, Origin, Peer, RankDown, RankLive, RankStall, RecordError, RoomFailure};
use crate::time;
use crate::views::RankStateKind;

/// Tunables of the verdict rules (SPEC section 5).
#[derive(Clone, Debug)]
pub struct IndexConfig {
    pub prefix: String,
    /// How long before a room's first record a death still counts (v3 default 360 s: longer
    /// than SGLang's 300 s timeouts, and than its 60 s crash-dump wait plus decode's
    /// heartbeat, after which a room's first record may arrive).
    pub death_window_ms: i64,
    /// Added to the slowest rank's lease TTL while a death could still show up (default 1 s).
    pub pending_grace_ms: i64,
    /// Lease TTL assumed for ranks whose live record does not say (default 5 s).
    pub default_lease_ttl_ms: i64,
    /// How many recent root causes `/v1/failures` can list.
    pub root_cause_log: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            prefix: "/rootrank/v1".to_string(),
            death_window_ms: 360_000,
            pending_grace_ms: 1_000,
            default_lease_ttl_ms: 5_000,
            root_cause_log: 1_024,
        }
    }
}

/// One etcd change, as the watch (or a snapshot read) delivers it.
#[derive(Clone, Debug)]
pub enum Event {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: i64,
        revision: i64,
        /// The key's create revision (etcd's `create_revision`): orders stall records, which
        /// a second writer may update (node-watch adds the stack) without moving them.
        create_revision: i64,
        observed_at_ms: i64,
    },
    /// No previous value: etcd 3.4 reads each one with a range of its own, which made 16,000
    /// deletes of one lease revoke take 21 s to arrive under read load (0.7 s without); events
    /// come in revision order, so the index knows what each deleted key held.
    Delete {
        key: Vec<u8>,
        revision: i64,
        observed_at_ms: i64,
    },
}

impl Event {
    pub fn revision(&self) -> i64 {
        match self {
            Event::Put { revision, .. } | Event::Delete { revision, .. } => *revision,
        }
    }

    pub fn key(&self) -> &[u8] {
        match self {
            Event::Put { key, .. } | Event::Delete { key, .. } => key,
        }
    }
}

/// What the shell should know or do after an event.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// v4: this replica's monotonic clock saw `window` end and etcd does not say so yet: the
    /// shell writes its end key create-only ([`crate::Keys::window_end`], a
    /// [`crate::WindowEnd`]); the revision at which the first such write lands closes it on
    /// every replica.
    WindowEnded {
        window: crate::Window,
        opened_revision: i64,
        length_ms: i64,
        revision: i64,
    },
    /// A room failure record entered the index (for `rootrank_failure_records_total`).
    RecordAccepted {
        room: RoomId,
        group: GroupId,
        origin: Origin,
        revision: i64,
    },
    /// A room's verdict became `resolved` (for `rootrank_root_causes_total` and
    /// `rootrank_resolution_seconds`: `observed_ms` minus `first_record_observed_ms`).
    RoomResolved {
        room: RoomId,
        group: GroupId,
        rank: Rank,
        reason: Reason,
        source: crate::CulpritSource,
        revision: i64,
        first_record_observed_ms: i64,
        observed_ms: i64,
    },
    /// A live key vanished with no certificate for its incarnation. The coordinator persists
    /// this death as a `source: coordinator` certificate so it survives its own restart.
    LiveKeyVanished {
        group: GroupId,
        rank: Rank,
        incarnation: Incarnation,
        revision: i64,
        at_ms: i64,
        detail: String,
        host: Option<String>,
        pid: Option<u32>,
        registered_revision: i64,
        /// The vanished incarnation's lease TTL, group size and role, for its certificate.
        lease_ttl_ms: Option<u64>,
        group_size: u32,
        role: Option<String>,
        /// v5: the key rode on its host's lease (node-watch's): a vanish is then also what
        /// node-watch stopping looks like, so the coordinator holds it as after an etcd stall.
        on_host_lease: bool,
    },
    /// v3: a rank's state changed (for `GET /v1/events`): registered (`live`), died (`down`
    /// or `shutdown`, with the reason as known at this revision; a later certificate that
    /// refines it is another change), stalled, or resumed (`live` again).
    RankChanged {
        group: GroupId,
        rank: Rank,
        state: RankStateKind,
        reason: Option<Reason>,
        incarnation: Incarnation,
        revision: i64,
    },
    /// etcd holds nothing for this group any more: the index forgot it (the shell forgets
    /// its metric series too).
    GroupForgotten { group: GroupId, revision: i64 },
    /// A value under the prefix that is not a valid record: skipped.
    Invalid {
        kind: &'static str,
        key: String,
        error: String,
        revision: i64,
    },
}

impl Output {
    /// The end key a coordinator writes for a window its clock saw end (create-only; the
    /// shell may add `by`), as `(window, value)`. `None` for any other output.
    pub fn into_window_end(self) -> Option<(crate::Window, crate::WindowEnd)> {
        let Output::WindowEnded {
            window,
            opened_revision,
            length_ms,
            ..
        } = self
        else {
            return None;
        };
        let end = crate::WindowEnd {
            v: crate::records::SCHEMA_VERSION,
            opened_revision,
            length_ms,
            by: None,
        };
        Some((window, end))
    }

    /// The certificate the coordinator persists for a vanished live key (`source:
    /// coordinator`, `lease_expired`, create-if-absent): what every replica and every restart
    /// then reads of that death. `None` for any other output.
    pub fn into_coordinator_certificate(self) -> Option<RankDown> {
        let Output::LiveKeyVanished {
            group,
            rank,
            incarnation,
            revision,
            at_ms,
            detail,
            host,
            pid,
            registered_revision,
            lease_ttl_ms,
            group_size,
            role,
            ..
        } = self
        else {
            return None;
        };
        Some(RankDown {
            v: crate::records::SCHEMA_VERSION,
            group,
            rank,
            incarnation,
            reason: Reason::well_known(reasons::LEASE_EXPIRED),
            detail,
            source: DownSource::Coordinator,
            at: Some(time::format_ms(at_ms)),
            exit: None,
            log_tail: None,
            host,
            pid,
            observed_revision: Some(revision),
            registered_revision: Some(registered_revision),
            lease_ttl_ms,
            group_size: Some(group_size),
            role,
        })
    }
}

#[derive(Debug)]
pub(crate) struct LiveEntry {
    pub(crate) record: RankLive,
    pub(crate) incarnation: Incarnation,
    /// The lease the key rides on: the incarnation's, or its host's (v5, adopted).
    pub(crate) lease: i64,
    pub(crate) registered_revision: i64,
    pub(crate) registered_at_ms: i64,
}

/// A dead incarnation's process that registered again ([`Index::lived_on`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LivedOn {
    /// Its new incarnation, and the revision it registered at.
    pub incarnation: Incarnation,
    pub revision: i64,
    pub pid: u32,
    pub host: Option<String>,
}

#[derive(Debug, Default)]
pub(crate) struct RankState {
    pub(crate) live: Option<Arc<LiveEntry>>,
    /// The last few incarnations (newest last), for host/pid of a dead one and for the
    /// "re-registered before the room's first record" rule.
    pub(crate) history: Vec<Arc<LiveEntry>>,
    /// When each recent incarnation registered, from live records and from certificates
    /// (which keep it after the live record is gone).
    pub(crate) registrations: Vec<(Incarnation, i64)>,
}

impl RankState {
    fn note_registration(&mut self, inc: Incarnation, revision: i64) {
        if self.registrations.iter().any(|(i, _)| *i == inc) {
            return;
        }
        self.registrations.push((inc, revision));
        self.registrations.sort_by_key(|(_, r)| *r);
        if self.registrations.len() > HISTORY {
            self.registrations.remove(0);
        }
    }
}

const HISTORY: usize = 8;

/// A TTL from a record (bounded at parse) as the index's milliseconds.
fn ttl_ms(ttl: u64) -> i64 {
    i64::try_from(ttl).unwrap_or(i64::MAX)
}

#[derive(Clone, Debug, Serialize)]
pub struct LastFailure {
    pub room: RoomId,
    pub reason: Reason,
    pub at: String,
    #[serde(skip)]
    pub revision: i64,
}

/// How a death is known, from least to most specific. Agent, watchdog and supervisor
/// certificates are equally specific: the newest one at the key wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum DeathEvidence {
    Vanished,
    CoordinatorCertificate,
    Certificate,
}

#[derive(Clone, Debug)]
pub(crate) struct Death {
    /// Ordering key: the earliest revision that revealed this death.
    pub(crate) revision: i64,
    /// The latest revision that told more of it (its certificate's last put): where
    /// `/v1/events` last said something of it, or later.
    pub(crate) changed_revision: i64,
    pub(crate) at_ms: i64,
    pub(crate) reason: Reason,
    pub(crate) detail: String,
    pub(crate) evidence: DeathEvidence,
    pub(crate) source: Option<DownSource>,
    pub(crate) exit: Option<ExitInfo>,
    pub(crate) log_tail: Option<Vec<String>>,
    pub(crate) host: Option<String>,
    pub(crate) pid: Option<u32>,
    pub(crate) has_certificate: bool,
    /// v4: the create revision of its down key (0 while it is a vanished live key only). A
    /// verdict names no uncertified death: after an etcd stall the coordinator may still
    /// certify it `lease_lost` (see `rootrank_coordinator::lease_doubt`).
    pub(crate) certified_revision: i64,
    /// The incarnation's lease TTL as its certificate says (a group's pending window counts
    /// it while the certificate exists); `None` for a death seen only as a vanished key.
    pub(crate) lease_ttl_ms: Option<i64>,
    /// The dead incarnation's `group_size` and `role`, as its certificate (or, until then, its
    /// vanished live record) says: a group whose ranks are all dead keeps its shape.
    pub(crate) group_size: Option<u32>,
    pub(crate) role: Option<String>,
    /// When the incarnation registered, as its certificate (or its live record) says.
    pub(crate) registered_revision: Option<i64>,
    /// A `peer_lost` death first seen as such (rule 7). One that refines a death already seen
    /// (a vanished live key) is no victim: a verdict may already have named it (rule 2).
    pub(crate) victim: bool,
    /// When this replica first knew of the death (its monotonic clock, ms): where its windows
    /// start here. Only this replica's deadlines use it; verdicts use the windows' end keys.
    pub(crate) seen_ms: i64,
}

/// v3: a live rank whose loop stopped advancing (its `stall` key).
#[derive(Clone, Debug)]
pub(crate) struct Stall {
    /// The stall key's create revision: the group's first stall by this order is the suspect.
    pub(crate) revision: i64,
    pub(crate) record: RankStall,
}

#[derive(Debug)]
pub(crate) struct RoomRecord {
    pub(crate) group: GroupId,
    pub(crate) rank: Rank,
    pub(crate) origin: Origin,
    pub(crate) reason: Reason,
    /// Only `local` records keep their detail: a propagated record's text is the generic
    /// fallback, and no verdict shows it. Saves a heap allocation on most records.
    pub(crate) detail: Option<Box<str>>,
    pub(crate) at_ms: i64,
    pub(crate) revision: i64,
    pub(crate) incarnation: Option<Incarnation>,
    pub(crate) peer: Option<Box<Peer>>,
}

#[derive(Debug, Default)]
pub(crate) struct RoomEntry {
    /// Sorted by revision.
    pub(crate) records: Vec<RoomRecord>,
    pub(crate) first_observed_ms: i64,
    pub(crate) resolved: bool,
    /// Its key in `root_causes`, once resolved.
    pub(crate) root_cause_revision: Option<i64>,
    /// Resolved on a victim (rule 7), which is named only once its window passed.
    pub(crate) resolved_by_victim: bool,
}

/// A root cause for `/v1/failures`: the culprit of one room, when it resolved.
#[derive(Clone, Debug, Serialize)]
pub struct RootCause {
    pub room: RoomId,
    pub group: GroupId,
    pub rank: Rank,
    pub reason: Reason,
    pub source: crate::CulpritSource,
    pub detail: String,
    pub at: String,
    pub revision: i64,
    pub repeat: u32,
    pub cause: Option<crate::CompactCause>,
    pub advice: Option<String>,
}

/// See the module docs.
#[derive(Debug)]
pub struct Index {
    pub(crate) config: IndexConfig,
    pub(crate) keys: Keys,
    pub(crate) revision: i64,
    /// The groups the index knows (a live record, a certificate or a room record names
    /// them). Their size and role are not kept: they come from the records etcd holds now
    /// (`views.rs`: `live_shape`, `certified_shape`), so a replica that watched for a day and
    /// one started now agree.
    pub(crate) groups: BTreeSet<GroupId>,
    pub(crate) ranks: BTreeMap<(GroupId, Rank), RankState>,
    pub(crate) deaths: BTreeMap<(GroupId, Rank, Incarnation), Death>,
    pub(crate) rooms: HashMap<RoomId, RoomEntry>,
    /// Rooms with records in a group and no verdict yet, re-checked when a death lands (in
    /// room order, so every replica emits the same outputs in the same order).
    pub(crate) unresolved: HashMap<GroupId, BTreeSet<RoomId>>,
    /// When a window of section 5 ends on this replica's monotonic clock (ms, window): the
    /// shell calls [`Index::handle_timeout`] at [`Index::poll_timeout`], which asks it to write
    /// the window's end key unless etcd already holds one. Verdicts change only when an end
    /// key lands (an event at a revision), never at a local deadline.
    pub(crate) window_timers: BTreeSet<(i64, crate::Window)>,
    /// v4: the windows etcd says ended, with the revision of their end key (the first value
    /// counts): exactly the end keys etcd holds, so a replica that loads later agrees. A room
    /// id used again while its end key lives (SGLang draws them at random from 63 bits) is
    /// closed from its first record.
    pub(crate) window_ends: HashMap<crate::Window, i64>,
    /// The most recently resolved rooms, by (revision, room): the revision at which the room
    /// had both its first record and its culprit, a function of etcd state, so replicas and
    /// a reloaded coordinator keep the same log. The root cause itself is derived when asked,
    /// so resolving a million rooms on a reload builds no strings.
    pub(crate) root_causes: BTreeSet<(i64, RoomId)>,
    /// `local` room records per rank (revision -> room), for `repeat` and a rank's last
    /// failure: like everything a verdict uses, a function of the records in etcd (they leave
    /// with their retention lease, and the rank's last failure with them).
    pub(crate) local_records: BTreeMap<(GroupId, Rank), BTreeMap<i64, RoomId>>,
    /// NIXL agent name -> the rank that registered it, so a record naming its peer by agent
    /// name (all a prefill rank knows of its decode peer) leads to that rank (rule 5).
    pub(crate) agents: BTreeMap<String, (GroupId, Rank)>,
    /// Endpoint a rank published in its live record (a prefill's bootstrap `host:port`) ->
    /// the ranks that published it, so a record naming its peer only by the address SGLang's
    /// decode errors carry leads to that peer's group (rules 5 and 7).
    pub(crate) endpoints: BTreeMap<String, BTreeSet<(GroupId, Rank)>>,
    /// v3: stall records of live ranks (at most one per rank: the key rides on its lease).
    pub(crate) stalls: BTreeMap<(GroupId, Rank), Stall>,
    record_count: usize,
    /// Room records per group, so a group etcd holds nothing for any more is seen at once
    /// and pruned ([`Index::prune_group`]).
    group_records: HashMap<GroupId, usize>,
    interned_reasons: HashSet<Reason>,
    /// While a snapshot loads: the latest time its events were observed. Rooms are decided
    /// once, in `finish_snapshot`, with every key of the snapshot known (see there).
    loading_now_ms: Option<i64>,
}

impl Index {
    pub fn new(config: IndexConfig) -> Self {
        Index {
            keys: Keys::new(&config.prefix),
            config,
            revision: 0,
            groups: BTreeSet::new(),
            ranks: BTreeMap::new(),
            deaths: BTreeMap::new(),
            rooms: HashMap::new(),
            local_records: BTreeMap::new(),
            agents: BTreeMap::new(),
            endpoints: BTreeMap::new(),
            stalls: BTreeMap::new(),
            unresolved: HashMap::new(),
            window_timers: BTreeSet::new(),
            window_ends: HashMap::new(),
            root_causes: BTreeSet::new(),
            record_count: 0,
            group_records: HashMap::new(),
            interned_reasons: HashSet::new(),
            loading_now_ms: None,
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// The etcd revision the index reflects.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// v4: whether the process of a dead incarnation registered again: the rank's live record
    /// now is a newer incarnation of the same process (same host, boot id, pid namespace, pid
    /// and agent start time, each of the dead incarnation's live record). Then its lease ran
    /// out but the process lived on (`lease_lost`). `None` when not, or not known (the dead
    /// record is no longer in the rank's history, or it lacks host, boot id or pid).
    pub fn lived_on(&self, group: &GroupId, rank: Rank, dead: Incarnation) -> Option<LivedOn> {
        let state = self.ranks.get(&(group.clone(), rank))?;
        let live = state.live.as_ref().filter(|l| l.incarnation != dead)?;
        let old = state.history.iter().find(|h| h.incarnation == dead)?;
        let (now, then) = (&live.record, &old.record);
        let pid = then.pid?;
        let same = then.host.is_some()
            && then.boot_id.is_some()
            && now.host == then.host
            && now.boot_id == then.boot_id
            && now.pid == Some(pid)
            && now.pid_ns == then.pid_ns
            && now.started_at == then.started_at
            && live.registered_revision > old.registered_revision;
        same.then(|| LivedOn {
            incarnation: live.incarnation,
            revision: live.registered_revision,
            pid,
            host: now.host.clone(),
        })
    }

    /// Rooms currently indexed (for `rootrank_index_rooms`).
    pub fn room_count(&self) -> usize {
        self.rooms.len()
    }

    /// Room failure records currently indexed.
    pub fn record_count(&self) -> usize {
        self.record_count
    }

    /// A watch progress notification: nothing changed up to `revision`.
    pub fn advance_to(&mut self, revision: i64) {
        self.revision = self.revision.max(revision);
    }

    /// Loads a whole snapshot read at `revision` into a new index (see
    /// [`Index::load_snapshot_page`]).
    pub fn load_snapshot(&mut self, kvs: Vec<Event>, revision: i64) -> Vec<Output> {
        let out = self.load_snapshot_page(kvs);
        self.finish_snapshot(revision);
        out
    }

    /// Applies one page of a snapshot (all puts at one revision). Pages and the keys in them
    /// may come in any order (a snapshot read in parallel parts): a snapshot holds one live
    /// key per rank and one certificate per incarnation, records sort themselves by
    /// revision, and no room is decided until [`Index::finish_snapshot`]. So the coordinator
    /// applies pages as they arrive and never holds a million raw key-values at once.
    /// (Property-tested against watching the whole history, and in shuffled order.)
    pub fn load_snapshot_page(&mut self, kvs: Vec<Event>) -> Vec<Output> {
        let mut out = Vec::new();
        for ev in kvs {
            let observed = match &ev {
                Event::Put { observed_at_ms, .. } | Event::Delete { observed_at_ms, .. } => *observed_at_ms,
            };
            self.loading_now_ms = Some(self.loading_now_ms.map_or(observed, |t| t.max(observed)));
            out.extend(self.apply(ev));
        }
        out
    }

    /// Ends a snapshot read at `revision`: the index now reflects it.
    pub fn finish_snapshot(&mut self, revision: i64) {
        self.advance_to(revision);
        // Every room is decided now, once, with the whole snapshot known: deciding a room as
        // its records arrived would depend on whether a death (a certificate in its group, or
        // its peer's in another) had been read yet, so on the order of the parts. Deciding
        // also places each resolved room in the root-cause log at the revision it had both
        // its first record and its culprit, as a coordinator that watched would have.
        let Some(now) = self.loading_now_ms else {
            return;
        };
        // A record of a rank outside its group's declared size is no rank of the group: the
        // watch drops it on arrival, a snapshot once every live record is known.
        let outside: Vec<(GroupId, RoomId, Rank)> = self
            .rooms
            .iter()
            .flat_map(|(room, e)| e.records.iter().map(move |r| (r.group.clone(), *room, r.rank)))
            .filter(|(g, _, rank)| self.declared_size(g).is_some_and(|size| *rank >= size))
            .collect();
        let mut discarded = Vec::new();
        for (group, room, rank) in outside {
            self.remove_room_record(&group, room, rank, revision, now, &mut discarded);
        }
        self.loading_now_ms = None;
        let waiting: BTreeSet<RoomId> = self.unresolved.values().flatten().copied().collect();
        discarded.clear();
        for room in waiting {
            self.recheck_room(room, revision, now, &mut discarded);
            discarded.clear(); // a reload's verdicts are not news (see the coordinator's load)
            if self.rooms.get(&room).is_some_and(|e| !e.resolved) {
                self.watch_peer_groups(room);
            }
        }
    }

    /// After a reload (this fresh snapshot replaces `old`, e.g. when the watch's revision was
    /// compacted during an outage): an incarnation live in `old` that is neither live nor dead
    /// here lost its live key while nobody watched, and etcd no longer holds the delete event.
    /// Each becomes the `lease_expired` death the watch would have made, at this snapshot's
    /// revision (the latest it can have happened: it outranks no death that was seen) and at
    /// `lost_at_ms`, when the watch was lost (the earliest this replica could have seen it:
    /// the rooms its victims recorded meanwhile come after it), so its certificate is written
    /// and rooms in its group count it. Returns the outputs, in (group, rank) order.
    pub fn carry_vanished_from(&mut self, old: &Index, lost_at_ms: i64) -> Vec<Output> {
        let mut out = Vec::new();
        let revision = self.revision;
        for ((group, rank), state) in &old.ranks {
            let Some(was) = &state.live else { continue };
            let inc = was.incarnation;
            let key = (group.clone(), *rank);
            let still_live = self
                .ranks
                .get(&key)
                .and_then(|s| s.live.as_ref())
                .is_some_and(|l| l.incarnation == inc);
            if still_live || self.deaths.contains_key(&(group.clone(), *rank, inc)) {
                continue;
            }
            let here = self.ranks.entry(key).or_default();
            if !here.history.iter().any(|h| h.incarnation == inc) {
                here.history.push(was.clone());
                here.history.sort_by_key(|h| h.registered_revision);
                if here.history.len() > HISTORY {
                    here.history.remove(0);
                }
            }
            here.note_registration(inc, was.registered_revision);
            for endpoint in &was.record.endpoints {
                self.endpoints
                    .entry(endpoint.clone())
                    .or_default()
                    .insert((group.clone(), *rank));
            }
            self.groups.insert(group.clone());
            let detail = vanished_detail(
                was,
                "its live key vanished while this coordinator was not watching (found missing when it reloaded), with no down certificate",
            );
            self.incarnation_ended(group, *rank, was, revision, lost_at_ms, detail, &mut out);
        }
        out
    }

    /// The longest lease TTL of a group's incarnations registered by `registered_by` (a room's
    /// first record: a rank that registered later cannot have failed it), as etcd says now:
    /// its live records and its certificates (which carry the dead incarnation's TTL). A rank
    /// that died silently may show up dead only a TTL late, so a pending room waits that long.
    /// A value remembered from records etcd no longer holds, or one of an incarnation newer
    /// than the room, would make a replica that watched answer differently from one started
    /// later (and the window of a room already answered grow).
    pub(crate) fn slowest_lease_ttl_ms(&self, group: &GroupId, registered_by: Option<i64>) -> Option<i64> {
        let counts = |registered: Option<i64>| registered_by.is_none_or(|by| registered.is_none_or(|r| r <= by));
        let live = self
            .ranks
            .range((group.clone(), Rank::MIN)..=(group.clone(), Rank::MAX))
            .filter_map(|(_, s)| s.live.as_ref())
            .filter(|l| counts(Some(l.registered_revision)))
            .filter_map(|l| l.record.lease_ttl_ms.map(ttl_ms));
        let certified = self
            .deaths
            .range((group.clone(), Rank::MIN, Incarnation::MIN)..=(group.clone(), Rank::MAX, Incarnation::MAX))
            .filter(|(_, d)| counts(d.registered_revision))
            .filter_map(|(_, d)| d.lease_ttl_ms);
        live.chain(certified).max()
    }

    /// Applies one event. Events must come in revision order (as etcd delivers them).
    pub fn apply(&mut self, event: Event) -> Vec<Output> {
        let mut out = Vec::new();
        self.revision = self.revision.max(event.revision());
        match event {
            Event::Put {
                key,
                value,
                lease,
                revision,
                create_revision,
                observed_at_ms,
            } => self.apply_put(
                &key,
                &value,
                lease,
                (revision, create_revision),
                observed_at_ms,
                &mut out,
            ),
            Event::Delete {
                key,
                revision,
                observed_at_ms,
            } => self.apply_delete(&key, revision, observed_at_ms, &mut out),
        }
        out
    }

    fn apply_put(
        &mut self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        (revision, create_revision): (i64, i64),
        now: i64,
        out: &mut Vec<Output>,
    ) {
        let invalid = |kind: &'static str, error: String| Output::Invalid {
            kind,
            key: String::from_utf8_lossy(key).into_owned(),
            error,
            revision,
        };
        let Some(kind) = self.keys.parse(key) else {
            out.push(invalid("key", "not a rootrank key (see SPEC section 4)".into()));
            return;
        };
        match kind {
            KeyKind::Coordinator | KeyKind::Nixl { .. } | KeyKind::HostCopy { .. } => {}
            KeyKind::WindowEnd(window) => match crate::WindowEnd::parse(value) {
                Err(e) => out.push(invalid("window", e.to_string())),
                Ok(_) => self.window_end_landed(window, revision, now, out),
            },
            KeyKind::Live { group, rank } => match RankLive::parse(value) {
                Err(e) => out.push(invalid("live", e.to_string())),
                Ok(rec) if rec.group != group || rec.rank != rank => out.push(invalid(
                    "live",
                    RecordError::KeyMismatch(format!("value names {}/{}", rec.group, rec.rank)).to_string(),
                )),
                Ok(rec) => match rec.incarnation_on(lease) {
                    Err(_) => out.push(invalid(
                        "live",
                        "live key without a lease: a live key must ride on the rank's liveness lease".into(),
                    )),
                    Ok(inc) => self.put_live(group, rank, rec, (inc, lease), revision, now, out),
                },
            },
            KeyKind::Down {
                group,
                rank,
                incarnation,
            } => match RankDown::parse(value) {
                Err(e) => out.push(invalid("down", e.to_string())),
                Ok(rec) if rec.group != group || rec.rank != rank || rec.incarnation != incarnation => {
                    out.push(invalid(
                        "down",
                        RecordError::KeyMismatch(format!("value names {}/{}/{}", rec.group, rec.rank, rec.incarnation))
                            .to_string(),
                    ))
                }
                Ok(rec) => self.put_down(group, rank, rec, (revision, create_revision.min(revision)), now, out),
            },
            KeyKind::Stall { group, rank } => match RankStall::parse(value) {
                Err(e) => out.push(invalid("stall", e.to_string())),
                Ok(rec) if rec.group != group || rec.rank != rank => out.push(invalid(
                    "stall",
                    RecordError::KeyMismatch(format!("value names {}/{}", rec.group, rec.rank)).to_string(),
                )),
                // On its incarnation's lease, or on the host lease its live key rides on (v5).
                Ok(rec)
                    if rec.incarnation.lease_id() != lease && !self.rides_on(&group, rank, rec.incarnation, lease) =>
                {
                    out.push(invalid(
                        "stall",
                        "a stall record must ride on its incarnation's liveness lease".into(),
                    ))
                }
                Ok(rec) => self.put_stall(group, rank, rec, revision, create_revision.min(revision), out),
            },
            KeyKind::Room { group, room, rank } => match RoomFailure::parse(value) {
                Err(e) => out.push(invalid("room", e.to_string())),
                Ok(rec) if rec.group != group || rec.rank != rank || rec.room != room => out.push(invalid(
                    "room",
                    RecordError::KeyMismatch(format!("value names {}/{}/{}", rec.group, rec.room, rec.rank))
                        .to_string(),
                )),
                Ok(rec) => match self.declared_size(&group) {
                    Some(size) if rec.rank >= size => out.push(invalid(
                        "room",
                        format!(
                            "rank {} is outside group {group}, whose ranks registered group_size {size}",
                            rec.rank
                        ),
                    )),
                    // Ordered by when the key was created: an overwritten key loaded from a
                    // snapshot keeps its place.
                    _ => {
                        let created = if create_revision > 0 {
                            create_revision.min(revision)
                        } else {
                            revision
                        };
                        self.put_room(group, rec, created, now, out)
                    }
                },
            },
        }
    }

    fn apply_delete(&mut self, key: &[u8], revision: i64, now: i64, out: &mut Vec<Output>) {
        match self.keys.parse(key) {
            Some(KeyKind::Live { group, rank }) => {
                let Some(state) = self.ranks.get_mut(&(group.clone(), rank)) else {
                    return;
                };
                let Some(live) = state.live.clone() else { return };
                state.live = None;
                let detail = vanished_detail(
                    &live,
                    if live.record.on_host_lease(live.lease) {
                        "its live key, on its host's lease, vanished with no down certificate and its process did not register again: the host is gone or cut off from etcd"
                    } else {
                        "its live key vanished (lease expired, revoked or deleted) with no down certificate"
                    },
                );
                self.incarnation_ended(&group, rank, &live, revision, now, detail, out);
            }
            Some(KeyKind::Stall { group, rank }) => {
                let Some(stall) = self.stalls.remove(&(group.clone(), rank)) else {
                    return;
                };
                // Resumed, unless the rank is gone (its lease took the stall key along).
                let inc = stall.record.incarnation;
                let live = self
                    .ranks
                    .get(&(group.clone(), rank))
                    .and_then(|s| s.live.as_ref())
                    .is_some_and(|l| l.incarnation == inc);
                if live && !self.deaths.contains_key(&(group.clone(), rank, inc)) {
                    out.push(Output::RankChanged {
                        group,
                        rank,
                        state: RankStateKind::Live,
                        reason: None,
                        incarnation: inc,
                        revision,
                    });
                }
            }
            Some(KeyKind::Down {
                group,
                rank,
                incarnation,
            }) => {
                // The retention lease ran out: the death is history beyond the window, and so
                // is the incarnation (unless it is the live one): what a replica started now
                // cannot know must not decide anything here either.
                self.deaths.remove(&(group.clone(), rank, incarnation));
                let key = (group.clone(), rank);
                if let Some(state) = self.ranks.get_mut(&key) {
                    if state.live.as_ref().is_none_or(|l| l.incarnation != incarnation) {
                        state.registrations.retain(|(i, _)| *i != incarnation);
                        state.history.retain(|h| h.incarnation != incarnation);
                    }
                    if state.live.is_none() && state.registrations.is_empty() && state.history.is_empty() {
                        self.ranks.remove(&key);
                    }
                }
                self.prune_group(&group, revision, out);
            }
            Some(KeyKind::Room { group, room, rank }) => {
                self.remove_room_record(&group, room, rank, revision, now, out)
            }
            Some(KeyKind::WindowEnd(window)) => {
                // Its lease ran out (it outlives the records it closes a window for). Only
                // the key's presence counts, so a replica that loads now agrees.
                self.window_ends.remove(&window);
            }
            _ => {}
        }
    }

    fn remove_room_record(
        &mut self,
        group: &GroupId,
        room: RoomId,
        rank: Rank,
        revision: i64,
        now: i64,
        out: &mut Vec<Output>,
    ) {
        let Some(entry) = self.rooms.get_mut(&room) else { return };
        let before = entry.records.len();
        if let Some(r) = entry
            .records
            .iter()
            .find(|r| &r.group == group && r.rank == rank && r.origin == Origin::Local)
        {
            note_local(&mut self.local_records, group, rank, r.revision, None);
        }
        entry.records.retain(|r| !(&r.group == group && r.rank == rank));
        let removed = before - entry.records.len();
        self.record_count -= removed;
        if let Some(n) = self.group_records.get_mut(group) {
            *n = n.saturating_sub(removed);
        }
        if !entry.records.iter().any(|r| &r.group == group) {
            if let Some(set) = self.unresolved.get_mut(group) {
                set.remove(&room);
            }
        }
        if entry.records.is_empty() {
            if let Some(rev) = self.rooms.remove(&room).and_then(|e| e.root_cause_revision) {
                self.root_causes.remove(&(rev, room));
            }
        } else if !entry.resolved && self.loading_now_ms.is_none() {
            // Its first record may have gone: the room's windows start later now, and
            // a death they did not reach may count, as on a replica that loads now.
            self.recheck_room(room, revision, now, out);
        }
        self.prune_group(group, revision, out);
    }

    /// Forgets a group once etcd holds nothing for it: no live rank, no death still inside
    /// its retention (a certificate, or a vanished live key whose certificate is on its way),
    /// no room record. So groups that come and go (the SGLang plugin names them after an
    /// instance's `host:port`, new at every restart) leave no memory behind, and a replica
    /// that has run for a month holds what one started now holds.
    fn prune_group(&mut self, group: &GroupId, revision: i64, out: &mut Vec<Output>) {
        let lo = (group.clone(), Rank::MIN);
        let hi = (group.clone(), Rank::MAX);
        if self.group_records.get(group).is_some_and(|n| *n > 0)
            || self.ranks.range(lo.clone()..=hi.clone()).any(|(_, s)| s.live.is_some())
            || self
                .deaths
                .range((group.clone(), Rank::MIN, Incarnation::MIN)..=(group.clone(), Rank::MAX, Incarnation::MAX))
                .next()
                .is_some()
        {
            return;
        }
        self.group_records.remove(group);
        if self.groups.remove(group) {
            out.push(Output::GroupForgotten {
                group: group.clone(),
                revision,
            });
        }
        let ranks: Vec<_> = self
            .ranks
            .range(lo.clone()..=hi.clone())
            .map(|(k, _)| k.clone())
            .collect();
        for k in &ranks {
            self.ranks.remove(k);
            self.local_records.remove(k);
            self.stalls.remove(k);
        }
        self.unresolved.remove(group);
        self.agents.retain(|_, (g, _)| g != group);
        self.endpoints.retain(|_, owners| {
            owners.retain(|(g, _)| g != group);
            !owners.is_empty()
        });
    }

    #[allow(clippy::too_many_arguments)]
    fn put_live(
        &mut self,
        group: GroupId,
        rank: Rank,
        rec: RankLive,
        (inc, lease): (Incarnation, i64),
        revision: i64,
        now: i64,
        out: &mut Vec<Output>,
    ) {
        self.groups.insert(group.clone());
        // Indexed on every put: a rank may publish its endpoints after it registered.
        for endpoint in &rec.endpoints {
            self.endpoints
                .entry(endpoint.clone())
                .or_default()
                .insert((group.clone(), rank));
        }
        let state = self.ranks.entry((group.clone(), rank)).or_default();
        let replaced = match &state.live {
            Some(cur) if cur.incarnation == inc => {
                // Same incarnation re-published its record: keep when it registered.
                // (Also when its host adopted it: the key moved to the host's lease.)
                let entry = Arc::new(LiveEntry {
                    record: rec,
                    incarnation: inc,
                    lease,
                    registered_revision: cur.registered_revision,
                    registered_at_ms: cur.registered_at_ms,
                });
                if let Some(h) = state.history.iter_mut().find(|h| h.incarnation == inc) {
                    *h = entry.clone();
                }
                state.live = Some(entry);
                return;
            }
            Some(cur) => Some(cur.clone()),
            None => None,
        };
        let registered_at_ms = rec.started_at.as_deref().and_then(time::parse_ms).unwrap_or(now);
        if let Some(agent) = &rec.nixl_agent {
            self.agents.insert(agent.clone(), (group.clone(), rank));
        }
        let entry = Arc::new(LiveEntry {
            record: rec,
            incarnation: inc,
            lease,
            registered_revision: revision,
            registered_at_ms,
        });
        state.note_registration(inc, revision);
        state.history.retain(|h| h.incarnation != inc);
        state.history.push(entry.clone());
        if state.history.len() > HISTORY {
            let gone = state.history.remove(0);
            if let Some(agent) = &gone.record.nixl_agent {
                self.agents.remove(agent);
            }
            // Another incarnation of this rank may still publish the same endpoint.
            let still: BTreeSet<&String> = state.history.iter().flat_map(|h| &h.record.endpoints).collect();
            for endpoint in gone.record.endpoints.iter().filter(|e| !still.contains(e)) {
                if let Some(set) = self.endpoints.get_mut(endpoint) {
                    set.remove(&(group.clone(), rank));
                    if set.is_empty() {
                        self.endpoints.remove(endpoint);
                    }
                }
            }
        }
        state.live = Some(entry);
        // The old incarnation's end comes first, so a reader of `/v1/events` that keeps the
        // last state per rank ends on the new one's `live`.
        if let Some(old) = replaced {
            let detail = vanished_detail(
                &old,
                &format!("replaced by incarnation {inc} before its lease expired, with no down certificate"),
            );
            self.incarnation_ended(&group, rank, &old, revision, now, detail, out);
        }
        out.push(Output::RankChanged {
            group: group.clone(),
            rank,
            state: RankStateKind::Live,
            reason: None,
            incarnation: inc,
            revision,
        });
    }

    #[allow(clippy::too_many_arguments)]
    fn incarnation_ended(
        &mut self,
        group: &GroupId,
        rank: Rank,
        live: &LiveEntry,
        revision: i64,
        now: i64,
        detail: String,
        out: &mut Vec<Output>,
    ) {
        let inc = live.incarnation;
        if let Some(d) = self.deaths.get_mut(&(group.clone(), rank, inc)) {
            d.revision = d.revision.min(revision);
            return; // a certificate already told us more than a vanished key can
        }
        let death = Death {
            revision,
            changed_revision: revision,
            at_ms: now,
            reason: self.intern_reason(Reason::well_known(reasons::LEASE_EXPIRED)),
            detail: detail.clone(),
            evidence: DeathEvidence::Vanished,
            source: None,
            exit: None,
            log_tail: None,
            host: live.record.host.clone(),
            pid: live.record.pid,
            has_certificate: false,
            certified_revision: 0,
            lease_ttl_ms: None,
            group_size: Some(live.record.group_size),
            role: live.record.role.clone(),
            registered_revision: Some(live.registered_revision),
            victim: false,
            seen_ms: now,
        };
        self.deaths.insert((group.clone(), rank, inc), death);
        self.schedule_death_windows(group, rank, inc);
        self.drop_stall(group, rank, inc);
        out.push(Output::RankChanged {
            group: group.clone(),
            rank,
            state: RankStateKind::Down,
            reason: Some(Reason::well_known(reasons::LEASE_EXPIRED)),
            incarnation: inc,
            revision,
        });
        out.push(Output::LiveKeyVanished {
            group: group.clone(),
            rank,
            incarnation: inc,
            revision,
            at_ms: now,
            detail,
            host: live.record.host.clone(),
            pid: live.record.pid,
            registered_revision: live.registered_revision,
            lease_ttl_ms: live.record.lease_ttl_ms,
            group_size: live.record.group_size,
            role: live.record.role.clone(),
            on_host_lease: live.record.on_host_lease(live.lease),
        });
        self.recheck_group(group, revision, now, out);
    }

    fn put_down(
        &mut self,
        group: GroupId,
        rank: Rank,
        rec: RankDown,
        (revision, created): (i64, i64),
        now: i64,
        out: &mut Vec<Output>,
    ) {
        let evidence = match rec.source {
            DownSource::Coordinator => DeathEvidence::CoordinatorCertificate,
            _ => DeathEvidence::Certificate,
        };
        let first_seen = rec.observed_revision.map_or(revision, |r| r.min(revision));
        if let Some(reg) = rec.registered_revision {
            self.ranks
                .entry((group.clone(), rank))
                .or_default()
                .note_registration(rec.incarnation, reg);
        }
        let at_ms = rec.at.as_deref().and_then(time::parse_ms).unwrap_or(now);
        let key = (group.clone(), rank, rec.incarnation);
        // A clean exit claimed after the rank was already seen dead without a certificate (the
        // claim replaced the coordinator's certificate, whose observed revision it carries) is
        // no clean exit: the death stays a death, so a verdict resolved on it stays (rule 2).
        let seen_dead_first = rec.observed_revision.is_some()
            || self
                .deaths
                .get(&key)
                .is_some_and(|d| d.evidence < DeathEvidence::Certificate);
        // Likewise a lease said lost (v4) over a death already certified otherwise: a verdict
        // may have named it. The coordinator writes `lease_lost` create-only, as the first.
        let certified_before = self
            .deaths
            .get(&key)
            .filter(|d| d.has_certificate)
            .map(|d| d.reason.clone());
        let reason = match certified_before {
            Some(before) if rec.reason.is_lease_lost() && !before.is_lease_lost() => before,
            _ if rec.reason.is_shutdown() && seen_dead_first => Reason::well_known(reasons::LEASE_EXPIRED),
            _ => rec.reason.clone(),
        };
        let reason = self.intern_reason(reason);
        let is_shutdown = reason.is_shutdown();
        let victim = reason.is_peer_lost() && !seen_dead_first;
        // What the rank's state said before, so a certificate that only persists what was
        // known (the coordinator's for a vanished key) is no second change.
        let reason_before = self.deaths.get(&key).map(|d| d.reason.clone());
        // v4: a death seen as a vanished key only turns certain with its certificate: that is
        // a change for consumers that act only on certified deaths (the plugin's fail fast).
        let uncertified_before = self.deaths.get(&key).is_some_and(|d| !d.has_certificate);
        match self.deaths.get_mut(&key) {
            Some(d) if d.evidence > evidence => {
                // A less specific certificate (the coordinator's) after a specific one: keep
                // what we know, note only that it is persisted.
                d.revision = d.revision.min(first_seen);
                d.has_certificate = true;
                d.certified_revision = certified_min(d.certified_revision, created);
                return;
            }
            Some(d) => {
                // Refines the same death: same death, better reason and detail.
                // The earlier of the two times is the death's: a vanished key is seen a TTL
                // late, and a death cannot come after its live key vanished. Never later, so a
                // death inside a room's windows stays inside them (rule 2). But a time this
                // replica only observed (a vanished key, not yet certified) gives way to the
                // certificate's: replicas observe at different instants, and a verdict must be
                // a function of etcd state, the same on every replica and after a reload.
                let observed_here = d.evidence == DeathEvidence::Vanished;
                d.at_ms = if observed_here { at_ms } else { d.at_ms.min(at_ms) };
                // Likewise its revision: replicas that saw the key vanish at different
                // revisions (one watching, one reloading after a compaction) adopt the one
                // the certificate that landed says.
                let moved = observed_here && d.revision != first_seen;
                d.revision = if observed_here {
                    first_seen
                } else {
                    d.revision.min(first_seen)
                };
                d.changed_revision = d.changed_revision.max(revision);
                d.reason = reason;
                d.detail = rec.detail;
                d.evidence = evidence;
                d.source = Some(rec.source);
                d.exit = rec.exit;
                d.log_tail = rec.log_tail;
                d.host = rec.host.or(d.host.take());
                d.pid = rec.pid.or(d.pid);
                d.has_certificate = true;
                d.certified_revision = certified_min(d.certified_revision, created);
                d.lease_ttl_ms = rec.lease_ttl_ms.map(ttl_ms).or(d.lease_ttl_ms);
                d.group_size = rec.group_size.or(d.group_size);
                d.role = rec.role.or(d.role.take());
                d.registered_revision = rec.registered_revision.or(d.registered_revision);
                // A death becomes no victim later (a verdict may have named it: rule 2).
                d.victim = d.victim && victim;
                if moved && self.loading_now_ms.is_none() {
                    self.relog_root_causes();
                }
            }
            None => {
                self.deaths.insert(
                    key,
                    Death {
                        revision: first_seen,
                        changed_revision: revision,
                        at_ms,
                        reason,
                        detail: rec.detail,
                        evidence,
                        source: Some(rec.source),
                        exit: rec.exit,
                        log_tail: rec.log_tail,
                        host: rec.host,
                        pid: rec.pid,
                        has_certificate: true,
                        certified_revision: created,
                        lease_ttl_ms: rec.lease_ttl_ms.map(ttl_ms),
                        group_size: rec.group_size,
                        role: rec.role,
                        registered_revision: rec.registered_revision,
                        victim,
                        seen_ms: now,
                    },
                );
                self.schedule_death_windows(&group, rank, rec.incarnation);
                // A death this index learns only now although etcd saw it earlier (a reload
                // between a vanished key and its certificate saw neither): a resolved room may
                // now name it, so its place in the root-cause log moves with it.
                if first_seen < revision && self.loading_now_ms.is_none() {
                    self.relog_root_causes();
                }
            }
        }
        self.groups.insert(group.clone());
        self.drop_stall(&group, rank, rec.incarnation);
        // A late certificate of an older incarnation says nothing about the rank now.
        let current = self
            .ranks
            .get(&(group.clone(), rank))
            .and_then(|s| s.live.as_ref())
            .is_none_or(|l| l.incarnation == rec.incarnation);
        if let Some(d) = self
            .deaths
            .get(&(group.clone(), rank, rec.incarnation))
            .filter(|d| current && (uncertified_before || reason_before.as_ref() != Some(&d.reason)))
        {
            out.push(Output::RankChanged {
                group: group.clone(),
                rank,
                state: if is_shutdown {
                    RankStateKind::Shutdown
                } else {
                    RankStateKind::Down
                },
                reason: Some(d.reason.clone()),
                incarnation: rec.incarnation,
                revision,
            });
        }
        if !is_shutdown {
            self.recheck_group(&group, revision, now, out);
        }
    }

    /// Whether `inc` is the live incarnation of (group, rank) and its key rides on `lease`.
    fn rides_on(&self, group: &GroupId, rank: Rank, inc: Incarnation, lease: i64) -> bool {
        self.ranks
            .get(&(group.clone(), rank))
            .and_then(|s| s.live.as_ref())
            .is_some_and(|l| l.incarnation == inc && l.lease == lease)
    }

    /// A stall record of a live incarnation. One of an incarnation that is dead, or not the
    /// rank's live one, describes nothing current and is ignored (its lease takes it soon).
    fn put_stall(
        &mut self,
        group: GroupId,
        rank: Rank,
        rec: RankStall,
        revision: i64,
        create_revision: i64,
        out: &mut Vec<Output>,
    ) {
        let inc = rec.incarnation;
        let live = self
            .ranks
            .get(&(group.clone(), rank))
            .and_then(|s| s.live.as_ref())
            .is_some_and(|l| l.incarnation == inc);
        if !live || self.deaths.contains_key(&(group.clone(), rank, inc)) {
            return;
        }
        let new = self
            .stalls
            .insert(
                (group.clone(), rank),
                Stall {
                    revision: create_revision,
                    record: rec,
                },
            )
            .is_none_or(|old| old.record.incarnation != inc);
        if new {
            out.push(Output::RankChanged {
                group,
                rank,
                state: RankStateKind::Stalled,
                reason: None,
                incarnation: inc,
                revision,
            });
        }
    }

    /// A dead incarnation stalls no more (its lease deletes the key too, a moment later).
    fn drop_stall(&mut self, group: &GroupId, rank: Rank, inc: Incarnation) {
        let key = (group.clone(), rank);
        if self.stalls.get(&key).is_some_and(|s| s.record.incarnation == inc) {
            self.stalls.remove(&key);
        }
    }

    fn put_room(&mut self, group: GroupId, rec: RoomFailure, revision: i64, now: i64, out: &mut Vec<Output>) {
        let group = match self.groups.get(&group) {
            Some(g) => g.clone(), // share one allocation per group name
            None => {
                self.groups.insert(group.clone());
                group
            }
        };
        let reason = self.intern_reason(rec.reason.clone());
        let at_ms = rec.at.as_deref().and_then(time::parse_ms).unwrap_or(now);
        let room = rec.room;
        let record = RoomRecord {
            group: group.clone(),
            rank: rec.rank,
            origin: rec.origin,
            reason,
            detail: (rec.origin != Origin::Propagated).then(|| rec.detail.into_boxed_str()),
            at_ms,
            revision,
            incarnation: rec.incarnation,
            peer: rec.peer.map(Box::new),
        };
        let new_room = !self.rooms.contains_key(&room);
        let entry = self.rooms.entry(room).or_insert_with(|| RoomEntry {
            first_observed_ms: now,
            ..RoomEntry::default()
        });
        // Writers create each (room, rank) key once (create-only): the first value is the one
        // that counts, and an overwrite by a foreign writer changes nothing (a resolved room
        // stays resolved). A replica that loads after an overwrite only has etcd's last
        // value, placed at the key's create revision, so the order of records stays the same.
        if entry.records.iter().any(|r| r.group == group && r.rank == rec.rank) {
            out.push(Output::Invalid {
                kind: "overwrite",
                key: self.keys.room(&group, room, rec.rank),
                error: "a room record key was written over; record keys are create-only, the first value counts".into(),
                revision,
            });
            return;
        }
        if rec.origin == Origin::Local {
            note_local(&mut self.local_records, &group, rec.rank, revision, Some(room));
        }
        let pos = entry.records.partition_point(|r| r.revision <= revision);
        // A Vec grows to 4 slots on its first push; most rooms hold a handful of records,
        // so keep the buffer exact (a million rooms x 3 spare slots is ~300 MB).
        entry.records.reserve_exact(1);
        entry.records.insert(pos, record);
        self.record_count += 1;
        *self.group_records.entry(group.clone()).or_default() += 1;
        out.push(Output::RecordAccepted {
            room,
            group: group.clone(),
            origin: rec.origin,
            revision,
        });
        if new_room {
            // A first estimate: handle_timeout measures the window again when it comes.
            let length = self.room_window_ms(room);
            self.window_timers
                .insert((now.saturating_add(length).saturating_add(1), crate::Window::Room(room)));
        }
        if self.rooms.get(&room).is_some_and(|e| !e.resolved) {
            self.unresolved.entry(group).or_default().insert(room);
            if self.loading_now_ms.is_none() {
                self.watch_peer_groups(room);
                self.recheck_room(room, revision, now, out);
            }
        }
    }

    /// A death landed in `group`: rooms waiting on it may now resolve.
    fn recheck_group(&mut self, group: &GroupId, revision: i64, now: i64, out: &mut Vec<Output>) {
        if self.loading_now_ms.is_some() {
            return; // a snapshot decides its rooms when it is complete
        }
        let Some(rooms) = self.unresolved.get(group) else {
            return;
        };
        let rooms: Vec<RoomId> = rooms.iter().copied().collect();
        for room in rooms {
            self.recheck_room(room, revision, now, out);
        }
    }

    fn recheck_room(&mut self, room: RoomId, revision: i64, now: i64, out: &mut Vec<Output>) {
        let decision = self.decide(room, None, now, now);
        let Some(entry) = self.rooms.get(&room) else { return };
        let first_observed = entry.first_observed_ms;
        let first_revision = entry.records.first().map_or(revision, |r| r.revision);
        let mut groups: BTreeSet<GroupId> = entry.records.iter().map(|r| r.group.clone()).collect();
        groups.extend(self.reported_peer_groups(room));
        let resolved = match decision.summary(self, room) {
            Some(c) => c,
            None => {
                // An `unknown` room stays watched: past its window a local record, or a death
                // etcd learns late but seen before the window's end key (a vanished live key
                // whose certificate was delayed), can still resolve it, as it would on a
                // replica that loads now. It leaves with its records.
                return;
            }
        };
        for g in &groups {
            if let Some(set) = self.unresolved.get_mut(g) {
                set.remove(&room);
            }
        }
        let (group, rank, reason, source) = resolved;
        let log_revision = self.decision_revision(&decision, room).max(first_revision);
        // A victim is named only once its window passed: when its end key lands (a catch-up
        // still places it by `resolved_by_victim`, see `views.rs`).
        let by_victim = matches!(decision.last(), crate::verdict::Decision::Death { key }
            if self.deaths.get(key).is_some_and(|d| d.victim));
        if let Some(entry) = self.rooms.get_mut(&room) {
            entry.resolved = true;
            entry.root_cause_revision = Some(log_revision);
            entry.resolved_by_victim = by_victim;
        }
        out.push(Output::RoomResolved {
            room,
            group,
            rank,
            reason,
            source,
            revision,
            first_record_observed_ms: first_observed,
            observed_ms: now,
        });
        self.root_causes.insert((log_revision, room));
        while self.root_causes.len() > self.config.root_cause_log {
            self.root_causes.pop_first();
        }
    }

    /// Puts every logged root cause at the key its culprit has now (`log_revision`), so the
    /// log stays ordered as `recent_failures` reads it. Bounded by the log's size; only needed
    /// when a death from the past becomes known late.
    fn relog_root_causes(&mut self) {
        let logged: Vec<(i64, RoomId)> = self.root_causes.iter().copied().collect();
        for (old, room) in logged {
            let new = self.log_revision(room);
            if new != old {
                self.root_causes.remove(&(old, room));
                self.root_causes.insert((new, room));
                if let Some(e) = self.rooms.get_mut(&room) {
                    e.root_cause_revision = Some(new);
                }
            }
        }
    }

    /// The earliest time (this replica's monotonic clock, ms) at which a window of section 5
    /// may end here ([`Index::handle_timeout`]); `None` when none is open.
    pub fn poll_timeout(&self) -> Option<i64> {
        self.window_timers.first().map(|(at, _)| *at)
    }

    /// Every window that ended by `now_ms` on this replica's clock and that etcd does not yet
    /// say ended: one [`Output::WindowEnded`] each, for the shell to write. A room's window
    /// is measured again first (a group with a longer lease TTL may have joined it). Verdicts
    /// do not change here: only when an end key lands, so they stay a function of etcd state.
    pub fn handle_timeout(&mut self, now_ms: i64) -> Vec<Output> {
        let mut out = Vec::new();
        if self.loading_now_ms.is_some() {
            return out; // a snapshot's windows are measured once it is complete
        }
        while let Some((at, window)) = self.window_timers.first().cloned() {
            if at > now_ms {
                break;
            }
            self.window_timers.pop_first();
            if self.window_ends.contains_key(&window) {
                continue;
            }
            let Some((opened_ms, opened_revision, length_ms)) = self.window_extent(&window) else {
                continue; // what it belonged to is gone, or no longer has that window
            };
            // Inclusive: a death seen at the window's last millisecond still counts.
            let end = opened_ms.saturating_add(length_ms);
            if end >= now_ms {
                self.window_timers.insert((end.saturating_add(1), window));
                continue;
            }
            out.push(Output::WindowEnded {
                window,
                opened_revision,
                length_ms,
                revision: self.revision,
            });
        }
        out
    }

    /// A window's start here (ms), the revision that opened it, and its length; `None` when
    /// it no longer applies.
    fn window_extent(&self, window: &crate::Window) -> Option<(i64, i64, i64)> {
        match window {
            crate::Window::Room(room) => {
                let e = self.rooms.get(room)?;
                let first = e.records.first()?.revision;
                Some((e.first_observed_ms, first, self.room_window_ms(*room)))
            }
            crate::Window::Death(g, r, i) => {
                let d = self
                    .deaths
                    .get(&(g.clone(), *r, *i))
                    .filter(|d| d.reason.may_be_culprit())?;
                Some((d.seen_ms, d.revision, self.config.death_window_ms))
            }
            crate::Window::Victim(g, r, i) => {
                let d = self.deaths.get(&(g.clone(), *r, *i)).filter(|d| d.victim)?;
                Some((d.seen_ms, d.revision, self.group_window_ms(g)))
            }
        }
    }

    /// Rule 7's window after a victim of `group` died.
    pub(crate) fn group_window_ms(&self, group: &GroupId) -> i64 {
        self.slowest_lease_ttl_ms(group, None)
            .unwrap_or(self.config.default_lease_ttl_ms)
            .saturating_add(self.config.pending_grace_ms)
    }

    /// A new death's windows start now: its death window, and its victim window if it is one.
    fn schedule_death_windows(&mut self, group: &GroupId, rank: Rank, inc: Incarnation) {
        let Some(d) = self.deaths.get(&(group.clone(), rank, inc)) else {
            return;
        };
        let (seen, victim) = (d.seen_ms, d.victim);
        let death_end = seen.saturating_add(self.config.death_window_ms).saturating_add(1);
        self.window_timers
            .insert((death_end, crate::Window::Death(group.clone(), rank, inc)));
        if victim {
            let end = seen.saturating_add(self.group_window_ms(group)).saturating_add(1);
            self.window_timers
                .insert((end, crate::Window::Victim(group.clone(), rank, inc)));
        }
    }

    /// An end key landed at `revision`: the window is closed from there on, on every replica.
    /// A room waiting on its pending window is decided again (now `unknown`, or a victim named).
    fn window_end_landed(&mut self, window: crate::Window, revision: i64, now: i64, out: &mut Vec<Output>) {
        if self.window_ends.contains_key(&window) {
            return; // create-only: the first end counts
        }
        self.window_ends.insert(window.clone(), revision);
        if self.loading_now_ms.is_some() {
            return;
        }
        match window {
            crate::Window::Room(room) => {
                if self.rooms.get(&room).is_some_and(|e| !e.resolved) {
                    self.recheck_room(room, revision, now, out);
                }
            }
            crate::Window::Victim(group, _, _) => self.recheck_group(&group, revision, now, out),
            crate::Window::Death(..) => {}
        }
    }

    /// A room whose records only report a peer's failure (rule 7) resolves when a death lands
    /// in the peer's group: wait on that group too.
    fn watch_peer_groups(&mut self, room: RoomId) {
        for g in self.reported_peer_groups(room) {
            self.unresolved.entry(g).or_default().insert(room);
        }
    }

    /// A resolved room's place in the root-cause log: when it had both its first record and
    /// its culprit (a function of etcd state, unlike when a coordinator happened to see it).
    pub(crate) fn log_revision(&self, room: RoomId) -> i64 {
        let first = self
            .rooms
            .get(&room)
            .and_then(|e| e.records.first())
            .map_or(0, |r| r.revision);
        let decision = self.decide(room, None, 0, 0);
        self.decision_revision(&decision, room).max(first)
    }

    /// The revision of a decision's culprit (its record or its death).
    fn decision_revision(&self, decision: &crate::verdict::Decision, room: RoomId) -> i64 {
        match decision.last() {
            crate::verdict::Decision::Record { idx } => self
                .rooms
                .get(&room)
                .and_then(|e| e.records.get(*idx))
                .map_or(0, |r| r.revision),
            // A death names a culprit from its certificate on (v4).
            crate::verdict::Decision::Death { key } => {
                self.deaths.get(key).map_or(0, |d| d.revision.max(d.certified_revision))
            }
            _ => 0,
        }
    }

    /// Shares one allocation per distinct reason (a million records carry a dozen reasons).
    fn intern_reason(&mut self, reason: Reason) -> Reason {
        if let Some(r) = self.interned_reasons.get(reason.as_str()) {
            return r.clone();
        }
        if self.interned_reasons.len() < 4096 {
            self.interned_reasons.insert(reason.clone());
        }
        reason
    }
}

/// A rank's `local` record at `revision` added (`Some(room)`) or gone (`None`).
fn note_local(
    records: &mut BTreeMap<(GroupId, Rank), BTreeMap<i64, RoomId>>,
    group: &GroupId,
    rank: Rank,
    revision: i64,
    room: Option<RoomId>,
) {
    let key = (group.clone(), rank);
    match room {
        Some(room) => {
            records.entry(key).or_default().insert(revision, room);
        }
        None => {
            if let Some(of_rank) = records.get_mut(&key) {
                of_rank.remove(&revision);
                if of_rank.is_empty() {
                    records.remove(&key);
                }
            }
        }
    }
}

/// The first revision a death was certified at (0: not yet).
fn certified_min(before: i64, created: i64) -> i64 {
    if before == 0 {
        created
    } else {
        before.min(created)
    }
}

fn vanished_detail(live: &LiveEntry, what: &str) -> String {
    let mut s = format!("incarnation {}: {what}", live.incarnation);
    if let Some(pid) = live.record.pid {
        s.push_str(&format!("; last seen as pid {pid}"));
        if let Some(host) = &live.record.host {
            s.push_str(&format!(" on {host}"));
        }
    }
    s
}
