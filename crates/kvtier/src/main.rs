//! `kvtier`: the tiered KV-cache store for LLM inference.

mod alloc;
mod bench;
mod cluster;
mod config;
mod eval;
mod health;
mod memory;
#[cfg(test)]
mod reference;
mod serve;
mod shape;
mod trace;
mod tune;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "kvtier",
    version,
    about = "A tiered KV-cache store for LLM inference, served over gRPC"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gRPC service (embedded defaults: loopback, tiers sized for this machine).
    Serve(Box<serve::ServeArgs>),
    /// Selection quality on a realkv dataset: recall, attention mass, output error, read sparsity.
    Eval(eval::EvalArgs),
    /// Benchmarks: select, tier, swapin, decode, fetch (results go under bench/results/).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Tier sizes from a workload's accesses: miss-ratio curves and the smallest sizes that meet a target.
    Tune(tune::TuneArgs),
    /// A cluster's nodes and etcd, read from etcd.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Whether a server is serving (gRPC health check; exit status 0 if it is).
    Health(health::HealthArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => serve::run(*args),
        // The in-process store's warnings (and, with KVTIER_LOG, more) reach
        // stderr; the reports go to stdout.
        Command::Eval(args) => {
            serve::init_logging(serve::LogFormat::Text, "warn");
            eval::run(args)
        }
        Command::Bench(command) => {
            serve::init_logging(serve::LogFormat::Text, "warn");
            bench::run(command)
        }
        Command::Tune(args) => tune::run(args),
        Command::Health(args) => health::run(args),
        Command::Cluster(command) => cluster::run(command),
    }
}
