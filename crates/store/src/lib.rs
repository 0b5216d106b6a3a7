//! rootrank's etcd layer: the few etcd operations rootrank makes, each with the semantics the
//! contract needs, and nothing about verdicts.
//!
//! - [`connect`]: a client for a list of endpoints, with timeouts a dead member cannot stall.
//! - [`create_if_absent`]: room records are written once per (room, rank); the first reason wins.
//!   [`create_or_read`] creates a live key only if absent and names its holder when not.
//! - [`put_certificate`]: down certificates, created once or written over a less specific
//!   coordinator certificate (keeping the revisions it carried).
//! - [`RetentionLeases`]: records outlive their writer by the retention window, and etcd
//!   forgets them after it, without ever riding on a liveness lease.
//! - [`snapshot_pages`]: the whole prefix at one revision, in parallel parts of short ranges
//!   (etcd 3.4 walks a request's whole range whatever its limit).
//! - [`RetainedWriter`]: records and certificates written until etcd takes them.
//! - [`follow`]: keeps a [`Mirror`] equal to a prefix (snapshot, then watch), the policy in the
//!   sans-IO [`Follower`]; the coordinator and node-watch both run it.
//! - [`Backoff`]: retry pacing shared by every loop that talks to etcd.
//! - [`embedded`]: a private etcd process, for `rootrank serve` on one machine and for tests.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
mod access;
pub mod embedded;
mod follow;
pub mod follower;
mod retained;
mod silence;
mod snapshot;

pub use access::{AccessError, EtcdAccess, EtcdCredentialFiles};
pub use follow::{follow, Mirror};
pub use follower::Follower;
pub use retained::{LazyClient, RefusalSink, Retained, RetainedWriter, WriteError, Written, NOSPACE};
pub use silence::{Silence, SilenceAction, CATCH_UP_SILENT_LIMIT, PROGRESS_EVERY, SILENT_LIMIT};

pub use snapshot::{put_event, snapshot_pages, snapshot_pages_skipping, Plan, SnapshotStats, DEFAULT_READERS, PAGE};

use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};

pub use etcd_client;

/// An etcd failure, with what to check.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("etcd at {endpoints} is unreachable or failing: {source}. Check that etcd runs there (rootrank serve without --etcd-endpoints starts a private one)")]
    Etcd {
        endpoints: String,
        #[source]
        source: etcd_client::Error,
    },
    #[error("etcd at {endpoints} refused us ({identity}): {refusal}")]
    Refused {
        endpoints: String,
        identity: String,
        refusal: Refusal,
    },
    #[error("no etcd endpoints given: pass --etcd-endpoints URL[,URL...] or set ROOTRANK_ETCD_ENDPOINTS")]
    NoEndpoints,
    #[error(transparent)]
    Access(#[from] AccessError),
}

impl StoreError {
    pub fn etcd(endpoints: &[String], source: etcd_client::Error) -> Self {
        StoreError::Etcd {
            endpoints: endpoints.join(","),
            source,
        }
    }

    /// `source` as what it is: a refusal (TLS, auth, permission: retrying will not help, the
    /// operator must act) or an outage.
    pub fn from_etcd(access: &EtcdAccess, source: etcd_client::Error) -> Self {
        match Refusal::of(&source) {
            Some(refusal) => StoreError::Refused {
                endpoints: access.endpoints.join(","),
                identity: access.identity(),
                refusal,
            },
            None => StoreError::etcd(&access.endpoints, source),
        }
    }

    /// The refusal, when etcd refused rather than failed.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            StoreError::Refused { refusal, .. } => Some(refusal),
            _ => None,
        }
    }
}

