//! Handing a sequence from its owner to another node (a drain or a
//! rebalance). The ownership record moves in one etcd transaction, at the
//! revision the owner read when the move began, so exactly one of the two
//! nodes owns the sequence at any time, whatever fails in between:
//!
//! - the owner reads the record and its revision ([`Node::ownership`]) and
//!   sends the sequence with that revision;
//! - the receiver, once it holds every page (durable rows persisted),
//!   rewrites the record for itself if it is still at that revision
//!   ([`Node::take_over`]): from then on it owns the sequence, under the
//!   same incarnation and group;
//! - the owner, told that the receiver took over, gives the sequence up
//!   without touching the record ([`Node::handed_over`]). Told nothing (the
//!   stream broke, the receiver died), it rewrites the record unchanged at
//!   that revision ([`Node::keep_or_learn`]): if that succeeds, the
//!   receiver can no longer take over and the sequence stays; if not, the
//!   record says where it went.

use std::sync::atomic::Ordering;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use kvtier_core::SequenceKey;

use crate::node::Node;
use crate::record::{NodeState, OwnerRecord};
use crate::refusal::Refusal;

/// A sequence's ownership record and the etcd revision it was last
/// written at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ownership {
    /// The record.
    pub record: OwnerRecord,
    /// Its mod revision: a move hands over only a record still at it.
    pub revision: i64,
}

/// Where a sequence is after a move that did not say how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kept {
    /// Still this node's, and no receiver can take it over any more.
    Here,
    /// The receiver (this node id) took it over.
    Moved(String),
    /// No longer this node's and not moved: its record is gone or names a
    /// node that took it over past this node's grace.
    Gone,
}

impl Node {
    /// The ownership record of `key` and its revision; `None`: none.
    pub async fn ownership(&self, key: &SequenceKey) -> Result<Option<Ownership>, etcd_client::Error> {
        let got = self.etcd.clone().get(self.keys.sequence(key), None).await?;
        Ok(got.kvs().first().and_then(|kv| {
            serde_json::from_slice::<OwnerRecord>(kv.value())
                .ok()
                .map(|record| Ownership {
                    record,
                    revision: kv.mod_revision(),
                })
        }))
    }

    /// The receiver's commit: takes over the record of a sequence `from`
    /// sent (incarnation `incarnation`), if it is still at `revision`, and
    /// owns the sequence from then on.
    pub async fn take_over(
        &self,
        key: &SequenceKey,
        from: &str,
        revision: i64,
        incarnation: u64,
    ) -> Result<(), Refusal> {
        self.check_serving()?;
        let me = self.config.node_id.clone();
        let refused = |why: String| Refusal::NotHandedOver {
            sequence: key.sequence.as_str().to_owned(),
            this: me.clone(),
            why,
        };
        let state = *self.state.lock();
        if state != NodeState::Serving {
            return Err(refused(format!("it is {}", state.as_str())));
        }
        let etcd_down = |e: etcd_client::Error| Refusal::Unavailable {
            this: self.config.node_id.clone(),
            what: "take a sequence over",
            why: format!("etcd: {e}"),
        };
        let Some(now) = self.ownership(key).await.map_err(etcd_down)? else {
            return Err(refused("it has no ownership record any more".into()));
        };
        if now.revision != revision || now.record.node_id != from || now.record.incarnation != incarnation {
            return Err(refused(format!(
                "its ownership record changed since the move began (node {} incarnation {} at revision {}, the \
                 move is for node {from} incarnation {incarnation} at revision {revision})",
                now.record.node_id, now.record.incarnation, now.revision
            )));
        }
        let k = self.keys.sequence(key);
        let mine = OwnerRecord {
            node_id: me.clone(),
            ..now.record
        };
        let value = serde_json::to_vec(&mine).expect("an owner record serialises");
        let taken = self
            .etcd
            .clone()
            .txn(
                Txn::new()
                    .when([Compare::mod_revision(k.clone(), CompareOp::Equal, revision)])
                    .and_then([TxnOp::put(k, value, None)]),
            )
            .await
            .map_err(etcd_down)?
            .succeeded();
        if !taken {
            return Err(refused("its ownership record changed during the commit".into()));
        }
        self.own(key, incarnation);
        tracing::info!(sequence = %key, from, "took a sequence over");
        Ok(())
    }

    /// The sender, told that the receiver took the sequence over: it is no
    /// longer this node's (the record is the receiver's now, and stays).
    pub fn handed_over(&self, key: &SequenceKey) {
        self.disown(key);
    }

    /// The sender, after a move whose outcome it was not told: rewrites the
    /// record unchanged if it is still at `revision`, so that the receiver
    /// can no longer take over, and otherwise reads where it went.
    pub async fn keep_or_learn(&self, key: &SequenceKey, revision: i64) -> Result<Kept, etcd_client::Error> {
        let k = self.keys.sequence(key);
        let mut etcd = self.etcd.clone();
        let got = etcd.get(k.clone(), None).await?;
        let Some(kv) = got.kvs().first() else {
            self.disown(key);
            return Ok(Kept::Gone);
        };
        let record: Option<OwnerRecord> = serde_json::from_slice(kv.value()).ok();
        if kv.mod_revision() == revision {
            let kept = etcd
                .txn(
                    Txn::new()
                        .when([Compare::mod_revision(k.clone(), CompareOp::Equal, revision)])
                        .and_then([TxnOp::put(k, kv.value(), None)]),
                )
                .await?
                .succeeded();
            if kept {
                return Ok(Kept::Here);
            }
            // Changed between the read and the write: read it again.
            return Box::pin(self.keep_or_learn(key, revision)).await;
        }
        match record {
            Some(r) if r.node_id == self.config.node_id => Ok(Kept::Here),
            Some(r) => {
                self.disown(key);
                Ok(Kept::Moved(r.node_id))
            }
            None => {
                self.disown(key);
                Ok(Kept::Gone)
            }
        }
    }

    /// Marks the node draining (placement skips it: a drain moves every
    /// sequence) or serving again (a drain called off); waits until the
    /// membership view shows it, at most the etcd timeout.
    pub async fn set_draining(&self, draining: bool) -> Result<(), etcd_client::Error> {
        let state = if draining {
            NodeState::Draining
        } else {
            NodeState::Serving
        };
        self.set_state(state).await?;
        let mut view = self.view_receiver();
        let me = self.config.node_id.clone();
        let seen = view.wait_for(|v| v.member(&me).is_some_and(|n| n.state == state));
        let _ = tokio::time::timeout(self.config.etcd.timeout, seen).await;
        Ok(())
    }

    /// The node's part in the cluster now.
    pub fn state(&self) -> NodeState {
        *self.state.lock()
    }

    /// Leaves the cluster holding nothing (a drain moved everything): both
    /// leases are revoked, so no record says the node may come back for
    /// sequences.
    pub async fn leave_empty(&self) {
        self.left.store(true, Ordering::Release);
        let (membership, grace) = {
            let l = self.leases.lock();
            (l.membership, l.grace)
        };
        let mut etcd = self.etcd.clone();
        for (what, lease) in [("grace", grace), ("membership", membership)] {
            if let Err(e) = etcd.lease_revoke(lease).await {
                tracing::warn!(error = %e, lease = what, "could not revoke a lease; it lapses by itself");
            }
        }
        tracing::info!(node = %self.config.node_id, "drained: left the cluster holding nothing");
    }
}
