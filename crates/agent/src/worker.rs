//! The agent's thread: a private single-threaded runtime running two tasks, the liveness
//! loop (register, keep alive, re-register after a lost lease) and the publisher (drain the
//! queue into etcd, retrying each item until it is written).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rootrank_core::records::{DownSource, RankDown, RankLive, RoomFailure, SCHEMA_VERSION};
use rootrank_core::{time, Incarnation, Keys, Reason};
use rootrank_store::etcd_client::{Client, PutOptions};
use rootrank_store::{Backoff, LazyClient, Retained, RetainedWriter, Written};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, info_span, warn, Instrument};

use crate::{AgentConfig, Command, Shared, AGENT_VERSION};

type Attachments = Arc<Mutex<BTreeMap<String, Vec<u8>>>>;

pub(crate) fn run(config: AgentConfig, rx: mpsc::Receiver<Command>, shared: Arc<Shared>) {
    // Scoped to this thread: the host's own logging is left alone.
    let _log = config.log.as_ref().map(tracing::dispatcher::set_default);
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            warn!(error = %e, "rootrank agent could not build its runtime; nothing will be published");
            return;
        }
    };
    let span = info_span!("agent", group = %config.group, rank = config.rank);
    rt.block_on(
        async move {
            let client = connect_with_retry(&config.endpoints).await;
            let attachments: Attachments = Arc::default();
            let registered_revision = Arc::new(AtomicI64::new(0));
            let (stop_tx, stop_rx) = watch::channel(false);
            let live = tokio::spawn(
                liveness(
                    config.clone(),
                    client.clone(),
                    shared.clone(),
                    attachments.clone(),
                    registered_revision.clone(),
                    stop_rx,
                )
                .in_current_span(),
            );
            publisher(config, client, shared, attachments, registered_revision, rx).await;
            let _ = stop_tx.send(true);
            let _ = live.await;
        }
        .instrument(span),
    );
}

async fn connect_with_retry(endpoints: &[String]) -> Client {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        match rootrank_store::connect(endpoints).await {
            Ok(c) => return c,
            Err(e) => {
                warn!(error = %e, "agent cannot reach etcd yet; retrying");
                tokio::time::sleep(backoff.next_pause()).await;
            }
        }
    }
}

fn lease_ttl_secs(config: &AgentConfig) -> i64 {
    // etcd leases are granted in whole seconds.
    config.lease_ttl.as_secs_f64().ceil().max(1.0) as i64
}

fn live_record(config: &AgentConfig, started_at: &str) -> Result<Vec<u8>, serde_json::Error> {
    let rec = RankLive {
        v: SCHEMA_VERSION,
        group: config.group.clone(),
        rank: config.rank,
        group_size: config.group_size,
        role: config.role.clone(),
        host: config.host.clone(),
        pid: Some(config.pid),
        boot_id: crate::read_trimmed("/proc/sys/kernel/random/boot_id"),
        started_at: Some(started_at.to_string()),
        lease_ttl_ms: Some((lease_ttl_secs(config) * 1000) as u64),
        agent: Some(AGENT_VERSION.to_string()),
        nixl_agent: config.nixl_agent.clone(),
        gpu: config.gpu.clone(),
        endpoints: config.advertised.clone(),
        pid_ns: None,
        start_ticks: None,
    };
    serde_json::to_vec(&rec)
}

