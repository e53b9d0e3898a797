//! `kvtier cluster`: a cluster's state, read from its etcd; and the cluster
//! settings of `kvtier serve`.

mod drain;
mod join;

pub(crate) use join::{ClusterArgs, ClusterFileConfig, Listening, node_config, peer_config};

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Debug, Subcommand)]
pub(crate) enum ClusterCommand {
    /// Nodes, their states, capacities and sequences; etcd's health.
    Status(StatusArgs),
    /// Moves a node's sequences to the other nodes (node to node), then
    /// the node leaves the cluster and stops. Admin only.
    Drain(drain::DrainArgs),
    /// Moves sequences to the nodes placement gives them now (after nodes
    /// joined), on every serving node or the ones named. Admin only.
    Rebalance(drain::RebalanceArgs),
}

/// Where a cluster is: what every `kvtier cluster` command takes.
#[derive(Debug, Args)]
pub(crate) struct EtcdArgs {
    /// A node's TOML configuration: its `[cluster]` table gives etcd's
    /// endpoints, the cluster's name and etcd's credentials and CA
    /// (`etcd_user`, `etcd_password`, `etcd_ca`), and how the node reaches
    /// other nodes (`peer_token` and `peer_ca`, else its first admin token
    /// and its TLS authority). Flags override it.
    #[arg(long, value_name = "FILE", env = "KVTIER_CONFIG")]
    config: Option<PathBuf>,
    /// The cluster's etcd (URL[,URL…]) [default: the config's].
    #[arg(long, value_name = "URLS")]
    etcd: Option<String>,
    /// The cluster's name [default: the config's, else default].
    #[arg(long, value_name = "NAME")]
    cluster: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    at: EtcdArgs,
    /// JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(command: ClusterCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    match command {
        ClusterCommand::Status(args) => runtime.block_on(status(args)),
        ClusterCommand::Drain(args) => runtime.block_on(drain::drain(args)),
        ClusterCommand::Rebalance(args) => runtime.block_on(drain::rebalance(args)),
    }
}

/// What `kvtier cluster` reads of a node's configuration file: its
/// `[cluster]` table, and how the node reaches other nodes (its peer token
/// and authority, else its first admin token and its TLS authority); the
/// rest of the file is the server's, and not read here.
#[derive(Debug, Default, serde::Deserialize)]
struct NodeFile {
    #[serde(default)]
    cluster: ClusterFileConfig,
    #[serde(default)]
    auth: AuthPart,
    tls: Option<TlsPart>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct AuthPart {
    #[serde(default)]
    tokens: Vec<TokenPart>,
}

#[derive(Debug, serde::Deserialize)]
struct TokenPart {
    token: String,
    #[serde(default)]
    admin: bool,
}

#[derive(Debug, serde::Deserialize)]
struct TlsPart {
    cert: PathBuf,
    ca: Option<PathBuf>,
}

fn node_file(path: Option<&std::path::Path>) -> anyhow::Result<NodeFile> {
    let Some(path) = path else {
        return Ok(NodeFile::default());
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))
}

impl EtcdArgs {
    /// The node configuration the flags name (none: empty), and the
    /// cluster's etcd as flags and that configuration say.
    fn resolve(&self) -> anyhow::Result<(NodeFile, kvtier_cluster::EtcdConfig)> {
        let file = node_file(self.config.as_deref())?;
        let Some(endpoints) = file.cluster.endpoints(self.etcd.clone()) else {
            anyhow::bail!("etcd: give --etcd URLS, or a --config whose [cluster] names etcd");
        };
        let etcd = join::etcd_access(endpoints, file.cluster.name(self.cluster.clone()), &file.cluster)?;
        Ok((file, etcd))
    }
}

async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let (_, config) = args.at.resolve()?;
    let status = kvtier_cluster::status(&config).await.with_context(|| {
        format!(
            "reading cluster {:?} from etcd at {}",
            config.cluster,
            config.endpoints.join(",")
        )
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
        return Ok(());
    }
    println!("cluster {}", status.cluster);
    println!(
        "{:<16} {:<9} {:<28} {:>10} {:>12} {:>12} {:>10}",
        "node", "state", "address", "version", "host", "nvme", "sequences"
    );
    for node in &status.nodes {
        let (addr, version, host, nvme) = match &node.record {
            Some(r) => (
                r.addr.as_str(),
                r.version.as_str(),
                format!(
                    "{}/{}",
                    gib(r.capacity.host - r.free.host.min(r.capacity.host)),
                    gib(r.capacity.host)
                ),
                format!(
                    "{}/{}",
                    gib(r.capacity.nvme - r.free.nvme.min(r.capacity.nvme)),
                    gib(r.capacity.nvme)
                ),
            ),
            None => ("-", "-", "-".into(), "-".into()),
        };
        println!(
            "{:<16} {:<9} {:<28} {:>10} {:>12} {:>12} {:>10}",
            node.node_id, node.state, addr, version, host, nvme, node.sequences
        );
    }
    println!("host and nvme: used/capacity, GiB");
    for e in &status.etcd {
        match &e.error {
            None => println!(
                "etcd {}: healthy, version {}{}",
                e.endpoint,
                e.version.as_deref().unwrap_or("?"),
                if e.leader == Some(true) { ", leader" } else { "" }
            ),
            Some(error) => println!("etcd {}: unhealthy: {error}", e.endpoint),
        }
    }
    Ok(())
}

fn gib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 30) as f64)
}