/// etcd said no to who we are, not "try later": retrying cannot help, so callers stop (serve,
/// node-watch) or say it once (the agent) instead of retrying silently.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the TLS handshake failed: {0}. Check --etcd-cacert (the CA that signed etcd's server certificate, whose names must include the endpoint's host) and --etcd-cert/--etcd-key (a client certificate etcd's --trusted-ca-file signed, not expired)")]
    Tls(String),
    #[error("authentication failed: {0}. Check --etcd-user and --etcd-password-file")]
    Auth(String),
    #[error(
        "permission denied: {0}. The etcd user lacks a role this component needs (README, Production: the least roles)"
    )]
    Permission(String),
}

impl Refusal {
    /// Classifies by gRPC code and by the TLS error in the transport error's chain; never by
    /// message text.
    pub fn of(e: &etcd_client::Error) -> Option<Refusal> {
        use tonic::Code;
        match e {
            etcd_client::Error::GRpcStatus(s) => match s.code() {
                Code::PermissionDenied => Some(Refusal::Permission(s.message().to_string())),
                Code::Unauthenticated => Some(Refusal::Auth(s.message().to_string())),
                // etcd answers a bad user or password, and a user given to an etcd without
                // auth, with these codes from the Authenticate call.
                Code::InvalidArgument | Code::FailedPrecondition if is_auth_message(s.message()) => {
                    Some(Refusal::Auth(s.message().to_string()))
                }
                // A failed handshake comes back as Unavailable with the transport error as
                // its source.
                _ => tls_error_in(s).map(Refusal::Tls),
            },
            other => tls_error_in(other).map(Refusal::Tls),
        }
    }
}

/// etcd's Authenticate errors share their gRPC codes with unrelated ones (InvalidArgument is
/// also "request too large"); these are etcd's own fixed texts for them (rpctypes).
fn is_auth_message(m: &str) -> bool {
    m.starts_with("etcdserver: authentication")
        || m.starts_with("etcdserver: user name")
        || m.starts_with("etcdserver: invalid auth token")
}

/// The rustls error somewhere in `e`'s source chain, an io::Error's inner error included
/// (io::Error's `source()` skips its inner error itself).
pub(crate) fn tls_error_in(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<rustls::Error>() {
            return Some(t.to_string());
        }
        let inner = err.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref());
        if let Some(found) = inner.and_then(|inner| tls_error_in(inner)) {
            return Some(found);
        }
        cur = err.source();
    }
    None
}

/// How long one etcd request may take before it is retried. Short, because a member that is
/// down answers nothing, and the agent and coordinator must move on to the next attempt.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// A client for `access`. Connecting is lazy in spirit: the returned client reconnects by
/// itself; an error here means no endpoint answered within the connect timeout, or one
/// refused who we are ([`StoreError::Refused`]).
pub async fn connect(access: &EtcdAccess) -> Result<Client, StoreError> {
    if access.endpoints.is_empty() {
        return Err(StoreError::NoEndpoints);
    }
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(REQUEST_TIMEOUT)
        .with_keep_alive(Duration::from_secs(5), Duration::from_secs(2))
        .with_keep_alive_while_idle(true);
    match Client::connect(&access.endpoints, Some(access.apply(opts))).await {
        Ok(c) => Ok(c),
        Err(e) => Err(classify(access, e).await),
    }
}

/// [`StoreError::from_etcd`], and when TLS is configured and the error says nothing clear
/// (a closed connection), a look for the TLS alert behind it ([`EtcdAccess::diagnose_tls`]).
pub async fn classify(access: &EtcdAccess, e: etcd_client::Error) -> StoreError {
    match StoreError::from_etcd(access, e) {
        StoreError::Etcd { endpoints, source } if access.uses_tls() => match access.diagnose_tls().await {
            Some(alert) => StoreError::Refused {
                endpoints,
                identity: access.identity(),
                refusal: Refusal::Tls(alert),
            },
            None => StoreError::Etcd { endpoints, source },
        },
        other => other,
    }
}

