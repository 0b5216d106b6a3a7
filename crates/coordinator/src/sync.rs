//! Keeps the index equal to etcd: the shared follower (`rootrank_store::follow`: snapshot at
//! a revision, then a watch from revision + 1, re-created on loss, a new snapshot after a
//! compaction, a silent etcd given up) applied to the index ([`IndexMirror`]).
//!
//! - A reload after a compaction carries over the ranks that vanished meanwhile as deaths.
//! - Live keys that vanish without a certificate are persisted as `source: coordinator`
//!   certificates, create-if-absent, so every replica and every restart sees the same death;
//!   after etcd was silent, only once [`LeaseDoubt`] knows whether the process lived on.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rootrank_core::{Event, Index, KeyKind, Keys, Output, RankDown, Window, WindowEnd};
use rootrank_store::{LazyClient, Mirror, RetainedWriter, SnapshotStats, Written};
use tokio::sync::mpsc;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::lease_doubt::LeaseDoubt;
use crate::{CoordinatorConfig, Shared};

/// What the writer task persists, create-only: converted where the output is handled, so the
/// writer only encodes and batches.
enum ToWrite {
    Certificate(RankDown),
    WindowEnd(Window, WindowEnd),
}

/// Runs forever (until aborted).
pub async fn run(config: CoordinatorConfig, shared: Arc<Shared>) {
    let span = info_span!("sync", prefix = %config.index.prefix);
    async move {
        let (cert_tx, cert_rx) = mpsc::unbounded_channel();
        tokio::spawn(certificate_writer(config.clone(), cert_rx).in_current_span());
        let keys = Keys::new(&config.index.prefix);
        let prefix = keys.root();
        let mut mirror = IndexMirror {
            keys,
            config: config.clone(),
            shared,
            cert_tx,
            logged_invalid: HashSet::new(),
            watch_lost_at_ms: rootrank_store::monotonic_ms(),
            fresh: None,
            doubt: LeaseDoubt::new(),
        };
        rootrank_store::follow(&config.etcd, &prefix, config.snapshot_readers, &mut mirror).await
    }
    .instrument(span)
    .await
}

/// The coordinator's copy of etcd: the shared index, what the follower applies to it.
struct IndexMirror {
    keys: Keys,
    config: CoordinatorConfig,
    shared: Arc<Shared>,
    cert_tx: mpsc::UnboundedSender<ToWrite>,
    logged_invalid: HashSet<String>,
    /// When the last watch ended: deaths found missing at a reload date from then.
    watch_lost_at_ms: i64,
    /// A snapshot being loaded, with the malformed values it found.
    fresh: Option<(Index, Vec<Output>)>,
    /// Vanished live keys held after etcd was silent (`lease_lost` or `lease_expired`).
    doubt: LeaseDoubt,
}

impl Mirror for IndexMirror {
    // Hosts' copies of live records are node-watch's; the index ignores them, and their
    // thousands of tiny prefixes would cost the snapshot a request per few hosts.
    fn snapshot_skips(&self) -> Option<String> {
        Some(self.keys.all_host_copies())
    }

    fn snapshot_started(&mut self) {
        self.fresh = Some((Index::new(self.config.index.clone()), Vec::new()));
    }

    fn snapshot_page(&mut self, page: Vec<Event>) {
        // Pages are applied as they arrive (from parallel readers, in any order) and dropped:
        // the raw key-values of a million records never sit in memory at once.
        if let Some((fresh, invalid)) = &mut self.fresh {
            invalid.extend(
                fresh
                    .load_snapshot_page(page)
                    .into_iter()
                    .filter(|o| matches!(o, Output::Invalid { .. })),
            );
        }
    }

