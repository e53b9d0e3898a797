//! kvtier as a cluster, against a real etcd and real `kvtier serve`
//! processes on loopback: placement and routing, refusals that name the
//! owner, a killed node out and back within its grace with its durable
//! rows, a node past its grace (lost, taken over, forgotten on return),
//! etcd down and back, a three-member etcd losing its leader, and status.

mod common;

use std::time::{Duration, Instant};

use common::Server;
use common::cluster::{cluster, cluster as cluster_of, code, eventually, healthy, node, read};
use common::etcd::Etcd;
use kvtier_client::{Client, ClientError, Cluster, layout, pb};
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

    // Sequences sharing a first page's hash land together, and a lookup
    // finds the prompt's stored pages where a create attaches them.
    let hashes: Vec<bytes::Bytes> = vec![bytes::Bytes::from_static(b"prompt-page-0")];
    let (at, pages) = cluster.lookup(tiny(), hashes.clone()).await.unwrap();
    assert_eq!(pages, 0);
    let (a, _) = cluster.create_sequence("p1", tiny(), hashes.clone()).await.unwrap();
    assert_eq!(a, at);
    cluster
        .call("p1", |mut c| async move {
            c.put_pages("p1", 0, 0..1, 0, PAGE as u32, kv(1, PAGE).into()).await
        })
        .await
        .unwrap();
    assert_eq!(cluster.lookup(tiny(), hashes.clone()).await.unwrap(), (a.clone(), 1));
    let (b, created) = cluster.create_sequence("p2", tiny(), hashes).await.unwrap();
    assert_eq!((b, created.attached_pages), (a, 1));

    // Every node serves the membership it follows.
    for (n, client) in direct.iter_mut().enumerate() {
        let view = client.cluster().await.unwrap();
        assert_eq!(view.node_id, format!("n{n}"));
        assert_eq!(view.nodes.len(), 3, "{view:?}");
        assert!(
            view.current && view.nodes.iter().all(|m| m.state == "serving"),
            "{view:?}"
        );
    }

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

/// The sequences (of `seqs`) whose owner is `node`.
fn owned_by<'a>(cluster: &Cluster, node: &str, seqs: &'a [String]) -> Vec<&'a String> {
    let view = cluster.view();
    seqs.iter()
        .filter(|s| {
            view.owner(kvtier_core::placement::PlacementKey::Sequence {
                tenant: "default",
                sequence_id: s,
            })
            .is_some_and(|o| o.node_id == node)
        })
        .collect()
}

