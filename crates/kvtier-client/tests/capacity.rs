//! Tier budgets are exact: the host tier never holds more than its bytes,
//! a write that does not fit is refused whole with RESOURCE_EXHAUSTED, and
//! nothing stored is dropped to make room. The device tier demotes (never
//! drops) its LRU pages.

mod common;

use common::{LaneData, TestServer, random_kv};
use kvtier_client::{Client, ClientError, actions, pb};
use kvtier_store::StoreConfig;
use tonic::Code;

const DTYPE: pb::DType = pb::DType::DtypeF16;
const HEAD_DIM: usize = 64;
const PAGE: u32 = 16;
/// 2 (K, V) × 16 tokens × 64 dims × 2 bytes.
const PAGE_BYTES: u64 = 4096;

fn layout() -> pb::Layout {
    kvtier_client::layout(1, 1, 1, HEAD_DIM as u32, DTYPE, PAGE)
}

fn tiers(stats: &pb::Stats) -> (u64, u64) {
    let used = |t: pb::Tier| stats.tiers.iter().find(|s| s.tier() == t).unwrap().used_bytes;
    (used(pb::Tier::Device), used(pb::Tier::Host))
}

async fn write(
    client: &mut Client,
    seq: &str,
    first_page: u32,
    tokens: u32,
    data: &mut LaneData,
    seed: u64,
) -> Result<pb::PutPagesResponse, ClientError> {
    let mut scratch = data.clone();
    let kv = random_kv(DTYPE, HEAD_DIM, &mut [&mut scratch], tokens as usize, seed);
    let result = client.put_pages(seq, 0, 0..1, first_page, tokens, kv).await;
    if result.is_ok() {
        *data = scratch;
    }
    result
}

fn exhausted(result: Result<impl std::fmt::Debug, ClientError>) -> String {
    match result {
        Err(ClientError::Status(s)) if s.code() == Code::ResourceExhausted => s.message().to_owned(),
        other => panic!("expected RESOURCE_EXHAUSTED, got {other:?}"),
    }
}

