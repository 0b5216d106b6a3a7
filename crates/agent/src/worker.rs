//! The agent's thread: a private single-threaded runtime running three tasks, the liveness
//! loop (register, keep alive, re-register after a lost lease), the publisher (drain the
//! queue into etcd, retrying each item until it is written) and the stall watch (v3).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rootrank_core::records::{DownSource, RankDown, RankLive, RankStall, RoomFailure, SCHEMA_VERSION};
use rootrank_core::{time, HostCopyOf, Incarnation, Keys, Reason};
use rootrank_store::etcd_client::{Client, PutOptions, Txn, TxnOp};
use rootrank_store::{Backoff, EtcdAccess, LazyClient, Retained, RetainedWriter, Written};
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::own_key::{KeyChange, OwnKeyWatch};
use crate::stall::StallAction;
use crate::{procfs, AgentConfig, Command, Shared, AGENT_VERSION};

/// `RankLive.agent` of a record written by a supervisor for its child (`on_behalf`).
const ON_BEHALF_VERSION: &str = concat!("rootrank-run/", env!("CARGO_PKG_VERSION"));

/// How often a refused registration is tried again: the holder may die (then this rank
/// registers), and a configuration error is not fixed faster by asking etcd more often.
const REFUSED_RETRY: Duration = Duration::from_secs(3);

/// How far up the process tree a supervisor that registered on a rank's behalf may be.
const MAX_ANCESTRY: usize = 8;

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
            let client = tokio::select! {
                c = connect_with_retry(&config.etcd, &shared) => c,
                _ = shared.shutdown_asked.notified() => {
                    // Shut down before etcd ever took a connection: no incarnation of ours
                    // exists to certify, and the host is leaving; say what is lost.
                    stop_unconnected(rx, &shared);
                    return;
                }
            };
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
                    stop_rx.clone(),
                )
                .in_current_span(),
            );
            let stalls =
                tokio::spawn(stall_watch(config.clone(), client.clone(), shared.clone(), stop_rx).in_current_span());
            publisher(config, client, shared, attachments, registered_revision, rx).await;
            let _ = stop_tx.send(true);
            let _ = live.await;
            let _ = stalls.await;
        }
        .instrument(span),
    );
}

async fn connect_with_retry(access: &EtcdAccess, shared: &Shared) -> Client {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        match rootrank_store::connect(access).await {
            Ok(c) => return c,
            Err(e) => {
                if e.refusal().is_some() {
                    say_refused(shared, e.to_string());
                } else {
                    warn!(error = %e, "agent cannot reach etcd yet; retrying");
                }
                tokio::time::sleep(backoff.next_pause()).await;
            }
        }
    }
}

/// Answers the queue of an agent that never connected: every waiter is released, records are
/// counted as dropped and said once.
fn stop_unconnected(mut rx: mpsc::Receiver<Command>, shared: &Shared) {
    let mut lost = 0u64;
    while let Ok(cmd) = rx.try_recv() {
        match cmd {
            Command::Failure(_) | Command::Down { .. } => lost += 1,
            Command::Attach { .. } => {}
            Command::Flush(done) | Command::Shutdown { done, .. } => {
                let _ = done.send(());
            }
        }
    }
    shared.stats.dropped.fetch_add(lost, Ordering::Relaxed);
    let refused = shared.etcd_refused.lock().ok().and_then(|r| r.clone());
    if lost > 0 {
        warn!(
            lost,
            refused, "agent shut down before etcd ever answered; its queued records were not published"
        );
    } else {
        info!(refused, "agent shut down before etcd ever answered");
    }
}

/// Says a refusal from one of the liveness loop's requests once, and whether it was one.
async fn note_refusal(shared: &Shared, access: &EtcdAccess, e: rootrank_store::etcd_client::Error) -> bool {
    // etcd's NOSPACE alarm: every write is refused until an operator acts, which "is etcd
    // reachable?" would hide.
    if e.to_string().contains("database space exceeded") {
        say_refused(shared, NOSPACE.to_string());
        return true;
    }
    let Some(refusal) = rootrank_store::classify(access, e).await.refusal().cloned() else {
        return false;
    };
    say_refused(
        shared,
        format!(
            "etcd refused this rank's registration ({}): {refusal}",
            access.identity()
        ),
    );
    true
}