/// Registers the live key and keeps its lease alive every TTL/3. A lost lease (etcd said it
/// expired) means a new incarnation: register again.
async fn liveness(
    config: AgentConfig,
    mut client: Client,
    shared: Arc<Shared>,
    attachments: Attachments,
    registered_revision: Arc<AtomicI64>,
    mut stop: watch::Receiver<bool>,
) {
    let keys = Keys::new(&config.prefix);
    let ttl = lease_ttl_secs(&config);
    let interval = Duration::from_millis((ttl as u64 * 1000 / 3).max(50));
    let started_at = time::format_ms(rootrank_store::unix_ms());
    let live_key = keys.live(&config.group, config.rank);
    let live_value = match live_record(&config, &started_at) {
        Ok(v) => v,
        Err(e) => {
            // Strings and integers always encode; if that ever broke, say so and stay out of etcd.
            warn!(error = %e, "could not encode this rank's live record; the rank will not register");
            return;
        }
    };
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    'register: loop {
        if *stop.borrow() {
            return;
        }
        // Register: a new lease, the live key and any attachments on it.
        let lease = match client.lease_grant(ttl, None).await {
            Ok(r) => r.id(),
            Err(e) => {
                warn!(error = %e, "agent could not grant its liveness lease; retrying");
                tokio::select! { _ = tokio::time::sleep(backoff.next_pause()) => {}, _ = stop.changed() => return }
                continue;
            }
        };
        let opts = PutOptions::new().with_lease(lease);
        match client
            .put(live_key.clone(), live_value.clone(), Some(opts.clone()))
            .await
        {
            Ok(r) => registered_revision.store(r.header().map_or(0, |h| h.revision()), Ordering::SeqCst),
            Err(e) => {
                warn!(error = %e, "agent could not write its live key; retrying");
                tokio::select! { _ = tokio::time::sleep(backoff.next_pause()) => {}, _ = stop.changed() => return }
                continue;
            }
        }
        let attached: Vec<(String, Vec<u8>)> = attachments
            .lock()
            .map(|a| a.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        for (suffix, value) in attached {
            let key = keys.rank_attachment(&config.group, config.rank, &suffix);
            if let Err(e) = client.put(key, value, Some(opts.clone())).await {
                warn!(error = %e, suffix, "agent could not re-attach a key to its new lease");
            }
        }
        shared.set_incarnation(lease);
        info!(incarnation = lease, ttl_s = ttl, "rank registered");
        backoff.reset();

        // Keep alive. Streams die with etcd restarts; re-open them for the same lease.
        let mut last_ok = Instant::now();
        loop {
            let (mut keeper, mut stream) = match client.lease_keep_alive(lease).await {
                Ok(ks) => ks,
                Err(e) => {
                    debug!(error = %e, "keepalive stream failed to open");
                    tokio::select! { _ = tokio::time::sleep(backoff.next_pause()) => {}, _ = stop.changed() => return }
                    continue;
                }
            };
            loop {
                if *stop.borrow() {
                    return;
                }
                let step = async {
                    keeper.keep_alive().await?;
                    stream.message().await
                };
                match tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, step).await {
                    Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                        last_ok = Instant::now();
                        backoff.reset();
                    }
                    Ok(Ok(Some(_))) => {
                        warn!(incarnation = lease, "liveness lease expired (etcd unreachable for longer than the TTL); registering a new incarnation");
                        continue 'register;
                    }
                    other => {
                        debug!(
                            ?other,
                            since_ok_ms = last_ok.elapsed().as_millis() as u64,
                            "keepalive failed; reopening"
                        );
                        tokio::select! { _ = tokio::time::sleep(backoff.next_pause()) => {}, _ = stop.changed() => return }
                        break;
                    }
                }
                tokio::select! { _ = tokio::time::sleep(interval) => {}, _ = stop.changed() => return }
            }
        }
    }
}

