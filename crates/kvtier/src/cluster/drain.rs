//! `kvtier cluster drain` and `kvtier cluster rebalance`: ask nodes (found
//! in etcd) to move their sequences (`DrainNode`), and print each move as
//! it ends. The calls are admin calls: the token and TLS authority come
//! from flags, or from a node's configuration as that node reaches others.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use kvtier_client::{Client, Connect, Tls, pb};
use kvtier_cluster::{NodeRecord, NodeState};
use kvtier_proto::v1::drain_progress::Event;

use super::{EtcdArgs, NodeFile, join};

/// Where the cluster is and how to call its nodes as admin.
#[derive(Debug, Args)]
pub(crate) struct AdminArgs {
    #[command(flatten)]
    at: EtcdArgs,
    /// An admin token of the nodes [default: the config's].
    #[arg(long, value_name = "TOKEN", env = "KVTIER_TOKEN")]
    token: Option<String>,
    /// PEM authority the nodes' certificates are checked against, for
    /// `https://` nodes [default: the config's].
    #[arg(long, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// Sequences each node moves at once (1..=16).
    #[arg(long, default_value_t = 2)]
    parallel: u32,
}

#[derive(Debug, Args)]
pub(crate) struct DrainArgs {
    /// The node to drain (its id).
    node: String,
    #[command(flatten)]
    admin: AdminArgs,
}

#[derive(Debug, Args)]
pub(crate) struct RebalanceArgs {
    /// The nodes whose sequences move [default: every serving node].
    nodes: Vec<String>,
    #[command(flatten)]
    admin: AdminArgs,
}

pub(crate) async fn drain(args: DrainArgs) -> anyhow::Result<()> {
    let admin = &args.admin;
    let (file, etcd) = admin.at.resolve()?;
    let view = view(&etcd).await?;
    let Some(node) = view.member(&args.node) else {
        bail!("node {:?} is not a member of the cluster", args.node);
    };
    let done = run(&file, admin, node, false).await?;
    if !done.left {
        bail!(
            "{} sequences did not move; node {} is still draining and serves them (run drain again to retry)",
            done.failed,
            args.node
        );
    }
    println!("node {} holds nothing and left the cluster", args.node);
    Ok(())
}

pub(crate) async fn rebalance(args: RebalanceArgs) -> anyhow::Result<()> {
    let admin = &args.admin;
    let (file, etcd) = admin.at.resolve()?;
    let view = view(&etcd).await?;
    let nodes: Vec<&NodeRecord> = view
        .members()
        .filter(|n| {
            if args.nodes.is_empty() {
                n.state == NodeState::Serving
            } else {
                args.nodes.contains(&n.node_id)
            }
        })
        .collect();
    if let Some(missing) = args.nodes.iter().find(|id| !nodes.iter().any(|n| n.node_id == **id)) {
        bail!("node {missing:?} is not a member of the cluster");
    }
    let mut failed = 0;
    for node in nodes {
        failed += run(&file, admin, node, true).await?.failed;
    }
    if failed > 0 {
        bail!("{failed} sequences did not move (they stay where they are; run rebalance again to retry)");
    }
    Ok(())
}

async fn view(etcd: &kvtier_cluster::EtcdConfig) -> anyhow::Result<std::sync::Arc<kvtier_cluster::View>> {
    let view = kvtier_cluster::follow(etcd).await.with_context(|| {
        format!(
            "reading cluster {:?} from etcd at {}",
            etcd.cluster,
            etcd.endpoints.join(",")
        )
    })?;
    Ok(std::sync::Arc::clone(&view.borrow()))
}

/// One node's `DrainNode`, printed as it goes; its totals. The node is
/// called where clients reach it, else where its peers do (from inside a
/// cluster's own network).
async fn run(file: &NodeFile, admin: &AdminArgs, record: &NodeRecord, stay: bool) -> anyhow::Result<pb::DrainDone> {
    let node = record.node_id.as_str();
    let admin_token = file.auth.tokens.iter().find(|t| t.admin).map(|t| t.token.as_str());
    let tls_ca = file
        .tls
        .as_ref()
        .map(|t| t.ca.clone().unwrap_or_else(|| t.cert.clone()));
    let peers = join::peer_config(&file.cluster, admin_token, tls_ca.as_deref())?;
    let ca_pem = match &admin.ca {
        Some(path) => Some(std::fs::read(path).with_context(|| format!("--ca: reading {}", path.display()))?),
        None => peers.ca_pem,
    };
    let options = |addr: &str| -> anyhow::Result<Connect> {
        Ok(Connect {
            token: admin.token.clone().or(peers.token.clone()),
            tls: match (addr.starts_with("https://"), &ca_pem) {
                (true, Some(ca_pem)) => Some(Tls {
                    ca_pem: ca_pem.clone(),
                    domain: None,
                }),
                (true, None) => bail!("node {node} serves TLS at {addr}: give --ca, or a --config with its authority"),
                (false, _) => None,
            },
        })
    };
    let mut addr = record.addr.as_str();
    let mut client = match Client::connect_with(addr.to_owned(), options(addr)?).await {
        Ok(client) => client,
        Err(e) if record.peer_addr() != addr => {
            tracing::debug!(error = %e, "trying the node's peer address");
            addr = record.peer_addr();
            Client::connect_with(addr.to_owned(), options(addr)?)
                .await
                .with_context(|| format!("connecting to node {node} at {} or {addr}", record.addr))?
        }
        Err(e) => return Err(e).with_context(|| format!("connecting to node {node} at {addr}")),
    };
    let started = Instant::now();
    println!("{} node {node} ({addr})", if stay { "rebalancing" } else { "draining" });
    let mut progress = client
        .drain_node(node, admin.parallel, stay)
        .await
        .with_context(|| format!("node {node}"))?;
    while let Some(message) = progress.message().await.with_context(|| format!("node {node}"))? {
        match message.event {
            Some(Event::Sequence(s)) if s.error.is_empty() => println!(
                "  moved {}/{} to {}: {} pages, {} in {:.1} ms",
                s.tenant,
                s.sequence_id,
                s.to_node,
                s.pages,
                human(s.bytes),
                s.micros as f64 / 1000.0
            ),
            Some(Event::Sequence(s)) => println!(
                "  NOT moved {}/{}{}: {}",
                s.tenant,
                s.sequence_id,
                if s.to_node.is_empty() {
                    String::new()
                } else {
                    format!(" to {}", s.to_node)
                },
                s.error
            ),
            Some(Event::Done(done)) => {
                let secs = (done.millis as f64 / 1000.0).max(1e-3);
                println!(
                    "node {node}: {} moved, {} not, {} in {:.2} s ({}/s)",
                    done.moved,
                    done.failed,
                    human(done.bytes),
                    secs,
                    human((done.bytes as f64 / secs) as u64)
                );
                return Ok(done);
            }
            None => {}
        }
    }
    bail!(
        "node {node} ended the drain without its totals after {:.1} s",
        started.elapsed().as_secs_f64()
    )
}

fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}