/// What the agent says while etcd's database is full (its NOSPACE alarm).
pub(crate) const NOSPACE: &str = rootrank_store::NOSPACE;

/// Keeps why etcd refuses the agent for the host to read, and logs it once (the operator
/// must act; retrying louder would not help).
fn say_refused(shared: &Shared, why: String) {
    if shared.set_etcd_refused(Some(why.clone())) {
        error!("{why}; retrying quietly until an operator fixes it");
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
        agent: Some(if config.on_behalf {
            ON_BEHALF_VERSION.to_string()
        } else {
            AGENT_VERSION.to_string()
        }),
        nixl_agent: config.nixl_agent.clone(),
        gpu: config.gpu.clone(),
        endpoints: config.advertised.clone(),
        pid_ns: config.pid_ns,
        start_ticks: config.start_ticks,
        incarnation: None,
    };
    serde_json::to_vec(&rec)
}

/// Registers the live key and keeps its lease alive every TTL/3. A lost lease (etcd said it
/// expired) means a new incarnation: register again.
async fn liveness(
    config: AgentConfig,
    client: Client,
    shared: Arc<Shared>,
    attachments: Attachments,
    registered_revision: Arc<AtomicI64>,
    stop: watch::Receiver<bool>,
) {
    let keys = Keys::new(&config.prefix);
    let ttl = lease_ttl_secs(&config);
    let started_at = time::format_ms(rootrank_store::unix_ms());
    let live_value = match live_record(&config, &started_at) {
        Ok(v) => v,
        Err(e) => {
            // Strings and integers always encode; if that ever broke, say so and stay out of etcd.
            warn!(error = %e, "could not encode this rank's live record; the rank will not register");
            return;
        }
    };
    let mut l = Liveness {
        live_key: keys.live(&config.group, config.rank),
        keys,
        interval: Duration::from_millis((ttl as u64 * 1000 / 3).max(50)),
        ttl,
        live_value,
        config,
        client,
        shared,
        attachments,
        registered_revision,
        stop,
        backoff: Backoff::new(Duration::from_millis(50), Duration::from_secs(1)),
        refused_by: None,
    };
    loop {
        if *l.stop.borrow() || l.shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let lease = match l.register().await {
            Next::Go(lease) => lease,
            Next::Again => continue,
            Next::Stop => return,
        };
        let mut own_key = OwnKeyWatch::new(l.live_key.clone(), lease, l.registered_revision.load(Ordering::SeqCst));
        match l.keep_alive(lease, &mut own_key).await {
            Next::Stop => return,
            // Moved to its host's lease (v5): followed there until that is lost.
            Next::Go(Some(host_lease)) => {
                if let Next::Stop = l.on_host_lease(lease, host_lease, &mut own_key).await {
                    return;
                }
            }
            // The incarnation is lost: register a new one.
            Next::Go(None) | Next::Again => continue,
        }
    }
}

/// What the liveness loop does after a step.
enum Next<T> {
    Go(T),
    Again,
    Stop,
}

/// A rank's liveness: its incarnations (a lease, the live key on it, the attachments), one
/// after another, each kept alive until it is lost.
struct Liveness {
    config: AgentConfig,
    client: Client,
    shared: Arc<Shared>,
    attachments: Attachments,
    registered_revision: Arc<AtomicI64>,
    stop: watch::Receiver<bool>,
    keys: Keys,
    live_key: String,
    live_value: Vec<u8>,
    ttl: i64,
    interval: Duration,
    backoff: Backoff,
    /// The lease of the incarnation that refused us last, to say a refusal once per holder.
    refused_by: Option<i64>,
}

impl Liveness {
    /// Sleeps `d`; `false` when the agent is stopping meanwhile.
    async fn pause(&mut self, d: Duration) -> bool {
        tokio::select! { _ = tokio::time::sleep(d) => true, _ = self.stop.changed() => false }
    }

    async fn backoff(&mut self) -> bool {
        let d = self.backoff.next_pause();
        self.pause(d).await
    }

