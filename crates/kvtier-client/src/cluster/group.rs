//! Context-parallel groups in a cluster: a sequence whose positions are
//! split over `world` shards, shard `r` holding the r-th block of pages on
//! the r-th node of the group's placement ranking, so each rank's pages
//! live on a different node. A selection over the whole group fans out to
//! the shards' nodes and merges into exactly the selection one node
//! holding everything would make ([`Partitioned`]).

use bytes::Bytes;
use kvtier_cluster::{Group, placement};

use super::{Cluster, Placed};
use crate::client::{ClientError, Result};
use crate::merge::{Part, Partitioned};
use crate::pb;

impl Cluster {
    /// The sequence id of shard `rank` of group `group`.
    pub fn shard_id(group: &str, rank: u32) -> String {
        format!("{group}.cp{rank}")
    }

    /// Creates the `world` shards of context-parallel group `group`, each
    /// on the node its rank places it (distinct nodes while the cluster has
    /// as many serving); shard `r` is [`Cluster::shard_id`]`(group, r)`.
    /// Where each went, in rank order.
    pub async fn create_group(
        &self,
        group: &str,
        world: u32,
        layout: pb::Layout,
        prefix_hashes: Vec<Bytes>,
    ) -> Result<Vec<Placed>> {
        let mut placed = Vec::with_capacity(world as usize);
        for rank in 0..world {
            let id = Self::shard_id(group, rank);
            let shard = Group {
                name: group.to_owned(),
                rank,
                world,
            };
            let owner = self
                .view()
                .placed(placement(self.placement_tenant(), &id, &prefix_hashes, Some(&shard)))
                .cloned()
                .ok_or_else(|| ClientError::Cluster("no node is serving".into()))?;
            let message = pb::PlacementGroup {
                name: shard.name.clone(),
                rank,
                world,
            };
            let (node, _) = self
                .create_at(owner, &id, layout.clone(), prefix_hashes.clone(), Some(message))
                .await?;
            placed.push(node);
        }
        Ok(placed)
    }

    /// The group as a [`Partitioned`] sequence: each shard's client (at its
    /// owner) and its block of pages as the shards hold them now, shard 0
    /// first. Selections through it fan out to the shards' nodes and merge
    /// exactly; build it again once the shards have grown.
    pub async fn group(&self, group: &str, world: u32) -> Result<Partitioned> {
        let mut parts = Vec::with_capacity(world as usize);
        let mut first_page = 0;
        for rank in 0..world {
            let id = Self::shard_id(group, rank);
            let mut client = self.sequence(&id).await?;
            let info = client.get_sequence(&id).await?;
            let page_size = info.layout.as_ref().map_or(1, |l| l.page_size.max(1));
            let pages = info.max_tokens.div_ceil(u64::from(page_size)) as u32;
            parts.push(Part {
                client,
                sequence_id: id,
                first_page,
                pages,
            });
            first_page += pages;
        }
        Partitioned::new(parts).map_err(ClientError::Cluster)
    }
}
