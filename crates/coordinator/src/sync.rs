//! Keeps the index equal to etcd: snapshot at a revision, then watch from revision + 1.
//!
//! - A watch error or disconnect re-creates the watch from the last applied revision + 1
//!   (etcd-client does not drop a dead endpoint, so this happens whenever one member dies).
//! - A compacted start revision cancels the watch: the index is rebuilt from a new snapshot.
//! - Live keys that vanish without a certificate are persisted as `source: coordinator`
//!   certificates, create-if-absent, so every replica and every restart sees the same death.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rootrank_core::records::{DownSource, RankDown, SCHEMA_VERSION};
use rootrank_core::{time, Event, Index, Keys, Output, Reason};
use rootrank_store::etcd_client::{Client, EventType, WatchOptions};
use rootrank_store::{Backoff, LazyClient, Retained, RetainedWriter, Silence, SILENT_LIMIT};
use tokio::sync::mpsc;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::{CoordinatorConfig, Shared};

/// Runs forever (until aborted).
pub async fn run(config: CoordinatorConfig, shared: Arc<Shared>) {
    let span = info_span!("sync", prefix = %config.index.prefix);
    run_in_span(config, shared).instrument(span).await
}

async fn run_in_span(config: CoordinatorConfig, shared: Arc<Shared>) {
    let (cert_tx, cert_rx) = mpsc::unbounded_channel();
    tokio::spawn(certificate_writer(config.clone(), cert_rx).in_current_span());
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut client: Option<Client> = None;
    let mut need_snapshot = true;
    let mut first_watch = true;
    let mut logged_invalid: HashSet<String> = HashSet::new();
    // When the last watch ended: deaths found missing at a reload date from then.
    let mut watch_lost_at_ms = rootrank_store::unix_ms();
    loop {
        let c = match &client {
            Some(c) => c.clone(),
            None => match rootrank_store::connect(&config.etcd).await {
                Ok(c) => {
                    client = Some(c.clone());
                    c
                }
                Err(e) => {
                    warn!(error = %e, "coordinator cannot reach etcd; retrying");
                    tokio::time::sleep(backoff.next_pause()).await;
                    continue;
                }
            },
        };
        if need_snapshot {
            match load(
                &config,
                &shared,
                c.clone(),
                &cert_tx,
                &mut logged_invalid,
                watch_lost_at_ms,
            )
            .instrument(info_span!("snapshot"))
            .await
            {
                Ok(rev) => {
                    info!(
                        revision = rev,
                        rooms = shared.index.read().map(|i| i.room_count()).unwrap_or(0),
                        "index loaded from etcd"
                    );
                    need_snapshot = false;
                }
                Err(e) => {
                    warn!(error = %e, "snapshot failed; retrying");
                    tokio::time::sleep(backoff.next_pause()).await;
                    continue;
                }
            }
        }
        if !first_watch {
            shared.metrics.watch_restarts.inc();
        }
        first_watch = false;
        // From the last applied revision + 1 (so a re-created watch loses nothing).
        let from = shared.index.read().map(|i| i.revision()).unwrap_or(0) + 1;
        let end = watch(&config, &shared, c, from, &cert_tx, &mut logged_invalid, &mut backoff)
            .instrument(info_span!("watch", from_revision = from))
            .await;
        // Not current from the moment the watch ends, not after the backoff.
        shared.set_unready();
        watch_lost_at_ms = rootrank_store::unix_ms();
        match end {
            WatchEnd::Compacted => {
                warn!("watch start revision was compacted; reloading the index from a fresh snapshot");
                need_snapshot = true;
            }
            WatchEnd::Broken(e) => {
                debug!(error = %e, "watch broke; re-creating from the last revision + 1");
                tokio::time::sleep(backoff.next_pause()).await;
            }
        }
    }
}

