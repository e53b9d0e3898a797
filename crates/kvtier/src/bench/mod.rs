//! `kvtier bench`: measurements whose results go under `bench/results/`.
//! Compare ratios measured in the same run; these machines are noisy.

mod burst;
mod cluster;
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
    /// Two tenants: one's shared prompt prefix during the other's burst of one-off prompts, per host policy.
    Burst(burst::BurstBenchArgs),
    /// A cluster of three nodes on loopback: routing cost against a direct connection, time to notice a lost node.
    Cluster(cluster::ClusterBenchArgs),
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
        BenchCommand::Cluster(args) => cluster::run(args),
        BenchCommand::Burst(args) => burst::run(args),
    }
}

/// Marks a directory whose contents a kvtier run wrote, and may replace.
const OUT_MARKER: &str = ".kvtier-out";

/// Prepares `dir` for one run's outputs, so that none of an earlier run's
/// sits beside them: created if absent; emptied if an earlier run wrote it
/// (its marker file says so); refused if it holds anything else.
pub(crate) fn fresh_out_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let held = std::fs::read_dir(dir).map(|mut d| d.next().is_some()).unwrap_or(false);
    if held {
        anyhow::ensure!(
            dir.join(OUT_MARKER).exists(),
            "--out {}: holds files no kvtier run wrote; give a new or empty directory",
            dir.display()
        );
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(
        dir.join(OUT_MARKER),
        "written by kvtier; replaced as a whole by the next run\n",
    )
    .with_context(|| format!("writing into {}", dir.display()))
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

#[cfg(test)]
mod tests {
    #[test]
    fn an_output_directory_is_replaced_whole_and_never_one_kvtier_did_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        super::fresh_out_dir(&out).unwrap();
        std::fs::write(out.join("stale.png"), b"an earlier run's plot").unwrap();
        super::fresh_out_dir(&out).unwrap();
        assert!(!out.join("stale.png").exists(), "an earlier run's output is cleared");
        let foreign = dir.path().join("mine");
        std::fs::create_dir(&foreign).unwrap();
        std::fs::write(foreign.join("notes.txt"), b"keep me").unwrap();
        let err = super::fresh_out_dir(&foreign).unwrap_err().to_string();
        assert!(err.contains("no kvtier run wrote"), "{err}");
        assert!(foreign.join("notes.txt").exists());
        super::fresh_out_dir(&dir.path().join("empty")).unwrap();
    }
}