    fn snapshot_finished(&mut self, stats: &SnapshotStats) {
        let Some((mut fresh, invalid)) = self.fresh.take() else {
            return;
        };
        let revision = stats.revision;
        fresh.finish_snapshot(revision);
        let shared = self.shared.clone();
        let (previous, vanished, old) = {
            let Ok(mut idx) = shared.index.write() else {
                return;
            };
            let prev = idx.revision();
            // Ranks that died while the watch was down, whose deletes were compacted away.
            let vanished = if prev > 0 {
                fresh.carry_vanished_from(&idx, self.watch_lost_at_ms)
            } else {
                Vec::new()
            };
            let old = std::mem::replace(&mut *idx, fresh);
            // Under the index lock, so no reader starts between the two. The catch-up includes
            // the deaths carried over above.
            shared.events.reset(&idx, rootrank_store::monotonic_ms());
            (prev, vanished, old)
        };
        // The old index (up to a million rooms) is freed outside the lock.
        drop(old);
        if !vanished.is_empty() {
            warn!(
                deaths = vanished
                    .iter()
                    .filter(|o| matches!(o, Output::LiveKeyVanished { .. }))
                    .count(),
                "ranks vanished while the watch was down; certifying them lease_expired"
            );
        }
        self.handle_outputs(vanished, true);
        // Counters count what happens while this process watches: a snapshot re-reads the
        // retention window, and counting it again would make `increase()` spike after every
        // restart. Only malformed values are counted (once per process), so they are seen.
        let invalid: Vec<Output> = invalid
            .into_iter()
            .filter(|o| previous == 0 || output_revision(o) > previous)
            .collect();
        self.handle_outputs(invalid, false);
        release_freed_memory();
        info!(
            revision,
            rooms = shared.index.read().map(|i| i.room_count()).unwrap_or(0),
            "index loaded from etcd"
        );
        // Readable (a replica that never watched answers from its snapshot), though not yet
        // current: `current` follows etcd's answer to the watch.
        shared.ready.store(true, Ordering::SeqCst);
        shared.revision_tx.send_replace(revision);
        // A new index: every answer may have changed.
        shared.waiters.wake_all();
    }

    fn apply(&mut self, events: Vec<Event>) {
        let now = rootrank_store::monotonic_ms();
        let (started, n) = (Instant::now(), events.len());
        // Anything but a room record or a room's window end (a rank's live record,
        // certificate, stall) may change the answer of any room: those are few; room records
        // are the load.
        let mut closed_rooms = Vec::new();
        let rank_level = events.iter().any(|e| match self.keys.parse(e.key()) {
            Some(KeyKind::Room { .. }) => false,
            Some(KeyKind::WindowEnd(Window::Room(room))) => {
                closed_rooms.push(room);
                false
            }
            _ => true,
        });
        let outputs = {
            let Ok(mut idx) = self.shared.index.write() else {
                return;
            };
            let mut outputs = Vec::new();
            for event in events {
                outputs.extend(idx.apply(event));
            }
            // With the index at this batch, so a resolved room's event carries its verdict.
            self.shared.events.append(&idx, &outputs, now);
            outputs
        };
        if rank_level {
            self.shared.waiters.wake_all();
        } else {
            self.wake_rooms(&outputs);
            // A window's end turns a pending room unknown with no output of its own.
            for room in closed_rooms {
                self.shared.waiters.wake(room);
            }
        }
        self.handle_outputs(outputs, true);
        self.settle_doubts(now);
        let rev = self.shared.index.read().map(|i| i.revision()).unwrap_or(0);
        self.shared.revision_tx.send_replace(rev);
        if n >= 1024 {
            debug!(
                events = n,
                revision = rev,
                apply_s = started.elapsed().as_secs_f64(),
                "applied a large batch"
            );
        }
    }

    fn current(&mut self) {
        self.shared.ready.store(true, Ordering::SeqCst);
        self.doubt.current(rootrank_store::monotonic_ms());
    }

    fn stale(&mut self, _why: &str) {
        // Not current from the moment the watch ends, not after the backoff: every long poll
        // answers 503 now, and a client moves to another replica.
        self.shared.set_unready();
        self.watch_lost_at_ms = rootrank_store::monotonic_ms();
        self.doubt.stale(self.watch_lost_at_ms);
    }

    fn watch_opening(&mut self, _from_revision: i64, restart: bool) {
        if restart {
            self.shared.metrics.watch_restarts.inc();
        }
    }

    fn poll_timeout(&self) -> Option<Instant> {
        // A pending room whose window ends resolves (or not) with no new event: the index
        // says when, and is asked again then.
        let index_at = self.shared.index.read().ok().and_then(|i| i.poll_timeout());
        let at_ms = match (index_at, self.doubt.poll_timeout()) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        let in_ms = u64::try_from(at_ms.saturating_sub(rootrank_store::monotonic_ms())).unwrap_or(0);
        Some(Instant::now() + Duration::from_millis(in_ms))
    }

