//! The cluster's members as clients and nodes see them: a snapshot of the
//! node records at one etcd revision, kept current by a watch.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, WatchOptions};
use kvtier_core::placement::{self, Candidate, PlacementKey};
use tokio::sync::watch;

use crate::keys::Keys;
use crate::record::{Group, NodeRecord, NodeState};

/// The members at one revision.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct View {
    /// The etcd revision the snapshot is at; 0 before the first read.
    pub revision: i64,
    /// Whether the watch behind this view is running. A view that is not
    /// current may miss members that left or joined since.
    pub current: bool,
    members: BTreeMap<String, NodeRecord>,
}

impl View {
    /// Every member, whatever its state, by node id.
    pub fn members(&self) -> impl Iterator<Item = &NodeRecord> {
        self.members.values()
    }

    /// The member of that id; `None` if no such node is in the cluster.
    pub fn member(&self, node_id: &str) -> Option<&NodeRecord> {
        self.members.get(node_id)
    }

    /// The serving members from the key's owner down (placement skips
    /// joining and draining nodes): rank `r` of a context-parallel sequence
    /// goes to the `r`-th.
    pub fn ranking(&self, key: PlacementKey<'_>) -> Vec<&NodeRecord> {
        let serving: Vec<&NodeRecord> = self.members().filter(|n| n.state == NodeState::Serving).collect();
        let candidates: Vec<Candidate<'_>> = serving
            .iter()
            .map(|n| Candidate {
                node_id: &n.node_id,
                weight: n.weight(),
            })
            .collect();
        placement::ranking(key.hash(), &candidates)
            .into_iter()
            .map(|i| serving[i])
            .collect()
    }

    /// The node that placement gives the key to.
    pub fn owner(&self, key: PlacementKey<'_>) -> Option<&NodeRecord> {
        self.ranking(key).into_iter().next()
    }

    /// The node that placement gives a sequence: the owner of its key, or
    /// for shard `rank` of a context-parallel group the rank-th node of the
    /// key's ranking (wrapping when fewer nodes serve).
    pub fn placed(&self, (key, rank): (PlacementKey<'_>, u32)) -> Option<&NodeRecord> {
        let ranking = self.ranking(key);
        (!ranking.is_empty()).then(|| ranking[rank as usize % ranking.len()])
    }

    fn apply(&mut self, record: NodeRecord) {
        self.members.insert(record.node_id.clone(), record);
    }
}

/// What places a sequence, and its rank in the key's ranking: a shard of a
/// context-parallel group is placed by the group's name (or the first
/// prefix hash) at its rank; any other sequence by its id (or the first
/// prefix hash) at rank 0.
pub fn placement<'a>(
    tenant: &'a str,
    sequence_id: &'a str,
    prefix_hashes: &'a [impl AsRef<[u8]>],
    group: Option<&'a Group>,
) -> (PlacementKey<'a>, u32) {
    match group {
        Some(g) => (PlacementKey::of(tenant, &g.name, prefix_hashes), g.rank),
        None => (PlacementKey::of(tenant, sequence_id, prefix_hashes), 0),
    }
}

/// Reads the members once, then follows their changes, re-reading after any
/// break (etcd down, a compacted revision), for as long as a receiver lives.
/// The first view is read before this returns.
pub(crate) async fn follow(
    mut etcd: etcd_client::Client,
    keys: Keys,
) -> Result<watch::Receiver<Arc<View>>, etcd_client::Error> {
    let first = read(&mut etcd, &keys).await?;
    let (tx, rx) = watch::channel(Arc::new(first));
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            if tx.is_closed() {
                return;
            }
            let revision = tx.borrow().revision;
            match watch_from(&mut etcd, &keys, &tx, revision).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "the membership watch broke; re-reading");
                    tx.send_modify(|v| {
                        let mut stale = View::clone(v);
                        stale.current = false;
                        *v = Arc::new(stale);
                    });
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
            if let Ok(view) = read(&mut etcd, &keys).await {
                backoff = Duration::from_millis(100);
                let _ = tx.send(Arc::new(view));
            }
        }
    });
    Ok(rx)
}

