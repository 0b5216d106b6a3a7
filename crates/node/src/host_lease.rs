//! `rootrank node-watch --host-lease-ttl-ms` (v5): one liveness lease for the whole host.
//!
//! A lease per rank costs etcd a keepalive per rank every TTL/3 (issue 29: ~12 etcd cores at
//! 100,000 ranks). node-watch already sees each rank's exit within milliseconds (pidfd), so a
//! rank it watches needs its own lease only for the case where the whole host goes: one lease
//! of the host's does that for all its ranks. Here:
//!
//! - [`keep`] grants the host's lease and keeps it alive (a new one when it is lost).
//! - [`adopt`] moves a watched rank's keys (live, stall, attachments, host copies) onto it in
//!   one transaction; the live record then names the rank's own lease as its `incarnation`,
//!   so every certificate and verdict still names the same incarnation. The rank's agent
//!   watches its live key, sees the move and stops keeping its own lease alive.
//! - [`release`] deletes a certified-dead rank's keys from the host lease (no lease of its
//!   own runs out for it any more).
//!
//! When node-watch stops, its lease runs out and the host's live keys vanish: each agent sees
//! its key go and registers again on its own lease, and the coordinator holds a vanished key
//! that rode on a host lease for its TTL + 3 s and certifies it `lease_lost` when the same
//! process registered again, `lease_expired` when not (the host is gone).

use std::time::Duration;

use rootrank_core::{GroupId, Keys, Rank, RankLive};
use rootrank_store::etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use rootrank_store::{Backoff, EtcdAccess, LazyClient};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// What the keeper tells node-watch's loop.
#[derive(Debug)]
pub(crate) enum HostLease {
    /// A new host lease, kept alive from now on: adopt the watched ranks onto it.
    Granted { lease: i64, ttl_ms: u64 },
    /// The lease is gone (etcd let it run out): the ranks register again on their own.
    Lost,
}

/// Grants the host's lease and keeps it alive every TTL/3, forever; a lost lease is replaced
/// by a new one. Never returns an error: etcd being away is waited for.
pub(crate) async fn keep(etcd: EtcdAccess, ttl: Duration, tx: mpsc::UnboundedSender<HostLease>) {
    let ttl_s = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    let interval = Duration::from_millis((ttl_s as u64 * 1000 / 3).max(50));
    let mut etcd = LazyClient::new(etcd);
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        let granted = match etcd.client().await {
            Ok(c) => tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, c.lease_grant(ttl_s, None)).await,
            Err(e) => {
                debug!(error = %e, "host lease: etcd not reachable yet");
                tokio::time::sleep(backoff.next_pause()).await;
                continue;
            }
        };
        let lease = match granted {
            Ok(Ok(r)) => r.id(),
            other => {
                debug!(?other, "host lease: grant failed; retrying");
                tokio::time::sleep(backoff.next_pause()).await;
                continue;
            }
        };
        backoff.reset();
        info!(lease, ttl_s, "host lease granted: this host's watched ranks ride on it");
        if tx
            .send(HostLease::Granted {
                lease,
                ttl_ms: ttl_s as u64 * 1000,
            })
            .is_err()
        {
            return;
        }
        let Ok(client) = etcd.client().await else { continue };
        let mut client = client.clone();
        keep_alive(&mut client, lease, ttl, interval).await;
        warn!(
            lease,
            "host lease lost: the host's ranks register again on their own leases"
        );
        if tx.send(HostLease::Lost).is_err() {
            return;
        }
    }
}

/// Keeps `lease` alive until etcd says it is gone or no keepalive got through for a TTL.
async fn keep_alive(client: &mut Client, lease: i64, ttl: Duration, interval: Duration) {
    let mut last_ok = tokio::time::Instant::now();
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        if last_ok.elapsed() > ttl {
            return;
        }
        let opened = tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, client.lease_keep_alive(lease)).await;
        let (mut keeper, mut stream) = match opened {
            Ok(Ok(ks)) => ks,
            Ok(Err(rootrank_store::etcd_client::Error::LeaseKeepAliveError(_))) => return,
            other => {
                debug!(?other, "host lease: keepalive stream failed to open");
                tokio::time::sleep(backoff.next_pause()).await;
                continue;
            }
        };
        loop {
            let step = async {
                keeper.keep_alive().await?;
                stream.message().await
            };
            match tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, step).await {
                Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                    last_ok = tokio::time::Instant::now();
                    backoff.reset();
                }
                Ok(Ok(Some(_))) => return,
                other => {
                    debug!(?other, "host lease: keepalive failed; reopening");
                    tokio::time::sleep(backoff.next_pause()).await;
                    break;
                }
            }
            tokio::time::sleep(interval).await;
        }
    }
}

/// An etcd request within `REQUEST_TIMEOUT`, its error as text for the caller's log.
async fn answered<T>(
    request: impl std::future::Future<Output = Result<T, rootrank_store::etcd_client::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, request).await {
        Err(_) => Err("etcd did not answer in time".into()),
        Ok(r) => r.map_err(|e| e.to_string()),
    }
}

/// The keys of one rank node-watch moves or deletes: under its group, and its host copies.
fn rank_prefixes(keys: &Keys, host: &str, group: &GroupId, rank: Rank) -> Vec<String> {
    let mut p = vec![keys.rank_keys(group, rank)];
    p.extend(keys.host_copies_of(host, group, rank));
    p
}

