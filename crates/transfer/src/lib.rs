//! KV-cache style DRAM transfers between processes over real NIXL (UCX
//! backend), with typed errors that map onto rootrank's failure reasons.
//!
//! ```no_run
//! use rootrank_transfer::{NixlLibrary, TransferAgent};
//! use std::time::Duration;
//! # fn main() -> Result<(), rootrank_transfer::TransferError> {
//! let lib = NixlLibrary::load(None)?; // before any other NIXL use
//! let mut agent = TransferAgent::new(&lib, "prefill-rank0")?;
//! let src = agent.register_dram(1 << 20)?;
//! let my_md = agent.local_metadata()?; // publish this (etcd, file, ...)
//! # let peer_md: Vec<u8> = Vec::new();
//! # let remote: rootrank_transfer::RemoteRegion = todo!();
//! let peer = agent.load_peer(&peer_md)?;
//! agent.write(&peer, src, 0, &remote, 0, 4096, b"kv:req42", Duration::from_secs(1))?;
//! # Ok(()) }
//! ```
//!
//! Metadata exchange is by bytes: the caller publishes
//! [`TransferAgent::local_metadata`] and [`RemoteRegion`]s (serde) wherever
//! its peers can read them.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
mod agent;
mod error;
mod library;

pub use agent::{AgentOptions, Progress, RegionId, RemoteRegion, TransferAgent, TransferStats, PROGRESS_ENV};
pub use error::{status_name, TransferError};
pub use library::{
    missing_ucx_defaults, set_ucx_defaults_before_threads, NixlLibrary, CACHE_DIR, CAPI_LIB, NIXL_DIR_ENV,
    UCX_DEFAULTS, WHEEL_LIBS_DIR,
};
