//! What a node publishes about itself, and who owns a sequence: the two
//! kinds of value kvtier keeps in etcd (JSON, so `etcdctl get` reads them).

use serde::{Deserialize, Serialize};

/// A node's part in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Registered, checking which of its sequences are still its own; owns
    /// no new sequences yet.
    Joining,
    /// Owns the sequences placement gives it.
    Serving,
    /// Finishing its calls or handing its sequences over; placement skips
    /// it, its sequences are still served.
    Draining,
}

impl NodeState {
    /// The state's name, as the JSON record and `kvtier cluster status`
    /// spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Joining => "joining",
            Self::Serving => "serving",
            Self::Draining => "draining",
        }
    }
}

/// Bytes per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierBytes {
    /// The device tier (GPU memory, or its emulation in host memory).
    pub device: u64,
    /// The host memory tier.
    pub host: u64,
    /// The NVMe tier.
    pub nvme: u64,
}

/// `nodes/<id>`, under the node's membership lease: present while the node
/// is in the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node's id, also the last part of its key.
    pub node_id: String,
    /// Where clients and other nodes reach its gRPC service
    /// (`http://host:port` or `https://…`).
    pub addr: String,
    /// Where other nodes reach it instead, when that differs from `addr`
    /// (containers whose published ports clients use).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_addr: Option<String>,
    /// Its part in the cluster; placement counts only serving nodes.
    pub state: NodeState,
    /// kvtier's version.
    pub version: String,
    /// Bytes per tier the node was configured with; host and NVMe make its
    /// placement weight.
    pub capacity: TierBytes,
    /// Refreshed while the node runs.
    pub free: TierBytes,
}

impl NodeRecord {
    /// Placement weight: the bytes it keeps sequences in (host and NVMe; the
    /// device tier caches them). Only capacity counts, so placement does not
    /// move as a node fills.
    pub fn weight(&self) -> f64 {
        (self.capacity.host + self.capacity.nvme) as f64
    }

    /// Where another node reaches this one.
    pub fn peer_addr(&self) -> &str {
        self.peer_addr.as_deref().unwrap_or(&self.addr)
    }
}

/// `seqs/<tenant>/<sequence id, hex>`, with no lease: the node that owns the
/// sequence. Written by a transaction that requires the key to be absent
/// (or its owner past its grace), so a sequence has one owner at a time;
/// a move rewrites it for the new owner, at the revision the old one read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerRecord {
    /// The owner's node id.
    pub node_id: String,
    /// Random per creation: a read never mixes two creations of one id.
    pub incarnation: u64,
    /// The context-parallel group the sequence is a shard of, which places
    /// it (kept so that a move places it as its create did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<Group>,
}

/// A shard of a context-parallel group: the group's shards share a
/// placement key (the group's name, or the first prefix hash), and shard
/// `rank` goes to the rank-th node of its ranking, so shards land on
/// distinct nodes while there are as many.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Group {
    /// The group's name, unique within the tenant.
    pub name: String,
    /// This shard's rank, below `world`.
    pub rank: u32,
    /// Shards in the group.
    pub world: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_as_written() {
        let node = NodeRecord {
            node_id: "n1".into(),
            addr: "http://127.0.0.1:1".into(),
            peer_addr: None,
            state: NodeState::Draining,
            version: "0.1.0".into(),
            capacity: TierBytes {
                device: 1,
                host: 2,
                nvme: 3,
            },
            free: TierBytes::default(),
        };
        let json = serde_json::to_string(&node).unwrap();
        assert!(json.contains("\"state\":\"draining\""), "{json}");
        assert_eq!(serde_json::from_str::<NodeRecord>(&json).unwrap(), node);
        assert_eq!(node.weight(), 5.0);
    }
}
