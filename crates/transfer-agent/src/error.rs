//! Typed errors of a rank's transfer agent.

use rootrank_agent::AgentError;
use rootrank_core::Peer;
use rootrank_store::StoreError;
use rootrank_transfer::TransferError;

/// What stopped the transfer agent; every message says what to check.
#[derive(Debug, thiserror::Error)]
pub enum TransferAgentError {
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("etcd request failed: {0}")]
    Etcd(#[from] rootrank_store::etcd_client::Error),
    #[error("could not start a runtime or thread: {0}")]
    Io(#[from] std::io::Error),
    #[error("{group} rank {rank} did not register with etcd within {secs} s: is etcd reachable at {endpoints}?")]
    NotRegistered {
        group: String,
        rank: u32,
        secs: u64,
        endpoints: String,
    },
    #[error("peer {group} rank {rank} published no NIXL metadata at {key} within {waited_ms} ms: is that rank running, with the same --prefix?")]
    PeerMissing {
        group: String,
        rank: u32,
        key: String,
        waited_ms: u64,
    },
    #[error("peer {group} rank {rank}: unusable NIXL record at {key}: {detail}")]
    BadPeerRecord {
        group: String,
        rank: u32,
        key: String,
        detail: String,
    },
    #[error("peer {group} rank {rank} has no region {index} (it published {count})")]
    NoSuchRegion {
        group: String,
        rank: u32,
        index: usize,
        count: usize,
    },
    #[error("could not encode this rank's NIXL record: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("peer group {group:?} is not a valid group id: {source}")]
    BadPeerGroup {
        group: String,
        #[source]
        source: rootrank_core::IdError,
    },
    #[error("etcd did not answer a read of {key} within {waited_ms} ms: is etcd reachable?")]
    EtcdSlow { key: String, waited_ms: u64 },
}

impl TransferAgentError {
    /// The rootrank reason a room failure caused by this error is recorded with: a transfer
    /// error's own (`nixl_error`, `transfer_timeout`, `peer_disconnect`); `other` for a
    /// caller's or a configuration mistake (a region the peer never published, a record that
    /// does not parse), which says nothing about the peer.
    pub fn reason(&self) -> &'static str {
        match self {
            TransferAgentError::Transfer(e) => e.reason(),
            _ => "other",
        }
    }

    /// The NIXL status name when NIXL returned one.
    pub fn nixl_status(&self) -> Option<&str> {
        match self {
            TransferAgentError::Transfer(e) => e.nixl_status(),
            _ => None,
        }
    }
}

/// A transfer for a room failed. It was recorded as a `local` RoomFailure (unless the
/// agent's queue refused it, see `recorded`).
#[derive(Debug, thiserror::Error)]
#[error("{detail}")]
pub struct RoomTransferError {
    pub room: u64,
    /// The rootrank reason recorded (`nixl_error`, `transfer_timeout`, `peer_disconnect`;
    /// `other` for a caller's mistake), from `error`'s type ([`TransferAgentError::reason`]).
    pub reason: &'static str,
    /// The recorded detail: SGLang's text, the NIXL status and the error.
    pub detail: String,
    pub peer: Peer,
    #[source]
    pub error: TransferAgentError,
    /// Whether the agent accepted the record (it never blocks; a full queue drops it).
    pub recorded: bool,
}
