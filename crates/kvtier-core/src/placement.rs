//! Where a sequence lives in a cluster: weighted rendezvous hashing over the
//! serving nodes, a pure function of membership that nodes and clients
//! compute alike.
//!
//! Each node scores a key `w / -ln(u)`, `u` a uniform draw in (0, 1) from the
//! hash of (key, node) (the logarithmic method of Schindelhauer and Schomaker,
//! 2005): the highest score owns the key, and a node owns a share of keys
//! proportional to its weight. A node joining or leaving moves only the keys
//! it wins or won. The ranking beyond the first gives distinct nodes for the
//! context-parallel shards of one sequence.

use crate::hash::mix64;

/// gRPC metadata on a FAILED_PRECONDITION that sends the client elsewhere:
/// the node that has (or is to have) the sequence, and its address.
pub const OWNER_NODE: &str = "kvtier-owner-node";
/// Metadata key of the owner node's address, sent with [`OWNER_NODE`].
pub const OWNER_ADDR: &str = "kvtier-owner-addr";
/// Request metadata naming the creation of a sequence a call is meant for.
pub const INCARNATION: &str = "kvtier-incarnation";

/// What places a sequence: the first page's prefix hash when the sequence has
/// a hash chain (sequences sharing a prompt land together and share its
/// pages; sharing is per tenant), else the tenant and the sequence id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementKey<'a> {
    /// A sequence with a prefix hash chain, placed by its tenant and the hash
    /// of its first page.
    Prefix {
        /// The tenant's name.
        tenant: &'a str,
        /// The first page's prefix hash, as the client sent it.
        first_hash: &'a [u8],
    },
    /// A sequence without prefix hashes, placed by its full name.
    Sequence {
        /// The tenant's name.
        tenant: &'a str,
        /// The sequence's name within the tenant.
        sequence_id: &'a str,
    },
}

impl<'a> PlacementKey<'a> {
    /// The key of a sequence created with `prefix_hashes`.
    pub fn of(tenant: &'a str, sequence_id: &'a str, prefix_hashes: &'a [impl AsRef<[u8]>]) -> Self {
        match prefix_hashes.first() {
            Some(first) => Self::Prefix {
                tenant,
                first_hash: first.as_ref(),
            },
            None => Self::Sequence { tenant, sequence_id },
        }
    }

    /// A stable 64-bit hash: the same on every machine and in every version
    /// that keeps this wire-visible rule (a change moves every sequence).
    pub fn hash(&self) -> u64 {
        let (tag, tenant, rest) = match self {
            Self::Prefix { tenant, first_hash } => (b'p', tenant, *first_hash),
            Self::Sequence { tenant, sequence_id } => (b's', tenant, sequence_id.as_bytes()),
        };
        let mut h = fnv1a(FNV_OFFSET, &[tag]);
        h = fnv1a(h, tenant.as_bytes());
        // The tenant's length separates ("ab", "c") from ("a", "bc").
        h = fnv1a(h, &(tenant.len() as u64).to_le_bytes());
        mix64(fnv1a(h, rest))
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A node that may own keys, with its weight (its capacity; 0 owns nothing).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate<'a> {
    /// The node's id, unique in the cluster; it seeds the node's hash.
    pub node_id: &'a str,
    /// Relative share of keys the node should own; 0, negative or NaN owns none.
    pub weight: f64,
}

/// A node's score for a key: higher wins.
fn score(key: u64, node_id: &str, weight: f64) -> f64 {
    if weight.is_nan() || weight <= 0.0 {
        return f64::NEG_INFINITY;
    }
    let h = mix64(key ^ mix64(fnv1a(FNV_OFFSET, node_id.as_bytes())));
    // In (0, 1): the top 53 bits and a half step, never 0 or 1.
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    weight / -u.ln()
}

/// The candidates' indices from the key's owner down: rank `r` of a
/// context-parallel sequence goes to the `r`-th. Ties (equal ids and
/// weights) break to the lower id, so every caller agrees.
pub fn ranking(key: u64, nodes: &[Candidate<'_>]) -> Vec<usize> {
    let mut scored: Vec<(f64, usize)> = nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.weight > 0.0)
        .map(|(i, n)| (score(key, n.node_id, n.weight), i))
        .collect();
    scored.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then_with(|| nodes[a.1].node_id.cmp(nodes[b.1].node_id))
    });
    scored.into_iter().map(|(_, i)| i).collect()
}

