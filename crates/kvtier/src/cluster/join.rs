//! `kvtier serve`'s cluster settings: flags, the `[cluster]` table, and the
//! node configuration they make.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use kvtier_cluster::{DEFAULT_CLUSTER, EtcdConfig, NodeConfig, TierBytes};
use kvtier_server::PeerConfig;
use serde::Deserialize;

/// Cluster flags of `kvtier serve`; without `--etcd` the server stands alone.
#[derive(Debug, Args)]
pub(crate) struct ClusterArgs {
    /// Join a cluster whose membership is in this etcd (URL[,URL…]).
    #[arg(long, value_name = "URLS")]
    etcd: Option<String>,
    /// This node's id in the cluster: 1..=64 of [A-Za-z0-9._-], kept across
    /// restarts (with the data directory) [required with --etcd].
    #[arg(long, value_name = "ID")]
    node_id: Option<String>,
    /// The cluster's name; clusters share an etcd under distinct names
    /// [default: default].
    #[arg(long, value_name = "NAME")]
    cluster: Option<String>,
    /// The URL clients and other nodes reach this node at
    /// [default: http(s)://LISTEN].
    #[arg(long, value_name = "URL")]
    advertise: Option<String>,
    /// The URL other nodes reach this node at, where it differs from
    /// --advertise (a container whose clients use a published port)
    /// [default: --advertise].
    #[arg(long, value_name = "URL")]
    peer_advertise: Option<String>,
    /// A node silent this long is out of the cluster [default: 10].
    #[arg(long, value_name = "SECONDS")]
    lease_ttl_secs: Option<u64>,
    /// A node out of the cluster keeps its sequences this long; back
    /// within it, it serves them again [default: 60].
    #[arg(long, value_name = "SECONDS")]
    grace_secs: Option<u64>,
}

/// The `[cluster]` table.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClusterFileConfig {
    /// etcd endpoints.
    etcd: Option<Vec<String>>,
    node_id: Option<String>,
    name: Option<String>,
    advertise: Option<String>,
    peer_advertise: Option<String>,
    lease_ttl_secs: Option<u64>,
    grace_secs: Option<u64>,
    /// etcd credentials, where etcd checks them.
    etcd_user: Option<String>,
    etcd_password: Option<String>,
    /// PEM CA certificate for `https://` etcd endpoints.
    etcd_ca: Option<PathBuf>,
    /// The token this node presents to other nodes (moves): an admin token
    /// of theirs [default: the first admin token in `[auth]`].
    peer_token: Option<String>,
    /// PEM authority other nodes' certificates are checked against
    /// [default: `[tls] ca`, else `[tls] cert`].
    peer_ca: Option<PathBuf>,
}

/// What the server needs to know to place itself.
#[derive(Debug)]
pub(crate) struct Listening {
    pub(crate) listen: SocketAddr,
    pub(crate) tls: bool,
}

const DEFAULT_TTL_SECS: u64 = 10;
const DEFAULT_GRACE_SECS: u64 = 60;

/// The node's configuration, or `None` without etcd. Capacity is filled in
/// once the store exists.
pub(crate) fn node_config(
    args: ClusterArgs,
    file: ClusterFileConfig,
    at: &Listening,
) -> anyhow::Result<Option<NodeConfig>> {
    let Some(endpoints) = file.endpoints(args.etcd) else {
        return Ok(None);
    };
    if endpoints.is_empty() {
        bail!("etcd: no endpoint given");
    }
    let Some(node_id) = args.node_id.or(file.node_id.clone()) else {
        bail!("node_id: required with --etcd (--node-id, or node_id in [cluster])");
    };
    check_name("node_id", &node_id)?;
    let cluster = file.name(args.cluster);
    check_name("cluster", &cluster)?;
    let advertise = match args.advertise.or(file.advertise.clone()) {
        Some(url) => url,
        None if at.listen.ip().is_unspecified() => bail!(
            "advertise: required when listening on {} (--advertise URL: where other nodes and clients reach this one)",
            at.listen
        ),
        None => format!("{}://{}", if at.tls { "https" } else { "http" }, at.listen),
    };
    let ttl = args.lease_ttl_secs.or(file.lease_ttl_secs).unwrap_or(DEFAULT_TTL_SECS);
    let grace = args.grace_secs.or(file.grace_secs).unwrap_or(DEFAULT_GRACE_SECS);
    if ttl == 0 || grace < ttl {
        bail!("lease_ttl_secs ({ttl}) must be at least 1 and grace_secs ({grace}) at least lease_ttl_secs");
    }
    let etcd = etcd_access(endpoints, cluster, &file)?;
    Ok(Some(NodeConfig {
        etcd,
        node_id,
        advertise,
        peer_advertise: args.peer_advertise.or(file.peer_advertise.clone()),
        ttl: Duration::from_secs(ttl),
        grace: Duration::from_secs(grace),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        capacity: TierBytes::default(),
    }))
}

impl ClusterFileConfig {
    /// etcd's endpoints: the flag's (`URL[,URL…]`), else the table's.
    pub(crate) fn endpoints(&self, flag: Option<String>) -> Option<Vec<String>> {
        match (flag, &self.etcd) {
            (Some(list), _) => Some(EtcdConfig::parse_endpoints(&list)),
            (None, Some(list)) => Some(EtcdConfig::parse_endpoints(&list.join(","))),
            (None, None) => None,
        }
    }

    /// The cluster's name: the flag's, else the table's, else the default.
    pub(crate) fn name(&self, flag: Option<String>) -> String {
        flag.or_else(|| self.name.clone())
            .unwrap_or_else(|| DEFAULT_CLUSTER.to_owned())
    }
}

/// How this node reaches other nodes: the `[cluster]` table's peer token
/// and authority, else the node's own first admin token and TLS authority
/// (nodes of a cluster share their tokens and their CA).
pub(crate) fn peer_config(
    file: &ClusterFileConfig,
    admin_token: Option<&str>,
    tls_ca: Option<&Path>,
) -> anyhow::Result<PeerConfig> {
    let ca = file.peer_ca.as_deref().or(tls_ca);
    Ok(PeerConfig {
        token: file.peer_token.clone().or(admin_token.map(str::to_owned)),
        ca_pem: match ca {
            Some(path) => {
                Some(std::fs::read(path).with_context(|| format!("cluster.peer_ca: reading {}", path.display()))?)
            }
            None => None,
        },
    })
}

/// How to reach etcd at `endpoints` for `cluster`: with the `[cluster]`
/// table's credentials and CA, as nodes and `kvtier cluster status` alike
/// are configured.
pub(crate) fn etcd_access(
    endpoints: Vec<String>,
    cluster: String,
    file: &ClusterFileConfig,
) -> anyhow::Result<EtcdConfig> {
    let mut etcd = EtcdConfig::new(endpoints);
    etcd.cluster = cluster;
    etcd.user = match (&file.etcd_user, &file.etcd_password) {
        (Some(user), Some(password)) => Some((user.clone(), password.clone())),
        (None, None) => None,
        _ => bail!("cluster.etcd_user and cluster.etcd_password: give both or neither"),
    };
    etcd.ca_pem = match &file.etcd_ca {
        Some(path) => {
            Some(std::fs::read(path).with_context(|| format!("cluster.etcd_ca: reading {}", path.display()))?)
        }
        None => None,
    };
    Ok(etcd)
}

/// Node ids and cluster names go into etcd keys and gRPC metadata.
fn check_name(field: &str, name: &str) -> anyhow::Result<()> {
    let ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !ok {
        bail!("{field}: {name:?} is not 1..=64 of [A-Za-z0-9._-]");
    }
    Ok(())
}
