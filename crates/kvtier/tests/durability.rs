//! The durability promises, each through gRPC against the real binary and
//! real restarts, in the cases an outside client found broken: a gone page
//! at a checkpoint handing live pages' ids (and bytes) to another tenant,
//! persisted rows after a memory-only append dropped, a gone reason changed
//! by a restart, and a second server on the same data directory.

mod common;

use std::time::Duration;

use common::{Server, corrupt_nvme};
use kvtier_client::{Client, actions, layout, pb};

const DIM: usize = 4;
const PAGE: usize = 4;

/// f16, 1 layer, 1 KV head, head_dim 4, page size 4.
fn tiny() -> pb::Layout {
    layout(1, 1, 1, DIM as u32, pb::DType::DtypeF16, PAGE as u32)
}

fn row(x: f32) -> Vec<u8> {
    (0..DIM).flat_map(|_| half::f16::from_f32(x).to_le_bytes()).collect()
}

/// K rows then V rows of the tokens whose values are `values` (V = K + 0.5).
fn kv(values: &[u32]) -> Vec<u8> {
    let k = values.iter().flat_map(|&v| row(v as f32));
    let v = values.iter().flat_map(|&v| row(v as f32 + 0.5));
    k.chain(v).collect()
}

/// `(page, state, bytes, gone reason)` of every page of `seq`.
async fn pages(client: &mut Client, seq: &str) -> Vec<(u32, pb::PageState, Vec<u8>, pb::Reason)> {
    let fetched = client.fetch_pages(seq, 0, 0..1, vec![]).await.unwrap();
    fetched
        .into_iter()
        .map(|p| (p.page, p.state(), p.kv.to_vec(), p.gone_reason()))
        .collect()
}

fn tokens(range: std::ops::RangeInclusive<u32>) -> Vec<u32> {
    range.collect()
}

