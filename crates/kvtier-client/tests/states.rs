//! The four-state machine over gRPC: every legal transition does what
//! docs/CONCEPTS.md §2 says and loses nothing it should not; every illegal one is
//! refused with FAILED_PRECONDITION and changes nothing.

mod common;

use common::{LaneData, TestServer, random_kv, size_of};
use kvtier_client::pb::set_page_state_request::Action;
use kvtier_client::{Client, ClientError, actions, pb};
use tonic::Code;

const DTYPE: pb::DType = pb::DType::DtypeBf16;
const HEAD_DIM: usize = 16;
const PAGE: usize = 4;

async fn setup(client: &mut Client, seq: &str, tokens: u32) -> Vec<LaneData> {
    client
        .create_sequence(
            seq,
            kvtier_client::layout(2, 2, 2, HEAD_DIM as u32, DTYPE, PAGE as u32),
            vec![],
        )
        .await
        .unwrap();
    let mut lanes = vec![LaneData::default(); 4];
    let (l0, l1) = lanes.split_at_mut(2);
    for (layer, lane) in [l0, l1].into_iter().enumerate() {
        let mut refs: Vec<&mut LaneData> = lane.iter_mut().collect();
        let kv = random_kv(DTYPE, HEAD_DIM, &mut refs, tokens as usize, layer as u64);
        client.put_pages(seq, layer as u32, 0..2, 0, tokens, kv).await.unwrap();
    }
    lanes
}

fn row() -> usize {
    HEAD_DIM * size_of(DTYPE)
}

/// Everything observable about a sequence: its info and every page.
async fn snapshot(client: &mut Client, seq: &str) -> (pb::SequenceInfo, Vec<pb::Page>) {
    let info = client.get_sequence(seq).await.unwrap();
    let mut pages = Vec::new();
    for layer in 0..2 {
        pages.extend(client.fetch_pages(seq, layer, 0..2, vec![]).await.unwrap());
    }
    (info, pages)
}

