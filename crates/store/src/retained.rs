//! Writing retained values (room records, down certificates) until etcd takes them: on a
//! rotating retention lease, through a client that connects lazily and reconnects, with
//! backoff between attempts. The agent, the coordinator and the node watchdog all write this
//! way, so it lives here once.

use std::time::{Duration, Instant};

use etcd_client::Client;
use rootrank_core::RankDown;
use tracing::{debug, error, warn};

use crate::{Backoff, RetentionLeases, StoreError};

/// A client that connects on first use, so a writer started while etcd is down still writes
/// once it is back. etcd-client reconnects a connected client by itself.
pub struct LazyClient {
    access: crate::EtcdAccess,
    client: Option<Client>,
}

impl LazyClient {
    pub fn new(access: crate::EtcdAccess) -> Self {
        LazyClient { access, client: None }
    }

    /// Starts from an already connected client.
    pub fn connected(access: crate::EtcdAccess, client: Client) -> Self {
        LazyClient {
            access,
            client: Some(client),
        }
    }

    pub fn access(&self) -> &crate::EtcdAccess {
        &self.access
    }

    /// The client, connecting first if needed.
    pub async fn client(&mut self) -> Result<&mut Client, StoreError> {
        if self.client.is_none() {
            self.client = Some(crate::connect(&self.access).await?);
        }
        self.client.as_mut().ok_or(StoreError::NoEndpoints)
    }
}

/// What to write.
#[derive(Debug, Clone, Copy)]
pub enum Retained<'a> {
    /// A room failure record: created once per key, the first one wins.
    Record { key: &'a str, value: &'a [u8] },
    /// A down certificate: created once, or over a coordinator's (see [`crate::put_certificate`]).
    Certificate { key: &'a str, down: &'a RankDown },
}

impl Retained<'_> {
    /// For people reading logs.
    fn kind(&self) -> &'static str {
        match self {
            Retained::Record { .. } => "room failure record",
            Retained::Certificate { .. } => "down certificate",
        }
    }

    fn key(&self) -> &str {
        match self {
            Retained::Record { key, .. } | Retained::Certificate { key, .. } => key,
        }
    }
}

/// How a write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The value is now the one at the key.
    Yes,
    /// Another value was there first and stays (first record or specific certificate wins).
    AlreadyThere,
    /// The deadline passed with etcd unreachable.
    GaveUp,
    /// etcd refused this value for good (too large, malformed request): retrying cannot
    /// help, so the writer moves on and the caller drops and counts it.
    Rejected,
}

impl Written {
    /// A create-if-absent that etcd answered: `created` is whether this value was put.
    fn from_created(created: bool) -> Written {
        if created {
            Written::Yes
        } else {
            Written::AlreadyThere
        }
    }
}

/// Why one attempt failed: worth retrying, or never going to succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// etcd unreachable, leaderless, restarting, timing out, or a lease that vanished.
    #[error("etcd did not take the write yet: {0}")]
    Transient(String),
    /// etcd answered that this request is invalid (e.g. larger than its request limit).
    #[error("etcd rejected the write for good: {0}")]
    Permanent(String),
    /// etcd refused who we are (TLS, auth, a role without this key): retried, since an
    /// operator can fix it, but said at once and loudly.
    #[error("etcd refused the write ({identity}): {refusal}")]
    Refused { identity: String, refusal: crate::Refusal },
}

impl WriteError {
    /// gRPC `InvalidArgument`, `OutOfRange`, `Unimplemented`, and a message over the gRPC size
    /// limit are answers about the request itself; everything else may pass on a retry
    /// (including `ResourceExhausted` for a full etcd, which an operator can mend).
    pub fn classify(e: &etcd_client::Error, access: &crate::EtcdAccess) -> WriteError {
        use etcd_client::Error as E;
        if let Some(refusal) = crate::Refusal::of(e) {
            return WriteError::Refused {
                identity: access.identity(),
                refusal,
            };
        }
        let message = e.to_string();
        let permanent = match e {
            E::GRpcStatus(status) => {
                use tonic::Code;
                matches!(
                    status.code(),
                    Code::InvalidArgument | Code::OutOfRange | Code::Unimplemented
                ) || (status.code() == Code::ResourceExhausted && status.message().contains("message larger than max"))
            }
            E::InvalidArgs(_) | E::InvalidUri(_) | E::InvalidMetadataValue(_) | E::Utf8Error(_) => true,
            _ => false,
        };
        if permanent {
            WriteError::Permanent(message)
        } else {
            WriteError::Transient(message)
        }
    }
}