/// `n` nodes of one cluster (membership TTL and grace in seconds), a
/// routing client, and `seqs` sequences `s0..` of `tokens` tokens each,
/// written persisted with `kv(i, tokens)`.
async fn populated(
    dir: &std::path::Path,
    etcd: &str,
    n: usize,
    (ttl, grace): (u32, u32),
    seqs: usize,
    tokens: usize,
) -> (Vec<Server>, Cluster, Vec<String>) {
    let mut servers: Vec<Server> = (0..n).map(|i| node(dir, &format!("n{i}"), etcd, ttl, grace)).collect();
    for s in &mut servers {
        s.client().await;
    }
    let cluster = cluster(etcd, n).await;
    let names: Vec<String> = (0..seqs).map(|i| format!("s{i}")).collect();
    for (i, seq) in names.iter().enumerate() {
        cluster.create_sequence(seq, tiny(), vec![]).await.unwrap();
        write(&cluster, seq, i as u32, tokens).await;
    }
    (servers, cluster, names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_is_out_then_back_within_its_grace_with_its_durable_rows() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let (mut servers, cluster, seqs) = populated(dir.path(), &etcd.client_url, 3, (1, 30), 12, 7).await;
    let on_n1 = owned_by(&cluster, "n1", &seqs);
    assert!(!on_n1.is_empty());
    servers.remove(1).kill();

    // Out: its sequences are UNAVAILABLE, naming it; never another's bytes.
    let victim = on_n1[0].clone();
    let e = eventually(Duration::from_secs(20), "n1's lease lapsing", || {
        let (cluster, victim) = (cluster.clone(), victim.clone());
        async move {
            match cluster.call(&victim, |c| read(c, &victim)).await {
                Err(e) if code(&e) == Code::Unavailable && e.to_string().contains("out of the cluster") => Some(e),
                _ => None,
            }
        }
    })
    .await;
    assert!(e.to_string().contains("n1"), "{e}");
    // The others' sequences are served all along.
    for (i, seq) in seqs.iter().enumerate().filter(|(_, s)| !on_n1.contains(s)) {
        let got = cluster.call(seq, |c| read(c, seq)).await.unwrap();
        assert_eq!(got, expected(i as u32, 7), "{seq}");
    }

    // Back within the grace, at another address: every durable row.
    servers.insert(1, node(dir.path(), "n1", &etcd.client_url, 1, 30));
    servers[1].client().await;
    cluster.wait_for_serving(3, Duration::from_secs(30)).await.unwrap();
    for seq in &on_n1 {
        let i: u32 = seq[1..].parse().unwrap();
        let got = eventually(Duration::from_secs(20), "n1 serving again", || {
            let cluster = cluster.clone();
            async move { cluster.call(seq, |c| read(c, seq)).await.ok() }
        })
        .await;
        assert_eq!(got, expected(i, 7), "{seq} after n1's rejoin");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_grace_a_nodes_sequences_are_lost_taken_over_and_forgotten_on_its_return() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let (mut servers, cluster, seqs) = populated(dir.path(), &etcd.client_url, 3, (1, 3), 12, 5).await;
    let on_n1 = owned_by(&cluster, "n1", &seqs);
    assert!(on_n1.len() >= 2, "{on_n1:?}");
    let (victim, untouched) = (on_n1[0].clone(), on_n1[1].clone());
    servers.remove(1).kill();
    let e = eventually(Duration::from_secs(30), "n1's grace ending", || {
        let (cluster, victim) = (cluster.clone(), victim.clone());
        async move {
            match cluster.call(&victim, |c| read(c, &victim)).await {
                Err(e) if code(&e) == Code::DataLoss => Some(e),
                _ => None,
            }
        }
    })
    .await;
    assert!(e.to_string().contains("n1") && e.to_string().contains("lost"), "{e}");

    // Another client creates the id again where placement now puts it,
    // with new bytes: this client's calls, meant for the first creation,
    // are refused, never served the new bytes.
    let other = cluster_of(&etcd.client_url, 2).await;
    let (placed, created) = other.create_sequence(&victim, tiny(), vec![]).await.unwrap();
    assert_ne!(placed.node_id, "n1");
    assert_ne!(created.incarnation, 0);
    write(&other, &victim, 999, 5).await;
    let e = cluster.call(&victim, |c| read(c, &victim)).await.unwrap_err();
    assert_eq!(code(&e), Code::NotFound, "{e}");
    assert!(e.to_string().contains("created again"), "{e}");
    let cluster = other;

    // n1 returns with the old incarnation on its disk: it gives it up.
    servers.insert(1, node(dir.path(), "n1", &etcd.client_url, 1, 3));
    let mut n1 = servers[1].client().await;
    cluster.wait_for_serving(3, Duration::from_secs(30)).await.unwrap();
    let e = n1.get_sequence(&victim).await.unwrap_err();
    assert_eq!(code(&e), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains(&placed.node_id), "{e}");
    let got = cluster.call(&victim, |c| read(c, &victim)).await.unwrap();
    assert_eq!(got, expected(999, 5), "the new incarnation's bytes, never the old");
    // Its other sequences are gone for good, not served from the old disk.
    let e = cluster.call(&untouched, |c| read(c, &untouched)).await.unwrap_err();
    assert_eq!(code(&e), Code::NotFound, "{untouched}: {e}");
    let log = servers[1].stderr();
    assert!(log.contains("within_grace=false"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_etcd_nodes_serve_what_they_hold_then_fence_then_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = Etcd::start(dir.path());
    let mut server = node(dir.path(), "n0", &etcd.client_url, 1, 10);
    let mut direct = server.client().await;
    let cluster = cluster(&etcd.client_url, 1).await;
    cluster.create_sequence("s0", tiny(), vec![]).await.unwrap();
    write(&cluster, "s0", 0, 9).await;
    assert!(healthy(&server.addr, kvtier_server::CLUSTER_HEALTH_SERVICE));

    etcd.kill();
    // Degraded: reads go on, creates (which need a fresh view) do not.
    eventually(Duration::from_secs(10), "health saying degraded", || async {
        (!healthy(&server.addr, kvtier_server::CLUSTER_HEALTH_SERVICE)).then_some(())
    })
    .await;
    assert!(healthy(&server.addr, "kvtier.v1.KvTier"));
    assert_eq!(read(direct.clone(), "s0").await.unwrap(), expected(0, 9));
    let e = direct.create_sequence("s1", tiny(), vec![]).await.unwrap_err();
    assert_eq!(code(&e), Code::Unavailable, "{e}");
    assert!(e.to_string().contains("n0"), "{e}");

    // Past half the grace: fenced, serving nothing.
    let e = eventually(Duration::from_secs(15), "the node fencing itself", || {
        let direct = direct.clone();
        async move { read(direct, "s0").await.err() }
    })
    .await;
    assert_eq!(code(&e), Code::Unavailable, "{e}");
    assert!(e.to_string().contains("serves no sequence"), "{e}");
    // Health follows at the node's next renewal attempt (a third of the TTL).
    eventually(Duration::from_secs(5), "health saying fenced", || async {
        (!healthy(&server.addr, "kvtier.v1.KvTier")).then_some(())
    })
    .await;

    // etcd back: the node renews, registers again, serves, creates.
    etcd.restart();
    eventually(Duration::from_secs(30), "the node serving again", || {
        let direct = direct.clone();
        async move { read(direct, "s0").await.ok() }
    })
    .await;
    eventually(Duration::from_secs(30), "health serving", || async {
        healthy(&server.addr, kvtier_server::CLUSTER_HEALTH_SERVICE).then_some(())
    })
    .await;
    cluster.wait_for_serving(1, Duration::from_secs(30)).await.unwrap();
    eventually(Duration::from_secs(30), "a create after etcd's return", || {
        let cluster = cluster.clone();
        async move { cluster.create_sequence("s1", tiny(), vec![]).await.ok() }
    })
    .await;
    assert_eq!(read(direct, "s0").await.unwrap(), expected(0, 9));
    server.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_member_etcd_losing_its_leader_does_not_stop_kvtier() {
    let dir = tempfile::tempdir().unwrap();
    let mut members = Etcd::members(dir.path(), 3);
    let urls = members
        .iter()
        .map(|m| m.client_url.clone())
        .collect::<Vec<_>>()
        .join(",");
    let mut servers: Vec<Server> = (0..2)
        .map(|i| node(dir.path(), &format!("n{i}"), &urls, 2, 30))
        .collect();
    for s in &mut servers {
        s.client().await;
    }
    let cluster = cluster(&urls, 2).await;
    for i in 0..4u32 {
        let seq = format!("before{i}");
        cluster.create_sequence(&seq, tiny(), vec![]).await.unwrap();
        write(&cluster, &seq, i, 4).await;
    }
    let status: serde_json::Value =
        serde_json::from_str(&common::kvtier(&["cluster", "status", "--etcd", &urls, "--json"])).unwrap();
    let leader = status["etcd"]
        .as_array()
        .unwrap()
        .iter()
        .position(|e| e["leader"] == true)
        .expect("one member leads");
    members[leader].kill();

    for i in 0..4u32 {
        let seq = format!("after{i}");
        eventually(Duration::from_secs(20), "a create with a new leader", || {
            let (cluster, seq) = (cluster.clone(), seq.clone());
            async move { cluster.create_sequence(&seq, tiny(), vec![]).await.ok() }
        })
        .await;
        write(&cluster, &seq, 100 + i, 4).await;
    }
    for i in 0..4u32 {
        for (seq, seed) in [(format!("before{i}"), i), (format!("after{i}"), 100 + i)] {
            let got = cluster.call(&seq, |c| read(c, &seq)).await.unwrap();
            assert_eq!(got, expected(seed, 4), "{seq}");
        }
    }
    // A node whose connection was to the lost member may report degraded
    // until its client reaches another member.
    for s in &servers {
        eventually(Duration::from_secs(20), "every node's health serving", || async {
            healthy(&s.addr, kvtier_server::CLUSTER_HEALTH_SERVICE).then_some(())
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_at_once_and_a_restart_within_the_grace_keeps_the_sequences() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let (mut servers, cluster, seqs) = populated(dir.path(), &etcd.client_url, 2, (30, 60), 8, 3).await;
    let on_n1: Vec<String> = owned_by(&cluster, "n1", &seqs).into_iter().cloned().collect();
    let stopped = Instant::now();
    servers.remove(1).terminate();
    // Gone from the view long before its 30 s lease would lapse.
    eventually(Duration::from_secs(10), "n1 leaving the view", || async {
        cluster.view().member("n1").is_none().then_some(())
    })
    .await;
    assert!(stopped.elapsed() < Duration::from_secs(30));
    servers.insert(1, node(dir.path(), "n1", &etcd.client_url, 30, 60));
    servers[1].client().await;
    cluster.wait_for_serving(2, Duration::from_secs(30)).await.unwrap();
    for seq in &on_n1 {
        let i: u32 = seq[1..].parse().unwrap();
        let got = cluster.call(seq, |c| read(c, seq)).await.unwrap();
        assert_eq!(got, expected(i, 3), "{seq}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_etcd_fences_itself_before_its_sequences_are_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let proxy = common::etcd::Proxy::start(&etcd.client_url).await;
    let (ttl, grace) = (1, 8);
    // n0 reaches etcd only through the proxy; n1 directly.
    let mut servers = [
        node(dir.path(), "n0", &proxy.url, ttl, grace),
        node(dir.path(), "n1", &etcd.client_url, ttl, grace),
    ];
    let mut n0 = servers[0].client().await;
    let mut n1 = servers[1].client().await;
    let cluster = cluster(&etcd.client_url, 2).await;
    let seqs: Vec<String> = (0..10).map(|i| format!("s{i}")).collect();
    for (i, seq) in seqs.iter().enumerate() {
        cluster.create_sequence(seq, tiny(), vec![]).await.unwrap();
        write(&cluster, seq, i as u32, 5).await;
    }
    let on_n0: Vec<String> = owned_by(&cluster, "n0", &seqs).into_iter().cloned().collect();
    assert!(on_n0.len() >= 2, "{on_n0:?}");
    let (taken, kept) = (on_n0[0].clone(), on_n0[1].clone());

    let cut = Instant::now();
    proxy.cut();
    // Out of the others' view after its lease: n1 says so. n0 still serves
    // what it holds to clients that reach it, until half its grace.
    eventually(Duration::from_secs(15), "n0 out of the view", || async {
        cluster.view().member("n0").is_none().then_some(())
    })
    .await;
    let e = n1.get_sequence(&kept).await.unwrap_err();
    assert_eq!(code(&e), Code::Unavailable, "{e}");
    assert!(e.to_string().contains("n0"), "{e}");
    let k: u32 = kept[1..].parse().unwrap();
    assert_eq!(read(n0.clone(), &kept).await.unwrap(), expected(k, 5));
    // From here on, each round tries the takeover (a create of the id on
    // n1) and asks n0 whether it still serves: n0 must fence itself (at
    // half its grace) before the takeover succeeds (after its grace).
    let (mut fenced, mut taken_at) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(40);
    while taken_at.is_none() {
        assert!(Instant::now() < deadline, "no takeover after {:?}", cut.elapsed());
        if fenced.is_none()
            && let Err(e) = read(n0.clone(), &kept).await
            && e.to_string().contains("serves no sequence")
        {
            fenced = Some(Instant::now());
        }
        if cluster.create_sequence(&taken, tiny(), vec![]).await.is_ok() {
            taken_at = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (fenced, taken_at) = (fenced.expect("n0 fenced itself before the takeover"), taken_at.unwrap());
    assert!(fenced < taken_at);
    assert!(
        fenced - cut < Duration::from_secs(grace as u64),
        "fenced after {:?}",
        fenced - cut
    );
    // The fenced n0 never serves its old copy while n1 has the new one.
    write(&cluster, &taken, 500, 5).await;
    let e = read(n0.clone(), &taken).await.unwrap_err();
    assert!(e.to_string().contains("serves no sequence"), "{e}");

    // Healed: n0 finds its grace over and gives up everything it held.
    proxy.heal();
    if let Err(e) = cluster.wait_for_serving(2, Duration::from_secs(30)).await {
        panic!("{e}; n0:\n{}", servers[0].stderr());
    }
    let e = eventually(Duration::from_secs(30), "n0 serving again", || {
        let (n0, taken) = (n0.clone(), taken.clone());
        async move {
            match n0.clone().get_sequence(&taken).await {
                Err(e) if code(&e) == Code::FailedPrecondition => Some(e),
                _ => None,
            }
        }
    })
    .await;
    assert!(e.to_string().contains("n1"), "{e}");
    assert_eq!(
        cluster.call(&taken, |c| read(c, &taken)).await.unwrap(),
        expected(500, 5)
    );
    let e = n0.get_sequence(&kept).await.unwrap_err();
    assert_eq!(code(&e), Code::NotFound, "{kept}, lost with n0's grace: {e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_token_learns_nothing_of_another_tenants_sequences() {
    const TOKEN_A: &str = "token-of-tenant-a-0123456789";
    const TOKEN_B: &str = "token-of-tenant-b-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let config = dir.path().join("kvtier.toml");
    std::fs::write(
        &config,
        format!(
            "[[auth.tokens]]\ntoken = \"{TOKEN_A}\"\ntenant = \"a\"\n\n[[auth.tokens]]\ntoken = \"{TOKEN_B}\"\ntenant = \"b\"\n"
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let servers: Vec<Server> = (0..2)
        .map(|i| {
            let id = format!("n{i}");
            let data = dir.path().join(&id);
            std::fs::create_dir_all(&data).unwrap();
            Server::start(
                &data,
                &[
                    "--config",
                    config,
                    "--etcd",
                    &etcd.client_url,
                    "--node-id",
                    &id,
                    "--lease-ttl-secs",
                    "2",
                ],
            )
        })
        .collect();
    let connect = |token: &'static str| kvtier_client::Connect {
        token: Some(token.to_owned()),
        tls: None,
    };
    let etcd_config = kvtier_client::EtcdConfig::new(vec![etcd.client_url.clone()]);
    let b = Cluster::connect(&etcd_config, connect(TOKEN_B))
        .await
        .unwrap()
        .with_tenant("b");
    b.wait_for_serving(2, Duration::from_secs(60)).await.unwrap();
    // Tenant b's sequences, one on each node. With a 2 s lease a loaded
    // machine can drop a node from the view for a moment (every create then
    // places on the other): keep creating, pausing, until both hold one.
    let mut on = std::collections::BTreeMap::new();
    for i in 0..256 {
        let seq = format!("secret{i}");
        let (placed, _) = b.create_sequence(&seq, tiny(), vec![]).await.unwrap();
        on.entry(placed.node_id).or_insert(seq);
        if on.len() == 2 {
            break;
        }
        if i % 16 == 15 {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    assert_eq!(on.len(), 2, "{on:?}");
    // Tenant a asks every node about each: PERMISSION_DENIED everywhere,
    // never where the sequence is.
    for s in &servers {
        let mut a = Client::connect_with(s.addr.clone(), connect(TOKEN_A))
            .await
            .unwrap()
            .with_tenant("b");
        for seq in on.values() {
            let e = a.get_sequence(seq).await.unwrap_err();
            assert_eq!(code(&e), Code::PermissionDenied, "{seq} at {}: {e}", s.addr);
            assert!(!e.to_string().contains("n0") && !e.to_string().contains("n1"), "{e}");
        }
    }
}

/// etcd serving TLS with authentication on: a node configured with the CA
/// and credentials (`[cluster] etcd_ca`, `etcd_user`, `etcd_password`)
/// joins and serves; the routing client and `kvtier cluster status
/// --config` reach etcd the same way; without the CA, or with a wrong
/// password, nothing gets in, and the refusal says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_tls_and_authentication_admits_only_configured_nodes_and_clients() {
    const PASSWORD: &str = "etcd-root-password-0123";
    let dir = tempfile::tempdir().unwrap();
    let tls = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kvtier-client/tests/tls");
    let etcd = Etcd::start_tls(dir.path(), &tls.join("server.pem"), &tls.join("server.key"));
    let ca = std::fs::read(tls.join("ca.pem")).unwrap();
    {
        let certificate = etcd_client::Certificate::from_pem(&ca);
        let options =
            etcd_client::ConnectOptions::new().with_tls(etcd_client::TlsOptions::new().ca_certificate(certificate));
        let mut admin = etcd_client::Client::connect([etcd.client_url.as_str()], Some(options))
            .await
            .unwrap();
        admin.user_add("root", PASSWORD, None).await.unwrap();
        // etcd 3.4 has the root role built in; later versions want it added.
        let _ = admin.role_add("root").await;
        admin.user_grant_role("root", "root").await.unwrap();
        admin.auth_enable().await.unwrap();
    }
    let config = |password: &str| {
        let path = dir.path().join(format!("kvtier-{password}.toml"));
        let ca = tls.join("ca.pem");
        std::fs::write(
            &path,
            format!(
                "[cluster]\netcd_user = \"root\"\netcd_password = \"{password}\"\netcd_ca = \"{}\"\n",
                ca.display()
            ),
        )
        .unwrap();
        path
    };
    let good = config(PASSWORD);
    let data = dir.path().join("n0");
    std::fs::create_dir_all(&data).unwrap();
    // The default lease: nothing here waits for one to expire, and a 2 s
    // lease over TLS lapsed once under CI's load (the node fenced between
    // `wait_for_serving` and the create: "no node is serving").
    let _node = Server::start(
        &data,
        &[
            "--config",
            good.to_str().unwrap(),
            "--etcd",
            &etcd.client_url,
            "--node-id",
            "n0",
        ],
    );
    let mut access = kvtier_client::EtcdConfig::new(vec![etcd.client_url.clone()]);
    access.user = Some(("root".to_owned(), PASSWORD.to_owned()));
    access.ca_pem = Some(ca.clone());
    let cluster = Cluster::connect(&access, kvtier_client::Connect::default())
        .await
        .unwrap();
    cluster.wait_for_serving(1, Duration::from_secs(60)).await.unwrap();
    cluster.create_sequence("s", tiny(), vec![]).await.unwrap();
    write(&cluster, "s", 7, 8).await;
    let got = cluster.call("s", |c| read(c, "s")).await.unwrap();
    assert_eq!(got, expected(7, 8));

    let status = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(["cluster", "status", "--etcd", &etcd.client_url, "--json"])
            .args(args)
            .env_remove("KVTIER_CONFIG")
            .output()
            .unwrap()
    };
    let ok = status(&["--config", good.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success() && text.contains("\"n0\"") && text.contains("serving"),
        "{ok:?}"
    );
    // No CA: the TLS endpoint is not reached. A wrong password: refused.
    let no_ca = status(&[]);
    assert!(!no_ca.status.success(), "{no_ca:?}");
    let wrong = config("not-the-password-0123");
    let refused = status(&["--config", wrong.to_str().unwrap()]);
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && why.contains("authentication failed"),
        "{why}"
    );

    // A node with the wrong password does not join, and says why.
    let data = dir.path().join("n1");
    std::fs::create_dir_all(&data).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
            "--shm-socket",
            "off",
        ])
        .args(["--data-dir", data.to_str().unwrap(), "--nvme-bytes", "0"])
        .args([
            "--config",
            wrong.to_str().unwrap(),
            "--etcd",
            &etcd.client_url,
            "--node-id",
            "n1",
        ])
        .env_remove("KVTIER_CONFIG")
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && why.contains("authentication failed"), "{why}");
}