    /// Registers a new incarnation: a new lease, the live key and any attachments on it.
    async fn register(&mut self) -> Next<i64> {
        let retry = |go_on: bool| if go_on { Next::Again } else { Next::Stop };
        let lease = match self.client.lease_grant(self.ttl, None).await {
            Ok(r) => r.id(),
            Err(e) => {
                let text = e.to_string();
                self.shared.stats.registration_retries.fetch_add(1, Ordering::Relaxed);
                if !note_refusal(&self.shared, &self.config.etcd, e).await {
                    warn!(error = %text, "agent could not grant its liveness lease; retrying");
                }
                return retry(self.backoff().await);
            }
        };
        // Create-if-absent (SPEC section 4): another incarnation's live key is never
        // overwritten, except a supervisor's registration for this very process.
        let created = match register(
            &mut self.client,
            &self.config,
            &self.live_key,
            self.live_value.clone(),
            lease,
        )
        .await
        {
            Ok(c) => c,
            Err(e) => {
                let text = e.to_string();
                self.shared.stats.registration_retries.fetch_add(1, Ordering::Relaxed);
                if !note_refusal(&self.shared, &self.config.etcd, e).await {
                    warn!(error = %text, "agent could not write its live key; retrying");
                }
                revoke_quietly(&mut self.client, lease).await;
                return retry(self.backoff().await);
            }
        };
        match created {
            Registration::Created(revision) => self.registered_revision.store(revision, Ordering::SeqCst),
            Registration::Refused(holder) => {
                revoke_quietly(&mut self.client, lease).await;
                let why = refusal(&self.config, holder.as_deref());
                // Said once per holder: retrying quietly is the point.
                if self.refused_by != Some(holder.as_ref().map_or(0, |h| h.lease)) {
                    self.refused_by = Some(holder.as_ref().map_or(0, |h| h.lease));
                    if holder.as_ref().is_some_and(|h| h.names_our_process) {
                        // A supervisor asked to register for a process whose own agent did
                        // first: that registration is the rank's, nothing is wrong.
                        info!("{why}");
                    } else {
                        error!("{why}");
                    }
                }
                self.shared.set_refused(Some(why));
                return retry(self.pause(REFUSED_RETRY).await);
            }
        }
        self.refused_by = None;
        self.reattach(lease).await;
        self.shared.set_etcd_refused(None);
        self.shared.set_incarnation(lease);
        info!(incarnation = lease, ttl_s = self.ttl, "rank registered");
        self.backoff.reset();
        Next::Go(lease)
    }

    /// The incarnation `own` rides on its host's lease (node-watch moved its keys there): its
    /// own lease is no longer kept alive (it carries nothing), stall records and attachments go
    /// on the host's, and the incarnation lasts until its live key goes (`Go`: register again,
    /// on an own lease: node-watch stopped, or someone deleted it) or the agent stops.
    async fn on_host_lease(&mut self, own: i64, mut host_lease: i64, own_key: &mut OwnKeyWatch) -> Next<()> {
        let mut client = self.client.clone();
        loop {
            self.shared.liveness_lease.store(host_lease, Ordering::SeqCst);
            info!(
                incarnation = own,
                host_lease, "this rank's live key rides on its host's lease now"
            );
            self.reattach(host_lease).await;
            let change = tokio::select! {
                c = own_key.next(&mut client) => c,
                _ = self.stop.changed() => return Next::Stop,
            };
            match change {
                KeyChange::OnLease(l) if l == host_lease => continue,
                KeyChange::OnLease(l) => host_lease = l,
                KeyChange::Gone => {
                    if *self.stop.borrow() || self.shared.stopping.load(Ordering::SeqCst) {
                        return Next::Stop;
                    }
                    warn!(
                        incarnation = own,
                        host_lease,
                        "this rank's live key on its host's lease is gone (node-watch stopped, or the key was deleted); registering again on its own lease"
                    );
                    return Next::Go(());
                }
            }
        }
    }