/// What a writer says while etcd's database is full.
pub const NOSPACE: &str = "etcd database space exceeded: etcd raised its NOSPACE alarm and refuses every write; free space (compact and defragment etcd, or raise --quota-backend-bytes) and run `etcdctl alarm disarm`";

/// Transactions [`RetainedWriter::write_records`] keeps in flight at once.
const IN_FLIGHT: usize = 8;

/// True when no key appears twice in `records`.
fn distinct_keys(records: &[(&str, &[u8])]) -> bool {
    let mut seen = std::collections::HashSet::with_capacity(records.len());
    records.iter().all(|(k, _)| seen.insert(*k))
}

/// Writes retained values, retrying each until etcd takes it. See the module docs.
pub struct RetainedWriter {
    etcd: LazyClient,
    retention: RetentionLeases,
    backoff: Backoff,
    /// Shared with whoever shows it (an agent's stats), so it counts while a write still retries.
    retries: std::sync::Arc<std::sync::atomic::AtomicU64>,
    rejected: u64,
    /// The refusal said last (said once until a write gets through or it changes).
    refused: Option<String>,
    /// Told of every change of `refused` (an agent shows it to its host while it lasts).
    on_refused: Option<RefusalSink>,
}

/// See [`RetainedWriter::on_refused`].
pub type RefusalSink = std::sync::Arc<dyn Fn(Option<String>) + Send + Sync>;

impl RetainedWriter {
    pub fn new(etcd: LazyClient, retention: Duration) -> Self {
        RetainedWriter {
            etcd,
            retention: RetentionLeases::new(retention),
            backoff: Backoff::new(Duration::from_millis(20), Duration::from_secs(1)),
            retries: Default::default(),
            rejected: 0,
            refused: None,
            on_refused: None,
        }
    }

    /// Calls `sink` when etcd starts refusing our writes (with why) and when it takes one again.
    pub fn on_refused(mut self, sink: RefusalSink) -> Self {
        self.on_refused = Some(sink);
        self
    }

    fn set_refused(&mut self, now: Option<String>) {
        if self.refused != now {
            if let Some(sink) = &self.on_refused {
                sink(now.clone());
            }
            self.refused = now;
        }
    }

    /// Why etcd refuses our writes, while it does (TLS, auth or permission).
    pub fn refused(&self) -> Option<&str> {
        self.refused.as_deref()
    }

