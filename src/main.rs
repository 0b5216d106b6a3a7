//! `rootrank`: names the tensor-parallel rank that really failed a PD-disaggregation transfer.
//! The binary is a thin edge: flags and environment in, one library call per subcommand.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
mod cmd;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // SAFETY: first thing in main, before any thread exists. The simulated ranks (this binary)
    // run NIXL over UCX; the library never sets the environment itself.
    unsafe { rootrank_transfer_agent::set_ucx_defaults_before_threads() };
    let cli = cmd::Cli::parse();
    init_tracing(cli.json_logs);
    match cmd::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("rootrank: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn init_tracing(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("ROOTRANK_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.compact().init();
    }
}