    /// Puts the attachments on `lease`: a new incarnation's, or the host's (node-watch moves
    /// those it saw; this covers one put meanwhile).
    async fn reattach(&mut self, lease: i64) {
        let opts = PutOptions::new().with_lease(lease);
        let attached: Vec<(String, Vec<u8>)> = self
            .attachments
            .lock()
            .map(|a| a.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        for (suffix, value) in attached {
            let key = self.keys.rank_attachment(&self.config.group, self.config.rank, &suffix);
            if let Err(e) = self.client.put(key, value, Some(opts.clone())).await {
                warn!(error = %e, suffix, "agent could not re-attach a key to its liveness lease");
            }
        }
    }

    /// Keeps `lease` alive until it is lost (`Go(None)`), its live key moves to its host's
    /// lease (`Go(Some(host lease))`) or the agent stops. Streams die with etcd restarts; they
    /// are re-opened for the same lease.
    async fn keep_alive(&mut self, lease: i64, own_key: &mut OwnKeyWatch) -> Next<Option<i64>> {
        let mut watch_client = self.client.clone();
        let ttl = self.ttl;
        let mut last_ok = Instant::now();
        loop {
            let opened =
                tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, self.client.lease_keep_alive(lease)).await;
            let (mut keeper, mut stream) = match opened {
                Ok(Ok(ks)) => ks,
                // etcd-client opens the stream with a first keepalive and returns this variant
                // when etcd answers it with TTL 0: the lease is gone (revoked, or expired while
                // the stream was down). Reopening for it would retry forever.
                Ok(Err(rootrank_store::etcd_client::Error::LeaseKeepAliveError(e))) => {
                    warn!(incarnation = lease, error = %e, "liveness lease is gone (revoked or expired); registering a new incarnation");
                    return Next::Go(None);
                }
                other => {
                    debug!(?other, "keepalive stream failed to open");
                    if gave_up(&mut self.client, lease, last_ok, ttl).await {
                        return Next::Go(None);
                    }
                    if !self.backoff().await {
                        return Next::Stop;
                    }
                    continue;
                }
            };
            loop {
                if *self.stop.borrow() {
                    return Next::Stop;
                }
                let step = async {
                    keeper.keep_alive().await?;
                    stream.message().await
                };
                match tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, step).await {
                    Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                        let gap = last_ok.elapsed();
                        if gap > self.interval * 2 {
                            // This thread (or etcd) got no CPU for that long: a lease this close to
                            // its TTL is a false death in waiting, so it is said before it happens.
                            warn!(
                                gap_ms = gap.as_millis() as u64,
                                ttl_s = ttl,
                                "keepalive late: the last one got through this long ago"
                            );
                        }
                        last_ok = Instant::now();
                        self.backoff.reset();
                    }
                    // A clean shutdown revoked it: nothing was lost, so nothing is said.
                    Ok(Ok(Some(_))) if self.shared.stopping.load(Ordering::SeqCst) => return Next::Stop,
                    Ok(Ok(Some(_))) => {
                        warn!(incarnation = lease, "liveness lease expired (etcd unreachable for longer than the TTL); registering a new incarnation");
                        return Next::Go(None);
                    }
                    other => {
                        debug!(
                            ?other,
                            since_ok_ms = last_ok.elapsed().as_millis() as u64,
                            "keepalive failed; reopening"
                        );
                        if gave_up(&mut self.client, lease, last_ok, ttl).await {
                            return Next::Go(None);
                        }
                        if !self.backoff().await {
                            return Next::Stop;
                        }
                        break;
                    }
                }
                // Between keepalives, the live key's watch: a move to the host's lease, or
                // the key gone while its lease lives (deleted by hand).
                let change = tokio::select! {
                    _ = tokio::time::sleep(self.interval) => None,
                    c = own_key.next(&mut watch_client) => Some(c),
                    _ = self.stop.changed() => return Next::Stop,
                };
                match change {
                    Some(KeyChange::OnLease(l)) if l != lease => return Next::Go(Some(l)),
                    Some(KeyChange::Gone) if !self.shared.stopping.load(Ordering::SeqCst) => {
                        warn!(
                            incarnation = lease,
                            "this rank's live key was deleted while its lease lives; registering a new incarnation"
                        );
                        revoke_quietly(&mut self.client, lease).await;
                        return Next::Go(None);
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Writes this rank's `RankStall` record when the host's loop stops advancing and deletes it
/// when it advances again (policy in [`crate::stall::StallDetector`]). The record rides on
/// the liveness lease: a rank that dies takes it along, and a re-registration re-writes it.
async fn stall_watch(config: AgentConfig, mut client: Client, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let keys = Keys::new(&config.prefix);
    let key = keys.stall(&config.group, config.rank);
    // Written and deleted with the record, in one transaction: both have the same create
    // revision, which node-watch's stack write compares against the record's.
    let copy = host_copy(&config, HostCopyOf::Stall);
    let mut detector = crate::stall::StallDetector::new(config.stall_after);
    let mono_ms = crate::stall::monotonic_ms;
    // (since_ms, stalled_ms) of the record to keep in etcd; the incarnation it names and the
    // lease it rides on, once written: both change it (v5: a new incarnation may ride on the
    // same host lease as the one before).
    let mut want: Option<(u64, u64)> = None;
    let mut written: Option<(i64, i64)> = None;
    loop {
        let now = mono_ms();
        let wake = detector.poll_timeout(now).saturating_sub(now);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wake)) => {},
            _ = stop.changed() => return,
        }
        let now = mono_ms();
        let count = shared.progress.load(Ordering::Relaxed);
        let at = shared.progress_at_ms.load(Ordering::Relaxed);
        match detector.observe(count, at, now) {
            Some(StallAction::Stalled { since_ms, stalled_ms }) => {
                warn!(
                    stalled_ms,
                    "this rank's loop has not advanced: writing its stall record"
                );
                want = Some((since_ms, stalled_ms));
                written = None;
            }
            Some(StallAction::Resumed) => {
                want = None;
                if written.is_some() {
                    info!("this rank's loop advances again: deleting its stall record");
                    let mut ops = vec![TxnOp::delete(key.as_str(), None)];
                    ops.extend(copy.iter().map(|c| TxnOp::delete(c.as_str(), None)));
                    if let Err(e) = client.txn(Txn::new().and_then(ops)).await {
                        // Deleted with the lease at the latest; the coordinator shows it stalled until then.
                        warn!(error = %e, "could not delete this rank's stall record");
                    }
                }
                written = None;
            }
            None => {}
        }
        let incarnation = shared.incarnation.load(Ordering::SeqCst);
        // The lease the live key rides on: written again when it changes (v5: moved to the
        // host's lease, or back to an own one).
        let lease = shared.liveness_lease.load(Ordering::SeqCst);
        let Some((since_ms, stalled_ms)) = want else { continue };
        let Ok(inc) = Incarnation::new(incarnation) else {
            continue;
        };
        if written == Some((incarnation, lease)) {
            continue;
        }
        // Wall-clock time of the last progress, for people (ordering is by etcd revision).
        let since_unix = rootrank_store::unix_ms() - i64::try_from(now.saturating_sub(since_ms)).unwrap_or(0);
        let record = RankStall {
            v: SCHEMA_VERSION,
            group: config.group.clone(),
            rank: config.rank,
            incarnation: inc,
            since: Some(time::format_ms(since_unix)),
            stalled_ms: Some(stalled_ms),
            in_flight: None,
            stack: None,
        };
        let Ok(value) = serde_json::to_vec(&record) else {
            continue;
        };
        let opts = PutOptions::new().with_lease(lease);
        let mut ops = vec![TxnOp::put(key.as_str(), value.clone(), Some(opts.clone()))];
        ops.extend(
            copy.iter()
                .map(|c| TxnOp::put(c.as_str(), value.clone(), Some(opts.clone()))),
        );
        match tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, client.txn(Txn::new().and_then(ops))).await {
            Ok(Ok(_)) => written = Some((incarnation, lease)),
            other => debug!(?other, "stall record not written yet; retrying"),
        }
    }
}

