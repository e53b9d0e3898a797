//! Sequences moving between nodes: a drain or a rebalance sends each
//! sequence this node owns to the node placement gives it (`drain.rs`,
//! `send.rs`), and a node receives the sequences others send it
//! (`receive.rs`). Calls against a moving sequence pass the gate
//! (`gate.rs`); the ownership record changes hands in etcd
//! (`kvtier-cluster`'s `handover.rs`); node-to-node calls use `peers.rs`.
//!
//! What a move carries: every page of every lane in its state (original
//! bytes, summaries, gone pages with their reasons and index entries), the
//! hash chain and the incarnation; durable rows are persisted at the
//! receiver before it takes over. What it does not: residency (the
//! receiver places pages by its own tiers), leases, attention statistics
//! and a registered policy, which a restart does not keep either.

mod drain;
mod gate;
mod peers;
mod receive;
mod send;
mod wire;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use kvtier_cluster::Node;
use kvtier_store::Store;
use tokio::sync::watch;

pub(crate) use drain::drain;
pub(crate) use gate::{Access, Moves, Permit};
pub use peers::PeerConfig;
pub(crate) use receive::{MoveStream, receive};

use peers::Peers;

/// What a node's moves work with.
#[derive(Debug)]
pub(crate) struct Mover {
    pub(crate) store: Arc<Store>,
    pub(crate) node: Arc<Node>,
    pub(crate) gate: Arc<Moves>,
    peers: Peers,
    /// Set while a drain runs: one at a time.
    pub(crate) draining: AtomicBool,
    /// Set once a drain emptied the node: the server stops.
    drained: watch::Sender<bool>,
}

impl Mover {
    pub(crate) fn new(store: Arc<Store>, node: Arc<Node>, peers: PeerConfig, max_message_bytes: usize) -> Self {
        let gate = Arc::new(Moves::new(node.id(), gate::CALL_WAIT));
        Self {
            store,
            node,
            gate,
            peers: Peers::new(peers, max_message_bytes),
            draining: AtomicBool::new(false),
            drained: watch::channel(false).0,
        }
    }

    /// Resolves once a drain emptied the node and it left the cluster.
    pub(crate) fn drained(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.drained.subscribe();
        async move {
            let _ = rx.wait_for(|d| *d).await;
        }
    }
}