fn status_of(e: ClientError) -> (Code, String) {
    match e {
        ClientError::Status(s) => (s.code(), s.message().to_owned()),
        other => panic!("expected a status, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legal_transitions_move_pages_and_lose_nothing_they_should_keep() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let lanes = setup(&mut client, "s", 4 * PAGE as u32).await;
    let page = |layer: usize, head: usize, p: usize| lanes[layer * 2 + head].page(p, PAGE, row());

    // hot → cold(host): bytes unchanged, state and tier reported.
    assert_eq!(
        client
            .set_page_state("s", 0..2, 0..2, 0..2, actions::offload_to_host())
            .await
            .unwrap(),
        8
    );
    let info = client.get_sequence("s").await.unwrap();
    let counts = info.pages.unwrap();
    assert_eq!((counts.hot, counts.cold_host), (8, 8));
    for p in client.fetch_pages("s", 1, 0..2, vec![0, 1, 2]).await.unwrap() {
        let (state, tier) = if p.page < 2 {
            (pb::PageState::Cold, pb::Tier::Host)
        } else {
            (pb::PageState::Hot, pb::Tier::Unspecified)
        };
        assert_eq!((p.state(), p.cold_tier()), (state, tier));
        assert!(p.kv[..] == page(1, p.kv_head as usize, p.page as usize)[..]);
    }

    // cold → hot.
    client
        .set_page_state("s", 1..2, 1..2, 0..1, actions::swap_in())
        .await
        .unwrap();
    let p = &client.fetch_pages("s", 1, 1..2, vec![0]).await.unwrap()[0];
    assert_eq!(p.state(), pb::PageState::Hot);
    assert!(p.kv[..] == page(1, 1, 0)[..]);

    // hot|cold → summary: counts cover the page; a 1-row-per-token summary
    // is the page itself.
    client
        .set_page_state("s", 0..1, 0..1, 0..2, actions::summarize(2))
        .await
        .unwrap();
    client
        .set_page_state("s", 0..1, 0..1, 2..3, actions::summarize(PAGE as u32))
        .await
        .unwrap();
    let pages = client.fetch_pages("s", 0, 0..1, vec![0, 1, 2]).await.unwrap();
    for p in &pages {
        assert_eq!(p.state(), pb::PageState::Summary);
        assert_eq!(p.summary_counts.iter().sum::<u32>(), PAGE as u32);
    }
    assert_eq!(pages[0].summary_counts, [2, 2]);
    assert_eq!(pages[0].kv.len(), 2 * 2 * row());
    assert!(
        pages[2].kv[..] == page(0, 0, 2)[..],
        "one row per token reproduces the page"
    );

    // hot|cold|summary → gone, reported per page without failing the read.
    client
        .set_page_state("s", 0..1, 0..1, 1..4, actions::evict())
        .await
        .unwrap();
    let pages = client.fetch_pages("s", 0, 0..1, vec![]).await.unwrap();
    assert_eq!(
        pages.iter().map(|p| p.state()).collect::<Vec<_>>(),
        [
            pb::PageState::Summary,
            pb::PageState::Gone,
            pb::PageState::Gone,
            pb::PageState::Gone
        ]
    );
    assert!(
        pages[1..]
            .iter()
            .all(|p| p.kv.is_empty() && p.gone_reason() == pb::Reason::Explicit)
    );
    // Gone pages keep their positions and digests.
    let info = client.get_sequence("s").await.unwrap();
    assert_eq!(info.tokens, 4 * PAGE as u64);
    let digests = client
        .fetch(pb::FetchPagesRequest {
            sequence_id: "s".into(),
            kv_head_count: 1,
            include_digests: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(digests.iter().all(|p| p.digest.len() == 2 * row()));

    // Counters by (from, to, reason).
    let stats = client.stats().await.unwrap();
    let count = |from: pb::PageState, to: pb::PageState| -> u64 {
        stats
            .transitions
            .iter()
            .filter(|t| t.from_state() == from && t.to_state() == to && t.reason() == pb::Reason::Explicit)
            .map(|t| t.count)
            .sum()
    };
    assert_eq!(count(pb::PageState::Hot, pb::PageState::Cold), 8);
    assert_eq!(count(pb::PageState::Cold, pb::PageState::Hot), 1);
    assert_eq!(count(pb::PageState::Cold, pb::PageState::Summary), 2);
    assert_eq!(count(pb::PageState::Hot, pb::PageState::Summary), 1);
    assert_eq!(count(pb::PageState::Summary, pb::PageState::Gone), 2);
    assert_eq!(count(pb::PageState::Hot, pb::PageState::Gone), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summaries_of_identical_keys_are_exact() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    client
        .create_sequence("s", kvtier_client::layout(1, 1, 1, 4, pb::DType::DtypeF16, 8), vec![])
        .await
        .unwrap();
    let k: Vec<half::f16> = (0..8)
        .flat_map(|_| [0.1f32, -2.5, 3.75, 1e-3])
        .map(half::f16::from_f32)
        .collect();
    let v: Vec<half::f16> = (0..8)
        .flat_map(|_| [7.0f32, 0.0, -1.0, 2.0])
        .map(half::f16::from_f32)
        .collect();
    client
        .put_pages("s", 0, 0..1, 0, 8, kvtier_client::pack_kv(&k, &v, 1, 8, 4).unwrap())
        .await
        .unwrap();
    client
        .set_page_state("s", 0..1, 0..1, 0..1, actions::summarize(1))
        .await
        .unwrap();
    let p = &client.fetch_pages("s", 0, 0..1, vec![]).await.unwrap()[0];
    let (sk, sv) = kvtier_client::unpack_rows::<half::f16>(&p.kv, 4).unwrap();
    assert_eq!((sk.as_slice(), sv.as_slice()), (&k[..4], &v[..4]));
    assert_eq!(p.summary_counts, [8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn illegal_transitions_are_refused_and_change_nothing() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    setup(&mut client, "s", 4 * PAGE as u32).await;
    // Layer 0 head 0: page 0 hot, 1 cold, 2 summary, 3 gone.
    client
        .set_page_state("s", 0..1, 0..1, 1..2, actions::offload_to_host())
        .await
        .unwrap();
    client
        .set_page_state("s", 0..1, 0..1, 2..3, actions::summarize(1))
        .await
        .unwrap();
    client
        .set_page_state("s", 0..1, 0..1, 3..4, actions::evict())
        .await
        .unwrap();

    let migrate = |tier: pb::Tier| Action::Migrate(pb::Migrate { tier: tier as i32 });
    let offload_nvme = Action::Offload(pb::Offload {
        tier: pb::Tier::Nvme as i32,
    });
    let illegal: Vec<(u32, Action)> = vec![
        (0, actions::swap_in()),
        (0, migrate(pb::Tier::Host)),
        (1, actions::offload_to_host()),
        (1, migrate(pb::Tier::Host)),
        (2, actions::offload_to_host()),
        (2, actions::swap_in()),
        (2, migrate(pb::Tier::Host)),
        (2, actions::summarize(1)),
        (3, actions::offload_to_host()),
        (3, actions::swap_in()),
        (3, migrate(pb::Tier::Host)),
        (3, actions::summarize(1)),
        (3, actions::evict()),
    ];
    let before = snapshot(&mut client, "s").await;
    let stats_before = client.stats().await.unwrap();
    for (page, action) in illegal {
        let err = client
            .set_page_state("s", 0..1, 0..1, page..page + 1, action)
            .await
            .unwrap_err();
        let (code, message) = status_of(err);
        assert_eq!(code, Code::FailedPrecondition, "page {page} {action:?}: {message}");
        assert!(message.starts_with("action: layer 0 KV head 0 page"), "{message}");
        assert_eq!(snapshot(&mut client, "s").await, before, "{action:?} changed something");
    }
    // All or nothing: a range whose first pages could be offloaded but whose
    // third cannot leaves the first ones hot.
    let (code, message) = status_of(
        client
            .set_page_state("s", 0..2, 0..2, 0..4, actions::offload_to_host())
            .await
            .unwrap_err(),
    );
    assert_eq!(code, Code::FailedPrecondition);
    assert!(message.contains("page 1"), "{message}");
    // No nvme tier: refused as a precondition.
    let (code, message) = status_of(
        client
            .set_page_state("s", 1..2, 0..1, 0..1, offload_nvme)
            .await
            .unwrap_err(),
    );
    assert_eq!(
        (code, message.as_str()),
        (Code::FailedPrecondition, "action: the nvme tier is not configured")
    );
    assert_eq!(snapshot(&mut client, "s").await, before);
    assert_eq!(client.stats().await.unwrap().transitions, stats_before.transitions);

    // Appending into a last page that lost its bytes is refused too.
    setup(&mut client, "t", 3).await;
    client
        .set_page_state("t", 0..1, 0..2, 0..1, actions::evict())
        .await
        .unwrap();
    let mut scratch = vec![LaneData::default(); 2];
    let mut refs: Vec<&mut LaneData> = scratch.iter_mut().collect();
    let kv = random_kv(DTYPE, HEAD_DIM, &mut refs, 1, 3);
    let (code, message) = status_of(client.append_tokens("t", 0, 0..2, 1, kv, None).await.unwrap_err());
    assert_eq!(code, Code::FailedPrecondition, "{message}");
    assert!(message.starts_with("position:"), "{message}");
}
