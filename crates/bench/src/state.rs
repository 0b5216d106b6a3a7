//! Realistic etcd state, written directly with etcd-client: live keys on leases (kept alive by a
//! few tasks instead of one agent each) and room records in batched transactions.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rootrank_core::records::{RankLive, RoomFailure, SCHEMA_VERSION};
use rootrank_core::{GroupId, Keys, Origin, Reason, RoomId};
use rootrank_store::etcd_client::{Client, PutOptions, Txn, TxnOp};

/// etcd's default `--max-txn-ops`.
pub const TXN_OPS: usize = 128;

/// splitmix64 (the simulator's): room ids that look like the router's random ones, reproducibly.
pub use rootrank_sim::pattern::splitmix64 as mix;

/// The room id of the `i`-th room of a data set `salt`.
pub fn room_id(salt: u64, i: u64) -> u64 {
    mix(salt.wrapping_mul(0x1000_0000_0000) ^ i) & rootrank_core::ids::MAX_ROOM
}

pub fn group_name(prefix: &str, g: usize) -> String {
    format!("{prefix}-{g}")
}

/// A RoomFailure as an agent writes it (same serializer, similar detail lengths).
pub fn record_value(group: &GroupId, rank: u32, room: u64, local: bool, at_ms: i64) -> anyhow::Result<Vec<u8>> {
    let (origin, reason, detail) = if local {
        (
            Origin::Local,
            "nixl_error",
            format!(
                "NIXL_ERR_BACKEND: UCX transport error on WRITE to decode rank {rank}: Connection reset by remote peer"
            ),
        )
    } else {
        (
            Origin::Propagated,
            "other",
            format!("KVTransferError(bootstrap_room={room}): NIXL KVSender Exception, is_from_another_rank=True"),
        )
    };
    let rec = RoomFailure {
        v: SCHEMA_VERSION,
        group: group.clone(),
        rank,
        room: RoomId::new(room)?,
        origin,
        reason: Reason::new(reason)?,
        detail,
        at: Some(rootrank_core::time::format_ms(at_ms)),
        incarnation: None,
        peer: None,
    };
    Ok(serde_json::to_vec(&rec)?)
}

pub fn live_value(group: &GroupId, rank: u32, size: u32, ttl_ms: u64) -> anyhow::Result<Vec<u8>> {
    live_value_on("bench-host", group, rank, size, ttl_ms)
}

/// [`live_value`] of a rank on `host`.
pub fn live_value_on(host: &str, group: &GroupId, rank: u32, size: u32, ttl_ms: u64) -> anyhow::Result<Vec<u8>> {
    let rec = RankLive {
        v: SCHEMA_VERSION,
        group: group.clone(),
        rank,
        group_size: size,
        role: Some("prefill".into()),
        host: Some(host.into()),
        pid: Some(100_000 + rank),
        boot_id: None,
        started_at: Some(rootrank_core::time::format_ms(rootrank_store::unix_ms())),
        lease_ttl_ms: Some(ttl_ms),
        agent: Some(rootrank_agent::AGENT_VERSION.into()),
        nixl_agent: None,
        gpu: None,
        endpoints: Vec::new(),
        pid_ns: None,
        start_ticks: None,
        incarnation: None,
    };
    Ok(serde_json::to_vec(&rec)?)
}

/// One put of a batch.
pub struct Put {
    pub key: String,
    pub value: Vec<u8>,
    pub lease: Option<i64>,
}

