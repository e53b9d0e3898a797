//! Draining and rebalancing a cluster, against a real etcd and real
//! `kvtier serve` processes: a drained node's sequences stream node to node
//! to their new owners while a reader and a writer keep using them
//! through the routing client, read back exactly as they were (summaries
//! and gone pages included), keep their durable rows across a kill -9 of
//! their new owner, and the drained node leaves and stops. A rebalance
//! after a join moves what placement gives the new node. Drains are admin
//! calls (a tenant's token is refused), and node-to-node streams run over
//! TLS with the nodes' admin token.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::Server;
use common::cluster::{cluster, eventually, node};
use common::etcd::Etcd;
use kvtier_client::{Client, Cluster, actions, layout, pb};
use tonic::Code;

const DIM: usize = 4;
const PAGE: usize = 4;

/// f32, 1 layer, 1 KV head, head_dim 4, page size 4: every value exact.
fn tiny() -> pb::Layout {
    layout(1, 1, 1, DIM as u32, pb::DType::DtypeF32, PAGE as u32)
}

/// K then V rows of tokens `from..from + n` of sequence `seed`: values
/// unique to (sequence, token), so a byte from anywhere else shows.
fn kv(seed: u32, from: usize, n: usize) -> Vec<u8> {
    let row = |t: usize, plus: f32| {
        let x = (seed * 1000) as f32 + t as f32 + plus;
        (0..DIM).flat_map(move |_| x.to_le_bytes())
    };
    (from..from + n)
        .flat_map(|t| row(t, 0.0))
        .chain((from..from + n).flat_map(|t| row(t, 0.5)))
        .collect()
}

/// A page as the test compares it: hot and cold are one (a node places
/// pages by its own tiers).
type Seen = (u32, bool, i32, u32, Vec<u8>, Vec<u32>, i32, Vec<u8>);

async fn pages(mut client: Client, seq: &str) -> Result<Vec<Seen>, kvtier_client::ClientError> {
    let req = pb::FetchPagesRequest {
        sequence_id: seq.to_owned(),
        layer: 0,
        kv_head_start: 0,
        kv_head_count: 1,
        include_digests: true,
        ..pb::FetchPagesRequest::default()
    };
    let pages = client.fetch(req).await?;
    Ok(pages
        .into_iter()
        .map(|p| {
            let original = matches!(p.state(), pb::PageState::Hot | pb::PageState::Cold);
            let state = if original { 0 } else { p.state };
            (
                p.page,
                original,
                state,
                p.tokens,
                p.kv.to_vec(),
                p.summary_counts,
                p.gone_reason,
                p.digest.to_vec(),
            )
        })
        .collect())
}

async fn read(cluster: &Cluster, seq: &str) -> Result<Vec<Seen>, kvtier_client::ClientError> {
    cluster.call(seq, |c| pages(c, seq)).await
}

/// Writes `s<i>`: 2 pages persisted, then 3 tokens in memory only; every
/// third gets page 0 summarized, every fifth page 1 evicted.
async fn populate(cluster: &Cluster, i: u32, hashes: Vec<bytes::Bytes>) -> String {
    let seq = format!("s{i}");
    cluster.create_sequence(&seq, tiny(), hashes).await.unwrap();
    let s = seq.as_str();
    cluster
        .call(s, |c| async move {
            c.with_persist(true)
                .put_pages(s, 0, 0..1, 0, 8, kv(i, 0, 8).into())
                .await
        })
        .await
        .unwrap();
    cluster
        .call(s, |mut c| async move {
            c.append_tokens(s, 0, 0..1, 3, kv(i, 8, 3).into(), Some(8)).await
        })
        .await
        .unwrap();
    if i.is_multiple_of(3) {
        cluster
            .call(s, |mut c| async move {
                c.set_page_state(s, 0..1, 0..1, 0..1, actions::summarize(2)).await
            })
            .await
            .unwrap();
    }
    if i.is_multiple_of(5) {
        cluster
            .call(s, |mut c| async move {
                c.set_page_state(s, 0..1, 0..1, 1..2, actions::evict()).await
            })
            .await
            .unwrap();
    }
    seq
}

/// Which node holds `seq`, asking every node directly.
async fn holders(direct: &mut [(String, Client)], seq: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (id, client) in direct.iter_mut() {
        if client.get_sequence(seq).await.is_ok() {
            out.push(id.clone());
        }
    }
    out
}

