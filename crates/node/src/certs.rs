//! Writing down certificates: the store's retained writer (rotating retention leases, never a
//! liveness lease, so they outlive the dead rank; create-if-absent or over a coordinator
//! certificate; retried with backoff until etcd takes them), keyed by the certificate.

use std::time::{Duration, Instant};

use rootrank_core::{Keys, RankDown};
pub(crate) use rootrank_store::{LazyClient as Etcd, Written};
use rootrank_store::{Retained, RetainedWriter};

pub(crate) struct CertWriter {
    inner: RetainedWriter,
    keys: Keys,
}

impl CertWriter {
    pub(crate) fn new(etcd: rootrank_store::EtcdAccess, prefix: &str, retention: Duration) -> Self {
        CertWriter {
            inner: RetainedWriter::new(Etcd::new(etcd), retention),
            keys: Keys::new(prefix),
        }
    }

    /// Grants the first retention lease ahead of time (best effort).
    pub(crate) async fn warm_up(&mut self) {
        self.inner.warm_up().await;
    }

    /// Writes `down`, retrying until etcd takes it or `deadline` passes (`None`: forever).
    /// `Written::AlreadyThere`: a specific certificate was there first (the agent's, the
    /// supervisor's, or ours from before a restart) and stays, as the contract says.
    pub(crate) async fn write(&mut self, down: &RankDown, deadline: Option<Instant>) -> Written {
        let key = self.keys.down(&down.group, down.rank, down.incarnation);
        self.inner
            .write(Retained::Certificate { key: &key, down }, deadline)
            .await
    }
}
