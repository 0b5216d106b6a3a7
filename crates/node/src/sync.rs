//! The node watchdog's view of etcd: live keys, down certificates and stall records, kept by
//! the follower the coordinator runs too (`rootrank_store::follow`): a snapshot, then a watch
//! from its revision + 1, re-created from the last revision + 1 when broken, a new snapshot
//! after a compaction, and a silent etcd (blackholed: no reset, no error) or a watch etcd
//! does not open in time given up and re-created on whichever endpoint answers.
//!
//! Only what the watchdog needs leaves this module, as [`SyncMsg`]s.

use std::collections::HashSet;

use rootrank_core::{Event, GroupId, HostCopyOf, Incarnation, KeyKind, Keys, Rank, RankLive, RankStall};
use rootrank_store::{Mirror, SnapshotStats};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// One incarnation of one rank.
pub(crate) type IncarnationId = (GroupId, Rank, Incarnation);

/// A live key as the watchdog needs it.
#[derive(Clone, Debug)]
pub(crate) struct LiveKv {
    pub group: GroupId,
    pub rank: Rank,
    pub record: RankLive,
    /// The live key's lease: the incarnation.
    pub lease: i64,
    /// The live key's mod revision: when this incarnation registered.
    pub mod_revision: i64,
}

/// A stall record with no stack yet (v3): node-watch may add the stalled thread's stack.
#[derive(Clone, Debug)]
pub(crate) struct StallKv {
    pub key: Vec<u8>,
    pub record: RankStall,
    pub lease: i64,
    /// The stall key's create revision: the stack is added only to this same stall.
    pub create_revision: i64,
}

/// What node-watch watches (`rootrank node-watch --watch-scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WatchScope {
    /// Only the copies of this host's ranks' records under `{p}/groups/_hosts/{host}/`: the
    /// watch carries this host's ranks, whatever the fleet's size (the default). Agents
    /// before this version write no copies: their ranks are not seen.
    #[default]
    Host,
    /// All of `{p}/groups/` (every event of the fleet), for ranks whose agents write no host
    /// copies (an older version, or a host name that cannot be a key).
    Fleet,
}

/// What a key is to node-watch in its scope: a rank's live or stall record (the record
/// itself in the fleet scope, its host copy in the host scope), or a certificate.
enum Watched {
    Live(GroupId, Rank),
    Stall(GroupId, Rank),
    Down(IncarnationId),
}

fn watched(keys: &Keys, scope: WatchScope, key: &[u8]) -> Option<Watched> {
    match (scope, keys.parse(key)?) {
        (WatchScope::Fleet, KeyKind::Live { group, rank }) => Some(Watched::Live(group, rank)),
        (WatchScope::Fleet, KeyKind::Stall { group, rank }) => Some(Watched::Stall(group, rank)),
        (
            WatchScope::Fleet,
            KeyKind::Down {
                group,
                rank,
                incarnation,
            },
        ) => Some(Watched::Down((group, rank, incarnation))),
        (WatchScope::Host, KeyKind::HostCopy { group, rank, of, .. }) => Some(match of {
            HostCopyOf::Live => Watched::Live(group, rank),
            HostCopyOf::Stall => Watched::Stall(group, rank),
        }),
        _ => None,
    }
}

/// `create_revision` is the watched key's: a host copy is created with its record, so both
/// have the same, which the stack write compares against the record's.
fn stall_kv(
    keys: &Keys,
    group: GroupId,
    rank: Rank,
    value: &[u8],
    lease: i64,
    create_revision: i64,
) -> Option<StallKv> {
    match RankStall::parse(value) {
        Ok(record) if record.rank == rank && record.group == group && record.stack.is_none() => Some(StallKv {
            key: keys.stall(&group, rank).into_bytes(),
            record,
            lease,
            create_revision,
        }),
        _ => None,
    }
}

#[derive(Debug)]
pub(crate) enum SyncMsg {
    /// Everything at one revision (at start, and after a compaction).
    Snapshot {
        lives: Vec<LiveKv>,
        certified: HashSet<IncarnationId>,
        /// Stall records without a stack, applied after `lives`.
        stalls: Vec<StallKv>,
        revision: i64,
    },
    /// v3: a rank's stall record without a stack.
    Stall(Box<StallKv>),
    /// Boxed: a live record is large next to the other messages.
    Live(Box<LiveKv>),
    /// A live key was deleted; `lease` is the deleted value's lease when etcd said.
    LiveGone {
        group: GroupId,
        rank: Rank,
    },
    Certified(IncarnationId),
    /// A certificate's retention lease ran out: forget it (bounded memory).
    CertificateGone(IncarnationId),
}

fn live_kv(key: &[u8], group: GroupId, rank: Rank, value: &[u8], lease: i64, mod_revision: i64) -> Option<LiveKv> {
    match RankLive::parse(value) {
        Ok(record) if record.rank == rank && record.group == group => Some(LiveKv {
            group,
            rank,
            record,
            lease,
            mod_revision,
        }),
        Ok(_) => {
            debug!(key = %String::from_utf8_lossy(key), "live record disagrees with its key; skipped");
            None
        }
        Err(e) => {
            debug!(key = %String::from_utf8_lossy(key), error = %e, "malformed live record; skipped");
            None
        }
    }
}

