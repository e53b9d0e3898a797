//! `kvtier cluster`: a cluster's state, read from its etcd; and the cluster
//! settings of `kvtier serve`.

mod join;

pub(crate) use join::{ClusterArgs, ClusterFileConfig, Listening, node_config};

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Debug, Subcommand)]
pub(crate) enum ClusterCommand {
    /// Nodes, their states, capacities and sequences; etcd's health.
    Status(StatusArgs),
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// A node's TOML configuration: its `[cluster]` table gives etcd's
    /// endpoints, the cluster's name and etcd's credentials and CA
    /// (`etcd_user`, `etcd_password`, `etcd_ca`). Flags override it.
    #[arg(long, value_name = "FILE", env = "KVTIER_CONFIG")]
    config: Option<PathBuf>,
    /// The cluster's etcd (URL[,URL…]) [default: the config's].
    #[arg(long, value_name = "URLS")]
    etcd: Option<String>,
    /// The cluster's name [default: the config's, else default].
    #[arg(long, value_name = "NAME")]
    cluster: Option<String>,
    /// JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(command: ClusterCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    match command {
        ClusterCommand::Status(args) => runtime.block_on(status(args)),
    }
}

/// The `[cluster]` table of a node's configuration file; the rest of the
/// file is the server's, and not read here.
fn node_file(path: &std::path::Path) -> anyhow::Result<ClusterFileConfig> {
    #[derive(serde::Deserialize)]
    struct NodeFile {
        #[serde(default)]
        cluster: ClusterFileConfig,
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
    let file: NodeFile = toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))?;
    Ok(file.cluster)
}

async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let file = match &args.config {
        Some(path) => node_file(path)?,
        None => ClusterFileConfig::default(),
    };
    let Some(endpoints) = file.endpoints(args.etcd) else {
        anyhow::bail!("etcd: give --etcd URLS, or a --config whose [cluster] names etcd");
    };
    let config = join::etcd_access(endpoints, file.name(args.cluster), &file)?;
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