async fn check_all(client: &mut Client, seq: &str, data: &LaneData) {
    let row = HEAD_DIM * 2;
    for p in client.fetch_pages(seq, 0, 0..1, vec![]).await.unwrap() {
        assert!(
            p.kv[..] == data.page(p.page as usize, PAGE as usize, row)[..],
            "page {} lost or changed",
            p.page
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_budget_is_never_exceeded_and_nothing_is_dropped() {
    let server = TestServer::start(StoreConfig {
        device_bytes: 4 * PAGE_BYTES,
        host_bytes: 10 * PAGE_BYTES,
        cache_writes_on_device: true,
        ..StoreConfig::default()
    })
    .await;
    let mut client = server.client().await;
    client.create_sequence("a", layout(), vec![]).await.unwrap();
    client.create_sequence("b", layout(), vec![]).await.unwrap();
    let (mut a, mut b) = (LaneData::default(), LaneData::default());

    // A write larger than the device: the newest pages get the device copies.
    write(&mut client, "a", 0, 6 * PAGE, &mut a, 1).await.unwrap();
    let states: Vec<_> = client
        .fetch_pages("a", 0, 0..1, vec![])
        .await
        .unwrap()
        .iter()
        .map(|p| p.state())
        .collect();
    assert_eq!(states[..2], [pb::PageState::Cold; 2]);
    assert_eq!(states[2..], [pb::PageState::Hot; 4]);
    // Promoting the two cold ones demotes the two least recently used hot
    // pages (capacity pressure), and drops nothing.
    client
        .set_page_state("a", 0..1, 0..1, 0..2, actions::swap_in())
        .await
        .unwrap();
    let stats = client.stats().await.unwrap();
    assert_eq!(tiers(&stats), (4 * PAGE_BYTES, 6 * PAGE_BYTES));
    let pages = client.get_sequence("a").await.unwrap().pages.unwrap();
    assert_eq!((pages.hot, pages.cold_host), (4, 2));
    let capacity: u64 = stats
        .transitions
        .iter()
        .filter(|t| t.reason() == pb::Reason::Capacity)
        .map(|t| t.count)
        .sum();
    assert_eq!(capacity, 2);

    // 4 pages of room left; a write of 5 is refused whole.
    let message = exhausted(write(&mut client, "b", 0, 5 * PAGE, &mut b, 2).await);
    assert!(message.contains("host tier is full"), "{message}");
    assert_eq!(client.get_sequence("b").await.unwrap().max_tokens, 0);
    assert_eq!(tiers(&client.stats().await.unwrap()).1, 6 * PAGE_BYTES);

    // Fill exactly to the budget: 3 full pages and a partial one.
    write(&mut client, "b", 0, 3 * PAGE + 5, &mut b, 3).await.unwrap();
    assert_eq!(tiers(&client.stats().await.unwrap()).1, 10 * PAGE_BYTES);
    // Appends that fit in the partial page still work; one more page does not.
    let mut scratch = b.clone();
    let kv = random_kv(DTYPE, HEAD_DIM, &mut [&mut scratch], (PAGE - 5) as usize, 4);
    client.append_tokens("b", 0, 0..1, PAGE - 5, kv, None).await.unwrap();
    b = scratch;
    let kv = random_kv(DTYPE, HEAD_DIM, &mut [&mut LaneData::default()], 1, 5);
    exhausted(client.append_tokens("b", 0, 0..1, 1, kv, None).await);
    exhausted(write(&mut client, "a", 6, PAGE, &mut a, 6).await);
    // A summary needs a slot too: refused whole when the host is full.
    exhausted(
        client
            .set_page_state("a", 0..1, 0..1, 0..2, actions::summarize(1))
            .await,
    );

    let stats = client.stats().await.unwrap();
    let (device, host) = tiers(&stats);
    assert!(device <= 4 * PAGE_BYTES && host <= 10 * PAGE_BYTES);
    assert_eq!(
        stats.pages.as_ref().unwrap().gone,
        0,
        "nothing was dropped to make room"
    );
    check_all(&mut client, "a", &a).await;
    check_all(&mut client, "b", &b).await;

    // Swapping in cold pages of `a` demotes other hot pages (of `b`) to make
    // room; every byte stays readable.
    let pages_in = |client: &mut Client, state: pb::PageState| {
        let mut client = client.clone();
        async move {
            let pages = client.fetch_pages("a", 0, 0..1, vec![]).await.unwrap();
            pages
                .iter()
                .filter(|p| p.state() == state)
                .map(|p| p.page)
                .collect::<Vec<u32>>()
        }
    };
    let list = |pages: Vec<u32>, action| pb::SetPageStateRequest {
        sequence_id: "a".into(),
        layer_count: 1,
        kv_head_count: 1,
        pages,
        action: Some(action),
        ..Default::default()
    };
    let mut cold = pages_in(&mut client, pb::PageState::Cold).await;
    cold.truncate(4);
    client
        .raw()
        .set_page_state(list(cold.clone(), actions::swap_in()))
        .await
        .unwrap();
    assert_eq!(pages_in(&mut client, pb::PageState::Hot).await, cold);
    assert_eq!(client.get_sequence("b").await.unwrap().pages.unwrap().hot, 0);
    assert_eq!(tiers(&client.stats().await.unwrap()).0, 4 * PAGE_BYTES);
    check_all(&mut client, "a", &a).await;
    check_all(&mut client, "b", &b).await;
    // Five pages cannot be hot at once on a four-page device: refused whole.
    client
        .raw()
        .set_page_state(list(cold, actions::offload_to_host()))
        .await
        .unwrap();
    let message = exhausted(client.set_page_state("a", 0..1, 0..1, 0..5, actions::swap_in()).await);
    assert!(message.contains("device tier is full"), "{message}");
    assert!(pages_in(&mut client, pb::PageState::Hot).await.is_empty());

    // Evicting frees room for new writes.
    client
        .set_page_state("a", 0..1, 0..1, 0..2, actions::evict())
        .await
        .unwrap();
    write(&mut client, "a", 6, 2 * PAGE, &mut a, 7).await.unwrap();
    assert_eq!(tiers(&client.stats().await.unwrap()).1, 10 * PAGE_BYTES);
}