/// This rank's copy of its live or stall record under its host (`None` without a host that
/// can name a key: such a rank is seen by `node-watch --watch-scope fleet` only).
fn host_copy(config: &AgentConfig, of: HostCopyOf) -> Option<String> {
    Keys::new(&config.prefix).host_copy(config.host.as_deref()?, &config.group, config.rank, of)
}

/// The live key's holder, when it is not us.
struct Holder {
    lease: i64,
    record: Option<RankLive>,
    /// The holder's record names the process we register for (`on_behalf` only).
    names_our_process: bool,
}

enum Registration {
    Created(i64),
    Refused(Option<Box<Holder>>),
}

/// Creates the live key on `lease` if absent. A key held by a `rootrank run` supervisor on
/// behalf of this process (or of an ancestor of it: a launcher between supervisor and rank)
/// is taken over: this process's own agent knows more than its supervisor.
async fn register(
    client: &mut Client,
    config: &AgentConfig,
    key: &str,
    value: Vec<u8>,
    lease: i64,
) -> Result<Registration, rootrank_store::etcd_client::Error> {
    // The host copy goes with the live key (same transaction, lease and revision): what a
    // node-watch on this host watches.
    let also: Vec<(String, Vec<u8>)> = host_copy(config, HostCopyOf::Live)
        .map(|k| (k, value.clone()))
        .into_iter()
        .collect();
    let kv = match rootrank_store::create_or_read(client, key, value.clone(), Some(lease), &also).await? {
        rootrank_store::Created::Yes { revision } => return Ok(Registration::Created(revision)),
        rootrank_store::Created::Held(None) => return Ok(Registration::Refused(None)),
        rootrank_store::Created::Held(Some(kv)) => kv,
    };
    let record = RankLive::parse(kv.value()).ok();
    // Whom the key may be taken from: nobody alive claims it as its own.
    let take_over = match &record {
        Some(r) if !config.on_behalf && registered_for_us(config, r) => {
            Some("the live key was registered for this process by its supervisor; taking it over")
        }
        Some(r) if process_gone(config, r) => {
            Some("the live key's holder was a process of this host that is gone (a restart before its lease ran out); taking it over")
        }
        _ if certified_dead(
            client,
            config,
            record
                .as_ref()
                .and_then(|r| r.incarnation_on(kv.lease()).ok())
                .map_or(kv.lease(), |i| i.lease_id()),
        )
        .await? =>
        {
            Some("the live key's holder is certified dead (its lease has not run out yet); taking it over")
        }
        _ => None,
    };
    if let Some(why) = take_over {
        info!(holder = kv.lease(), "{why}");
        if let Some(revision) =
            rootrank_store::put_if_unchanged(client, key, kv.mod_revision(), value, Some(lease), &also).await?
        {
            return Ok(Registration::Created(revision));
        }
    }
    let names_our_process = config.on_behalf && record.as_ref().is_some_and(|r| names_process_or_child(config, r));
    Ok(Registration::Refused(Some(Box::new(Holder {
        lease: kv.lease(),
        record,
        names_our_process,
    }))))
}

