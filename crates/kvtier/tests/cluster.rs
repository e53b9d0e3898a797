//! kvtier as a cluster, against a real etcd and real `kvtier serve`
//! processes on loopback: placement and routing, refusals that name the
//! owner, a killed node out and back within its grace with its durable
//! rows, a node past its grace (lost, taken over, forgotten on return),
//! etcd down and back, a three-member etcd losing its leader, and status.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::Server;
use common::etcd::Etcd;
use kvtier_client::{Client, ClientError, Cluster, Connect, EtcdConfig, layout, pb};
use tonic::Code;

const DIM: usize = 4;
const PAGE: usize = 4;

/// f16, 1 layer, 1 KV head, head_dim 4, page size 4.
fn tiny() -> pb::Layout {
    layout(1, 1, 1, DIM as u32, pb::DType::DtypeF16, PAGE as u32)
}

/// K then V rows of `n` tokens, each value naming the sequence and token:
/// a byte served from the wrong sequence or position shows.
fn kv(seed: u32, n: usize) -> Vec<u8> {
    let row = |t: usize, plus: f32| {
        let x = (seed % 512) as f32 + t as f32 / 8.0 + plus;
        (0..DIM).flat_map(move |_| half::f16::from_f32(x).to_le_bytes())
    };
    (0..n)
        .flat_map(|t| row(t, 0.0))
        .chain((0..n).flat_map(|t| row(t, 0.25)))
        .collect()
}

/// A node: `kvtier serve` joined to the cluster at `etcd`.
fn node(dir: &Path, id: &str, etcd: &str, ttl: u32, grace: u32) -> Server {
    let dir = dir.join(id);
    std::fs::create_dir_all(&dir).unwrap();
    Server::start(
        &dir,
        &[
            "--etcd",
            etcd,
            "--node-id",
            id,
            "--lease-ttl-secs",
            &ttl.to_string(),
            "--grace-secs",
            &grace.to_string(),
        ],
    )
}

async fn cluster(etcd: &str, nodes: usize) -> Cluster {
    let cluster = Cluster::connect(&EtcdConfig::new(EtcdConfig::parse_endpoints(etcd)), Connect::default())
        .await
        .unwrap();
    cluster.wait_for_serving(nodes, Duration::from_secs(60)).await.unwrap();
    cluster
}

fn code(e: &ClientError) -> Code {
    match e {
        ClientError::Status(s) => s.code(),
        other => panic!("not a status: {other}"),
    }
}

/// Every page's bytes of a one-layer, one-head sequence.
async fn read(mut client: Client, seq: &str) -> Result<Vec<u8>, ClientError> {
    let pages = client.fetch_pages(seq, 0, 0..1, vec![]).await?;
    // Pages are whole K then V; the test compares the concatenation of
    // each page's bytes against the same split of what was written.
    Ok(pages.into_iter().flat_map(|p| p.kv.to_vec()).collect())
}

/// What `read` returns for `n` tokens written as one `kv(seed, n)`.
fn expected(seed: u32, n: usize) -> Vec<u8> {
    let whole = kv(seed, n);
    let half = whole.len() / 2;
    let row = DIM * 2;
    let (k, v) = whole.split_at(half);
    (0..n.div_ceil(PAGE))
        .flat_map(|p| {
            let rows = p * PAGE..((p + 1) * PAGE).min(n);
            let (a, b) = (rows.start * row, rows.end * row);
            k[a..b].iter().chain(&v[a..b]).copied().collect::<Vec<_>>()
        })
        .collect()
}

async fn write(cluster: &Cluster, seq: &str, seed: u32, n: usize) {
    cluster
        .call(seq, |c| async move {
            c.with_persist(true)
                .put_pages(seq, 0, 0..1, 0, n as u32, kv(seed, n).into())
                .await
        })
        .await
        .unwrap();
}

/// Retries `f` until it returns `Some`, at most `limit`.
async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(t) = f().await {
            return t;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_go_where_placement_says_and_other_nodes_refuse_naming_the_owner() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let mut servers: Vec<Server> = (0..3)
        .map(|i| node(dir.path(), &format!("n{i}"), &etcd.client_url, 3, 30))
        .collect();
    let mut direct = Vec::new();
    for s in &mut servers {
        direct.push(s.client().await);
    }
    let cluster = cluster(&etcd.client_url, 3).await;
    let addr_of = |node: &str| {
        let view = cluster.view();
        view.member(node).unwrap().addr.clone()
    };
    let mut per_node = std::collections::BTreeMap::new();
    for i in 0..24u32 {
        let seq = format!("s{i}");
        let (placed, _) = cluster.create_sequence(&seq, tiny(), vec![]).await.unwrap();
        *per_node.entry(placed.node_id.clone()).or_insert(0) += 1;
        write(&cluster, &seq, i, 6).await;
        let got = cluster.call(&seq, |c| read(c, &seq)).await.unwrap();
        assert_eq!(got, expected(i, 6), "{seq}: wrong bytes through the cluster");
        // Every other node refuses, naming the owner, and holds nothing.
        for (n, client) in direct.iter_mut().enumerate() {
            let me = format!("n{n}");
            if me == placed.node_id {
                continue;
            }
            let e = client.get_sequence(&seq).await.unwrap_err();
            assert_eq!(code(&e), Code::FailedPrecondition, "{seq} on {me}: {e}");
            assert!(e.to_string().contains(&placed.node_id), "{e}");
            let e = client.create_sequence(&seq, tiny(), vec![]).await.unwrap_err();
            assert!(
                matches!(code(&e), Code::FailedPrecondition | Code::AlreadyExists),
                "a second create of {seq} on {me}: {e}"
            );
            assert!(e.to_string().contains(&placed.node_id), "{e}");
        }
        assert_eq!(addr_of(&placed.node_id), placed.addr);
    }
    assert_eq!(per_node.len(), 3, "24 sequences over 3 equal nodes: {per_node:?}");

    // A create sent to a node placement does not choose is refused with the
    // owner in metadata; a client with that node's id finds the right one.
    let seq = "direct";
    let owner = cluster
        .view()
        .owner(kvtier_core::placement::PlacementKey::Sequence {
            tenant: "default",
            sequence_id: seq,
        })
        .unwrap()
        .node_id
        .clone();
    let other = (0..3).map(|n| format!("n{n}")).find(|n| *n != owner).unwrap();
    let e = direct[other[1..].parse::<usize>().unwrap()]
        .create_sequence(seq, tiny(), vec![])
        .await
        .unwrap_err();
    let ClientError::Status(status) = &e else { panic!("{e}") };
    assert_eq!(status.code(), Code::FailedPrecondition, "{e}");
    let named = status
        .metadata()
        .get(kvtier_cluster::OWNER_NODE)
        .unwrap()
        .to_str()
        .unwrap();
    assert_eq!(named, owner);

    // Sequences sharing a first page's hash land together.
    let hashes: Vec<bytes::Bytes> = vec![bytes::Bytes::from_static(b"prompt-page-0")];
    let (a, _) = cluster.create_sequence("p1", tiny(), hashes.clone()).await.unwrap();
    let (b, _) = cluster.create_sequence("p2", tiny(), hashes).await.unwrap();
    assert_eq!(a, b);

    // status counts every sequence, per node.
    let status = common::kvtier(&["cluster", "status", "--etcd", &etcd.client_url, "--json"]);
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let total: u64 = status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["sequences"].as_u64().unwrap())
        .sum();
    assert_eq!(total, 24 + 2);
    assert!(status["etcd"][0]["error"].is_null(), "{status}");
}
