//! `kvtier bench`: measurements whose results go under `bench/results/`.
//! Compare ratios measured in the same run; these machines are noisy.

pub(crate) mod decode;
mod echo;
pub(crate) mod fetch;
pub(crate) mod plot;
mod select;
mod swapin;
mod tier;

use std::time::{Duration, Instant};

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Scoring and top-k over a digest column, against memcpy of the same bytes.
    Select(select::SelectBenchArgs),
    /// Random page-slot reads and writes through the NVMe tier.
    Tier(tier::TierBenchArgs),
    /// Batched swap-in to the device against one plain host-to-device copy.
    Swapin(swapin::SwapinBenchArgs),
    /// Decode steps through gRPC: step latency by miss class, bytes moved, plots.
    Decode(Box<decode::DecodeArgs>),
    /// Replays a decode trace's page fetches through kvtier and, optionally, Redis.
    Fetch(fetch::FetchBenchArgs),
    /// Serves the bare tonic unary echo that `bench fetch` measures its floor with.
    Echo(echo::EchoArgs),
}

pub(crate) fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Select(args) => select::run(args),
        BenchCommand::Tier(args) => tier::run(args),
        BenchCommand::Swapin(args) => swapin::run(args),
        BenchCommand::Decode(args) => decode::run(*args),
        BenchCommand::Fetch(args) => fetch::run(args),
        BenchCommand::Echo(args) => echo::run(args),
    }
}

/// Prints `result` as one JSON object, or as the line `text` makes of it.
pub(crate) fn emit<T: serde::Serialize>(json: bool, result: &T, text: impl FnOnce(&T) -> String) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(result)?);
    } else {
        println!("{}", text(result));
    }
    Ok(())
}

/// Median wall time of `f` over at least `min_runs` runs and about
/// `min_total` of measuring, after one warm-up run.
pub(crate) fn median_time(min_runs: usize, min_total: Duration, mut f: impl FnMut()) -> (Duration, usize) {
    f();
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < min_runs || (start.elapsed() < min_total && times.len() < 10_000) {
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    }
    times.sort_unstable();
    (times[times.len() / 2], times.len())
}
