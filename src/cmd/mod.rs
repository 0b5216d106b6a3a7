//! Subcommands (SPEC section 7). Exit codes: 0 ok (or resolved), 1 error, 2 usage (clap),
//! 3 verdict pending or unknown. The ones that run NIXL (`demo`, `simulate`) come with the
//! `nixl` feature (the binary's default; the Python package's `rootrank` command has the rest).

mod client;
#[cfg(feature = "nixl")]
mod demo;
mod node_watch;
mod rank;
mod run;
mod serve;
#[cfg(feature = "nixl")]
mod sim_rank;
#[cfg(feature = "nixl")]
mod simulate;
mod status;
mod watch;
mod why;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "rootrank",
    version,
    about = "Names the tensor-parallel rank that really failed a PD transfer, and why"
)]
pub struct Cli {
    /// Logs as JSON lines (for log shippers) instead of text.
    #[arg(long, global = true)]
    pub json_logs: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// Flags shared by everything that talks to etcd.
#[derive(clap::Args, Debug, Clone)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated (e.g. http://10.0.0.1:2379,http://10.0.0.2:2379).
    #[arg(long, env = "ROOTRANK_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix in etcd.
    #[arg(long, env = "ROOTRANK_PREFIX", default_value = "/rootrank/v1")]
    pub prefix: String,
    /// CA bundle that signed etcd's server certificate (TLS; https:// endpoints).
    #[arg(long, env = "ROOTRANK_ETCD_CACERT", value_name = "FILE")]
    pub etcd_cacert: Option<PathBuf>,
    /// Client certificate for etcd (with --etcd-key), when etcd asks for one.
    #[arg(long, env = "ROOTRANK_ETCD_CERT", value_name = "FILE")]
    pub etcd_cert: Option<PathBuf>,
    /// The client certificate's private key.
    #[arg(long, env = "ROOTRANK_ETCD_KEY", value_name = "FILE")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd's own auth), with --etcd-password-file.
    #[arg(long, env = "ROOTRANK_ETCD_USER", value_name = "NAME")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (first line).
    #[arg(long, env = "ROOTRANK_ETCD_PASSWORD_FILE", value_name = "FILE")]
    pub etcd_password_file: Option<PathBuf>,
}

impl EtcdArgs {
    pub fn files(&self) -> rootrank_store::EtcdCredentialFiles {
        rootrank_store::EtcdCredentialFiles {
            cacert: self.etcd_cacert.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
            user: self.etcd_user.clone(),
            password_file: self.etcd_password_file.clone(),
        }
    }

    /// The endpoints with their credentials, read and checked now (a missing file or a flag
    /// without its partner stops the command with what to fix).
    pub fn access(&self) -> anyhow::Result<rootrank_store::EtcdAccess> {
        Ok(rootrank_store::EtcdAccess::new(
            self.etcd_endpoints.clone(),
            &self.files(),
        )?)
    }
}

/// Flags shared by the coordinator's clients.
#[derive(clap::Args, Debug, Clone)]
pub struct CoordinatorArgs {
    /// The coordinator's URL, or several replicas comma-separated (tried in turn).
    #[arg(long, env = "ROOTRANK_COORDINATOR", default_value = "http://127.0.0.1:9750")]
    pub coordinator: String,
    /// File holding the coordinator's bearer token (when it runs with --auth-token-file).
    #[arg(long, env = "ROOTRANK_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// CA bundle that signed the coordinator's HTTPS certificate (default: the system's).
    #[arg(long, env = "ROOTRANK_CACERT", value_name = "FILE")]
    pub cacert: Option<PathBuf>,
}

impl CoordinatorArgs {
    /// An HTTP client that trusts `--cacert` and sends the token of `--token-file` (marked
    /// sensitive: never in logs) with every request.
    pub fn http(&self) -> anyhow::Result<reqwest::Client> {
        let mut builder = rootrank_tls::http_client(self.cacert.as_deref())?;
        if let Some(path) = &self.token_file {
            let token = rootrank_tls::AuthToken::from_file(path)?;
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", token.expose()))?;
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder = builder.default_headers(headers);
        }
        Ok(builder.build()?)
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the coordinator (with no --etcd-endpoints: with a private etcd of its own).
    Serve(serve::ServeArgs),
    /// Which rank really failed ROOM, and why.
    Why(why::WhyArgs),
    /// Groups and ranks at a glance.
    Status(status::StatusArgs),
    /// Follows what changes (ranks live, down, stalled; rooms resolved), one line per event.
    Watch(watch::WatchArgs),
    /// A scriptable rank with an embedded agent: reads commands on stdin (for tests and for
    /// trying rootrank by hand). Type `help` for the commands.
    #[command(hide = true)]
    Rank(rank::RankArgs),
    /// The whole story on one machine (private etcd, coordinator, real NIXL), narrated.
    #[cfg(feature = "nixl")]
    Demo(demo::DemoArgs),
    /// A simulated PD deployment: one process per rank, real NIXL transfers, fault injection.
    #[cfg(feature = "nixl")]
    Simulate(Box<simulate::SimulateArgs>),
    /// One rank of `rootrank simulate` (spawned by it).
    #[cfg(feature = "nixl")]
    #[command(hide = true)]
    SimRank(sim_rank::SimRankArgs),
    /// The node watchdog (one per host): reports rank deaths in milliseconds, with their cause.
    NodeWatch(node_watch::NodeWatchArgs),
    /// Supervise one rank process: environment, liveness, signals, and its exit reported.
    Run(run::RunArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<u8> {
    match cli.command {
        Command::Serve(a) => serve::run(a),
        Command::Why(a) => why::run(a),
        Command::Status(a) => status::run(a),
        Command::Watch(a) => watch::run(a),
        Command::Rank(a) => rank::run(a),
        #[cfg(feature = "nixl")]
        Command::Demo(a) => demo::run(a),
        #[cfg(feature = "nixl")]
        Command::Simulate(a) => simulate::run(*a),
        #[cfg(feature = "nixl")]
        Command::SimRank(a) => sim_rank::run(a),
        Command::NodeWatch(a) => node_watch::run(a),
        Command::Run(a) => run::run(a),
    }
}

/// A runtime for subcommands that need one.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// SIGINT or SIGTERM: a subcommand that runs until stopped ends cleanly on either.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
}
