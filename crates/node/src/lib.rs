//! The node watchdog and supervisor: host facts from `rootrank-watchdog`, certificates into
//! etcd.
//!
//! A rank killed by SIGKILL or the kernel OOM killer cannot report anything, and its lease
//! takes seconds to expire. Two processes close that gap:
//!
//! - [`watch::run`] (`rootrank node-watch`, one per host) learns the ranks of its host from
//!   their live records, watches each process with a pidfd, and writes a `source: watchdog`
//!   down certificate within milliseconds of its death, classified from the kernel log, the
//!   memory cgroup and (when it knows it) the exit status.
//! - [`supervise::supervise`] (`rootrank run`) starts one rank process, registers liveness for
//!   it when it has no agent of its own, keeps the tail of its stderr, and writes a
//!   `source: supervisor` certificate with the exit status and that tail when it ends.
//!
//! Both write with [`rootrank_store::put_certificate`] on retention leases, retrying with
//! backoff, so a death seen while etcd is down is written when it is back. With
//! `metrics_listen` set, each serves `GET /metrics` (`rootrank_unverified_pids_total`).

mod certs;
mod host;
mod host_lease;
mod metrics;
mod pidns;
pub mod stack;
pub mod supervise;
mod sync;
pub mod watch;

pub use host::HostIdentity;
pub use supervise::{supervise, SuperviseConfig, SupervisedExit};
pub use sync::WatchScope;
pub use watch::{run as node_watch, NodeWatchConfig};

/// What went wrong, and what to check.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Store(#[from] rootrank_store::StoreError),
    #[error(transparent)]
    Agent(#[from] rootrank_agent::AgentError),
    #[error(transparent)]
    Id(#[from] rootrank_core::IdError),
    #[error("could not start {program:?}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("could not wait for the supervised process: {0}")]
    Wait(#[source] std::io::Error),
    #[error("could not install a handler for signal {signal}: {source}")]
    Signal {
        signal: i32,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot serve metrics on {addr} (--metrics-listen)")]
    MetricsListen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
}