    /// Failed attempts so far (each was retried).
    pub fn retries(&self) -> u64 {
        self.retries.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts retries in `counter` (an agent's stats), live, not once a write is through.
    pub fn count_retries_in(mut self, counter: std::sync::Arc<std::sync::atomic::AtomicU64>) -> Self {
        self.retries = counter;
        self
    }

    /// Values etcd rejected for good (dropped).
    pub fn rejected(&self) -> u64 {
        self.rejected
    }

    /// Grants the first retention lease ahead of time, so the first write costs one etcd
    /// round trip instead of two. Best effort.
    pub async fn warm_up(&mut self) {
        if let Ok(c) = self.etcd.client().await {
            if let Err(e) = self.retention.lease(c).await {
                debug!(error = %e, "could not grant a retention lease yet");
            }
        }
    }

    /// A client and the current retention lease, for one attempt.
    async fn ready(&mut self) -> Result<(&mut Client, i64), WriteError> {
        let access = self.etcd.access().clone();
        let c = self.etcd.client().await.map_err(|e| match e {
            StoreError::Refused { identity, refusal, .. } => WriteError::Refused { identity, refusal },
            other => WriteError::Transient(other.to_string()),
        })?;
        let lease = self
            .retention
            .lease(c)
            .await
            .map_err(|e| WriteError::classify(&e, &access))?;
        Ok((c, lease))
    }

    /// What an attempt's etcd error means for the next one.
    fn failed(&mut self, e: &etcd_client::Error) -> WriteError {
        if crate::is_lease_not_found(e) {
            // etcd lost or expired the lease (e.g. it was down longer than the lease's TTL).
            self.retention.invalidate();
        }
        WriteError::classify(e, self.etcd.access())
    }

    async fn attempt(&mut self, what: Retained<'_>) -> Result<bool, WriteError> {
        let (c, lease) = self.ready().await?;
        let res = match what {
            Retained::Record { key, value } => crate::create_if_absent(c, key, value.to_vec(), Some(lease)).await,
            Retained::Certificate { key, down } => crate::put_certificate(c, key, down, Some(lease)).await,
        };
        res.map_err(|e| self.failed(&e))
    }

    async fn attempt_records(&mut self, records: &[(&str, &[u8])]) -> Result<Vec<bool>, WriteError> {
        let (c, lease) = self.ready().await?;
        let res = crate::create_all_if_absent(c, records, Some(lease)).await;
        res.map_err(|e| self.failed(&e))
    }

    /// Counts a transient failure (said loudly at the third in a row), then sleeps the
    /// backoff; false when `deadline` would pass first.
    async fn retry_after(
        &mut self,
        attempts: &mut u32,
        e: &WriteError,
        what: &str,
        key: &str,
        deadline: Option<Instant>,
    ) -> bool {
        *attempts += 1;
        self.retries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if e.to_string().contains("database space exceeded") {
            // etcd's NOSPACE alarm: nothing is written until an operator acts. Said once, and
            // shown to the host like a refusal, until a write gets through.
            if self.refused.as_deref() != Some(NOSPACE) {
                error!(key, "{what}: {NOSPACE}; retrying quietly");
                self.set_refused(Some(NOSPACE.to_string()));
            }
        } else if let WriteError::Refused { .. } = e {
            let text = e.to_string();
            if self.refused.as_deref() != Some(text.as_str()) {
                error!(error = %e, key, "{what} refused by etcd; retrying quietly until an operator fixes the credentials or role");
                self.set_refused(Some(text));
            }
        } else if *attempts == 3 {
            warn!(error = %e, key, "{what} not written yet; retrying until etcd takes it");
        } else {
            debug!(error = %e, key, "{what} not written yet; retrying");
        }
        let pause = self.backoff.next_pause();
        if deadline.is_some_and(|d| crate::deadline_after(pause) > d) {
            return false;
        }
        tokio::time::sleep(pause).await;
        true
    }

    /// Writes room records `(key, value)` in order, in as few etcd transactions as
    /// [`crate::MAX_BATCH_RECORDS`] and [`crate::MAX_BATCH_BYTES`] allow, with the guarantees
    /// of one [`Retained::Record`] write each: create-if-absent per key (the first value of a
    /// key wins, also within the batch), on the retention lease, retried until etcd takes it
    /// or `deadline` passes. A batch etcd rejects for good (an etcd run with a lower
    /// `--max-txn-ops` or request size) is split in halves, down to single records, so only a
    /// bad record itself is [`Written::Rejected`]. Returns one outcome per record.
    pub async fn write_records(&mut self, records: &[(&str, &[u8])], deadline: Option<Instant>) -> Vec<Written> {
        let mut out = Vec::with_capacity(records.len());
        // Ranges still to write, front first, so records keep their order.
        let mut todo = std::collections::VecDeque::new();
        let mut start = 0;
        while start < records.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < records.len()
                && end - start < crate::MAX_BATCH_RECORDS
                && (end == start || bytes + records[end].1.len() <= crate::MAX_BATCH_BYTES)
            {
                bytes += records[end].1.len();
                end += 1;
            }
            todo.push_back(start..end);
            start = end;
        }
        // Several transactions in flight at once (etcd folds concurrent proposals into one raft
        // round), so a 100,000-record batch does not wait 800 round trips end to end. Only
        // when no key repeats: a later value applied first would win over an earlier one.
        // What this pass does not write goes through the careful path below, in order.
        let first_pass = if todo.len() > 1 && distinct_keys(records) {
            self.write_in_flight(records, &todo).await
        } else {
            Vec::new()
        };
        // Each range with what the first pass wrote of it (`None`: still to write). The
        // halves of a batch split below have none, so they never take another batch's answer.
        let mut todo: std::collections::VecDeque<_> = todo
            .into_iter()
            .zip(first_pass.into_iter().chain(std::iter::repeat(None)))
            .collect();
        while let Some((range, written)) = todo.pop_front() {
            if let Some(created) = written {
                out.extend(created.into_iter().map(Written::from_created));
                continue;
            }
            let batch = &records[range.clone()];
            if let [(key, value)] = batch {
                out.push(self.write(Retained::Record { key, value }, deadline).await);
                continue;
            }
            match self.write_batch(batch, deadline).await {
                Some(written) => out.extend(written),
                None => {
                    let mid = range.start + batch.len() / 2;
                    todo.push_front((mid..range.end, None));
                    todo.push_front((range.start..mid, None));
                }
            }
        }
        out
    }

    /// One attempt at each batch of `ranges`, [`IN_FLIGHT`] at a time, in order: what etcd
    /// took, or `None` for a batch to write again the careful way (retried, split if refused).
    /// A pass that finds etcd unreachable tries nothing.
    async fn write_in_flight(
        &mut self,
        records: &[(&str, &[u8])],
        ranges: &std::collections::VecDeque<std::ops::Range<usize>>,
    ) -> Vec<Option<Vec<bool>>> {
        use futures_util::stream::{self, StreamExt};
        let Ok((c, lease)) = self.ready().await else {
            return Vec::new();
        };
        let client = c.clone();
        let results: Vec<Result<Vec<bool>, etcd_client::Error>> = stream::iter(ranges.iter().cloned())
            .map(|range| {
                let mut c = client.clone();
                async move { crate::create_all_if_absent(&mut c, &records[range], Some(lease)).await }
            })
            .buffered(IN_FLIGHT)
            .collect()
            .await;
        results
            .into_iter()
            .map(|r| match r {
                Ok(written) => Some(written),
                Err(e) => {
                    // Only what it means for the lease; the careful path counts and says it.
                    let _ = self.failed(&e);
                    None
                }
            })
            .collect()
    }

    /// One batch until etcd takes it; `None` when etcd rejected it for good.
    async fn write_batch(&mut self, batch: &[(&str, &[u8])], deadline: Option<Instant>) -> Option<Vec<Written>> {
        let mut attempts = 0u32;
        loop {
            match self.attempt_records(batch).await {
                Ok(written) => {
                    self.backoff.reset();
                    self.set_refused(None);
                    return Some(written.into_iter().map(Written::from_created).collect());
                }
                Err(WriteError::Permanent(e)) => {
                    debug!(error = %e, records = batch.len(), "batch rejected by etcd; splitting it");
                    return None;
                }
                Err(e) => {
                    let what = format!("batch of {} records", batch.len());
                    if !self
                        .retry_after(
                            &mut attempts,
                            &e,
                            &what,
                            batch.first().map_or("", |(k, _)| *k),
                            deadline,
                        )
                        .await
                    {
                        return Some(vec![Written::GaveUp; batch.len()]);
                    }
                }
            }
        }
    }

    /// Writes `what`, retrying transient failures until etcd takes it or `deadline` passes
    /// (`None`: forever). A permanent rejection returns [`Written::Rejected`] at once, so one
    /// bad value never blocks the values queued behind it.
    pub async fn write(&mut self, what: Retained<'_>, deadline: Option<Instant>) -> Written {
        let mut attempts = 0u32;
        loop {
            match self.attempt(what).await {
                Ok(written) => {
                    self.backoff.reset();
                    self.set_refused(None);
                    return Written::from_created(written);
                }
                Err(e @ WriteError::Permanent(_)) => {
                    // Logged once per writer: the first says what is wrong, the count says how often.
                    if self.rejected == 0 {
                        warn!(error = %e, key = what.key(), "{} rejected by etcd and dropped (later rejections are only counted)", what.kind());
                    } else {
                        debug!(error = %e, key = what.key(), "{} rejected by etcd and dropped", what.kind());
                    }
                    self.rejected += 1;
                    return Written::Rejected;
                }
                Err(e) => {
                    if !self
                        .retry_after(&mut attempts, &e, what.kind(), what.key(), deadline)
                        .await
                    {
                        return Written::GaveUp;
                    }
                }
            }
        }
    }
}
