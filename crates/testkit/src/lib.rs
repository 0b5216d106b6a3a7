//! Test harness for rootrank's tests, one copy of each helper.
//!
//! Always there (no etcd, so the watchdog and transfer crates can use it cheaply):
//! - [`sys`]: free ports, signals, `/proc` probes, the root requirement, the paths of the
//!   repository and of the `rootrank` binary;
//! - [`nixl`]: the NIXL runtime, honouring `ROOTRANK_NIXL_DIR`, fetched when missing;
//! - [`cgroup`]: a memory-limited cgroup for real OOM kills.
//!
//! With the `etcd` feature (on by default):
//! - [`harness`]: real etcd processes on random loopback ports, real coordinator and rank
//!   processes, HTTP helpers and [`eventually`];
//! - [`node`]: a `rootrank node-watch` process and reads of live records and certificates;
//! - [`pd`]: `rootrank simulate` runs and reads of room records;
//! - [`pki`]: certificates made with openssl, etcd with TLS or with auth and least roles.
//!
//! Every process is killed when its handle drops, so a failing test leaves nothing behind.

pub mod cgroup;
pub mod nixl;
pub mod sys;

#[cfg(feature = "etcd")]
pub mod browser;
#[cfg(feature = "etcd")]
pub mod harness;
#[cfg(feature = "etcd")]
pub mod node;
#[cfg(feature = "etcd")]
pub mod pd;
#[cfg(feature = "etcd")]
pub mod pki;

pub use cgroup::MemoryCgroup;
pub use nixl::nixl_dir;
pub use sys::{
    alive, children_of, clock_skew_env, free_port, listening_tcp_ports, processes_mentioning, promtool_check_metrics,
    python_with_rootrank, repo_root, require_root, rootrank_bin, signal, try_signal,
};

#[cfg(feature = "etcd")]
pub use browser::Browser;
#[cfg(feature = "etcd")]
pub use harness::{
    agreed_verdict, events_within, eventually, get, scrape_metrics, Coordinator, Etcd, EtcdCluster, Rank,
};