/// The index of the key's owner, or `None` when no node has weight.
pub fn owner(key: u64, nodes: &[Candidate<'_>]) -> Option<usize> {
    nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.weight > 0.0)
        .map(|(i, n)| (score(key, n.node_id, n.weight), i))
        .max_by(|a, b| {
            a.0.total_cmp(&b.0)
                .then_with(|| nodes[b.1].node_id.cmp(nodes[a.1].node_id))
        })
        .map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn nodes(ids: &[String], weights: &[f64]) -> Vec<Candidate<'static>> {
        ids.iter()
            .zip(weights)
            .map(|(id, &weight)| Candidate {
                node_id: Box::leak(id.clone().into_boxed_str()),
                weight,
            })
            .collect()
    }

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("node-{i}")).collect()
    }

    #[test]
    fn owners_share_keys_in_proportion_to_weight() {
        let weights = [1.0, 2.0, 4.0, 1.0];
        let nodes = nodes(&ids(4), &weights);
        let mut won = [0usize; 4];
        let keys = 80_000u64;
        for k in 0..keys {
            won[owner(mix64(k), &nodes).unwrap()] += 1;
        }
        let total: f64 = weights.iter().sum();
        for (i, w) in weights.iter().enumerate() {
            let share = won[i] as f64 / keys as f64;
            assert!(
                (share - w / total).abs() < 0.01,
                "node {i}: share {share}, weight share {}",
                w / total
            );
        }
    }

    #[test]
    fn the_hash_is_the_documented_one() {
        // Placement is part of the wire contract between nodes and clients
        // of different builds: a change here moves every sequence.
        let key = PlacementKey::Sequence {
            tenant: "default",
            sequence_id: "s1",
        };
        assert_eq!(
            key.hash(),
            PlacementKey::Sequence {
                tenant: "default",
                sequence_id: "s1"
            }
            .hash()
        );
        assert_ne!(
            PlacementKey::Sequence {
                tenant: "ab",
                sequence_id: "c"
            }
            .hash(),
            PlacementKey::Sequence {
                tenant: "a",
                sequence_id: "bc"
            }
            .hash()
        );
        let (chain, other) = ([b"h0".to_vec(), b"h1".to_vec()], [b"h0".to_vec()]);
        let prefix = PlacementKey::of("t", "x", &chain);
        assert_eq!(prefix, PlacementKey::of("t", "y", &other));
        assert_eq!(
            prefix.hash(),
            0x7a5a_7320_4498_17af,
            "the hash rule changed (value computed apart, in Python)"
        );
    }

    #[test]
    fn no_weight_owns_nothing() {
        let nodes = nodes(&ids(2), &[0.0, 0.0]);
        assert_eq!(owner(1, &nodes), None);
        assert!(ranking(1, &nodes).is_empty());
        assert_eq!(owner(1, &[]), None);
    }

    proptest! {
        #[test]
        fn the_owner_heads_the_ranking_and_ranks_are_distinct(
            key in any::<u64>(),
            weights in prop::collection::vec(0.0f64..8.0, 1..12),
        ) {
            let nodes = nodes(&ids(weights.len()), &weights);
            let ranked = ranking(key, &nodes);
            prop_assert_eq!(ranked.first().copied(), owner(key, &nodes));
            let mut seen = ranked.clone();
            seen.sort_unstable();
            seen.dedup();
            prop_assert_eq!(seen.len(), ranked.len());
            prop_assert_eq!(ranked.len(), weights.iter().filter(|&&w| w > 0.0).count());
        }

        #[test]
        fn a_join_moves_only_keys_to_the_new_node(
            keys in prop::collection::vec(any::<u64>(), 1..200),
            n in 1usize..8,
        ) {
            let before = nodes(&ids(n), &vec![1.0; n]);
            let after = nodes(&ids(n + 1), &vec![1.0; n + 1]);
            for k in keys {
                let (was, is) = (owner(k, &before).unwrap(), owner(k, &after).unwrap());
                prop_assert!(is == was || is == n, "key {k} moved from {was} to {is}, not to the new node");
            }
        }

        #[test]
        fn the_order_of_candidates_does_not_matter(
            key in any::<u64>(),
            weights in prop::collection::vec(0.1f64..8.0, 1..10),
        ) {
            let ids = ids(weights.len());
            let nodes_fwd = nodes(&ids, &weights);
            let mut rev = nodes_fwd.clone();
            rev.reverse();
            let a = nodes_fwd[owner(key, &nodes_fwd).unwrap()].node_id;
            let b = rev[owner(key, &rev).unwrap()].node_id;
            prop_assert_eq!(a, b);
        }
    }
}