fn kvtier(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .env_remove("KVTIER_CONFIG")
        .env_remove("KVTIER_TOKEN")
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_moves_every_sequence_while_it_is_read_and_written_then_the_node_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let mut servers: Vec<Option<Server>> = (0..3)
        .map(|i| Some(node(dir.path(), &format!("n{i}"), &etcd.client_url, 2, 60)))
        .collect();
    let mut direct = Vec::new();
    for (i, s) in servers.iter_mut().enumerate() {
        direct.push((format!("n{i}"), s.as_mut().unwrap().client().await));
    }
    let cluster = cluster(&etcd.client_url, 3).await;
    // 16 sequences, two of them sharing a prompt's first page.
    let mut seqs = Vec::new();
    for i in 0..16u32 {
        let hashes = if i < 2 {
            vec![bytes::Bytes::from_static(b"prompt-0")]
        } else {
            vec![]
        };
        seqs.push(populate(&cluster, i, hashes).await);
    }
    let mut before = BTreeMap::new();
    for seq in &seqs {
        before.insert(seq.clone(), read(&cluster, seq).await.unwrap());
    }
    let mut on_n0 = Vec::new();
    for seq in &seqs {
        if holders(&mut direct, seq).await == ["n0"] {
            on_n0.push(seq.clone());
        }
    }
    assert!(on_n0.len() >= 2, "n0 holds {on_n0:?}");

    // While it drains: a reader checks n0's sequences, a writer appends to
    // one of them, both through the routing client.
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, appended) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let written = on_n0[0].clone();
    let reader = {
        let (cluster, stop, reads) = (cluster.clone(), Arc::clone(&stop), Arc::clone(&reads));
        let (watched, before) = (on_n0[1..].to_vec(), before.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                for seq in &watched {
                    let got = read(&cluster, seq)
                        .await
                        .unwrap_or_else(|e| panic!("reading {seq} during the drain: {e}"));
                    assert_eq!(got, before[seq], "{seq} read differently during the drain");
                    reads.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
    };
    let writer = {
        let (cluster, stop, appended, seq) = (
            cluster.clone(),
            Arc::clone(&stop),
            Arc::clone(&appended),
            written.clone(),
        );
        let i: u32 = seq[1..].parse().unwrap();
        tokio::spawn(async move {
            let mut at = 11u64;
            while !stop.load(Ordering::SeqCst) {
                let s = seq.as_str();
                cluster
                    .call(s, |mut c| async move {
                        c.append_tokens(s, 0, 0..1, 1, kv(i, at as usize, 1).into(), Some(at))
                            .await
                    })
                    .await
                    .unwrap_or_else(|e| panic!("appending to {s} at {at} during the drain: {e}"));
                at += 1;
                appended.store(at - 11, Ordering::SeqCst);
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let url = etcd.client_url.clone();
    let out = tokio::task::spawn_blocking(move || kvtier(&["cluster", "drain", "n0", "--etcd", &url]))
        .await
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "drain failed:\n{printed}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(printed.contains("n0 holds nothing and left the cluster"), "{printed}");
    assert_eq!(printed.matches("  moved ").count(), on_n0.len(), "{printed}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    reader.await.unwrap();
    writer.await.unwrap();
    assert!(reads.load(Ordering::SeqCst) > 0 && appended.load(Ordering::SeqCst) > 0);
    eprintln!(
        "{printed}reads {} appends {}",
        reads.load(Ordering::SeqCst),
        appended.load(Ordering::SeqCst)
    );
    // The drained node stopped by itself.
    let n0 = servers[0].as_mut().unwrap();
    let status = n0.wait(Duration::from_secs(30));
    assert!(status.success(), "n0 exited {status}:\n{}", n0.stderr());

    // Every sequence reads back as it was, held by one node, never n0.
    direct.remove(0);
    let appended = appended.load(Ordering::SeqCst) as usize;
    for seq in &seqs {
        let got = read(&cluster, seq).await.unwrap();
        if *seq == written {
            let i: u32 = seq[1..].parse().unwrap();
            let tokens: u32 = got.iter().map(|p| p.3).sum();
            assert_eq!(
                tokens as usize,
                11 + appended,
                "{seq}: appends acknowledged during the drain"
            );
            let whole: Vec<u8> = got.iter().filter(|p| p.1).flat_map(|p| p.4.clone()).collect();
            let want: Vec<u8> = before[seq]
                .iter()
                .filter(|p| p.1 && p.0 < 2)
                .flat_map(|p| p.4.clone())
                .collect();
            assert!(whole.starts_with(&want), "{seq}: its first pages changed");
            let last = got.last().unwrap();
            let from = last.0 as usize * PAGE;
            assert_eq!(last.4, kv(i, from, last.3 as usize), "{seq}: its last page");
        } else {
            assert_eq!(got, before[seq], "{seq} after the drain");
        }
        let held = holders(&mut direct, seq).await;
        assert_eq!(held.len(), 1, "{seq} held by {held:?}");
    }
    // The prompt's two sequences share its page on their new node too.
    let status = kvtier(&["cluster", "status", "--etcd", &etcd.client_url, "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let nodes = status["nodes"].as_array().unwrap();
    assert!(nodes.iter().all(|n| n["node_id"] != "n0"), "{status}");
    let total: u64 = nodes.iter().map(|n| n["sequences"].as_u64().unwrap()).sum();
    assert_eq!(total, seqs.len() as u64, "{status}");

    // Durable rows stay durable: the moved sequences' new owners killed
    // and restarted within their grace have their persisted pages.
    let moved_to: Vec<String> = {
        let mut d = Vec::new();
        for seq in &on_n0 {
            d.extend(holders(&mut direct, seq).await);
        }
        d.sort();
        d.dedup();
        d
    };
    drop(direct);
    for id in &moved_to {
        let i: usize = id[1..].parse().unwrap();
        servers[i].take().unwrap().kill();
        let mut restarted = node(dir.path(), id, &etcd.client_url, 2, 60);
        restarted.client().await;
        servers[i] = Some(restarted);
    }
    cluster.wait_for_serving(2, Duration::from_secs(60)).await.unwrap();
    for seq in &on_n0 {
        let got = eventually(Duration::from_secs(30), "the restarted owner serving", || {
            let cluster = cluster.clone();
            async move { read(&cluster, seq).await.ok() }
        })
        .await;
        // Pages 0 and 1 were persisted: back as they were (summarized or
        // gone where they were).
        let first: Vec<&Seen> = got.iter().filter(|p| p.0 < 2).collect();
        let want: Vec<&Seen> = before[seq].iter().filter(|p| p.0 < 2).collect();
        assert_eq!(first, want, "{seq} after its new owner's kill -9");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_after_a_join_moves_what_placement_gives_the_new_node() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let mut servers: Vec<Server> = (0..2)
        .map(|i| node(dir.path(), &format!("n{i}"), &etcd.client_url, 2, 60))
        .collect();
    for s in &mut servers {
        s.client().await;
    }
    let cluster = cluster(&etcd.client_url, 2).await;
    let mut seqs = Vec::new();
    for i in 0..12u32 {
        seqs.push(populate(&cluster, i, vec![]).await);
    }
    let mut before = BTreeMap::new();
    for seq in &seqs {
        before.insert(seq.clone(), read(&cluster, seq).await.unwrap());
    }
    servers.push(node(dir.path(), "n2", &etcd.client_url, 2, 60));
    let mut n2 = servers[2].client().await;
    cluster.wait_for_serving(3, Duration::from_secs(60)).await.unwrap();
    let placed_on_n2: Vec<&String> = {
        let view = cluster.view();
        seqs.iter()
            .filter(|s| {
                view.owner(kvtier_core::placement::PlacementKey::Sequence {
                    tenant: "default",
                    sequence_id: s,
                })
                .is_some_and(|n| n.node_id == "n2")
            })
            .collect()
    };
    assert!(!placed_on_n2.is_empty(), "placement gives n2 none of 12");
    let out = kvtier(&["cluster", "rebalance", "--etcd", &etcd.client_url]);
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(printed.matches("  moved ").count(), placed_on_n2.len(), "{printed}");
    for seq in &seqs {
        assert_eq!(
            read(&cluster, seq).await.unwrap(),
            before[seq],
            "{seq} after the rebalance"
        );
        let on_n2 = n2.get_sequence(seq).await.is_ok();
        assert_eq!(on_n2, placed_on_n2.contains(&seq), "{seq} on n2: {on_n2}");
    }
    // The nodes stay serving; a second rebalance moves nothing.
    let out = kvtier(&["cluster", "rebalance", "--etcd", &etcd.client_url]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).matches("  moved ").count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drains_are_admin_only_and_nodes_move_sequences_over_tls_with_their_token() {
    const ADMIN: &str = "admin-token-0123456789";
    const TENANT: &str = "tenant-a-token-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let tls = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kvtier-client/tests/tls");
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        format!(
            "[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n\n[[auth.tokens]]\ntoken = \"{ADMIN}\"\nadmin = true\n\n\
             [[auth.tokens]]\ntoken = \"{TENANT}\"\ntenant = \"a\"\n",
            tls.join("server.pem").display(),
            tls.join("server.key").display(),
            tls.join("ca.pem").display(),
        ),
    )
    .unwrap();
    let start = |id: &str| {
        let data = dir.path().join(id);
        std::fs::create_dir_all(&data).unwrap();
        Server::start(
            &data,
            &[
                "--config",
                config.to_str().unwrap(),
                "--etcd",
                &etcd.client_url,
                "--node-id",
                id,
                "--lease-ttl-secs",
                "2",
            ],
        )
    };
    let mut servers = [start("n0"), start("n1")];
    let ca = std::fs::read(tls.join("ca.pem")).unwrap();
    let options = |token: &str| kvtier_client::Connect {
        token: Some(token.to_owned()),
        tls: Some(kvtier_client::Tls {
            ca_pem: ca.clone(),
            domain: None,
        }),
    };
    let cluster = Cluster::connect(
        &kvtier_client::EtcdConfig::new(vec![etcd.client_url.clone()]),
        options(TENANT),
    )
    .await
    .unwrap()
    .with_tenant("a");
    cluster.wait_for_serving(2, Duration::from_secs(60)).await.unwrap();
    let n0 = cluster.view().member("n0").unwrap().addr.clone();
    assert!(n0.starts_with("https://"), "{n0}");
    // Sequences until n0 holds one.
    let mut on_n0 = None;
    for i in 0..32u32 {
        let seq = format!("t{i}");
        let (placed, _) = cluster.create_sequence(&seq, tiny(), vec![]).await.unwrap();
        let s = seq.as_str();
        cluster
            .call(s, |c| async move {
                c.with_persist(true)
                    .put_pages(s, 0, 0..1, 0, 6, kv(i, 0, 6).into())
                    .await
            })
            .await
            .unwrap();
        if placed.node_id == "n0" {
            on_n0 = Some(seq);
            break;
        }
    }
    let seq = on_n0.expect("one of 32 sequences on n0");
    let before = read(&cluster, &seq).await.unwrap();

    // A tenant's token may not drain, nor send a node a sequence.
    let ca_path = tls.join("ca.pem");
    let refused = kvtier(&[
        "cluster",
        "drain",
        "n0",
        "--etcd",
        &etcd.client_url,
        "--token",
        TENANT,
        "--ca",
        ca_path.to_str().unwrap(),
    ]);
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && why.contains("DrainNode is server-wide"),
        "{why}"
    );
    let mut tenant_client = Client::connect_with(n0.clone(), options(TENANT)).await.unwrap();
    let header = pb::MoveSequenceRequest {
        part: Some(pb::move_sequence_request::Part::Header(pb::MoveHeader::default())),
    };
    let request = tenant_client.request(tokio_stream::iter([header]));
    let e = tenant_client.raw().move_sequence(request).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");

    // The admin drains n0 with the node's own configuration: its admin
    // token and its CA, which n0 also uses to stream to n1 over TLS.
    let out = kvtier(&[
        "cluster",
        "drain",
        "n0",
        "--config",
        config.to_str().unwrap(),
        "--etcd",
        &etcd.client_url,
    ]);
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(servers[0].wait(Duration::from_secs(30)).success());
    assert_eq!(
        read(&cluster, &seq).await.unwrap(),
        before,
        "{seq} after its move over TLS"
    );
    let mut n1 = Client::connect_with(cluster.view().member("n1").unwrap().addr.clone(), options(TENANT))
        .await
        .unwrap()
        .with_tenant("a");
    assert!(n1.get_sequence(&seq).await.is_ok());
}
