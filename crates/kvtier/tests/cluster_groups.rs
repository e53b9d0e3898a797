//! Context-parallel groups and prompt lookups in a cluster, against a real
//! etcd and real `kvtier serve` processes: a group's shards land on
//! distinct nodes and a selection over them, fanned out and merged, is the
//! one a node holding the whole sequence makes; a lookup finds a prompt's
//! pages on the node that holds them after a join moved its placement, and
//! a rebalance brings them to where creates go.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::Server;
use common::cluster::{cluster, code, node};
use common::etcd::Etcd;
use kvtier_client::{Cluster, SelectRequest, layout, pb};
use kvtier_core::placement::{Candidate, PlacementKey, ranking};
use tonic::Code;

const DIM: usize = 4;
const PAGE: usize = 4;
const HEADS: u32 = 2;

/// f32, 1 layer, 2 KV heads (4 query heads), head_dim 4, page size 4.
fn model() -> pb::Layout {
    layout(1, HEADS, HEADS * 2, DIM as u32, pb::DType::DtypeF32, PAGE as u32)
}

/// K then V rows, head-major, of global tokens `from..from + n`: keys vary
/// by token and head, so every page's bound differs.
fn kv(from: usize, n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for h in 0..HEADS as usize {
        for part in 0..2 {
            for t in from..from + n {
                for i in 0..DIM {
                    let x = ((t * 7 + h * 3 + i * 5) % 23) as f32 - 11.0 + part as f32 * 0.5;
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
    }
    out
}

async fn put(cluster: &Cluster, seq: &str, from: usize, n: usize) {
    cluster
        .call(seq, |mut c| async move {
            c.put_pages(seq, 0, 0..HEADS, 0, n as u32, kv(from, n).into()).await
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_groups_shards_land_on_distinct_nodes_and_a_merged_selection_equals_the_whole() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let mut servers: Vec<Server> = (0..3)
        .map(|i| node(dir.path(), &format!("n{i}"), &etcd.client_url, 3, 30))
        .collect();
    for s in &mut servers {
        s.client().await;
    }
    let cluster = cluster(&etcd.client_url, 3).await;
    let placed = cluster.create_group("g", 3, model(), vec![]).await.unwrap();
    let nodes: std::collections::BTreeSet<&str> = placed.iter().map(|p| p.node_id.as_str()).collect();
    assert_eq!(nodes.len(), 3, "3 shards on 3 nodes: {placed:?}");
    // Shard r holds the r-th block of 8 pages; one sequence holds it all.
    let block = 8 * PAGE;
    for rank in 0..3u32 {
        put(&cluster, &Cluster::shard_id("g", rank), rank as usize * block, block).await;
    }
    cluster.create_sequence("whole", model(), vec![]).await.unwrap();
    put(&cluster, "whole", 0, 3 * block).await;

    let mut group = cluster.group("g", 3).await.unwrap();
    assert_eq!(group.pages(), 24);
    for (budget, sinks, window) in [(6, 1, 1), (10, 2, 3), (24, 0, 0), (3, 1, 1)] {
        let queries: Vec<f32> = (0..HEADS as usize * 2 * DIM).map(|i| (i % 5) as f32 - 2.0).collect();
        let req = SelectRequest {
            sink_pages: sinks,
            window_pages: window,
            mode: pb::SelectionMode::Quest,
            ..SelectRequest::new(0, 0..HEADS, queries, budget)
        };
        let merged = group.select(&req).await.unwrap();
        let whole = cluster
            .call("whole", |mut c| {
                let req = req.clone();
                async move { c.select_pages("whole", &req).await }
            })
            .await
            .unwrap();
        let pages = |heads: &[pb::HeadSelection]| -> Vec<Vec<(u32, u32)>> {
            heads
                .iter()
                .map(|h| h.pages.iter().map(|p| (p.page, p.bound.to_bits())).collect())
                .collect()
        };
        assert_eq!(
            pages(&merged),
            pages(&whole.heads),
            "budget {budget}, sinks {sinks}, window {window}: the merge differs from the whole"
        );
    }

    // A shard created where its rank does not place it is refused, naming
    // the node it goes to.
    let shard = pb::PlacementGroup {
        name: "h".into(),
        rank: 1,
        world: 3,
    };
    let view = cluster.view();
    let at = view
        .placed(kvtier_cluster::placement(
            "default",
            "x",
            &[] as &[&[u8]],
            Some(&kvtier_cluster::Group {
                name: "h".into(),
                rank: 1,
                world: 3,
            }),
        ))
        .unwrap()
        .node_id
        .clone();
    let other = view.members().find(|n| n.node_id != at).unwrap().addr.clone();
    let mut elsewhere = kvtier_client::Client::connect(other).await.unwrap();
    let e = elsewhere
        .create_in_group("h.cp1", model(), vec![], Some(shard))
        .await
        .unwrap_err();
    assert_eq!(code(&e), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains(&at), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_finds_a_prompt_on_the_node_holding_it_after_a_join_and_a_rebalance_moves_it() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let mut servers: Vec<Server> = (0..2)
        .map(|i| node(dir.path(), &format!("n{i}"), &etcd.client_url, 3, 30))
        .collect();
    for s in &mut servers {
        s.client().await;
    }
    let cluster = cluster(&etcd.client_url, 2).await;
    // A prompt whose first hash three equal nodes place on n2, which joins
    // later.
    let weight = cluster.view().members().next().unwrap().weight();
    let ids = ["n0", "n1", "n2"];
    let candidates: Vec<Candidate<'_>> = ids.iter().map(|id| Candidate { node_id: id, weight }).collect();
    let first = (0..)
        .map(|i| format!("prompt-{i}").into_bytes())
        .find(|h| {
            let key = PlacementKey::Prefix {
                tenant: "default",
                first_hash: h,
            };
            ranking(key.hash(), &candidates)[0] == 2
        })
        .unwrap();
    let hashes = vec![Bytes::from(first), Bytes::from_static(b"prompt-page-1")];
    let (before, _) = cluster.create_sequence("p1", model(), hashes.clone()).await.unwrap();
    put(&cluster, "p1", 0, 2 * PAGE).await;
    assert_eq!(
        cluster.lookup(model(), hashes.clone()).await.unwrap(),
        (before.clone(), 2)
    );

    servers.push(node(dir.path(), "n2", &etcd.client_url, 3, 30));
    servers[2].client().await;
    cluster.wait_for_serving(3, Duration::from_secs(60)).await.unwrap();
    // Placement now names n2, which holds nothing: the lookup still finds
    // both pages where they are.
    assert_eq!(
        cluster.lookup(model(), hashes.clone()).await.unwrap(),
        (before, 2),
        "after the join"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["cluster", "rebalance", "--etcd", &etcd.client_url])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (now, pages) = cluster.lookup(model(), hashes.clone()).await.unwrap();
    assert_eq!((now.node_id.as_str(), pages), ("n2", 2), "after the rebalance");
    // A create with the prompt goes to n2 and attaches its pages.
    let (placed, created) = cluster.create_sequence("p2", model(), hashes).await.unwrap();
    assert_eq!((placed.node_id.as_str(), created.attached_pages), ("n2", 2));
}