/// Every key under `prefixes` that rides on `lease`, with its value and mod revision.
async fn on_lease(client: &mut Client, prefixes: &[String], lease: i64) -> Result<Vec<(String, Vec<u8>, i64)>, String> {
    let mut out = Vec::new();
    for p in prefixes {
        let resp = answered(client.get(p.as_str(), Some(GetOptions::new().with_prefix()))).await?;
        for kv in resp.kvs().iter().filter(|kv| kv.lease() == lease) {
            out.push((
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.value().to_vec(),
                kv.mod_revision(),
            ));
        }
    }
    Ok(out)
}

/// Moves one watched rank's keys from `from` (its own lease, or a host lease of an earlier
/// node-watch) onto `host_lease`, in one transaction that applies only if none of them
/// changed since read. `Ok(false)`: nothing to move (its live key is not on `from`) or a
/// key changed meanwhile (the caller tries again when it next sees the rank).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn adopt(
    etcd: &mut LazyClient,
    keys: &Keys,
    host: &str,
    group: &GroupId,
    rank: Rank,
    from: i64,
    (host_lease, ttl_ms): (i64, u64),
) -> Result<bool, String> {
    let live_key = keys.live(group, rank);
    let live_copy = keys.host_copy(host, group, rank, rootrank_core::HostCopyOf::Live);
    let client = etcd.client().await.map_err(|e| e.to_string())?;
    let found = on_lease(client, &rank_prefixes(keys, host, group, rank), from).await?;
    let Some((_, live_value, _)) = found.iter().find(|(k, _, _)| *k == live_key) else {
        return Ok(false);
    };
    let mut live = RankLive::parse(live_value).map_err(|e| e.to_string())?;
    // The incarnation stays the rank's own lease, whichever lease carried the key so far.
    live.incarnation = Some(live.incarnation_on(from).map_err(|e| e.to_string())?);
    live.lease_ttl_ms = Some(ttl_ms);
    let adopted = serde_json::to_vec(&live).map_err(|e| e.to_string())?;
    let opts = PutOptions::new().with_lease(host_lease);
    let mut compares = Vec::new();
    let mut puts = Vec::new();
    // The live key first: a watcher then knows the incarnation before its stall record.
    let mut found = found;
    found.sort_by_key(|(k, _, _)| (*k != live_key, k.clone()));
    for (key, value, mod_revision) in found {
        compares.push(Compare::mod_revision(key.as_str(), CompareOp::Equal, mod_revision));
        let is_live = key == live_key || live_copy.as_deref() == Some(key.as_str());
        let value = if is_live { adopted.clone() } else { value };
        puts.push(TxnOp::put(key, value, Some(opts.clone())));
    }
    let moved = puts.len();
    let resp = answered(client.txn(Txn::new().when(compares).and_then(puts))).await?;
    if resp.succeeded() {
        debug!(%group, rank, moved, host_lease, "rank's keys moved to the host lease");
    }
    Ok(resp.succeeded())
}

/// Deletes a rank's keys that ride on `host_lease`, once its incarnation `dead` is certified:
/// only while its live key still names that incarnation (a new one of the same rank keeps
/// its keys).
pub(crate) async fn release(
    etcd: &mut LazyClient,
    keys: &Keys,
    host: &str,
    (group, rank, dead): (&GroupId, Rank, rootrank_core::Incarnation),
    host_lease: i64,
) -> Result<usize, String> {
    let live_key = keys.live(group, rank);
    let client = etcd.client().await.map_err(|e| e.to_string())?;
    let found = on_lease(client, &rank_prefixes(keys, host, group, rank), host_lease).await?;
    let names_dead = found
        .iter()
        .find(|(k, _, _)| *k == live_key)
        .and_then(|(_, v, _)| RankLive::parse(v).ok())
        .is_some_and(|l| l.incarnation == Some(dead));
    if !names_dead {
        return Ok(0);
    }
    let compares: Vec<Compare> = found
        .iter()
        .map(|(k, _, m)| Compare::mod_revision(k.as_str(), CompareOp::Equal, *m))
        .collect();
    let deletes: Vec<TxnOp> = found.iter().map(|(k, _, _)| TxnOp::delete(k.as_str(), None)).collect();
    let n = deletes.len();
    let resp = answered(client.txn(Txn::new().when(compares).and_then(deletes))).await?;
    Ok(if resp.succeeded() { n } else { 0 })
}

/// [`release`], retried a few times (a key may change between read and delete), logged.
pub(crate) async fn release_logged(
    etcd: EtcdAccess,
    keys: Keys,
    host: String,
    (group, rank, dead): (GroupId, Rank, rootrank_core::Incarnation),
    host_lease: i64,
) {
    let mut etcd = LazyClient::new(etcd);
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    for _ in 0..5 {
        match release(&mut etcd, &keys, &host, (&group, rank, dead), host_lease).await {
            Ok(n) => {
                if n > 0 {
                    info!(%group, rank, incarnation = %dead, keys = n, "dead rank's keys deleted from the host lease");
                }
                return;
            }
            Err(e) => debug!(%group, rank, error = %e, "could not delete a dead rank's keys yet"),
        }
        tokio::time::sleep(backoff.next_pause()).await;
    }
    warn!(%group, rank, incarnation = %dead, "could not delete a dead rank's keys from the host lease; they go when the host lease does");
}
