#![warn(missing_docs)]
//! kvtier as a cluster. Membership lives in etcd (a maintained consensus
//! engine; kvtier runs none of its own), and so does one ownership record
//! per sequence; no page metadata does.
//!
//! - [`placement`](kvtier_core::placement): where a new sequence goes, a
//!   pure function of the serving members that nodes and clients compute
//!   alike;
//! - [`Node`]: a server's membership, its leases, and the ownership of the
//!   sequences it creates (at most one owner per sequence, by etcd
//!   transactions);
//! - [`View`] and [`follow`]: the members as a client routes by.

mod etcd;
mod handover;
mod keys;
mod node;
mod record;
mod refusal;
mod status;
mod view;

pub use etcd::{DEFAULT_CLUSTER, EtcdConfig};
pub use handover::{Kept, Ownership};
pub use keys::Keys;
pub use kvtier_core::placement::{INCARNATION, OWNER_ADDR, OWNER_NODE};
pub use node::{Health, JoinError, Joined, LocalSequences, Node, NodeConfig};
pub use record::{Group, NodeRecord, NodeState, OwnerRecord, TierBytes};
pub use refusal::Refusal;
pub use status::{ClusterStatus, EndpointHealth, NodeStatus, status};
pub use view::{View, placement};

use std::sync::Arc;

use tokio::sync::watch;

/// Connects to etcd and follows the cluster's members: the first view is
/// read before this returns, later ones arrive on the receiver.
pub async fn follow(config: &EtcdConfig) -> Result<watch::Receiver<Arc<View>>, etcd_client::Error> {
    let etcd = config.connect().await?;
    view::follow(etcd, Keys::new(&config.cluster)).await
}
