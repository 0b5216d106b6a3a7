//! Writing down certificates: on rotating retention leases (never a liveness lease, so they
//! outlive the dead rank), create-if-absent or over a coordinator certificate, retried with
//! backoff until etcd takes them.

use std::time::{Duration, Instant};

use rootrank_core::{Keys, RankDown};
use rootrank_store::etcd_client::Client;
use rootrank_store::{Backoff, RetentionLeases};
use tracing::{debug, warn};

/// A client that connects lazily and reconnects after failures, so a writer started while
/// etcd is down still writes once it is back.
pub(crate) struct Etcd {
    endpoints: Vec<String>,
    client: Option<Client>,
}

impl Etcd {
    pub(crate) fn new(endpoints: Vec<String>) -> Self {
        Etcd {
            endpoints,
            client: None,
        }
    }

    /// The client, connecting first if needed.
    pub(crate) async fn client(&mut self) -> Result<&mut Client, rootrank_store::StoreError> {
        if self.client.is_none() {
            self.client = Some(rootrank_store::connect(&self.endpoints).await?);
        }
        match self.client.as_mut() {
            Some(c) => Ok(c),
            None => Err(rootrank_store::StoreError::NoEndpoints),
        }
    }
}

pub(crate) struct CertWriter {
    etcd: Etcd,
    keys: Keys,
    retention: RetentionLeases,
    backoff: Backoff,
}

/// How a write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    /// This certificate is now the one at the key.
    Yes,
    /// A specific certificate was already there (the agent's, the supervisor's, or ours
    /// from before a restart): it stays, as the contract says the first one wins.
    AlreadyCertified,
    /// The deadline passed with etcd unreachable.
    GaveUp,
}

impl CertWriter {
    pub(crate) fn new(endpoints: Vec<String>, prefix: &str, retention: Duration) -> Self {
        CertWriter {
            etcd: Etcd::new(endpoints),
            keys: Keys::new(prefix),
            retention: RetentionLeases::new(retention),
            backoff: Backoff::new(Duration::from_millis(20), Duration::from_secs(1)),
        }
    }

    /// Grants the first retention lease ahead of time, so the first death costs one etcd
    /// round trip instead of two. Best effort.
    pub(crate) async fn warm_up(&mut self) {
        if let Ok(c) = self.etcd.client().await {
            if let Err(e) = self.retention.lease(c).await {
                debug!(error = %e, "could not grant a retention lease yet");
            }
        }
    }

    /// Writes `down`, retrying until etcd takes it or `deadline` passes (`None`: forever).
    pub(crate) async fn write(&mut self, down: &RankDown, deadline: Option<Instant>) -> Written {
        let key = self.keys.down(&down.group, down.rank, down.incarnation);
        let mut attempts = 0u32;
        loop {
            let res = match self.etcd.client().await {
                Ok(c) => match self.retention.lease(c).await {
                    Ok(lease) => rootrank_store::put_certificate(c, &key, down, Some(lease))
                        .await
                        .map_err(|e| {
                            if rootrank_store::is_lease_not_found(&e) {
                                self.retention.invalidate();
                            }
                            e.to_string()
                        }),
                    Err(e) => Err(e.to_string()),
                },
                Err(e) => Err(e.to_string()),
            };
            match res {
                Ok(true) => {
                    self.backoff.reset();
                    return Written::Yes;
                }
                Ok(false) => {
                    self.backoff.reset();
                    return Written::AlreadyCertified;
                }
                Err(e) => {
                    attempts += 1;
                    if attempts == 3 {
                        warn!(error = %e, key, "down certificate not written yet; retrying until etcd takes it");
                    } else {
                        debug!(error = %e, key, "down certificate not written yet; retrying");
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
