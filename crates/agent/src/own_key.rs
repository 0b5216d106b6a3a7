//! The agent's watch on its own live key (v5).
//!
//! `rootrank node-watch --host-lease-ttl-ms` may move a rank's live key onto its host's lease
//! (the record then names the rank's own lease as its `incarnation`): the agent must see that,
//! to stop keeping its own lease alive and to put its stall record and attachments on the host
//! lease; and when that lease runs out (node-watch stopped) or anyone deletes the key, it
//! must register again at once, before the coordinator's hold on the vanished key ends.

use std::time::Duration;

use rootrank_core::RankLive;
use rootrank_store::etcd_client::{Client, EventType, WatchOptions, WatchStream};
use rootrank_store::Backoff;
use tracing::debug;

/// What became of this incarnation's live key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyChange {
    /// It is this incarnation's and rides on this lease (its own, or its host's).
    OnLease(i64),
    /// It was deleted, or now holds another incarnation's record.
    Gone,
}

/// A watch on one live key from one revision on, re-opened from the last revision seen + 1
/// when it breaks; after a compaction the key is read instead.
pub(crate) struct OwnKeyWatch {
    key: String,
    /// The incarnation's own lease.
    own: i64,
    next_revision: i64,
    stream: Option<WatchStream>,
    backoff: Backoff,
}

impl OwnKeyWatch {
    pub(crate) fn new(key: String, own: i64, registered_revision: i64) -> Self {
        OwnKeyWatch {
            key,
            own,
            next_revision: registered_revision + 1,
            stream: None,
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_secs(2)),
        }
    }

    /// Whether a value on `lease` is this incarnation's.
    fn ours(&self, value: &[u8], lease: i64) -> bool {
        match RankLive::parse(value) {
            Ok(r) => r.incarnation_on(lease).is_ok_and(|i| i.lease_id() == self.own),
            Err(_) => false,
        }
    }

    /// The next change to the key. Cancel-safe between awaits: a dropped call loses at most
    /// a watch being opened, which the next call opens again.
    pub(crate) async fn next(&mut self, client: &mut Client) -> KeyChange {
        loop {
            let Some(stream) = self.stream.as_mut() else {
                let opts = WatchOptions::new().with_start_revision(self.next_revision);
                match tokio::time::timeout(
                    rootrank_store::REQUEST_TIMEOUT,
                    client.watch(self.key.as_str(), Some(opts)),
                )
                .await
                {
                    Ok(Ok(s)) => self.stream = Some(s),
                    other => {
                        debug!(?other, "could not open the watch on this rank's live key; retrying");
                        tokio::time::sleep(self.backoff.next_pause()).await;
                    }
                }
                continue;
            };
            let msg = match stream.message().await {
                Ok(Some(m)) => m,
                other => {
                    debug!(?other, "the watch on this rank's live key ended; re-opening");
                    self.stream = None;
                    tokio::time::sleep(self.backoff.next_pause()).await;
                    continue;
                }
            };
            self.backoff.reset();
            if msg.canceled() || msg.compact_revision() > 0 {
                // Compacted past what we saw: read the key as it is now.
                self.stream = None;
                return self.read(client).await;
            }
            let mut last = None;
            for ev in msg.events() {
                let Some(kv) = ev.kv() else { continue };
                self.next_revision = kv.mod_revision() + 1;
                last = Some(match ev.event_type() {
                    EventType::Delete => KeyChange::Gone,
                    EventType::Put if self.ours(kv.value(), kv.lease()) => KeyChange::OnLease(kv.lease()),
                    EventType::Put => KeyChange::Gone,
                });
            }
            if let Some(change) = last {
                return change;
            }
        }
    }

    /// The key as etcd holds it now (after a compaction), retried until etcd answers.
    async fn read(&mut self, client: &mut Client) -> KeyChange {
        loop {
            match tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, client.get(self.key.as_str(), None)).await {
                Ok(Ok(resp)) => {
                    if let Some(h) = resp.header() {
                        self.next_revision = h.revision() + 1;
                    }
                    return match resp.kvs().first() {
                        Some(kv) if self.ours(kv.value(), kv.lease()) => KeyChange::OnLease(kv.lease()),
                        _ => KeyChange::Gone,
                    };
                }
                other => {
                    debug!(?other, "could not read this rank's live key; retrying");
                    tokio::time::sleep(self.backoff.next_pause()).await;
                }
            }
        }
    }
}