/// Writes `puts` in transactions of [`TXN_OPS`], `writers` at a time. Returns the count.
pub async fn write_all(clients: &[Client], puts: Vec<Put>, writers: usize) -> anyhow::Result<usize> {
    let n = puts.len();
    let mut batches: Vec<Vec<Put>> = Vec::new();
    let mut it = puts.into_iter().peekable();
    while it.peek().is_some() {
        batches.push(it.by_ref().take(TXN_OPS).collect());
    }
    let queue = Arc::new(std::sync::Mutex::new(batches));
    let mut tasks = Vec::new();
    for w in 0..writers.max(1) {
        let mut client = clients[w % clients.len()].clone();
        let queue = queue.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let batch = match queue.lock() {
                    Ok(mut q) => q.pop(),
                    Err(_) => None,
                };
                let Some(batch) = batch else {
                    return Ok::<(), anyhow::Error>(());
                };
                let ops: Vec<TxnOp> = batch
                    .into_iter()
                    .map(|p| TxnOp::put(p.key, p.value, p.lease.map(|l| PutOptions::new().with_lease(l))))
                    .collect();
                // Retried a few times: a busy etcd may time a request out (REQUEST_TIMEOUT).
                let mut tries = 0;
                loop {
                    match client.txn(Txn::new().and_then(ops.clone())).await {
                        Ok(_) => break,
                        Err(e) if tries < 5 => {
                            tries += 1;
                            tracing::debug!(error = %e, "txn failed; retrying");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(e) => return Err(e).context("writing a batch"),
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(n)
}

/// Writes live keys in transactions; when a batch fails (a lease already expired, or an etcd
/// too busy renewing tens of thousands of leases timed the request out), writes that batch key
/// by key with a few retries, and counts the keys it could not write instead of failing: an
/// overloaded etcd is a result here, not an error. Returns (written, lost).
pub async fn write_live(client: &Client, puts: Vec<Put>) -> anyhow::Result<(usize, usize)> {
    let mut client = client.clone();
    let (mut ok, mut lost) = (0, 0);
    let mut it = puts.into_iter().peekable();
    while it.peek().is_some() {
        let batch: Vec<Put> = it.by_ref().take(TXN_OPS).collect();
        let ops: Vec<TxnOp> = batch
            .iter()
            .map(|p| {
                TxnOp::put(
                    p.key.clone(),
                    p.value.clone(),
                    p.lease.map(|l| PutOptions::new().with_lease(l)),
                )
            })
            .collect();
        if client.txn(Txn::new().and_then(ops)).await.is_ok() {
            ok += batch.len();
            continue;
        }
        for p in batch {
            let opts = p.lease.map(|l| PutOptions::new().with_lease(l));
            let mut tries = 0;
            loop {
                match client.put(p.key.clone(), p.value.clone(), opts.clone()).await {
                    Ok(_) => {
                        ok += 1;
                        break;
                    }
                    Err(e) if rootrank_store::is_lease_not_found(&e) || tries >= 3 => {
                        lost += 1;
                        break;
                    }
                    Err(_) => {
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
    }
    Ok((ok, lost))
}

/// Grants `n` leases of `ttl_s`, `parallel` requests in flight.
pub async fn grant_leases(clients: &[Client], n: usize, ttl_s: i64, parallel: usize) -> anyhow::Result<Vec<i64>> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..parallel.max(1) {
        let mut client = clients[w % clients.len()].clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < n as u64 {
                let mut tries = 0;
                loop {
                    match client.lease_grant(ttl_s, None).await {
                        Ok(r) => {
                            got.push(r.id());
                            break;
                        }
                        Err(e) if tries < 5 => {
                            tries += 1;
                            tracing::debug!(error = %e, "lease grant failed; retrying");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        // An etcd overloaded by keepalives times grants out: that lease is
                        // skipped (the caller sees fewer leases than asked), not fatal.
                        Err(e) => {
                            tracing::debug!(error = %e, "lease grant failed; skipped");
                            break;
                        }
                    }
                }
            }
            Ok::<_, anyhow::Error>(got)
        }));
    }
    let mut all = Vec::with_capacity(n);
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

/// Keeps leases alive every `interval` from one task per lease over a few shared connections
/// (many leases per connection, as a node agent multiplexing its ranks would).
pub struct KeepAlives {
    stop: Arc<AtomicBool>,
    pub sent: Arc<AtomicU64>,
    pub failed: Arc<AtomicU64>,
    /// Keepalive answers with TTL 0: etcd had already expired the lease.
    pub expired: Arc<AtomicU64>,
    /// The first failure, for the results.
    pub first_error: Arc<std::sync::Mutex<Option<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl KeepAlives {
    pub fn start(clients: &[Client], leases: &[i64], interval: Duration, max_run: Duration) -> KeepAlives {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let expired = Arc::new(AtomicU64::new(0));
        let first_error: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
        let mut tasks = Vec::with_capacity(leases.len());
        let hard_stop = Instant::now() + max_run;
        for (i, &id) in leases.iter().enumerate() {
            let mut client = clients[i % clients.len()].clone();
            let (stop, sent, failed, expired) = (stop.clone(), sent.clone(), failed.clone(), expired.clone());
            let first_error = first_error.clone();
            let note = move |e: String| {
                if let Ok(mut f) = first_error.lock() {
                    f.get_or_insert(e);
                }
            };
            // Spread the first renewals over one interval so they do not arrive in one burst.
            let offset = interval.mul_f64((i as f64 / leases.len().max(1) as f64).fract());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(offset).await;
                // Like an agent: a broken keepalive stream is re-opened after a pause, so an
                // overloaded etcd shows as failures and a lower rate, not as silent give-ups.
                'stream: while !stop.load(Ordering::Relaxed) && Instant::now() < hard_stop {
                    let (mut keeper, mut stream) = match client.lease_keep_alive(id).await {
                        Ok(k) => k,
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            note(format!("opening the keepalive stream: {e}"));
                            tokio::time::sleep(interval).await;
                            continue 'stream;
                        }
                    };
                    let mut tick = tokio::time::interval(interval);
                    while !stop.load(Ordering::Relaxed) && Instant::now() < hard_stop {
                        tick.tick().await;
                        if let Err(e) = keeper.keep_alive().await {
                            failed.fetch_add(1, Ordering::Relaxed);
                            note(format!("sending a keepalive: {e}"));
                            continue 'stream;
                        }
                        sent.fetch_add(1, Ordering::Relaxed);
                        match tokio::time::timeout(Duration::from_secs(5), stream.message()).await {
                            Ok(Ok(Some(r))) if r.ttl() <= 0 => {
                                expired.fetch_add(1, Ordering::Relaxed);
                                return;
                            }
                            Ok(Ok(Some(_))) => {}
                            Ok(Ok(None)) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                                note("keepalive stream ended".into());
                                continue 'stream;
                            }
                            Ok(Err(e)) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                                note(format!("keepalive answer: {e}"));
                                continue 'stream;
                            }
                            Err(_) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                                note("no keepalive answer in 5 s".into());
                            }
                        }
                    }
                }
            }));
        }
        KeepAlives {
            stop,
            sent,
            failed,
            expired,
            first_error,
            tasks,
        }
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.abort();
        }
    }
}

