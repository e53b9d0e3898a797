//! `kvtier`: the tiered KV-cache store for LLM inference.

mod config;
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
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => serve::run(args),
    }
}