/// [`connect`], then one read of everything under `prefix` and one write probe of a
/// certificate key ([`Keys::probe_certificate`]) that etcd checks for permission but never
/// applies (a transaction whose condition cannot hold): start-up learns of a wrong
/// certificate, password or role within a second, and nothing is written.
pub async fn connect_checked(access: &EtcdAccess, prefix: &str) -> Result<Client, StoreError> {
    let keys = rootrank_core::Keys::new(prefix);
    let (root, write_key) = (keys.root(), keys.probe_certificate());
    let mut client = connect(access).await?;
    let probe = async {
        client
            .get(
                root.as_str(),
                Some(GetOptions::new().with_prefix().with_keys_only().with_limit(1)),
            )
            .await?;
        let never = Txn::new()
            .when([Compare::create_revision(write_key.as_str(), CompareOp::Less, 0)])
            .and_then([TxnOp::put(write_key.as_str(), "", None)]);
        client.txn(never).await
    };
    match tokio::time::timeout(REQUEST_TIMEOUT * 2, probe).await {
        Ok(Ok(_)) => Ok(client),
        Ok(Err(e)) => Err(classify(access, e).await),
        Err(_) => Err(StoreError::Etcd {
            endpoints: access.endpoints.join(","),
            source: etcd_client::Error::InvalidArgs("no answer to the start-up read within 4 s".into()),
        }),
    }
}

/// Writes `value` at `key` only if the key does not exist. Returns whether it was written.
pub async fn create_if_absent(
    client: &mut Client,
    key: &str,
    value: Vec<u8>,
    lease: Option<i64>,
) -> Result<bool, etcd_client::Error> {
    let opts = lease.map(|l| PutOptions::new().with_lease(l));
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key, value, opts)]);
    Ok(client.txn(txn).await?.succeeded())
}

/// What [`create_or_read`] found.
#[derive(Debug)]
pub enum Created {
    /// Written, at this revision.
    Yes { revision: i64 },
    /// The key exists: its current value (`None` only if etcd answered without it).
    Held(Option<etcd_client::KeyValue>),
}

/// [`create_if_absent`] that, when the key exists, reads who holds it in the same
/// transaction (a refused live key names its holder in one round trip).
///
/// `also` are written with it, in the same transaction and on the same lease (a rank's host
/// copy of its live record): they have its revision and go with it.
pub async fn create_or_read(
    client: &mut Client,
    key: &str,
    value: Vec<u8>,
    lease: Option<i64>,
    also: &[(String, Vec<u8>)],
) -> Result<Created, etcd_client::Error> {
    let opts = lease.map(|l| PutOptions::new().with_lease(l));
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then(puts(key, value, also, opts))
        .or_else([TxnOp::get(key, None)]);
    let resp = client.txn(txn).await?;
    if resp.succeeded() {
        return Ok(Created::Yes {
            revision: resp.header().map_or(0, |h| h.revision()),
        });
    }
    let holder = resp.op_responses().into_iter().find_map(|r| match r {
        etcd_client::TxnOpResponse::Get(g) => g.kvs().first().cloned(),
        _ => None,
    });
    Ok(Created::Held(holder))
}

/// Writes `value` at `key` if it is still at `mod_revision` (nobody wrote it since it was
/// read), and `also` with it as [`create_or_read`] does. Returns the revision written at, or
/// `None` when the key changed.
pub async fn put_if_unchanged(
    client: &mut Client,
    key: &str,
    mod_revision: i64,
    value: Vec<u8>,
    lease: Option<i64>,
    also: &[(String, Vec<u8>)],
) -> Result<Option<i64>, etcd_client::Error> {
    let opts = lease.map(|l| PutOptions::new().with_lease(l));
    let txn = Txn::new()
        .when([Compare::mod_revision(key, CompareOp::Equal, mod_revision)])
        .and_then(puts(key, value, also, opts));
    let resp = client.txn(txn).await?;
    Ok(resp.succeeded().then(|| resp.header().map_or(0, |h| h.revision())))
}