    /// The index's deadline came: rooms it decides now are announced (events, metrics) and the
    /// long polls woken, as for a new revision.
    fn handle_timeout(&mut self, _now: Instant) {
        let now = rootrank_store::monotonic_ms();
        self.settle_doubts(now);
        let (outputs, revision) = {
            let Ok(mut idx) = self.shared.index.write() else { return };
            let outputs = idx.handle_timeout(now);
            self.shared.events.append(&idx, &outputs, now);
            (outputs, idx.revision())
        };
        if outputs.is_empty() {
            return;
        }
        self.wake_rooms(&outputs);
        self.handle_outputs(outputs, true);
        self.shared.revision_tx.send_replace(revision);
    }
}

/// A snapshot of a million records passes through ~300 MB of raw key-values that are freed
/// once indexed; glibc keeps such memory mapped unless asked to return it.
fn release_freed_memory() {
    // SAFETY: malloc_trim only walks glibc's own free lists; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn output_revision(o: &Output) -> i64 {
    match o {
        Output::RecordAccepted { revision, .. }
        | Output::RoomResolved { revision, .. }
        | Output::LiveKeyVanished { revision, .. }
        | Output::RankChanged { revision, .. }
        | Output::GroupForgotten { revision, .. }
        | Output::Invalid { revision, .. }
        | Output::WindowEnded { revision, .. } => *revision,
    }
}

impl IndexMirror {
    /// Wakes the long polls of the rooms these outputs concern (their records, their
    /// resolution). Rank-level changes, which only rank-level keys bring, wake them all
    /// (`apply`); a timeout only resolves rooms.
    fn wake_rooms(&self, outputs: &[Output]) {
        let waiters = &self.shared.waiters;
        for o in outputs {
            match o {
                Output::RecordAccepted { room, .. } | Output::RoomResolved { room, .. } => waiters.wake(*room),
                _ => {}
            }
        }
    }

    fn handle_outputs(&mut self, outputs: Vec<Output>, live: bool) {
        // Their series go with them: instances restart under new group names, and a counter
        // per name ever seen would grow the registry (and every scrape) forever.
        let forgotten: std::collections::HashSet<&str> = outputs
            .iter()
            .filter_map(|o| match o {
                Output::GroupForgotten { group, .. } => Some(group.as_str()),
                _ => None,
            })
            .collect();
        self.shared.metrics.forget_groups(&forgotten);
        drop(forgotten);
        let m = &self.shared.metrics;
        for o in outputs {
            match &o {
                Output::RecordAccepted { group, origin, .. } => {
                    m.failure_records.inc(&[group.as_str(), origin.as_str()]);
                }
                Output::RoomResolved {
                    room,
                    group,
                    rank,
                    reason,
                    source,
                    first_record_observed_ms,
                    observed_ms,
                    ..
                } => {
                    m.root_causes
                        .inc(&[group.as_str(), &rank.to_string(), reason.as_str(), source.as_str()]);
                    if live {
                        m.resolution_seconds
                            .observe((observed_ms - first_record_observed_ms).max(0) as f64 / 1000.0);
                    }
                    info!(%room, %group, rank, %reason, %source, "room resolved");
                }
                Output::LiveKeyVanished {
                    group,
                    rank,
                    incarnation,
                    on_host_lease,
                    ..
                } => {
                    let (group, rank, incarnation) = (group.clone(), *rank, *incarnation);
                    let why = if *on_host_lease {
                        "live key on its host's lease vanished: certifying it once it is known whether its process registered again (node-watch stopped) or not (the host is gone)"
                    } else {
                        "live key vanished right after etcd was silent: certifying it once it is known whether its process lived on"
                    };
                    match self.doubt.vanished(o, rootrank_store::monotonic_ms()) {
                        Some(o) => {
                            info!(%group, rank, %incarnation, "live key vanished without a certificate: recording lease_expired");
                            if let Some(down) = o.into_coordinator_certificate() {
                                let _ = self.cert_tx.send(ToWrite::Certificate(down));
                            }
                        }
                        None => info!(%group, rank, %incarnation, "{why}"),
                    }
                }
                Output::RankChanged {
                    group,
                    rank,
                    state,
                    reason,
                    ..
                } => {
                    if live {
                        info!(%group, rank, ?state, reason = reason.as_ref().map(|r| r.as_str()), "rank state changed");
                    }
                }
                Output::GroupForgotten { group, .. } => {
                    debug!(%group, "group forgotten: etcd holds nothing for it");
                }
                Output::WindowEnded { window, .. } => {
                    debug!(
                        ?window,
                        "a window ended on this coordinator's clock: writing its end key"
                    );
                    if let Some((window, end)) = o.into_window_end() {
                        let _ = self.cert_tx.send(ToWrite::WindowEnd(window, end));
                    }
                }
                Output::Invalid { kind, key, error, .. } => {
                    m.invalid_records.with_label_values(&[kind]).inc();
                    // Logged once per key; the set is bounded so a flood cannot grow it forever.
                    if self.logged_invalid.len() < 10_000 && self.logged_invalid.insert(key.clone()) {
                        warn!(kind, key, error, "skipping a malformed value in etcd");
                    }
                }
            }
        }
    }
}