async fn load(
    config: &CoordinatorConfig,
    shared: &Shared,
    client: Client,
    cert_tx: &mpsc::UnboundedSender<Output>,
    logged: &mut HashSet<String>,
    watch_lost_at_ms: i64,
) -> Result<i64, rootrank_store::etcd_client::Error> {
    let prefix = Keys::new(&config.index.prefix).root();
    let mut fresh = Index::new(config.index.clone());
    let mut outputs = Vec::new();
    // Pages are applied as they arrive (from parallel readers, in any order) and dropped:
    // the raw key-values of a million records never sit in memory at once.
    let started = std::time::Instant::now();
    let stats = rootrank_store::snapshot_pages(
        &client,
        &prefix,
        rootrank_store::unix_ms(),
        config.snapshot_readers,
        |page| {
            outputs.extend(
                fresh
                    .load_snapshot_page(page)
                    .into_iter()
                    .filter(|o| matches!(o, Output::Invalid { .. })),
            );
        },
    )
    .await?;
    let read_s = started.elapsed().as_secs_f64();
    let revision = stats.revision;
    fresh.finish_snapshot(revision);
    info!(
        keys = stats.keys,
        requests = stats.requests,
        etcd_walked = stats.walked,
        readers = stats.readers,
        busy_readers = stats.busy_readers,
        read_s,
        total_s = started.elapsed().as_secs_f64(),
        "snapshot read"
    );
    let (previous, vanished, old) = {
        let Ok(mut idx) = shared.index.write() else {
            return Ok(revision);
        };
        let prev = idx.revision();
        // Ranks that died while the watch was down, whose deletes were compacted away.
        let vanished = if prev > 0 {
            fresh.carry_vanished_from(&idx, watch_lost_at_ms)
        } else {
            Vec::new()
        };
        let old = std::mem::replace(&mut *idx, fresh);
        // Under the index lock, so no reader starts between the two. The catch-up includes
        // the deaths carried over above.
        shared.events.reset(&idx, rootrank_store::unix_ms());
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
    handle_outputs(shared, vanished, cert_tx, logged, true);
    // Counters count what happens while this process watches: a snapshot re-reads the
    // retention window, and counting it again would make `increase()` spike after every
    // restart. Only malformed values are counted (once per process), so they are seen.
    let outputs: Vec<Output> = outputs
        .into_iter()
        .filter(|o| matches!(o, Output::Invalid { .. }) && (previous == 0 || output_revision(o) > previous))
        .collect();
    handle_outputs(shared, outputs, cert_tx, logged, false);
    release_freed_memory();
    shared.ready.store(true, Ordering::SeqCst);
    shared.revision_tx.send_replace(revision);
    Ok(revision)
}

/// A snapshot of a million records passes through ~300 MB of raw key-values that are freed
/// once indexed; glibc keeps such memory mapped unless asked to return it.
fn release_freed_memory() {
    // SAFETY: malloc_trim only walks glibc's own free lists; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

enum WatchEnd {
    Compacted,
    Broken(String),
}

async fn watch(
    config: &CoordinatorConfig,
    shared: &Shared,
    mut client: Client,
    start: i64,
    cert_tx: &mpsc::UnboundedSender<Output>,
    logged: &mut HashSet<String>,
    backoff: &mut Backoff,
) -> WatchEnd {
    let prefix = Keys::new(&config.index.prefix).root();
    let opts = WatchOptions::new()
        .with_prefix()
        .with_start_revision(start)
        .with_prev_key()
        .with_progress_notify();
    let created = tokio::time::timeout(
        rootrank_store::REQUEST_TIMEOUT,
        client.watch(prefix.as_str(), Some(opts)),
    )
    .await;
    let (mut requests, mut stream) = match created {
        Ok(Ok(s)) => s.split(),
        Ok(Err(e)) => return WatchEnd::Broken(e.to_string()),
        Err(_) => {
            return WatchEnd::Broken(format!(
                "etcd did not open a watch within {:?}",
                rootrank_store::REQUEST_TIMEOUT
            ))
        }
    };
    // A blackholed etcd (no reset, no error) would leave the stream silent for ever, and this
    // replica answering as if current: progress requests, and the watch given up (not ready)
    // when etcd has said nothing for SILENT_LIMIT.
    let mut silence = Silence::standard(Instant::now());
    loop {
        // A pending room whose window ends resolves (or not) with no new event: the index
        // says when, and is asked again then.
        let index_timeout = shared.index.read().ok().and_then(|i| i.poll_timeout());
        let next = tokio::select! {
            m = stream.message() => m,
            _ = sleep_until_ms(index_timeout) => {
                on_index_timeout(shared, cert_tx, logged);
                continue;
            }
            silent = rootrank_store::tend_silence(&mut silence, &mut requests) => {
                if silent {
                    return WatchEnd::Broken(format!("etcd said nothing for {SILENT_LIMIT:?} (partitioned?)"));
                }
                continue;
            }
        };
        let msg = match next {
            Ok(Some(m)) => m,
            Ok(None) => return WatchEnd::Broken("watch stream ended".into()),
            Err(e) => return WatchEnd::Broken(e.to_string()),
        };
        silence.heard(Instant::now());
        if msg.compact_revision() > 0 {
            return WatchEnd::Compacted;
        }
        if msg.canceled() {
            return WatchEnd::Broken(format!("watch canceled: {}", msg.cancel_reason()));
        }
        if msg.created() {
            shared.ready.store(true, Ordering::SeqCst);
            backoff.reset();
        }
        let now = rootrank_store::unix_ms();
        let header_rev = msg.header().map_or(0, |h| h.revision());
        let mut outputs = Vec::new();
        {
            let Ok(mut idx) = shared.index.write() else {
                return WatchEnd::Broken("index lock poisoned".into());
            };
            for ev in msg.events() {
                let Some(kv) = ev.kv() else { continue };
                let event = match ev.event_type() {
                    EventType::Put => rootrank_store::put_event(kv.clone(), now),
                    EventType::Delete => Event::Delete {
                        key: kv.key().to_vec(),
                        prev_lease: ev.prev_kv().map(|p| p.lease()),
                        revision: kv.mod_revision(),
                        observed_at_ms: now,
                    },
                };
                outputs.extend(idx.apply(event));
            }
            // A progress notification (no events) also says the index is current to here.
            if msg.events().is_empty() && header_rev > 0 {
                idx.advance_to(header_rev);
            }
            // With the index at this batch, so a resolved room's event carries its verdict.
            shared.events.append(&idx, &outputs, now);
        }
        handle_outputs(shared, outputs, cert_tx, logged, true);
        let rev = shared.index.read().map(|i| i.revision()).unwrap_or(0);
        shared.revision_tx.send_replace(rev);
    }
}

/// Sleeps until `at_ms` (unix ms), or for ever when there is nothing to wait for.
async fn sleep_until_ms(at_ms: Option<i64>) {
    match at_ms {
        Some(at) => {
            let ms = u64::try_from(at.saturating_sub(rootrank_store::unix_ms())).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        None => std::future::pending().await,
    }
}

/// The index's deadline came: rooms it decides now are announced (events, metrics) and the
/// long polls woken, as for a new revision.
fn on_index_timeout(shared: &Shared, cert_tx: &mpsc::UnboundedSender<Output>, logged: &mut HashSet<String>) {
    let now = rootrank_store::unix_ms();
    let (outputs, revision) = {
        let Ok(mut idx) = shared.index.write() else { return };
        let outputs = idx.handle_timeout(now);
        shared.events.append(&idx, &outputs, now);
        (outputs, idx.revision())
    };
    if outputs.is_empty() {
        return;
    }
    handle_outputs(shared, outputs, cert_tx, logged, true);
    shared.revision_tx.send_replace(revision);
}

fn output_revision(o: &Output) -> i64 {
    match o {
        Output::RecordAccepted { revision, .. }
        | Output::RoomResolved { revision, .. }
        | Output::LiveKeyVanished { revision, .. }
        | Output::RankChanged { revision, .. }
        | Output::Invalid { revision, .. } => *revision,
    }
}

fn handle_outputs(
    shared: &Shared,
    outputs: Vec<Output>,
    cert_tx: &mpsc::UnboundedSender<Output>,
    logged: &mut HashSet<String>,
    live: bool,
) {
    let m = &shared.metrics;
    for o in outputs {
        match &o {
            Output::RecordAccepted { group, origin, .. } => {
                m.failure_records
                    .with_label_values(&[group.as_str(), origin.as_str()])
                    .inc();
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
                    .with_label_values(&[group.as_str(), &rank.to_string(), reason.as_str(), source.as_str()])
                    .inc();
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
                ..
            } => {
                info!(%group, rank, %incarnation, "live key vanished without a certificate: recording lease_expired");
                let _ = cert_tx.send(o);
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
            Output::Invalid { kind, key, error, .. } => {
                m.invalid_records.with_label_values(&[kind]).inc();
                // Logged once per key; the set is bounded so a flood cannot grow it forever.
                if logged.len() < 10_000 && logged.insert(key.clone()) {
                    warn!(kind, key, error, "skipping a malformed value in etcd");
                }
            }
        }
    }
}

/// Persists vanished live keys as coordinator certificates, retrying until etcd takes them.
async fn certificate_writer(config: CoordinatorConfig, mut rx: mpsc::UnboundedReceiver<Output>) {
    let keys = Keys::new(&config.index.prefix);
    let mut writer = RetainedWriter::new(LazyClient::new(config.etcd.clone()), config.retention);
    while let Some(o) = rx.recv().await {
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
        } = o
        else {
            continue;
        };
        let down = RankDown {
            v: SCHEMA_VERSION,
            group: group.clone(),
            rank,
            incarnation,
            reason: Reason::well_known(rootrank_core::ids::reasons::LEASE_EXPIRED),
            detail,
            source: DownSource::Coordinator,
            at: Some(time::format_ms(at_ms)),
            exit: None,
            log_tail: None,
            host,
            pid,
            observed_revision: Some(revision),
            registered_revision: Some(registered_revision),
        };
        let key = keys.down(&group, rank, incarnation);
        let span = info_span!("certificate", %group, rank, %incarnation);
        let written = writer
            .write(Retained::Certificate { key: &key, down: &down }, None)
            .instrument(span.clone())
            .await;
        span.in_scope(|| debug!(key, ?written, "lease_expired certificate"));
    }
}
