//! Sequences created with the same prefix hash chain share physical pages;
//! a shared page is freed only when its last sequence drops it.

mod common;

use bytes::Bytes;
use common::{LaneData, TestServer, random_kv, size_of};
use kvtier_client::{Client, actions, pb};

const DTYPE: pb::DType = pb::DType::DtypeF16;
const HEAD_DIM: usize = 32;
const PAGE: u32 = 8;
const LAYERS: u32 = 2;
const HEADS: u32 = 2;

fn layout() -> pb::Layout {
    kvtier_client::layout(LAYERS, HEADS, 4, HEAD_DIM as u32, DTYPE, PAGE)
}

fn chain(tag: &str, pages: usize) -> Vec<Bytes> {
    (0..pages)
        .map(|p| Bytes::from(format!("{tag}-prefix-through-page-{p}")))
        .collect()
}

/// Writes `tokens` tokens to every layer, returning what was written.
async fn prefill(
    client: &mut Client,
    seq: &str,
    first_page: u32,
    tokens: u32,
    seed: u64,
) -> (pb::PutPagesResponse, Vec<Vec<LaneData>>) {
    let mut lanes = vec![vec![LaneData::default(); HEADS as usize]; LAYERS as usize];
    let mut writes = Vec::new();
    for layer in 0..LAYERS {
        let mut refs: Vec<&mut LaneData> = lanes[layer as usize].iter_mut().collect();
        let kv = random_kv(DTYPE, HEAD_DIM, &mut refs, tokens as usize, seed + u64::from(layer));
        writes.push(client.page_write(seq, layer, 0..HEADS, first_page, tokens, kv));
    }
    (client.put_page_stream(writes).await.unwrap(), lanes)
}

fn host_used(stats: &pb::Stats) -> u64 {
    stats
        .tiers
        .iter()
        .find(|t| t.tier() == pb::Tier::Host)
        .unwrap()
        .used_bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_pages_are_shared_and_freed_at_the_last_drop() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let page_bytes = 2 * u64::from(PAGE) * (HEAD_DIM * size_of(DTYPE)) as u64;
    let lanes = u64::from(LAYERS * HEADS);

    // A: 4 full pages under the chain, and a partial fifth page.
    let a = client.create_sequence("a", layout(), chain("doc", 4)).await.unwrap();
    assert_eq!(a.attached_pages, 0);
    // C is created before anything is stored, so it attaches nothing now.
    let c = client.create_sequence("c", layout(), chain("doc", 2)).await.unwrap();
    assert_eq!(c.attached_pages, 0);
    let (put, a_data) = prefill(&mut client, "a", 0, 4 * PAGE + 3, 1).await;
    assert_eq!((put.pages_written, put.pages_shared), (5 * lanes, 0));
    let after_a = client.stats().await.unwrap();
    assert_eq!(after_a.physical_pages, 5 * lanes);

    // B: same chain for its first 3 pages, then its own. The 3 pages attach
    // at creation and are not sent again.
    let mut b_chain = chain("doc", 3);
    b_chain.push(Bytes::from_static(b"b-own-page-3"));
    let b = client.create_sequence("b", layout(), b_chain).await.unwrap();
    assert_eq!(b.attached_pages, 3);
    assert_eq!(b.info.as_ref().unwrap().tokens, 3 * u64::from(PAGE));
    let (put, _) = prefill(&mut client, "b", 3, 2 * PAGE, 2).await;
    assert_eq!((put.pages_written, put.pages_shared), (2 * lanes, 0));
    let after_b = client.stats().await.unwrap();
    assert_eq!(after_b.physical_pages, 7 * lanes, "3 pages per lane shared, 2 new");
    assert_eq!(host_used(&after_b) - host_used(&after_a), 2 * lanes * page_bytes);
    assert_eq!(client.get_sequence("b").await.unwrap().shared_pages, 3 * lanes);

    // B reads A's bytes for the shared pages.
    let row = HEAD_DIM * size_of(DTYPE);
    for p in client.fetch_pages("b", 1, 0..HEADS, vec![0, 1, 2]).await.unwrap() {
        assert!(p.kv[..] == a_data[1][p.kv_head as usize].page(p.page as usize, PAGE as usize, row)[..]);
    }

    // C writes the shared prefix itself; the pages are found by hash at write
    // time and not stored again.
    let (put, _) = prefill(&mut client, "c", 0, 2 * PAGE, 3).await;
    assert_eq!((put.pages_written, put.pages_shared), (0, 2 * lanes));
    assert_eq!(client.stats().await.unwrap().physical_pages, 7 * lanes);

    // Dropping A frees only its unshared pages (page 3 and the partial 4).
    client.drop_sequence("a").await.unwrap();
    let after_drop_a = client.stats().await.unwrap();
    assert_eq!(after_drop_a.physical_pages, 5 * lanes);
    for p in client.fetch_pages("b", 0, 0..HEADS, vec![0, 1, 2]).await.unwrap() {
        assert!(p.kv[..] == a_data[0][p.kv_head as usize].page(p.page as usize, PAGE as usize, row)[..]);
    }
    // A new sequence still attaches the pages B and C keep alive, but not
    // page 3 of the chain, which died with A.
    let d = client.create_sequence("d", layout(), chain("doc", 4)).await.unwrap();
    assert_eq!(d.attached_pages, 3);
    client.drop_sequence("d").await.unwrap();

    // Evicting a shared page in B leaves C's copy alone.
    client
        .set_page_state("b", 0..1, 0..1, 0..1, actions::evict())
        .await
        .unwrap();
    let c0 = client.fetch_pages("c", 0, 0..1, vec![0]).await.unwrap();
    assert_eq!(c0[0].state(), pb::PageState::Hot);
    assert!(c0[0].kv[..] == a_data[0][0].page(0, PAGE as usize, row)[..]);

    client.drop_sequence("b").await.unwrap();
    client.drop_sequence("c").await.unwrap();
    let end = client.stats().await.unwrap();
    assert_eq!(end.physical_pages, 0);
    assert_eq!(host_used(&end), 0, "the last drop frees every byte");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharing_never_crosses_tenants_or_layouts() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    client.create_sequence("a", layout(), chain("doc", 2)).await.unwrap();
    prefill(&mut client, "a", 0, 2 * PAGE, 1).await;
    let mut other_tenant = server.client().await.with_tenant("team-b");
    assert_eq!(
        other_tenant
            .create_sequence("a", layout(), chain("doc", 2))
            .await
            .unwrap()
            .attached_pages,
        0
    );
    let mut f32_layout = layout();
    f32_layout.dtype = pb::DType::DtypeF32 as i32;
    assert_eq!(
        client
            .create_sequence("x", f32_layout, chain("doc", 2))
            .await
            .unwrap()
            .attached_pages,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_hash_in_a_chain_is_refused() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let mut hashes = chain("doc", 3);
    hashes.push(hashes[1].clone());
    let err = client.create_sequence("a", layout(), hashes).await.unwrap_err();
    let kvtier_client::ClientError::Status(status) = err else {
        panic!("{err}")
    };
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().starts_with("prefix_hashes[3]"), "{}", status.message());
}
