//! Writing retained values (room records, down certificates) until etcd takes them: on a
//! rotating retention lease, through a client that connects lazily and reconnects, with
//! backoff between attempts. The agent, the coordinator and the node watchdog all write this
//! way, so it lives here once.

use std::time::{Duration, Instant};

use etcd_client::Client;
use rootrank_core::RankDown;
use tracing::{debug, warn};

use crate::{Backoff, RetentionLeases, StoreError};

/// A client that connects on first use, so a writer started while etcd is down still writes
/// once it is back. etcd-client reconnects a connected client by itself.
pub struct LazyClient {
    endpoints: Vec<String>,
    client: Option<Client>,
}

impl LazyClient {
    pub fn new(endpoints: Vec<String>) -> Self {
        LazyClient {
            endpoints,
            client: None,
        }
    }

    /// Starts from an already connected client.
    pub fn connected(endpoints: Vec<String>, client: Client) -> Self {
        LazyClient {
            endpoints,
            client: Some(client),
        }
    }

    /// The client, connecting first if needed.
    pub async fn client(&mut self) -> Result<&mut Client, StoreError> {
        if self.client.is_none() {
            self.client = Some(crate::connect(&self.endpoints).await?);
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
}

/// Writes retained values, retrying each until etcd takes it. See the module docs.
pub struct RetainedWriter {
    etcd: LazyClient,
    retention: RetentionLeases,
    backoff: Backoff,
    retries: u64,
}

impl RetainedWriter {
    pub fn new(etcd: LazyClient, retention: Duration) -> Self {
        RetainedWriter {
            etcd,
            retention: RetentionLeases::new(retention),
            backoff: Backoff::new(Duration::from_millis(20), Duration::from_secs(1)),
            retries: 0,
        }
    }

    /// Failed attempts so far (each was retried).
    pub fn retries(&self) -> u64 {
        self.retries
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

    async fn attempt(&mut self, what: Retained<'_>) -> Result<bool, String> {
        let c = self.etcd.client().await.map_err(|e| e.to_string())?;
        let lease = self.retention.lease(c).await.map_err(|e| e.to_string())?;
        let res = match what {
            Retained::Record { key, value } => crate::create_if_absent(c, key, value.to_vec(), Some(lease)).await,
            Retained::Certificate { key, down } => crate::put_certificate(c, key, down, Some(lease)).await,
        };
        res.map_err(|e| {
            if crate::is_lease_not_found(&e) {
                // etcd lost or expired the lease (e.g. it was down longer than the lease's TTL).
                self.retention.invalidate();
            }
            e.to_string()
        })
    }

    /// Writes `what`, retrying until etcd takes it or `deadline` passes (`None`: forever).
    pub async fn write(&mut self, what: Retained<'_>, deadline: Option<Instant>) -> Written {
        let mut attempts = 0u32;
        loop {
            match self.attempt(what).await {
                Ok(written) => {
                    self.backoff.reset();
                    return if written { Written::Yes } else { Written::AlreadyThere };
                }
                Err(e) => {
                    attempts += 1;
                    self.retries += 1;
                    if attempts == 3 {
                        warn!(error = %e, key = what.key(), "{} not written yet; retrying until etcd takes it", what.kind());
                    } else {
                        debug!(error = %e, key = what.key(), "{} not written yet; retrying", what.kind());
                    }
                }
            }
            let pause = self.backoff.next_pause();
            if deadline.is_some_and(|d| Instant::now() + pause > d) {
                return Written::GaveUp;
            }
            tokio::time::sleep(pause).await;
        }
    }
}