/// `key`'s put and those of `also`, all with `opts`.
fn puts(key: &str, value: Vec<u8>, also: &[(String, Vec<u8>)], opts: Option<PutOptions>) -> Vec<TxnOp> {
    let mut ops = vec![TxnOp::put(key, value, opts.clone())];
    ops.extend(
        also.iter()
            .map(|(k, v)| TxnOp::put(k.as_str(), v.clone(), opts.clone())),
    );
    ops
}

/// The most records one batch transaction carries: etcd's default `--max-txn-ops` (128), the
/// most operations it takes in each of a transaction's three lists. Against an etcd set lower,
/// [`RetainedWriter::write_records`] splits the batches etcd refuses.
pub const MAX_BATCH_RECORDS: usize = 128;

/// The most value bytes one batch transaction carries: far below etcd's default 1.5 MiB request
/// limit, so a batch of records at the 4 KiB detail cap always fits.
pub const MAX_BATCH_BYTES: usize = 512 * 1024;

/// [`create_if_absent`] for many keys in as few transactions as the keys allow: one, unless a
/// key already exists. Returns, per input, whether it was written; the same key twice counts
/// as one write (the first value wins, as two single writes would have it).
///
/// Each round sends one transaction that creates every pending key if none exists, and
/// otherwise reads which exist; those are dropped and the rest tried again. A round that
/// fails names at least one existing key, so this ends within `records.len() + 1` rounds.
/// Callers keep a batch within [`MAX_BATCH_RECORDS`] and [`MAX_BATCH_BYTES`].
pub async fn create_all_if_absent(
    client: &mut Client,
    records: &[(&str, &[u8])],
    lease: Option<i64>,
) -> Result<Vec<bool>, etcd_client::Error> {
    let mut written = vec![false; records.len()];
    // etcd refuses a transaction that names one key twice.
    let mut seen = std::collections::HashSet::new();
    let mut pending: Vec<usize> = (0..records.len()).filter(|&i| seen.insert(records[i].0)).collect();
    while !pending.is_empty() {
        let opts = lease.map(|l| PutOptions::new().with_lease(l));
        let txn = Txn::new()
            .when(
                pending
                    .iter()
                    .map(|&i| Compare::create_revision(records[i].0, CompareOp::Equal, 0))
                    .collect::<Vec<_>>(),
            )
            .and_then(
                pending
                    .iter()
                    .map(|&i| TxnOp::put(records[i].0, records[i].1.to_vec(), opts.clone()))
                    .collect::<Vec<_>>(),
            )
            .or_else(
                pending
                    .iter()
                    .map(|&i| TxnOp::get(records[i].0, Some(GetOptions::new().with_count_only())))
                    .collect::<Vec<_>>(),
            );
        let resp = client.txn(txn).await?;
        if resp.succeeded() {
            for &i in &pending {
                written[i] = true;
            }
            break;
        }
        let exists: Vec<bool> = resp
            .op_responses()
            .iter()
            .map(|r| matches!(r, etcd_client::TxnOpResponse::Get(g) if g.count() > 0))
            .collect();
        let before = pending.len();
        pending = pending
            .into_iter()
            .zip(exists.iter().copied().chain(std::iter::repeat(false)))
            .filter_map(|(i, e)| (!e).then_some(i))
            .collect();
        if pending.len() == before {
            // Not possible from a conforming etcd (the compare failed, so some key exists);
            // finish one key at a time rather than loop.
            for &i in &pending {
                written[i] = create_if_absent(client, records[i].0, records[i].1.to_vec(), lease).await?;
            }
            break;
        }
    }
    Ok(written)
}

