//! The store as a cluster node sees it, and the node's health as the gRPC
//! health service reports it.

use std::sync::Arc;

use kvtier_cluster::{Health, LocalSequences, Node, TierBytes};
use kvtier_core::SequenceKey;
use kvtier_store::{Store, TierKind};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// The service name under which health reports the node's cluster
/// standing: NOT_SERVING while etcd is unreachable (degraded: the node
/// serves what it holds and creates nothing).
pub const CLUSTER_HEALTH_SERVICE: &str = "kvtier.v1.Cluster";

/// The sequences a store holds, for [`Node::join`].
#[derive(Debug)]
pub struct StoreSequences(pub Arc<Store>);

impl LocalSequences for StoreSequences {
    fn sequences(&self) -> Vec<SequenceKey> {
        self.0.sequence_keys()
    }

    fn forget(&self, key: &SequenceKey) {
        match self.0.drop_sequence(key) {
            Ok(()) => {
                tracing::info!(tenant = %key.tenant.as_str(), sequence = %key.sequence.as_str(), "gave up a sequence the cluster no longer says is this node's")
            }
            Err(e) => tracing::warn!(error = %e, "could not drop a sequence the cluster no longer says is this node's"),
        }
    }

    fn free(&self) -> TierBytes {
        let mut free = TierBytes::default();
        for tier in self.0.stats().tiers {
            let left = tier.capacity_bytes.saturating_sub(tier.used_bytes);
            match tier.kind {
                TierKind::Device => free.device = left,
                TierKind::Host => free.host = left,
                TierKind::Nvme => free.nvme = left,
            }
        }
        free
    }
}

/// The capacities a node registers with (its placement weight).
pub fn capacity(store: &Store) -> TierBytes {
    let mut bytes = TierBytes::default();
    for tier in store.stats().tiers {
        match tier.kind {
            TierKind::Device => bytes.device = tier.capacity_bytes,
            TierKind::Host => bytes.host = tier.capacity_bytes,
            TierKind::Nvme => bytes.nvme = tier.capacity_bytes,
        }
    }
    bytes
}

/// Mirrors the node's health into the health service until the node goes:
/// degraded shows on [`CLUSTER_HEALTH_SERVICE`]; fenced (serving no
/// sequence) on kvtier.v1.KvTier too.
pub(crate) async fn report_health(node: Arc<Node>, reporter: HealthReporter, kvtier_service: &'static str) {
    let mut health = node.health();
    drop(node);
    loop {
        let now = health.borrow_and_update().clone();
        let (cluster, kvtier) = match &now {
            Health::Serving => (ServingStatus::Serving, ServingStatus::Serving),
            Health::Degraded(_) => (ServingStatus::NotServing, ServingStatus::Serving),
            Health::Fenced(_) => (ServingStatus::NotServing, ServingStatus::NotServing),
        };
        reporter.set_service_status(CLUSTER_HEALTH_SERVICE, cluster).await;
        reporter.set_service_status(kvtier_service, kvtier).await;
        if health.changed().await.is_err() {
            return;
        }
    }
}
