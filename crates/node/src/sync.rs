//! The node watchdog's view of etcd: a snapshot of live keys and down certificates, then a
//! watch from the snapshot's revision + 1, following the coordinator's pattern:
//!
//! - A broken watch (etcd restart, member down) is re-created from the last seen revision
//!   + 1, so nothing that happened meanwhile is missed.
//! - A compacted start revision means events are lost: reload from a fresh snapshot.
//! - A silent etcd (blackholed: no reset, no error) is noticed as the coordinator notices it
//!   (`rootrank_store::Silence`: progress requests, the watch given up after
//!   `SILENT_LIMIT`), and so is a watch etcd does not open within the request timeout:
//!   the watch is re-created, on whichever endpoint answers, instead of staying blind.
//!
//! Only what the watchdog needs leaves this module, as [`SyncMsg`]s.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use rootrank_core::{GroupId, Incarnation, KeyKind, Keys, Rank, RankLive, RankStall};
use rootrank_store::etcd_client::{Client, EventType, WatchOptions};
use rootrank_store::{Backoff, Silence, SILENT_LIMIT};
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

fn stall_kv(keys: &Keys, key: &[u8], value: &[u8], lease: i64, create_revision: i64) -> Option<StallKv> {
    let KeyKind::Stall { group, rank } = keys.parse(key)? else {
        return None;
    };
    match RankStall::parse(value) {
        Ok(record) if record.rank == rank && record.group == group && record.stack.is_none() => Some(StallKv {
            key: key.to_vec(),
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
        lease: Option<i64>,
    },
    Certified(IncarnationId),
    /// A certificate's retention lease ran out: forget it (bounded memory).
    CertificateGone(IncarnationId),
}

fn live_kv(keys: &Keys, key: &[u8], value: &[u8], lease: i64, mod_revision: i64) -> Option<LiveKv> {
    let KeyKind::Live { group, rank } = keys.parse(key)? else {
        return None;
    };
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

fn down_id(keys: &Keys, key: &[u8]) -> Option<IncarnationId> {
    match keys.parse(key)? {
        KeyKind::Down {
            group,
            rank,
            incarnation,
        } => Some((group, rank, incarnation)),
        _ => None,
    }
}

/// Runs until the receiver is dropped.
pub(crate) async fn run(etcd: rootrank_store::EtcdAccess, prefix: String, tx: mpsc::UnboundedSender<SyncMsg>) {
    let keys = Keys::new(&prefix);
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut client: Option<Client> = None;
    let mut revision: Option<i64> = None;
    loop {
        if tx.is_closed() {
            return;
        }
        let c = match &client {
            Some(c) => c.clone(),
            None => match rootrank_store::connect(&etcd).await {
                Ok(c) => client.insert(c).clone(),
                Err(e) => {
                    warn!(error = %e, "node watchdog cannot reach etcd; retrying");
                    tokio::time::sleep(backoff.next_pause()).await;
                    continue;
                }
            },
        };
        let rev = match revision {
            Some(r) => r,
            None => match load(&keys, c.clone(), &tx).await {
                Ok(r) => r,
                Err(e) => {
                    warn!(error = %e, "snapshot failed; retrying");
                    tokio::time::sleep(backoff.next_pause()).await;
                    continue;
                }
            },
        };
        match watch(&keys, c, rev, &tx, &mut backoff).await {
            End::Compacted => {
                warn!("watch start revision was compacted; reloading from a fresh snapshot");
                revision = None;
            }
            End::Broken(last, why) => {
                revision = Some(last);
                debug!(why, "watch broke; re-creating from the last revision + 1");
                tokio::time::sleep(backoff.next_pause()).await;
            }
            End::Silent(last) => {
                revision = Some(last);
                warn!(
                    silent_ms = SILENT_LIMIT.as_millis() as u64,
                    "etcd said nothing on the watch (partitioned?); node-watch is blind until it re-creates the watch"
                );
            }
            End::Closed => return,
        }
    }
}

async fn load(
    keys: &Keys,
    client: Client,
    tx: &mpsc::UnboundedSender<SyncMsg>,
) -> Result<i64, rootrank_store::etcd_client::Error> {
    // Page by page, keeping only live keys and certificate ids: room records (a million of
    // them on a busy cluster) pass through one page at a time and are dropped, so a node
    // watchdog's memory does not grow with the rooms of the whole fleet.
    let mut lives = Vec::new();
    let mut certified = HashSet::new();
    let mut stalls = Vec::new();
    let prefix = format!("{}/groups/", keys.prefix());
    // One reader: a watchdog runs on every host, so its memory (pages in flight) matters more
    // than the second or so parallel readers would save; its ranges are bounded all the same.
    let readers = 1;
    let stats = rootrank_store::snapshot_pages(&client, &prefix, 0, readers, |page| {
        for ev in page {
            let rootrank_core::Event::Put {
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
            if let Some(l) = live_kv(keys, &key, &value, lease, revision) {
                lives.push(l);
            } else if let Some(s) = stall_kv(keys, &key, &value, lease, create_revision) {
                stalls.push(s);
            } else if let Some(id) = down_id(keys, &key) {
                certified.insert(id);
            }
        }
    })
    .await?;
    let revision = stats.revision;
    info!(
        revision,
        keys = stats.keys,
        live = lives.len(),
        certificates = certified.len(),
        "node watchdog loaded the ranks from etcd"
    );
    let _ = tx.send(SyncMsg::Snapshot {
        lives,
        certified,
        stalls,
        revision,
    });
    Ok(revision)
}

enum End {
    Compacted,
    /// Broken, with the last revision seen.
    Broken(i64, String),
    /// etcd said nothing for `SILENT_LIMIT`, with the last revision seen.
    Silent(i64),
    Closed,
}

async fn watch(
    keys: &Keys,
    mut client: Client,
    mut revision: i64,
    tx: &mpsc::UnboundedSender<SyncMsg>,
    backoff: &mut Backoff,
) -> End {
    let opts = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1)
        .with_prev_key()
        .with_progress_notify();
    let created = tokio::time::timeout(
        rootrank_store::REQUEST_TIMEOUT,
        client.watch(format!("{}/groups/", keys.prefix()), Some(opts)),
    )
    .await;
    let (mut requests, mut stream) = match created {
        Ok(Ok(s)) => s.split(),
        Ok(Err(e)) => return End::Broken(revision, e.to_string()),
        Err(_) => {
            let waited = rootrank_store::REQUEST_TIMEOUT;
            return End::Broken(revision, format!("etcd did not open a watch within {waited:?}"));
        }
    };
    let mut silence = Silence::standard(Instant::now());
    loop {
        let next = tokio::select! {
            m = stream.message() => m,
            silent = rootrank_store::tend_silence(&mut silence, &mut requests) => {
                if silent {
                    return End::Silent(revision);
                }
                continue;
            }
        };
        let msg = match next {
            Ok(Some(m)) => m,
            Ok(None) => return End::Broken(revision, "watch stream ended".into()),
            Err(e) => return End::Broken(revision, e.to_string()),
        };
        silence.heard(Instant::now());
        if msg.compact_revision() > 0 {
            return End::Compacted;
        }
        if msg.canceled() {
            return End::Broken(revision, format!("watch canceled: {}", msg.cancel_reason()));
        }
        if msg.created() {
            backoff.reset();
        }
        for ev in msg.events() {
            let Some(kv) = ev.kv() else { continue };
            revision = revision.max(kv.mod_revision());
            let out = match ev.event_type() {
                EventType::Put => live_kv(keys, kv.key(), kv.value(), kv.lease(), kv.mod_revision())
                    .map(|l| SyncMsg::Live(Box::new(l)))
                    .or_else(|| {
                        stall_kv(keys, kv.key(), kv.value(), kv.lease(), kv.create_revision())
                            .map(|s| SyncMsg::Stall(Box::new(s)))
                    })
                    .or_else(|| down_id(keys, kv.key()).map(SyncMsg::Certified)),
                EventType::Delete => match keys.parse(kv.key()) {
                    Some(KeyKind::Live { group, rank }) => Some(SyncMsg::LiveGone {
                        group,
                        rank,
                        lease: ev.prev_kv().map(|p| p.lease()),
                    }),
                    _ => down_id(keys, kv.key()).map(SyncMsg::CertificateGone),
                },
            };
            if let Some(m) = out {
                if tx.send(m).is_err() {
                    return End::Closed;
                }
            }
        }
        // A progress notification (no events) says nothing changed up to its revision.
        if msg.events().is_empty() {
            if let Some(h) = msg.header() {
                revision = revision.max(h.revision());
            }
        }
    }
}