/// Writes a down certificate: created if absent, or written over a `source: coordinator` one
/// (a coordinator only knows that a lease expired; any other writer knows more). The
/// coordinator's `observed_revision` is kept so the death's order stays what it was.
/// Returns whether it was written.
pub async fn put_certificate(
    client: &mut Client,
    key: &str,
    down: &rootrank_core::RankDown,
    lease: Option<i64>,
) -> Result<bool, etcd_client::Error> {
    // A RankDown of strings and integers always serializes; were it ever not to, the write is
    // refused as invalid (never an empty value in etcd).
    let encode = |d: &rootrank_core::RankDown| {
        serde_json::to_vec(d).map_err(|e| etcd_client::Error::InvalidArgs(format!("down certificate: {e}")))
    };
    if create_if_absent(client, key, encode(down)?, lease).await? {
        return Ok(true);
    }
    if down.source == rootrank_core::DownSource::Coordinator {
        return Ok(false);
    }
    let existing = client.get(key, None).await?;
    let Some(kv) = existing.kvs().first() else {
        return Ok(false);
    };
    let Ok(prev) = rootrank_core::RankDown::parse(kv.value()) else {
        return Ok(false);
    };
    if prev.source != rootrank_core::DownSource::Coordinator {
        return Ok(false); // first specific certificate wins
    }
    let mut refined = down.clone();
    refined.observed_revision = refined.observed_revision.or(prev.observed_revision);
    refined.registered_revision = refined.registered_revision.or(prev.registered_revision);
    // The death happened no later than the coordinator saw its live key vanish.
    let earlier = |a: &str, b: &str| match (rootrank_core::time::parse_ms(a), rootrank_core::time::parse_ms(b)) {
        (Some(x), Some(y)) if y < x => b.to_string(),
        _ => a.to_string(),
    };
    refined.at = match (refined.at.take(), prev.at) {
        (Some(a), Some(b)) => Some(earlier(&a, &b)),
        (a, b) => a.or(b),
    };
    let opts = lease.map(|l| PutOptions::new().with_lease(l));
    let txn = Txn::new()
        .when([Compare::mod_revision(key, CompareOp::Equal, kv.mod_revision())])
        .and_then([TxnOp::put(key, encode(&refined)?, opts)]);
    Ok(client.txn(txn).await?.succeeded())
}

/// Rotating retention leases. Each lease is granted with TTL `retention + rotation` and used
/// for the records written during one `rotation` period, so every record lives between
/// `retention` and `retention + rotation` after it was written, and a writer holds at most
/// `retention / rotation + 1` leases. Nothing keeps them alive: expiry is the point.
#[derive(Debug)]
pub struct RetentionLeases {
    retention: Duration,
    rotation: Duration,
    current: Option<(i64, Instant)>,
}

impl RetentionLeases {
    pub fn new(retention: Duration) -> Self {
        // A tenth of the window, at least a second: few leases, little overshoot.
        let rotation = (retention / 10).max(Duration::from_secs(1));
        RetentionLeases {
            retention,
            rotation,
            current: None,
        }
    }

    /// The lease to attach a record to now.
    pub async fn lease(&mut self, client: &mut Client) -> Result<i64, etcd_client::Error> {
        if let Some((id, granted)) = self.current {
            if granted.elapsed() < self.rotation {
                return Ok(id);
            }
        }
        let ttl = (self.retention + self.rotation).as_secs().max(1) as i64;
        let id = client.lease_grant(ttl, None).await?.id();
        self.current = Some((id, Instant::now()));
        Ok(id)
    }

    /// Forget the current lease (e.g. etcd said it does not exist any more).
    pub fn invalidate(&mut self) {
        self.current = None;
    }
}

/// Whether an etcd error says a lease is gone (expired, revoked, or etcd lost it): etcd's
/// `ErrGRPCLeaseNotFound`, gRPC `NotFound` (the only `NotFound` the calls we make return).
pub fn is_lease_not_found(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.code() == tonic::Code::NotFound)
}

/// Whether an etcd error says the revision asked for was compacted: etcd's `ErrGRPCCompacted`,
/// gRPC `OutOfRange`.
pub fn is_compacted(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.code() == tonic::Code::OutOfRange)
}