/// Whether `holder` is a supervisor's registration (`on_behalf`) for this process or one of
/// its ancestors: same host, boot and pid namespace, and the named process is us or above
/// us with the start time the record says (a pid alone could name a later process).
fn registered_for_us(config: &AgentConfig, holder: &RankLive) -> bool {
    let ours = |h: &Option<String>, c: &Option<String>| h.is_some() && h == c;
    if !holder.agent.as_deref().is_some_and(|a| a.starts_with("rootrank-run/"))
        || !ours(&holder.host, &config.host)
        || !ours(&holder.boot_id, &crate::read_trimmed("/proc/sys/kernel/random/boot_id"))
        || holder.pid_ns.is_none()
        || holder.pid_ns != config.pid_ns
        || holder.start_ticks.is_none()
    {
        return false;
    }
    let Some(target) = holder.pid else {
        return false;
    };
    let mut p = config.pid;
    for _ in 0..=MAX_ANCESTRY {
        if p == target {
            let same_start = if p == config.pid {
                config.start_ticks
            } else {
                procfs::start_ticks(Some(p))
            };
            return same_start == holder.start_ticks;
        }
        match procfs::parent_of(p) {
            Some(pp) if pp > 1 && pp != p => p = pp,
            _ => return false,
        }
    }
    false
}

/// Whether `holder` names the process we register for (`on_behalf`), or a descendant of it
/// (a rank under a launcher): the rank's own agent registered first.
fn names_process_or_child(config: &AgentConfig, holder: &RankLive) -> bool {
    if holder.pid == Some(config.pid) && holder.start_ticks == config.start_ticks {
        return true;
    }
    let Some(mut p) = holder
        .pid
        .filter(|_| holder.pid_ns.is_some() && holder.pid_ns == procfs::pid_ns(None))
    else {
        return false;
    };
    for _ in 0..MAX_ANCESTRY {
        match procfs::parent_of(p) {
            Some(pp) if pp == config.pid => return true,
            Some(pp) if pp > 1 && pp != p => p = pp,
            _ => return false,
        }
    }
    false
}