/// A put as what node-watch keeps, if it keeps it.
fn on_put(
    keys: &Keys,
    scope: WatchScope,
    key: &[u8],
    value: &[u8],
    lease: i64,
    revision: i64,
    create_revision: i64,
) -> Option<SyncMsg> {
    Some(match watched(keys, scope, key)? {
        Watched::Live(group, rank) => SyncMsg::Live(Box::new(live_kv(key, group, rank, value, lease, revision)?)),
        Watched::Stall(group, rank) => {
            SyncMsg::Stall(Box::new(stall_kv(keys, group, rank, value, lease, create_revision)?))
        }
        Watched::Down(id) => SyncMsg::Certified(id),
    })
}

/// Runs until the receiver is dropped. `host` is this host's name: in the host scope, what
/// is watched is its ranks' copies (the fleet's whole `groups/` when it cannot be a key).
pub(crate) async fn run(
    etcd: rootrank_store::EtcdAccess,
    prefix: String,
    host: String,
    scope: WatchScope,
    events: prometheus::IntCounter,
    tx: mpsc::UnboundedSender<SyncMsg>,
) {
    let keys = Keys::new(&prefix);
    let scope = if scope == WatchScope::Host && !rootrank_core::is_key_host(&host) {
        warn!(
            host,
            "this host's name cannot name a key: watching the whole fleet (--watch-scope fleet)"
        );
        WatchScope::Fleet
    } else {
        scope
    };
    let range = match scope {
        WatchScope::Host => keys.host_copies(&host),
        WatchScope::Fleet => format!("{}/groups/", keys.prefix()),
    };
    info!(prefix = %range, ?scope, "node watchdog watches this prefix");
    let mut mirror = RankMirror {
        keys,
        scope,
        tx,
        loading: None,
        live_gone_total: 0,
        events,
    };
    // One snapshot reader: a watchdog runs on every host, so its memory (pages in flight)
    // matters more than the second or so parallel readers would save.
    rootrank_store::follow(&etcd, &range, 1, &mut mirror).await
}

/// node-watch's copy of etcd: only what the watchdog needs, sent on as [`SyncMsg`]s.
struct RankMirror {
    keys: Keys,
    scope: WatchScope,
    /// `rootrank_node_watch_events_total`: every key the snapshots and the watch delivered.
    events: prometheus::IntCounter,
    tx: mpsc::UnboundedSender<SyncMsg>,
    /// A snapshot being read: live keys, certificate ids, stall records without a stack.
    loading: Option<(Vec<LiveKv>, HashSet<IncarnationId>, Vec<StallKv>)>,
    /// Live keys deleted since this process started (any host's): in the log with each batch,
    /// so a mass death can be seen applied whole (`rootrank-bench mass-death`).
    live_gone_total: u64,
}

impl Mirror for RankMirror {
    fn snapshot_started(&mut self) {
        self.loading = Some(Default::default());
    }

    // Page by page, keeping only live keys and certificate ids: room records (a million of
    // them on a busy cluster) pass through one page at a time and are dropped, so a node
    // watchdog's memory does not grow with the rooms of the whole fleet.
    fn snapshot_page(&mut self, page: Vec<Event>) {
        let Some((lives, certified, stalls)) = &mut self.loading else {
            return;
        };
        self.events.inc_by(page.len() as u64);
        for ev in page {
            let Event::Put {
                key,
                value,
                lease,
                revision,
                create_revision,
                ..
            } = ev
            else {
                continue;
            };
            match on_put(&self.keys, self.scope, &key, &value, lease, revision, create_revision) {
                Some(SyncMsg::Live(l)) => lives.push(*l),
                Some(SyncMsg::Stall(s)) => stalls.push(*s),
                Some(SyncMsg::Certified(id)) => {
                    certified.insert(id);
                }
                _ => {}
            }
        }
    }

    fn snapshot_finished(&mut self, stats: &SnapshotStats) {
        let Some((lives, certified, stalls)) = self.loading.take() else {
            return;
        };
        info!(
            revision = stats.revision,
            keys = stats.keys,
            live = lives.len(),
            certificates = certified.len(),
            "node watchdog loaded the ranks from etcd"
        );
        let _ = self.tx.send(SyncMsg::Snapshot {
            lives,
            certified,
            stalls,
            revision: stats.revision,
        });
    }

    fn apply(&mut self, events: Vec<Event>) {
        let (n, gone_before) = (events.len(), self.live_gone_total);
        let revision = events.last().map_or(0, Event::revision);
        self.events.inc_by(n as u64);
        for event in events {
            let msg = match event {
                Event::Put {
                    key,
                    value,
                    lease,
                    revision,
                    create_revision,
                    ..
                } => on_put(&self.keys, self.scope, &key, &value, lease, revision, create_revision),
                Event::Delete { key, .. } => match watched(&self.keys, self.scope, &key) {
                    Some(Watched::Live(group, rank)) => {
                        self.live_gone_total += 1;
                        Some(SyncMsg::LiveGone { group, rank })
                    }
                    Some(Watched::Down(id)) => Some(SyncMsg::CertificateGone(id)),
                    _ => None,
                },
            };
            if let Some(m) = msg {
                let _ = self.tx.send(m);
            }
        }
        let gone = self.live_gone_total - gone_before;
        if n >= 1024 || gone >= 100 {
            info!(
                events = n,
                live_gone = gone,
                live_gone_total = self.live_gone_total,
                revision,
                "applied a large batch of etcd events"
            );
        } else {
            debug!(
                events = n,
                live_gone = gone,
                live_gone_total = self.live_gone_total,
                revision,
                "applied etcd events"
            );
        }
    }

    fn stale(&mut self, why: &str) {
        warn!(
            why,
            "etcd said nothing on the watch, or the watch is lost (partitioned?); node-watch is blind until it re-creates the watch"
        );
    }

    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}