impl IndexMirror {
    /// Certifies the held vanished keys that are decided now: `lease_lost` when their process
    /// registered again, `lease_expired` when their hold ran out.
    fn settle_doubts(&mut self, now: i64) {
        if self.doubt.held() == 0 {
            return;
        }
        let downs = {
            let Ok(idx) = self.shared.index.read() else { return };
            self.doubt.settle(now, |g, r, i| idx.lived_on(g, r, i))
        };
        for down in downs {
            if down.reason.is_lease_lost() {
                warn!(group = %down.group, rank = down.rank, incarnation = %down.incarnation, detail = %down.detail, "lease lost, not a death: recording lease_lost");
            } else {
                info!(group = %down.group, rank = down.rank, incarnation = %down.incarnation, "its process did not register again: recording lease_expired");
            }
            let _ = self.cert_tx.send(ToWrite::Certificate(down));
        }
    }
}

/// Persists vanished live keys as coordinator certificates, and the ends of windows this
/// coordinator's clock saw (v4), retrying until etcd takes them. What the channel holds is
/// written together, in as few create-if-absent transactions as etcd's limits allow
/// (`write_records`: 128 a transaction), so a mass death (a lease shared by 100,000 keys
/// revoked) is on record within seconds, not one round trip per death. A window's end is
/// written create-only by every replica that sees it: the first to land counts.
async fn certificate_writer(config: CoordinatorConfig, mut rx: mpsc::UnboundedReceiver<ToWrite>) {
    const MOST_AT_ONCE: usize = 16_384;
    let keys = Keys::new(&config.index.prefix);
    let mut writer = RetainedWriter::new(LazyClient::new(config.etcd.clone()), config.retention);
    // An end key outlives the records whose windows it closes (a room's records come up to
    // SGLang's 300 s timeouts after its first, and keep their retention from then), so a
    // replica that loads later finds it while they are there.
    let window_lease = config.retention + Duration::from_millis(config.index.death_window_ms.max(0) as u64);
    let mut window_writer = RetainedWriter::new(LazyClient::new(config.etcd.clone()), window_lease);
    let by = config.listen.to_string();
    let mut items = Vec::with_capacity(MOST_AT_ONCE);
    while rx.recv_many(&mut items, MOST_AT_ONCE).await > 0 {
        let mut certificates: Vec<(String, Vec<u8>)> = Vec::new();
        let mut ends: Vec<(String, Vec<u8>)> = Vec::new();
        for item in items.drain(..) {
            // Values of strings and integers always serialize.
            match item {
                ToWrite::WindowEnd(window, mut end) => {
                    end.by = Some(by.clone());
                    if let Ok(v) = serde_json::to_vec(&end) {
                        ends.push((keys.window_end(&window), v));
                    }
                }
                ToWrite::Certificate(down) => {
                    if let Ok(v) = serde_json::to_vec(&down) {
                        certificates.push((keys.down(&down.group, down.rank, down.incarnation), v));
                    }
                }
            }
        }
        write_batch(&mut writer, &certificates, "coordinator certificates").await;
        write_batch(&mut window_writer, &ends, "window end keys").await;
    }
}

/// Writes one kind of record create-only, in as few transactions as etcd's limits allow.
async fn write_batch(writer: &mut RetainedWriter, records: &[(String, Vec<u8>)], what: &'static str) {
    if records.is_empty() {
        return;
    }
    let batch: Vec<(&str, &[u8])> = records.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    let written = writer
        .write_records(&batch, None)
        .instrument(info_span!("write_batch", what, count = batch.len()))
        .await;
    let new = written.iter().filter(|w| **w == Written::Yes).count();
    debug!(what, count = batch.len(), new, "written");
}