/// Whether `holder` names a process of this host, boot and pid namespace that no longer
/// runs (no process at its pid, or a younger one): a rank restarted before its previous
/// incarnation's lease ran out.
fn process_gone(config: &AgentConfig, holder: &RankLive) -> bool {
    let ours = |h: &Option<String>, c: &Option<String>| h.is_some() && h == c;
    let (Some(pid), Some(started)) = (holder.pid, holder.start_ticks) else {
        return false;
    };
    // Our /proc must show our own namespace (a container may see the host's), or a pid of
    // the holder's namespace would be read as another process.
    let own_proc = procfs::start_ticks(Some(std::process::id()));
    if !ours(&holder.host, &config.host)
        || !ours(&holder.boot_id, &crate::read_trimmed("/proc/sys/kernel/random/boot_id"))
        || holder.pid_ns.is_none()
        || holder.pid_ns != procfs::pid_ns(None)
        || own_proc.is_none()
        || own_proc != procfs::start_ticks(None)
    {
        return false;
    }
    procfs::start_ticks(Some(pid)) != Some(started)
}

/// Whether the holder's incarnation already has a down certificate (node-watch or a
/// supervisor saw it die): its live key only waits for its lease to run out.
async fn certified_dead(
    client: &mut Client,
    config: &AgentConfig,
    holder_lease: i64,
) -> Result<bool, rootrank_store::etcd_client::Error> {
    let Ok(incarnation) = Incarnation::new(holder_lease) else {
        return Ok(false);
    };
    let key = Keys::new(&config.prefix).down(&config.group, config.rank, incarnation);
    let resp = client
        .get(
            key,
            Some(rootrank_store::etcd_client::GetOptions::new().with_count_only()),
        )
        .await?;
    Ok(resp.count() > 0)
}

/// The one error a refused registration logs, and what the host reads back.
fn refusal(config: &AgentConfig, holder: Option<&Holder>) -> String {
    let (group, rank) = (&config.group, config.rank);
    let held_by = match holder {
        Some(h) => {
            let r = h.record.as_ref();
            format!(
                "incarnation {} (pid {} on host {})",
                h.lease,
                r.and_then(|r| r.pid).map_or("?".to_string(), |p| p.to_string()),
                r.and_then(|r| r.host.clone()).unwrap_or_else(|| "?".to_string()),
            )
        }
        None => "another incarnation".to_string(),
    };
    if holder.is_some_and(|h| h.names_our_process) {
        return format!(
            "rank {rank} of group {group} is already registered by the process itself ({held_by}); not registering on its behalf"
        );
    }
    format!(
        "rank {rank} of group {group} is not registered: its live key is held by {held_by}. \
         Two processes claim rank {rank} of group {group}: check ROOTRANK_INSTANCE / the group naming. \
         Retrying every {}s in case the holder is gone",
        REFUSED_RETRY.as_secs()
    )
}

/// Whether no keepalive got through for a whole TTL: etcd has expired the lease (or it was
/// revoked), whatever the stream says. Then the incarnation is given up ([`abandon`]).
async fn gave_up(client: &mut Client, lease: i64, last_ok: Instant, ttl: i64) -> bool {
    if last_ok.elapsed() <= Duration::from_secs(ttl as u64) {
        return false;
    }
    warn!(
        incarnation = lease,
        "no keepalive for a whole lease TTL; registering a new incarnation"
    );
    abandon(client, lease).await;
    true
}

/// Gives up an incarnation whose keepalives stopped getting through. If etcd still holds the
/// lease (it was only slow), revoking it frees the live key now: otherwise the new incarnation
/// would be refused by our own old one until its TTL ran out.
async fn abandon(client: &mut Client, lease: i64) {
    if tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, revoke_quietly(client, lease))
        .await
        .is_err()
    {
        debug!(lease, "revoking the abandoned liveness lease timed out; it will expire");
    }
}