/// A populated data set: where each room's records are, for the load generators.
pub struct DataSet {
    /// (group, room) of every room.
    pub rooms: Vec<(String, u64)>,
    pub records: usize,
    pub live_keys: usize,
    pub leases: Vec<i64>,
}

/// Registers `groups x ranks` live keys on their own leases (TTL `ttl_s`), and writes `rooms`
/// rooms with `per_room` records each (one `local`, the others `propagated`) on one
/// retention lease. Room `i` goes to group `i % groups`.
#[allow(clippy::too_many_arguments)]
pub async fn populate(
    clients: &[Client],
    prefix: &str,
    group_prefix: &str,
    groups: usize,
    ranks: u32,
    ttl_s: i64,
    rooms: usize,
    per_room: u32,
    salt: u64,
) -> anyhow::Result<DataSet> {
    let keys = Keys::new(prefix);
    let gids: Vec<GroupId> = (0..groups)
        .map(|g| GroupId::new(&group_name(group_prefix, g)))
        .collect::<Result<_, _>>()?;
    let leases = grant_leases(clients, groups * ranks as usize, ttl_s, 64).await?;
    let mut puts = Vec::with_capacity(leases.len());
    for (g, gid) in gids.iter().enumerate() {
        for r in 0..ranks {
            puts.push(Put {
                key: keys.live(gid, r),
                value: live_value(gid, r, ranks, ttl_s as u64 * 1000)?,
                lease: Some(leases[g * ranks as usize + r as usize]),
            });
        }
    }
    let live_keys = write_all(clients, puts, 16).await?;
    let per_room = per_room.min(ranks).max(1);
    let (room_list, records) = write_rooms(clients, &keys, &gids, rooms, per_room, salt).await?;
    Ok(DataSet {
        rooms: room_list,
        records,
        live_keys,
        leases,
    })
}

/// Writes `rooms` rooms' records (`per_room` ranks each, rank `i % per_room` of room `i`
/// `local`, the others `propagated`) round-robin over `gids`, on one retention lease, in
/// chunks so a million records never sit in memory as puts all at once. Returns every
/// (group, room) and the records written.
pub async fn write_rooms(
    clients: &[Client],
    keys: &Keys,
    gids: &[GroupId],
    rooms: usize,
    per_room: u32,
    salt: u64,
) -> anyhow::Result<(Vec<(String, u64)>, usize)> {
    const CHUNK: usize = 20_000;
    let retention = clients[0].clone().lease_grant(24 * 3600, None).await?.id();
    let now = rootrank_store::unix_ms();
    let mut room_list = Vec::with_capacity(rooms);
    let mut records = 0;
    let mut start = 0;
    while start < rooms {
        let end = (start + CHUNK).min(rooms);
        let mut puts = Vec::with_capacity((end - start) * per_room as usize);
        for i in start..end {
            let gid = &gids[i % gids.len()];
            let room = room_id(salt, i as u64);
            let local_rank = (i as u32) % per_room;
            for r in 0..per_room {
                puts.push(Put {
                    key: keys.room(gid, RoomId::new(room)?, r),
                    value: record_value(gid, r, room, r == local_rank, now)?,
                    lease: Some(retention),
                });
            }
            room_list.push((gid.as_str().to_string(), room));
        }
        records += write_all(clients, puts, 8)
            .await
            .with_context(|| format!("writing records ({records} written so far)"))?;
        start = end;
    }
    Ok((room_list, records))
}

/// `n` connections to etcd at `endpoint` (comma-separated for a cluster: each connection is
/// given every member, as agents are). Bulk loading gets a longer request timeout than
/// rootrank's own 2 s (`rootrank_store::REQUEST_TIMEOUT`): an etcd busy renewing tens of
/// thousands of leases answers a 128-op transaction slowly, and a timeout would only retry it.
pub async fn clients(endpoint: &str, n: usize) -> anyhow::Result<Vec<Client>> {
    use rootrank_store::etcd_client::ConnectOptions;
    let endpoints: Vec<&str> = endpoint.split(',').collect();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(30));
        out.push(
            Client::connect(&endpoints, Some(opts))
                .await
                .with_context(|| format!("connecting to etcd at {endpoint}"))?,
        );
    }
    Ok(out)
}
