//! Why a node refuses a call for a sequence in a cluster. The server maps
//! each to one status code (`kvtier-server`'s `status.rs`).

/// A refusal. Every message names the node it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// FAILED_PRECONDITION: the sequence is, or is to be, on another node;
    /// the client routes there.
    #[error("sequence {sequence} is {why} node {owner} ({addr}), not {this}")]
    Elsewhere {
        /// The sequence's id.
        sequence: String,
        /// `placed on` (placement puts a new sequence there) or `on` (that
        /// node owns it).
        why: &'static str,
        /// The node to go to.
        owner: String,
        /// That node's gRPC address.
        addr: String,
        /// The refusing node.
        this: String,
    },
    /// ALREADY_EXISTS: another node owns a sequence of that id.
    #[error("sequence {sequence} already exists on node {owner}")]
    ExistsElsewhere {
        /// The sequence's id.
        sequence: String,
        /// The node that owns it.
        owner: String,
    },
    /// NOT_FOUND: the call is meant for an earlier creation of the id.
    #[error(
        "sequence {sequence} was created again since: the call is for incarnation {expected}, the sequence \
         is incarnation {now}"
    )]
    Recreated {
        /// The sequence's id.
        sequence: String,
        /// The incarnation the call was meant for (its `kvtier-incarnation`).
        expected: u64,
        /// The incarnation the sequence is now.
        now: u64,
    },
    /// UNAVAILABLE: the owner's membership lease lapsed; it has until its
    /// grace ends to come back with the sequence.
    #[error(
        "sequence {sequence} is on node {owner}, which is out of the cluster (its lease lapsed); it gets the \
         sequence back if it returns within its grace period"
    )]
    OwnerOut {
        /// The sequence's id.
        sequence: String,
        /// The node that owns it.
        owner: String,
    },
    /// DATA_LOSS: the owner stayed away past its grace period.
    #[error("sequence {sequence} was lost with node {owner}, which stayed out of the cluster past its grace period")]
    Lost {
        /// The sequence's id.
        sequence: String,
        /// The node it was lost with.
        owner: String,
    },
    /// UNAVAILABLE: what the call needs from etcd cannot be had now.
    #[error("node {this} cannot {what}: {why}")]
    Unavailable {
        /// The refusing node.
        this: String,
        /// What it cannot do (`create a sequence`, say).
        what: &'static str,
        /// Why not.
        why: String,
    },
    /// FAILED_PRECONDITION: a move cannot hand the sequence over (the
    /// ownership record changed since the move began, say).
    #[error("sequence {sequence} cannot move to node {this}: {why}")]
    NotHandedOver {
        /// The sequence's id.
        sequence: String,
        /// The receiving node.
        this: String,
        /// Why not.
        why: String,
    },
    /// UNAVAILABLE: the node lost etcd for half its grace period; the
    /// cluster may give its sequences to others, so it serves none.
    #[error(
        "node {this} serves no sequence: it has not reached etcd for {secs} s, half its grace period, so the \
         cluster may declare its sequences lost"
    )]
    Fenced {
        /// The refusing node.
        this: String,
        /// Seconds since etcd last answered a renewal of its grace lease.
        secs: u64,
    },
}

impl Refusal {
    /// The node the client should go to instead, with its address.
    pub fn redirect(&self) -> Option<(&str, &str)> {
        match self {
            Self::Elsewhere { owner, addr, .. } => Some((owner, addr)),
            _ => None,
        }
    }
}