/// Drains the queue in order. Each item is retried until etcd takes it, so nothing that
/// entered the queue is lost to an etcd restart.
async fn publisher(
    config: AgentConfig,
    client: Client,
    shared: Arc<Shared>,
    attachments: Attachments,
    registered_revision: Arc<AtomicI64>,
    mut rx: mpsc::Receiver<Command>,
) {
    let keys = Keys::new(&config.prefix);
    let mut attach_client = client.clone();
    let mut writer = RetainedWriter::new(
        LazyClient::connected(config.endpoints.clone(), client),
        config.retention,
    );
    let certify =
        |reason: Reason, detail: String, log_tail: Option<Vec<String>>, at_ms: i64, incarnation: Incarnation| {
            RankDown {
                v: SCHEMA_VERSION,
                group: config.group.clone(),
                rank: config.rank,
                incarnation,
                reason,
                detail,
                source: DownSource::Agent,
                at: Some(time::format_ms(at_ms)),
                exit: None,
                log_tail,
                host: config.host.clone(),
                pid: Some(config.pid),
                observed_revision: None,
                registered_revision: Some(registered_revision.load(Ordering::SeqCst)).filter(|r| *r > 0),
            }
        };
    // A command taken off the queue while gathering a batch, handled next.
    let mut next: Option<Command> = None;
    loop {
        let cmd = match next.take() {
            Some(cmd) => cmd,
            None => match rx.recv().await {
                Some(cmd) => cmd,
                None => return,
            },
        };
        match cmd {
            Command::Failure(f) => {
                // Whatever else waits goes into the same transaction: a burst of failures costs
                // etcd one request per batch, not per record. Order is kept: a batch stops at
                // the first command that is not a failure.
                let mut batch = vec![f];
                while batch.len() < config.max_batch {
                    match rx.try_recv() {
                        Ok(Command::Failure(f)) => batch.push(f),
                        Ok(other) => {
                            next = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                publish_failures(&config, &keys, &shared, &mut writer, batch).await;
            }
            Command::Down {
                reason,
                detail,
                log_tail,
                at_ms,
            } => {
                let down = certify(reason, detail, log_tail, at_ms, wait_incarnation(&shared).await);
                write_certificate(&keys, &mut writer, &down).await;
                shared.stats.retries.store(writer.retries(), Ordering::Relaxed);
            }
            Command::Attach { suffix, value } => {
                if let Ok(mut a) = attachments.lock() {
                    a.insert(suffix.clone(), value.clone());
                }
                let lease = wait_incarnation(&shared).await;
                let key = keys.rank_attachment(&config.group, config.rank, &suffix);
                let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
                let mut tries = 0;
                while let Err(e) = attach_client
                    .put(
                        key.clone(),
                        value.clone(),
                        Some(PutOptions::new().with_lease(lease.lease_id())),
                    )
                    .await
                {
                    tries += 1;
                    // The liveness loop re-attaches after a re-registration; give up here.
                    if tries > 20 {
                        warn!(error = %e, suffix, "could not attach a key to the liveness lease");
                        break;
                    }
                    tokio::time::sleep(backoff.next_pause()).await;
                }
            }
            Command::Flush(done) => {
                let _ = done.send(());
            }
            Command::Shutdown { clean, done } => {
                if clean {
                    let reason = Reason::well_known(rootrank_core::ids::reasons::SHUTDOWN);
                    let down = certify(
                        reason,
                        "clean exit".into(),
                        None,
                        rootrank_store::unix_ms(),
                        wait_incarnation(&shared).await,
                    );
                    write_certificate(&keys, &mut writer, &down).await;
                    let lease = shared.incarnation.load(Ordering::SeqCst);
                    if lease > 0 {
                        if let Err(e) = attach_client.lease_revoke(lease).await {
                            warn!(error = %e, "could not revoke the liveness lease; it will expire");
                        }
                    }
                    info!("rank shut down cleanly");
                }
                let _ = done.send(());
                return;
            }
        }
    }
}

/// Writes a batch of room failures (in one transaction when there are several) and counts
/// each outcome.
async fn publish_failures(
    config: &AgentConfig,
    keys: &Keys,
    shared: &Shared,
    writer: &mut RetainedWriter,
    batch: Vec<crate::PendingFailure>,
) {
    let incarnation = Incarnation::new(shared.incarnation.load(Ordering::SeqCst)).ok();
    let mut encoded: Vec<(String, Vec<u8>, tracing::Span)> = Vec::with_capacity(batch.len());
    for f in batch {
        let span = info_span!("room_failure", room = %f.room, origin = f.origin.as_str(), reason = %f.reason);
        let rec = RoomFailure {
            v: SCHEMA_VERSION,
            group: config.group.clone(),
            rank: config.rank,
            room: f.room,
            origin: f.origin,
            reason: f.reason,
            detail: f.detail,
            at: Some(time::format_ms(f.at_ms)),
            incarnation,
            peer: f.peer,
        };
        match serde_json::to_vec(&rec) {
            Ok(value) => encoded.push((keys.room(&config.group, f.room, config.rank), value, span)),
            Err(e) => {
                shared.stats.rejected.fetch_add(1, Ordering::Relaxed);
                span.in_scope(|| warn!(error = %e, "room failure could not be encoded; dropped"));
            }
        }
    }
    let records: Vec<(&str, &[u8])> = encoded.iter().map(|(k, v, _)| (k.as_str(), v.as_slice())).collect();
    let outcomes = writer
        .write_records(&records, None)
        .instrument(info_span!("room_failures", records = records.len()))
        .await;
    for ((_, _, span), written) in encoded.iter().zip(outcomes) {
        if written == Written::Rejected {
            shared.stats.rejected.fetch_add(1, Ordering::Relaxed);
        } else {
            shared.stats.published.fetch_add(1, Ordering::Relaxed);
        }
        span.in_scope(|| debug!(?written, "room failure published"));
    }
    shared.stats.retries.store(writer.retries(), Ordering::Relaxed);
}

async fn wait_incarnation(shared: &Shared) -> Incarnation {
    loop {
        if let Ok(i) = Incarnation::new(shared.incarnation.load(Ordering::SeqCst)) {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn write_certificate(keys: &Keys, writer: &mut RetainedWriter, down: &RankDown) {
    let key = keys.down(&down.group, down.rank, down.incarnation);
    match writer.write(Retained::Certificate { key: &key, down }, None).await {
        Written::Yes => info!(reason = %down.reason, incarnation = %down.incarnation, "down certificate written"),
        // A supervisor or watchdog certified this incarnation first; theirs stands.
        _ => info!(reason = %down.reason, incarnation = %down.incarnation, "down certificate already present; kept"),
    }
}
