//! A simulated PD deployment on one machine: `rootrank simulate` and `rootrank demo` (the
//! [`parent`]) and its rank processes
//! (`rootrank sim-rank`, the [`rank`] module), built on `rootrank-transfer-agent`.
//!
//! The parent plays SGLang's launcher and router, and the gloo group of the prefill ranks:
//! it spawns one process per rank, mints rooms, and runs a small TCP hub over which the
//! prefill ranks MIN-all-reduce their poll states per room. It knows nothing of rootrank: it
//! writes no records and no down certificates. What reports a rank's death is the rank's own
//! agent, its lease, or a watchdog.
//!
//! Hub protocol (one line per message, over loopback TCP):
//!
//! ```text
//! rank -> hub   hello prefill|decode RANK PID
//! hub  -> pre   room IDX ROOM -|fail|pause      (pause: say `midway IDX` after chunk 0, wait for `go IDX`)
//! hub  -> dec   room IDX ROOM
//! pre  -> hub   midway IDX          hub -> pre   go IDX
//! pre  -> hub   reduce IDX STATE    hub -> pre   result IDX MIN
//! pre  -> hub   done {RankRoomReport JSON}
//! dec  -> hub   recv IDX SRC_RANK ok|bad
//! hub  -> all   exit
//! ```

pub mod parent;
pub mod pattern;
pub mod rank;

/// What stopped the simulator; every message says what to check.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    TransferAgent(#[from] rootrank_transfer_agent::TransferAgentError),
    #[error(transparent)]
    Transfer(#[from] rootrank_transfer_agent::TransferError),
    #[error(transparent)]
    Agent(#[from] rootrank_agent::AgentError),
    #[error(transparent)]
    Store(#[from] rootrank_store::StoreError),
    #[error("etcd request failed: {0}")]
    Etcd(#[from] rootrank_store::etcd_client::Error),
    #[error("could not start a process, thread or socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("simulator: {0}")]
    Sim(String),
}

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// SGLang's `KVPoll` states: plain ints, so a MIN all-reduce makes Failed win.
pub mod kvpoll {
    pub const FAILED: u8 = 0;
    pub const BOOTSTRAPPING: u8 = 1;
    pub const WAITING_FOR_INPUT: u8 = 2;
    pub const TRANSFERRING: u8 = 3;
    pub const SUCCESS: u8 = 4;

    pub fn name(state: u8) -> &'static str {
        match state {
            FAILED => "Failed",
            BOOTSTRAPPING => "Bootstrapping",
            WAITING_FOR_INPUT => "WaitingForInput",
            TRANSFERRING => "Transferring",
            SUCCESS => "Success",
            _ => "Unknown",
        }
    }
}

/// SGLang's fallback text when a rank only saw the group's Failed.
pub const GENERIC_SENDER_ERROR: &str = "NIXL KVSender Exception";

/// A rank's role in the simulated deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Everything a rank process needs; the parent passes it as one JSON argument.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankOpts {
    pub role: Role,
    pub group: String,
    pub rank: u32,
    pub group_size: u32,
    /// The other side's group (decode for prefill, prefill for decode).
    pub peer_group: String,
    pub etcd_endpoints: Vec<String>,
    pub prefix: String,
    pub coordinator: Option<String>,
    /// The parent's hub (loopback).
    pub hub: String,
    pub block_size: usize,
    pub chunks: u32,
    /// Room slots in each decode region (room IDX uses slot IDX % slots).
    pub slots: u32,
    pub lease_ttl_ms: u64,
    pub transfer_timeout_ms: u64,
    pub verdict_wait_ms: u64,
    /// Where NIXL is (the parent found it; the rank loads only from there).
    pub nixl_dir: Option<PathBuf>,
}

/// What a prefill rank reports about one room.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RankRoomReport {
    pub idx: u64,
    /// Decimal, as everywhere in rootrank's JSON.
    pub room: String,
    pub rank: u32,
    /// This rank's own poll state.
    pub own: u8,
    /// The all-reduced state.
    pub reduced: u8,
    /// This rank's own error (it failed itself), SGLang-style.
    #[serde(default)]
    pub error: Option<String>,
    /// The reason it recorded (`local`).
    #[serde(default)]
    pub reason: Option<String>,
    /// The generic error it would have raised without rootrank (it only saw Failed).
    #[serde(default)]
    pub generic: Option<String>,
    /// The coordinator's answer, when it asked.
    #[serde(default)]
    pub verdict: Option<serde_json::Value>,
    /// When the verdict came back (Unix ms), for the measurements.
    #[serde(default)]
    pub verdict_at_ms: Option<i64>,
    /// Time spent in NIXL WRITEs for this room (microseconds).
    #[serde(default)]
    pub transfer_us: Option<u64>,
}