async fn revoke_quietly(client: &mut Client, lease: i64) {
    if let Err(e) = client.lease_revoke(lease).await {
        debug!(error = %e, lease, "could not revoke an unused liveness lease; it will expire");
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
    let sink_shared = shared.clone();
    let mut writer = RetainedWriter::new(LazyClient::connected(config.etcd.clone(), client), config.retention)
        .on_refused(Arc::new(move |why| {
            sink_shared.set_etcd_refused(why);
        }))
        .count_retries_in(shared.stats.retries.clone());
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
                lease_ttl_ms: Some((lease_ttl_secs(&config) * 1000) as u64),
                group_size: Some(config.group_size),
                role: config.role.clone(),
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
            }
            Command::Attach { suffix, value } => {
                if let Ok(mut a) = attachments.lock() {
                    a.insert(suffix.clone(), value.clone());
                }
                wait_incarnation(&shared).await;
                let lease = shared.liveness_lease.load(Ordering::SeqCst);
                let key = keys.rank_attachment(&config.group, config.rank, &suffix);
                let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
                let mut tries = 0;
                while let Err(e) = attach_client
                    .put(key.clone(), value.clone(), Some(PutOptions::new().with_lease(lease)))
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
                let never_registered = shared.incarnation.load(Ordering::SeqCst) <= 0 && shared.is_refused();
                if clean && never_registered {
                    // No incarnation of ours to certify: the live key is someone else's.
                    info!("rank shut down before its registration was accepted");
                } else if clean {
                    let reason = Reason::well_known(rootrank_core::ids::reasons::SHUTDOWN);
                    let incarnation = wait_incarnation(&shared).await;
                    // From here the liveness loop registers nothing new (after the wait: a
                    // rank that is still registering must get its incarnation to certify).
                    shared.stopping.store(true, Ordering::SeqCst);
                    let down = certify(
                        reason,
                        "clean exit".into(),
                        None,
                        rootrank_store::unix_ms(),
                        incarnation,
                    );
                    write_certificate(&keys, &mut writer, &down).await;
                    let lease = shared.incarnation.load(Ordering::SeqCst);
                    let rides_on = shared.liveness_lease.load(Ordering::SeqCst);
                    if lease > 0 && rides_on > 0 && rides_on != lease {
                        // On the host's lease (v5), which the other ranks of the host share:
                        // this rank's keys are deleted, not the lease.
                        delete_from_host_lease(&mut attach_client, &config, &keys, &attachments, rides_on).await;
                    } else if lease > 0 {
                        if let Err(e) = attach_client.lease_revoke(lease).await {
                            warn!(error = %e, "could not revoke the liveness lease; it will expire");
                        }
                    }
                    info!("rank shut down cleanly");
                } else {
                    // The host dropped its agent without a shutdown: the lease runs out, and the
                    // coordinator will read this rank as dead. Said, so a death nobody saw is explained.
                    warn!("agent dropped by its host without a shutdown; the liveness lease is left to expire");
                }
                let _ = done.send(());
                return;
            }
        }
    }
}

/// A clean shutdown's delete of this rank's keys from its host's lease: its live key, stall
/// record, attachments and host copies, only while the live key still rides on that lease.
async fn delete_from_host_lease(
    client: &mut Client,
    config: &AgentConfig,
    keys: &Keys,
    attachments: &Attachments,
    host_lease: i64,
) {
    let live = keys.live(&config.group, config.rank);
    let mut doomed = vec![live.clone(), keys.stall(&config.group, config.rank)];
    doomed.extend(host_copy(config, HostCopyOf::Live));
    doomed.extend(host_copy(config, HostCopyOf::Stall));
    if let Ok(a) = attachments.lock() {
        doomed.extend(a.keys().map(|s| keys.rank_attachment(&config.group, config.rank, s)));
    }
    let txn = Txn::new()
        .when([rootrank_store::etcd_client::Compare::lease(
            live.as_str(),
            rootrank_store::etcd_client::CompareOp::Equal,
            host_lease,
        )])
        .and_then(
            doomed
                .iter()
                .map(|k| TxnOp::delete(k.as_str(), None))
                .collect::<Vec<_>>(),
        );
    match tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, client.txn(txn)).await {
        Ok(Ok(_)) => {}
        other => warn!(
            ?other,
            "could not delete this rank's keys from its host's lease; node-watch deletes them when the process exits"
        ),
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
