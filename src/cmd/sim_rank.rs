//! `rootrank sim-rank` (hidden): one rank process of `rootrank simulate`.

use anyhow::Context;
use rootrank_sim::RankOpts;

#[derive(clap::Args, Debug)]
pub struct SimRankArgs {
    /// The rank's options as JSON (written by `rootrank simulate`).
    #[arg(long)]
    pub opts: String,
}

pub fn run(a: SimRankArgs) -> anyhow::Result<u8> {
    let opts: RankOpts = serde_json::from_str(&a.opts).context("--opts is not a sim-rank JSON")?;
    rootrank_sim::rank::run(opts)?;
    Ok(0)
}
