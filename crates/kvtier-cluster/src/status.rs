//! A cluster at a glance, read from etcd alone: `kvtier cluster status`.

use std::collections::BTreeMap;

use etcd_client::GetOptions;
use serde::Serialize;

use crate::etcd::EtcdConfig;
use crate::keys::Keys;
use crate::record::{NodeRecord, OwnerRecord};

/// One etcd endpoint as it answered.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointHealth {
    /// The endpoint's URL, as configured.
    pub endpoint: String,
    /// `None` when it answered; the error otherwise.
    pub error: Option<String>,
    /// etcd's version, when the endpoint answered.
    pub version: Option<String>,
    /// Whether this member is the leader.
    pub leader: Option<bool>,
}

/// A node in the status: a member, or a node out of the cluster that still
/// owns sequences (within its grace, or lost).
#[derive(Debug, Clone, Serialize)]
pub struct NodeStatus {
    /// The node's id.
    pub node_id: String,
    /// `joining`, `serving`, `draining`; `out` (lease lapsed, within its
    /// grace); `lost` (past its grace, sequences still recorded).
    pub state: String,
    /// Its node record; `None` for a node out of the cluster.
    pub record: Option<NodeRecord>,
    /// Ownership records naming the node.
    pub sequences: u64,
}

/// What [`status`] read: the cluster's nodes and how each etcd endpoint
/// answered.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterStatus {
    /// The cluster's name.
    pub cluster: String,
    /// Members, and nodes out of the cluster that ownership records still
    /// name, by id.
    pub nodes: Vec<NodeStatus>,
    /// Every configured endpoint, in the configured order.
    pub etcd: Vec<EndpointHealth>,
}

/// Reads the cluster's status; fails only when no endpoint answers.
pub async fn status(config: &EtcdConfig) -> Result<ClusterStatus, etcd_client::Error> {
    let keys = Keys::new(&config.cluster);
    let mut etcd = Vec::new();
    for endpoint in &config.endpoints {
        let one = EtcdConfig {
            endpoints: vec![endpoint.clone()],
            ..config.clone()
        };
        let answer = async {
            let mut client = one.connect().await?;
            client.status().await
        };
        etcd.push(match answer.await {
            Ok(s) => EndpointHealth {
                endpoint: endpoint.clone(),
                error: s.errors().first().cloned(),
                version: Some(s.version().to_owned()),
                leader: s.header().map(|h| h.member_id() == s.leader()),
            },
            Err(e) => EndpointHealth {
                endpoint: endpoint.clone(),
                error: Some(e.to_string()),
                version: None,
                leader: None,
            },
        });
    }
    let mut client = config.connect().await?;
    let prefix = Some(GetOptions::new().with_prefix());
    let members = client.get(keys.nodes(), prefix.clone()).await?;
    let owners = client.get(keys.sequences(), prefix.clone()).await?;
    let mut nodes: BTreeMap<String, NodeStatus> = BTreeMap::new();
    for kv in members.kvs() {
        if let Ok(record) = serde_json::from_slice::<NodeRecord>(kv.value()) {
            nodes.insert(
                record.node_id.clone(),
                NodeStatus {
                    node_id: record.node_id.clone(),
                    state: record.state.as_str().to_owned(),
                    record: Some(record),
                    sequences: 0,
                },
            );
        }
    }
    for kv in owners.kvs() {
        let Ok(owner) = serde_json::from_slice::<OwnerRecord>(kv.value()) else {
            continue;
        };
        nodes
            .entry(owner.node_id.clone())
            .or_insert_with(|| NodeStatus {
                node_id: owner.node_id.clone(),
                state: String::new(),
                record: None,
                sequences: 0,
            })
            .sequences += 1;
    }
    for node in nodes.values_mut().filter(|n| n.record.is_none()) {
        let held = client
            .get(keys.held(&node.node_id), Some(GetOptions::new().with_count_only()))
            .await?;
        node.state = if held.count() > 0 { "out" } else { "lost" }.to_owned();
    }
    Ok(ClusterStatus {
        cluster: config.cluster.clone(),
        nodes: nodes.into_values().collect(),
        etcd,
    })
}