async fn read(etcd: &mut etcd_client::Client, keys: &Keys) -> Result<View, etcd_client::Error> {
    let got = etcd.get(keys.nodes(), Some(GetOptions::new().with_prefix())).await?;
    let mut view = View {
        revision: got.header().map_or(0, |h| h.revision()),
        current: true,
        members: BTreeMap::new(),
    };
    for kv in got.kvs() {
        match serde_json::from_slice::<NodeRecord>(kv.value()) {
            Ok(record) => view.apply(record),
            Err(e) => {
                tracing::warn!(key = %String::from_utf8_lossy(kv.key()), error = %e, "skipping a node record that does not parse")
            }
        }
    }
    Ok(view)
}

/// Applies changes after `revision` until the watch breaks (an error) or
/// every receiver is gone (`Ok`).
async fn watch_from(
    etcd: &mut etcd_client::Client,
    keys: &Keys,
    tx: &watch::Sender<Arc<View>>,
    revision: i64,
) -> Result<(), etcd_client::Error> {
    let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
    let mut stream = etcd.watch(keys.nodes(), Some(options)).await?;
    loop {
        let message = tokio::select! {
            m = stream.message() => m?,
            () = tx.closed() => return Ok(()),
        };
        let Some(response) = message else {
            return Err(etcd_client::Error::WatchError("the watch ended".into()));
        };
        if response.canceled() {
            return Err(etcd_client::Error::WatchError(format!(
                "the watch was canceled: {}",
                response.cancel_reason()
            )));
        }
        let mut view = View::clone(&tx.borrow());
        view.current = true;
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            view.revision = view.revision.max(kv.mod_revision());
            match event.event_type() {
                EventType::Put => match serde_json::from_slice::<NodeRecord>(kv.value()) {
                    Ok(record) => view.apply(record),
                    Err(e) => tracing::warn!(error = %e, "skipping a node record that does not parse"),
                },
                EventType::Delete => {
                    let key = String::from_utf8_lossy(kv.key());
                    if let Some(id) = key.strip_prefix(&keys.nodes()) {
                        view.members.remove(id);
                    }
                }
            }
        }
        if let Some(h) = response.header() {
            view.revision = view.revision.max(h.revision());
        }
        tx.send_replace(Arc::new(view));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::TierBytes;

    fn node(id: &str, state: NodeState, host: u64) -> NodeRecord {
        NodeRecord {
            node_id: id.into(),
            addr: format!("http://{id}"),
            peer_addr: None,
            state,
            version: "test".into(),
            capacity: TierBytes {
                device: 0,
                host,
                nvme: 0,
            },
            free: TierBytes::default(),
        }
    }

    #[test]
    fn placement_skips_nodes_that_are_not_serving() {
        let mut view = View::default();
        view.apply(node("a", NodeState::Serving, 1));
        view.apply(node("b", NodeState::Joining, 1));
        view.apply(node("c", NodeState::Draining, 1));
        for i in 0..100 {
            let id = format!("s{i}");
            let key = PlacementKey::Sequence {
                tenant: "t",
                sequence_id: &id,
            };
            assert_eq!(view.owner(key).unwrap().node_id, "a");
            assert_eq!(view.ranking(key).len(), 1);
        }
        // A group's shards go to distinct nodes while there are as many.
        view.apply(node("d", NodeState::Serving, 1));
        view.apply(node("e", NodeState::Serving, 1));
        let shards: std::collections::BTreeSet<&str> = (0..3)
            .map(|rank| {
                let g = Group {
                    name: "g".into(),
                    rank,
                    world: 3,
                };
                let none: &[&[u8]] = &[];
                view.placed(placement("t", "ignored", none, Some(&g)))
                    .unwrap()
                    .node_id
                    .as_str()
            })
            .collect();
        assert_eq!(shards.len(), 3, "{shards:?}");
        let fourth = Group {
            name: "g".into(),
            rank: 3,
            world: 4,
        };
        let none: &[&[u8]] = &[];
        let first = Group {
            rank: 0,
            ..fourth.clone()
        };
        assert_eq!(
            view.placed(placement("t", "x", none, Some(&fourth))),
            view.placed(placement("t", "y", none, Some(&first))),
            "rank 3 of 3 nodes wraps to rank 0's node"
        );
        view.members.clear();
        assert!(
            view.owner(PlacementKey::Sequence {
                tenant: "t",
                sequence_id: "s"
            })
            .is_none()
        );
    }
}