/// A server on `dir` holding sequence "s": two full pages (tokens 1..=8),
/// persisted; and a persisting client.
async fn two_durable_pages(dir: &std::path::Path) -> (Server, Client) {
    let mut server = Server::start(dir, &[]);
    let mut client = server.client().await.with_persist(true);
    client.create_sequence("s", tiny(), vec![]).await.unwrap();
    client
        .put_pages("s", 0, 0..1, 0, 8, kv(&tokens(1..=8)).into())
        .await
        .unwrap();
    (server, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gone_page_at_a_checkpoint_never_hands_its_id_or_bytes_to_another_page() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let mut a = server.client().await.with_tenant("ta").with_persist(true);
    a.create_sequence("a", tiny(), vec![]).await.unwrap();
    let put = a
        .put_pages("a", 0, 0..1, 0, 12, kv(&tokens(1..=12)).into())
        .await
        .unwrap();
    assert_eq!(put.durability(), pb::Durability::Relaxed);
    a.set_page_state("a", 0..1, 0..1, 0..1, actions::evict()).await.unwrap();
    // Two restarts, each writing a checkpoint with the gone page in it.
    for _ in 0..2 {
        server.terminate();
        server = Server::start(dir.path(), &[]);
        server.client().await;
    }
    let mut b = server.client().await.with_tenant("tb").with_persist(true);
    b.create_sequence("b", tiny(), vec![]).await.unwrap();
    let put = b
        .put_pages("b", 0, 0..1, 0, 16, kv(&tokens(100..=115)).into())
        .await
        .unwrap();
    assert_eq!(put.durability(), pb::Durability::Relaxed);
    server.terminate();
    let mut server = Server::start(dir.path(), &[]);
    let mut a = server.client().await.with_tenant("ta");
    let mut b = server.client().await.with_tenant("tb");

    let a_pages = pages(&mut a, "a").await;
    assert_eq!(a_pages.len(), 3);
    assert_eq!(
        (a_pages[0].1, a_pages[0].3),
        (pb::PageState::Gone, pb::Reason::Explicit)
    );
    assert_eq!(a_pages[1].2, kv(&tokens(5..=8)), "a page 1");
    assert_eq!(a_pages[2].2, kv(&tokens(9..=12)), "a page 2");
    let b_pages = pages(&mut b, "b").await;
    assert_eq!(b_pages.len(), 4, "b's pages");
    for (page, state, bytes, _) in b_pages {
        assert_ne!(state, pb::PageState::Gone, "b page {page} was acknowledged durable");
        let first = 100 + 4 * page;
        assert_eq!(bytes, kv(&tokens(first..=first + 3)), "b page {page}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persist_makes_the_whole_lane_durable_memory_only_rows_before_it_included() {
    for kill in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut server = Server::start(dir.path(), &[]);
        let client = server.client().await;
        client.clone().create_sequence("s", tiny(), vec![]).await.unwrap();
        for (values, persist) in [(1..=3, true), (4..=6, false), (7..=9, true)] {
            let first = *values.start();
            let mut c = client.clone().with_persist(persist);
            let r = c
                .append_tokens("s", 0, 0..1, 3, kv(&tokens(values)).into(), Some(u64::from(first - 1)))
                .await
                .unwrap();
            let expected = if persist {
                pb::Durability::Relaxed
            } else {
                pb::Durability::Memory
            };
            assert_eq!(r.durability(), expected);
        }
        server.stop(kill);
        let mut server = Server::start(dir.path(), &[]);
        let mut client = server.client().await;
        assert_eq!(client.get_sequence("s").await.unwrap().tokens, 9, "kill: {kill}");
        let back = pages(&mut client, "s").await;
        let bytes: Vec<Vec<u8>> = back.iter().map(|p| p.2.clone()).collect();
        assert_eq!(
            bytes,
            [kv(&tokens(1..=4)), kv(&tokens(5..=8)), kv(&tokens(9..=9))],
            "kill: {kill}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_gone_for_a_failed_crc_stays_gone_for_that_reason_after_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, mut client) = two_durable_pages(dir.path()).await;
    // Only the NVMe copies remain; page 0's is the file's first extent.
    let to_nvme = actions::offload_to_nvme();
    client.set_page_state("s", 0..1, 0..1, 0..2, to_nvme).await.unwrap();
    corrupt_nvme(dir.path(), 10, 0x40);
    let expect = |back: &[(u32, pb::PageState, Vec<u8>, pb::Reason)], when: &str| {
        assert_eq!(
            (back[0].1, back[0].3),
            (pb::PageState::Gone, pb::Reason::Integrity),
            "page 0 {when}"
        );
        assert_eq!(back[1].2, kv(&tokens(5..=8)), "page 1 {when}");
    };
    expect(&pages(&mut client, "s").await, "before the restart");
    for (kill, restart) in [(false, "after a clean restart"), (true, "after a kill")] {
        server.stop(kill);
        server = Server::start(dir.path(), &[]);
        let mut client = server.client().await;
        expect(&pages(&mut client, "s").await, restart);
        let info = client.get_sequence("s").await.unwrap();
        let reasons: Vec<_> = info.gone.iter().map(|g| (g.reason(), g.pages)).collect();
        assert_eq!(reasons, [(pb::Reason::Integrity, 1)], "{restart}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_on_the_same_data_directory_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = Server::start(dir.path(), &[]);
    let mut client = first.client().await.with_persist(true);
    client.create_sequence("s", tiny(), vec![]).await.unwrap();
    client
        .put_pages("s", 0, 0..1, 0, 4, kv(&tokens(1..=4)).into())
        .await
        .unwrap();

    let mut second = Server::start(dir.path(), &[]);
    let status = second.wait(Duration::from_secs(30));
    let said = second.stderr();
    assert!(!status.success(), "a second server started:\n{said}");
    assert!(
        said.contains("in use") && said.contains(&format!("pid {}", first.pid())),
        "the refusal names the holder:\n{said}"
    );

    // The first server's journal is still the manifest: what it
    // acknowledges now survives its restart.
    let r = client
        .append_tokens("s", 0, 0..1, 2, kv(&[5, 6]).into(), Some(4))
        .await
        .unwrap();
    assert_eq!(r.durability(), pb::Durability::Relaxed);
    first.terminate();
    let mut server = Server::start(dir.path(), &[]);
    let mut client = server.client().await;
    let back = pages(&mut client, "s").await;
    assert_eq!(back.len(), 2);
    assert_eq!(back[0].2, kv(&tokens(1..=4)));
    assert_eq!(back[1].2, kv(&[5, 6]));
}

/// What a restart keeps (docs/CONCEPTS.md, Guarantees): durable rows,
/// bit-exact, now cold on NVMe. What it loses: which pages were hot,
/// leases, statistics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_durable_rows_and_loses_residency_leases_and_statistics() {
    for kill in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (server, mut client) = two_durable_pages(dir.path()).await;
        let mut select = kvtier_client::SelectRequest::new(0, 0..1, vec![1.0; DIM], 2);
        select.swap_in = true;
        select.lease_ms = 600_000;
        let chosen = client.select_pages("s", &select).await.unwrap();
        let (lease, _) = chosen.lease.expect("a lease");
        let before = client.get_sequence("s").await.unwrap();
        assert_eq!(before.pages.unwrap().hot, 2, "kill: {kill}");
        assert!(client.stats().await.unwrap().pages_written > 0);

        server.stop(kill);
        let mut server = Server::start(dir.path(), &[]);
        let mut client = server.client().await;
        let back = pages(&mut client, "s").await;
        let bytes: Vec<Vec<u8>> = back.iter().map(|p| p.2.clone()).collect();
        assert_eq!(bytes, [kv(&tokens(1..=4)), kv(&tokens(5..=8))], "kill: {kill}");
        assert!(
            back.iter().all(|p| p.1 == pb::PageState::Cold),
            "kill: {kill}: no page is hot after a restart: {:?}",
            back.iter().map(|p| p.1).collect::<Vec<_>>()
        );
        match client.release_lease(lease).await {
            Err(kvtier_client::ClientError::Status(s)) => {
                assert_eq!(s.code(), tonic::Code::NotFound, "kill: {kill}: {s}")
            }
            other => panic!("kill: {kill}: the lease outlived the restart: {other:?}"),
        }
        let stats = client.stats().await.unwrap();
        assert_eq!((stats.pages_written, stats.bytes_written), (0, 0), "kill: {kill}");
        drop(server);
    }
}