/// The smallest key greater than every key with this prefix.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Exponential backoff with jitter, capped. `next()` gives the next pause.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    current: Duration,
    seed: u64,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self::with_seed(base, cap, os_random_seed())
    }

    /// A fixed seed, for tests that need the same pauses twice.
    pub fn with_seed(base: Duration, cap: Duration, seed: u64) -> Self {
        // xorshift never leaves 0.
        let seed = if seed == 0 { 0x9e37_79b9_7f4a_7c15 } else { seed };
        Backoff {
            base,
            cap,
            current: base,
            seed,
        }
    }
    pub fn reset(&mut self) {
        self.current = self.base;
    }
    pub fn next_pause(&mut self) -> Duration {
        // xorshift: jitter so that many agents do not retry in lockstep after an etcd restart.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let pause = self.current;
        self.current = (self.current * 2).min(self.cap);
        let jitter = pause.as_millis() as u64 / 4;
        let j = if jitter > 0 { self.seed % jitter } else { 0 };
        pause + Duration::from_millis(j)
    }
}

/// `now + after`, saturating: a timeout too large for an `Instant` (a caller's `u64::MAX` ms,
/// a Python `1e12` s) means "a century from now", never a panic in someone else's process.
pub fn deadline_after(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

/// 64 random bits from the OS (the keys std's `RandomState` draws from it), mixed with the pid
/// and the wall clock: ranks in containers with equal pids, started together, still retry
/// out of step.
fn os_random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_i64(unix_ms());
    h.finish()
}

/// The clock observations are stamped with (when a revision was applied) and windows are
/// measured on (SPEC v4 section 4): monotonic, so a wall-clock step (NTP, an operator's
/// `date -s`) neither opens nor closes a window, and anchored at the wall clock of its first
/// reading, so its stamps read as times for people.
pub fn monotonic_ms() -> i64 {
    static ANCHOR: std::sync::OnceLock<(std::time::Instant, i64)> = std::sync::OnceLock::new();
    let (start, wall) = ANCHOR.get_or_init(|| (std::time::Instant::now(), unix_ms()));
    wall.saturating_add(i64::try_from(start.elapsed().as_millis()).unwrap_or(i64::MAX))
}

/// Milliseconds since the Unix epoch, for `at` fields (which are for people). The shells
/// read the clock; the core never does.
pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_is_exclusive_upper_bound() {
        assert_eq!(prefix_end(b"/rootrank/v1/"), b"/rootrank/v10".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
    }

    #[test]
    fn a_deadline_of_any_size_is_safe() {
        assert!(deadline_after(Duration::MAX) > Instant::now() + Duration::from_secs(86_400));
        assert!(deadline_after(Duration::from_secs(u64::MAX / 2)) > Instant::now());
        assert!(deadline_after(Duration::ZERO) <= Instant::now());
    }

    #[test]
    fn backoff_grows_to_its_cap() {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(100));
        let pauses: Vec<_> = (0..8).map(|_| b.next_pause()).collect();
        assert!(pauses[0] >= Duration::from_millis(10) && pauses[0] < Duration::from_millis(13));
        assert!(pauses[7] >= Duration::from_millis(100) && pauses[7] <= Duration::from_millis(125));
    }

    /// Two writers started at the same instant in processes with the same pid (containers)
    /// must not retry in lockstep: the jitter comes from the OS, not from the pid and clock.
    #[test]
    fn backoffs_created_together_jitter_apart() {
        let wide = |b: &mut Backoff| (0..4).map(|_| b.next_pause()).collect::<Vec<_>>();
        let base = Duration::from_secs(1000); // jitter range 250 s: a tie is a 1-in-250,000 event
        let (mut a, mut b) = (Backoff::new(base, base), Backoff::new(base, base));
        assert_ne!(wide(&mut a), wide(&mut b));
        let (mut c, mut d) = (Backoff::with_seed(base, base, 7), Backoff::with_seed(base, base, 7));
        assert_eq!(wide(&mut c), wide(&mut d));
    }
}
