//! `rootrank`'s command line as a library: the `rootrank` binary (`src/main.rs`) and the
//! Python package's `rootrank` command (`crates/python`, the subcommands without NIXL) both
//! call [`main`]. Flags and environment in, one library call per subcommand (`cmd`).

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
mod cmd;

use std::ffi::OsString;

use clap::Parser;

/// Runs one command line (`args[0]` is the program name) and returns its exit code: 0 ok (or
/// resolved), 1 error, 2 usage, 3 verdict pending or unknown.
pub fn main<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match cmd::Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version end here too, with 0.
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    init_tracing(cli.json_logs);
    match cmd::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("rootrank: error: {e:#}");
            1
        }
    }
}

fn init_tracing(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("ROOTRANK_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // `try_init`: a host that set a subscriber already keeps it.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.compact().try_init()
    };
}
