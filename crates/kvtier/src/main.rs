//! `kvtier`: the tiered KV-cache store for LLM inference.

mod bench;
mod config;
mod eval;
mod serve;

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
    Serve(serve::ServeArgs),
    /// Selection quality on a realkv dataset: recall, attention mass, output error, read sparsity.
    Eval(eval::EvalArgs),
    /// Benchmarks (`kvtier bench select`).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Bench(command) => bench::run(command),
    }
}
