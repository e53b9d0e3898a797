//! Policies over gRPC (docs/CONCEPTS.md §5): ApplyPolicy evicts, summarizes or
//! offloads what its scorer does not keep, with reason `policy`; reported
//! attention decides what H2O keeps; attention the store computes for given
//! queries decides max-mass and reports the dropped mass; registered policies
//! run by themselves as a sequence grows; offload loses no byte; bad
//! requests name their field and change nothing.

mod common;

use common::{LaneData, TestServer, random_kv, size_of};
use kvtier_client::pb::apply_policy_request::Action;
use kvtier_client::pb::policy::Scorer;
use kvtier_client::{Client, ClientError, pack_kv, pb};
use tonic::Code;

const DTYPE: pb::DType = pb::DType::DtypeF32;
const HEAD_DIM: usize = 4;
const PAGE: usize = 4;
const GROUP: usize = 2;

fn layout() -> pb::Layout {
    kvtier_client::layout(2, 2, 2 * GROUP as u32, HEAD_DIM as u32, DTYPE, PAGE as u32)
}

/// A sequence of `tokens` random tokens in both layers; the lanes' data
/// (layer-major).
async fn setup(client: &mut Client, seq: &str, tokens: u32) -> Vec<LaneData> {
    client.create_sequence(seq, layout(), vec![]).await.unwrap();
    let mut lanes = vec![LaneData::default(); 4];
    for (layer, pair) in lanes.chunks_mut(2).enumerate() {
        let mut refs: Vec<&mut LaneData> = pair.iter_mut().collect();
        let kv = random_kv(DTYPE, HEAD_DIM, &mut refs, tokens as usize, layer as u64 + 7);
        client.put_pages(seq, layer as u32, 0..2, 0, tokens, kv).await.unwrap();
    }
    lanes
}

fn request(scorer: Scorer, budget_tokens: u32, action: Action) -> pb::ApplyPolicyRequest {
    pb::ApplyPolicyRequest {
        layer_start: 0,
        layer_count: 1,
        policy: Some(pb::Policy {
            scorer: Some(scorer),
            allocator: None,
        }),
        budget_tokens,
        action: Some(action),
        ..Default::default()
    }
}

fn evict() -> Action {
    Action::Evict(pb::Evict {})
}

fn streaming(sink_tokens: u32) -> Scorer {
    Scorer::Streaming(pb::StreamingPolicy { sink_tokens })
}

/// Pages per (kv head) of `layer` by state: (resident, gone by policy).
async fn pages(client: &mut Client, seq: &str, layer: u32) -> Vec<pb::Page> {
    client.fetch_pages(seq, layer, 0..2, vec![]).await.unwrap()
}

fn kept(pages: &[pb::Page], head: u32) -> Vec<u32> {
    pages
        .iter()
        .filter(|p| p.kv_head == head && p.state() != pb::PageState::Gone)
        .map(|p| p.page)
        .collect()
}

fn status_of(e: ClientError) -> (Code, String) {
    match e {
        ClientError::Status(s) => (s.code(), s.message().to_owned()),
        other => panic!("expected a status, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2o_keeps_what_reported_attention_says_and_evicts_the_rest() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let lanes = setup(&mut client, "s", 32).await;
    // Head 0 attends to pages 2 and 5, head 1 to pages 1 and 3.
    let mut weights = vec![0.001f32; 64];
    for (head, hot) in [(0usize, [2usize, 5]), (1, [1, 3])] {
        for page in hot {
            weights[head * 32 + page * PAGE..head * 32 + (page + 1) * PAGE].fill(0.1);
        }
    }
    client.report_attention("s", 0, 0..2, weights, 0.0).await.unwrap();
    let h2o = Scorer::H2o(pb::H2oPolicy {
        window_tokens: PAGE as u32,
        normalize: false,
    });
    let outcome = client
        .apply_policy("s", request(h2o, 3 * PAGE as u32, evict()))
        .await
        .unwrap();
    assert_eq!((outcome.pages_kept, outcome.pages_changed), (6, 10));
    assert_eq!(outcome.dropped_mass, None, "no queries given");
    let layer0 = pages(&mut client, "s", 0).await;
    assert_eq!(kept(&layer0, 0), [2, 5, 7]);
    assert_eq!(kept(&layer0, 1), [1, 3, 7]);
    let row = HEAD_DIM * size_of(DTYPE);
    for p in &layer0 {
        if p.state() == pb::PageState::Gone {
            assert_eq!(p.gone_reason(), pb::Reason::Policy);
        } else {
            assert_eq!(p.kv, lanes[p.kv_head as usize].page(p.page as usize, PAGE, row));
        }
    }
    // The same attention reported per page instead gives the same choice.
    let mut raw = kvtier_client::pb::kv_tier_client::KvTierClient::connect(format!("http://{}", server.addr))
        .await
        .unwrap();
    setup(&mut client, "per-page", 32).await;
    let mut page_weights = vec![0.004f32; 16];
    for (head, hot) in [(0usize, [2usize, 5]), (1, [1, 3])] {
        for page in hot {
            page_weights[head * 8 + page] = 0.4;
        }
    }
    raw.report_attention(pb::ReportAttentionRequest {
        sequence_id: "per-page".into(),
        layer: 0,
        kv_head_count: 2,
        page_weights,
        ..Default::default()
    })
    .await
    .unwrap();
    let h2o = Scorer::H2o(pb::H2oPolicy {
        window_tokens: PAGE as u32,
        normalize: false,
    });
    client
        .apply_policy("per-page", request(h2o, 3 * PAGE as u32, evict()))
        .await
        .unwrap();
    let per_page = pages(&mut client, "per-page", 0).await;
    assert_eq!((kept(&per_page, 0), kept(&per_page, 1)), (vec![2, 5, 7], vec![1, 3, 7]));
    // Layer 1 was not named: untouched.
    assert!(
        pages(&mut client, "s", 1)
            .await
            .iter()
            .all(|p| p.state() != pb::PageState::Gone)
    );
    let stats = client.stats().await.unwrap();
    let by_policy: u64 = stats
        .transitions
        .iter()
        .filter(|t| t.reason() == pb::Reason::Policy && t.to_state() == pb::PageState::Gone)
        .map(|t| t.count)
        .sum();
    assert_eq!(by_policy, 2 * 10, "both sequences");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offload_by_policy_loses_no_byte() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let lanes = setup(&mut client, "s", 30).await;
    let offload = Action::Offload(pb::Offload {
        tier: pb::Tier::Host as i32,
    });
    let mut req = request(streaming(4), 3 * PAGE as u32, offload);
    req.layer_count = 2;
    let outcome = client.apply_policy("s", req).await.unwrap();
    // 8 pages per lane, the partial last one never a candidate: 7 candidates,
    // 3 kept (the sink page and the two newest full pages).
    assert_eq!((outcome.pages_kept, outcome.pages_changed), (4 * 3, 4 * 4));
    let row = HEAD_DIM * size_of(DTYPE);
    for layer in 0..2 {
        for p in pages(&mut client, "s", layer).await {
            let expected_hot = [0, 5, 6, 7].contains(&p.page);
            assert_eq!(p.state() == pb::PageState::Hot, expected_hot, "page {}", p.page);
            if !expected_hot {
                assert_eq!((p.state(), p.cold_tier()), (pb::PageState::Cold, pb::Tier::Host));
            }
            let lane = &lanes[2 * layer as usize + p.kv_head as usize];
            assert_eq!(
                p.kv,
                lane.page(p.page as usize, PAGE, row),
                "layer {layer} page {}",
                p.page
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summarizing_a_page_of_identical_keys_keeps_it_exactly() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    client.create_sequence("s", layout(), vec![]).await.unwrap();
    // Every token of a page has the same key and value: page p's rows are p.
    let tokens = 16;
    let rows: Vec<f32> = (0..2 * tokens)
        .flat_map(|t| [((t % tokens) / PAGE) as f32 + 0.5; HEAD_DIM])
        .collect();
    let kv = pack_kv(&rows, &rows, 2, tokens, HEAD_DIM).unwrap();
    client.put_pages("s", 0, 0..2, 0, tokens as u32, kv).await.unwrap();
    let summarize = Action::Summarize(pb::Summarize { rows: 1 });
    client
        .apply_policy("s", request(streaming(4), PAGE as u32, summarize))
        .await
        .unwrap();
    for p in pages(&mut client, "s", 0).await {
        if p.page == 0 {
            assert_eq!(p.state(), pb::PageState::Hot);
            continue;
        }
        assert_eq!(p.state(), pb::PageState::Summary, "page {}", p.page);
        assert_eq!(p.summary_counts, [PAGE as u32]);
        let expected: Vec<u8> = [p.page as f32 + 0.5; 2 * HEAD_DIM]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(p.kv, expected, "page {}: the summary row is the page's row", p.page);
    }
}

/// Dense attention of `q` over `keys` (`[t][d]`), in f64.
fn softmax(q: &[f32], keys: &[f32]) -> Vec<f64> {
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    let logits: Vec<f64> = keys
        .chunks(HEAD_DIM)
        .map(|k| k.iter().zip(q).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() * scale)
        .collect();
    let top = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits.iter().map(|l| (l - top).exp()).collect();
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_mass_keeps_the_heaviest_pages_for_the_queries_and_reports_what_it_dropped() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    client.create_sequence("s", layout(), vec![]).await.unwrap();
    let tokens = 24;
    let keys: Vec<f32> = (0..2 * tokens * HEAD_DIM)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) / 4.0)
        .collect();
    let kv = pack_kv(&keys, &keys, 2, tokens, HEAD_DIM).unwrap();
    client.put_pages("s", 0, 0..2, 0, tokens as u32, kv).await.unwrap();
    let queries: Vec<f32> = (0..2 * GROUP * HEAD_DIM).map(|i| (i % 5) as f32 - 2.0).collect();
    let mut req = request(Scorer::MaxMass(pb::MaxMassPolicy {}), 2 * PAGE as u32, evict());
    req.queries = queries.iter().flat_map(|q| q.to_le_bytes()).collect::<Vec<u8>>().into();
    let outcome = client.apply_policy("s", req).await.unwrap();
    // Per KV head: the mean over its query group of dense attention, summed
    // per page; the two heaviest pages are kept.
    let mut dropped = 0.0;
    let layer0 = pages(&mut client, "s", 0).await;
    for head in 0..2 {
        let lane_keys = &keys[head * tokens * HEAD_DIM..(head + 1) * tokens * HEAD_DIM];
        let mut mass = vec![0f64; tokens / PAGE];
        for g in 0..GROUP {
            let qh = head * GROUP + g;
            let p = softmax(&queries[qh * HEAD_DIM..(qh + 1) * HEAD_DIM], lane_keys);
            for (t, w) in p.iter().enumerate() {
                mass[t / PAGE] += w / GROUP as f64;
            }
        }
        let mut order: Vec<usize> = (0..mass.len()).collect();
        order.sort_by(|a, b| mass[*b].total_cmp(&mass[*a]).then(a.cmp(b)));
        let mut best: Vec<u32> = order[..2].iter().map(|&p| p as u32).collect();
        best.sort();
        assert_eq!(kept(&layer0, head as u32), best, "head {head}: {mass:?}");
        dropped += order[2..].iter().map(|&p| mass[p]).sum::<f64>() / 2.0;
    }
    let reported = outcome.dropped_mass.expect("queries were given");
    assert!((reported - dropped).abs() < 1e-5, "{reported} vs {dropped}");
}

async fn resident_pages(client: &mut Client, seq: &str) -> usize {
    kept(&pages(client, seq, 0).await, 0).len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_policy_keeps_a_growing_sequence_within_its_budget_until_turned_off() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let mut lanes = setup(&mut client, "s", 8).await;
    let mut req = request(streaming(4), 2 * PAGE as u32, evict());
    req.trigger = pb::Trigger::EveryTokens as i32;
    req.every_tokens = PAGE as u32;
    let registered = client.apply_policy("s", req).await.unwrap();
    assert_eq!(
        (registered.pages_kept, registered.pages_changed),
        (0, 0),
        "nothing runs yet"
    );
    let mut tokens = 8;
    let append = async |client: &mut Client, lanes: &mut Vec<LaneData>, tokens: &mut u32| {
        let mut refs: Vec<&mut LaneData> = lanes[..2].iter_mut().collect();
        let kv = random_kv(DTYPE, HEAD_DIM, &mut refs, PAGE, u64::from(*tokens));
        client
            .append_tokens("s", 0, 0..2, PAGE as u32, kv, Some(u64::from(*tokens)))
            .await
            .unwrap();
        *tokens += PAGE as u32;
    };
    for _ in 0..4 {
        append(&mut client, &mut lanes, &mut tokens).await;
        assert_eq!(resident_pages(&mut client, "s").await, 2, "at {tokens} tokens");
    }
    // The sink page and the newest page, bytes intact.
    let row = HEAD_DIM * size_of(DTYPE);
    for p in pages(&mut client, "s", 0)
        .await
        .iter()
        .filter(|p| p.state() != pb::PageState::Gone)
    {
        assert!([0, 5].contains(&p.page));
        assert_eq!(p.kv, lanes[p.kv_head as usize].page(p.page as usize, PAGE, row));
    }
    let off = pb::ApplyPolicyRequest {
        trigger: pb::Trigger::Off as i32,
        ..Default::default()
    };
    client.apply_policy("s", off).await.unwrap();
    append(&mut client, &mut lanes, &mut tokens).await;
    assert_eq!(resident_pages(&mut client, "s").await, 3, "off: nothing evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapkv_after_prefill_runs_once_at_the_first_append_from_the_reported_window() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let mut lanes = setup(&mut client, "s", 32).await;
    // The observation window's attention, reported at the end of prefill:
    // both heads on page 3.
    let mut weights = vec![0.001f32; 64];
    for head in 0..2 {
        weights[head * 32 + 3 * PAGE..head * 32 + 4 * PAGE].fill(0.2);
    }
    client.report_attention("s", 0, 0..2, weights, 0.0).await.unwrap();
    let snapkv = Scorer::Snapkv(pb::SnapKvPolicy {
        window_tokens: PAGE as u32,
        kernel: 1,
        avg_pool: false,
    });
    let mut req = request(snapkv, 2 * PAGE as u32, evict());
    req.trigger = pb::Trigger::AfterPrefill as i32;
    client.apply_policy("s", req).await.unwrap();
    assert_eq!(resident_pages(&mut client, "s").await, 8, "not before the first append");
    for round in 0..2 {
        let mut refs: Vec<&mut LaneData> = lanes[..2].iter_mut().collect();
        let kv = random_kv(DTYPE, HEAD_DIM, &mut refs, 1, 100 + round);
        client.append_tokens("s", 0, 0..2, 1, kv, None).await.unwrap();
    }
    // Page 3 and the window (page 7) stay; the new partial page 8 too.
    let layer0 = pages(&mut client, "s", 0).await;
    assert_eq!(kept(&layer0, 0), [3, 7, 8]);
    assert_eq!(kept(&layer0, 1), [3, 7, 8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_policy_requests_name_their_field_and_change_nothing() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    setup(&mut client, "s", 16).await;
    let before = (
        client.get_sequence("s").await.unwrap(),
        pages(&mut client, "s", 0).await,
    );
    let with = |f: &dyn Fn(&mut pb::ApplyPolicyRequest)| {
        let mut r = request(streaming(4), 8, evict());
        f(&mut r);
        r
    };
    let cases: Vec<(&str, pb::ApplyPolicyRequest, Code)> = vec![
        ("policy", with(&|r| r.policy = None), Code::InvalidArgument),
        (
            "policy.scorer",
            with(&|r| r.policy.as_mut().unwrap().scorer = None),
            Code::InvalidArgument,
        ),
        ("action", with(&|r| r.action = None), Code::InvalidArgument),
        ("budget_tokens", with(&|r| r.budget_tokens = 0), Code::InvalidArgument),
        ("layer_count", with(&|r| r.layer_count = 0), Code::InvalidArgument),
        ("layer_start", with(&|r| r.layer_start = 2), Code::InvalidArgument),
        (
            "summarize.rows",
            with(&|r| r.action = Some(Action::Summarize(pb::Summarize { rows: 0 }))),
            Code::InvalidArgument,
        ),
        (
            "offload.tier",
            with(&|r| {
                r.action = Some(Action::Offload(pb::Offload {
                    tier: pb::Tier::Device as i32,
                }))
            }),
            Code::InvalidArgument,
        ),
        (
            "offload.tier",
            with(&|r| {
                r.action = Some(Action::Offload(pb::Offload {
                    tier: pb::Tier::Nvme as i32,
                }))
            }),
            Code::FailedPrecondition,
        ),
        (
            "policy.snapkv.kernel",
            with(&|r| {
                r.policy.as_mut().unwrap().scorer = Some(Scorer::Snapkv(pb::SnapKvPolicy {
                    window_tokens: 4,
                    kernel: 4,
                    avg_pool: false,
                }))
            }),
            Code::InvalidArgument,
        ),
        (
            "policy.ada.floor",
            with(&|r| {
                r.policy.as_mut().unwrap().allocator = Some(pb::policy::Allocator::Ada(pb::AdaAllocator { floor: 2.0 }))
            }),
            Code::InvalidArgument,
        ),
        (
            "policy.pyramid.beta",
            with(&|r| {
                r.policy.as_mut().unwrap().allocator =
                    Some(pb::policy::Allocator::Pyramid(pb::PyramidAllocator { beta: f64::NAN }))
            }),
            Code::InvalidArgument,
        ),
        (
            "queries",
            with(&|r| r.queries = vec![0u8; 12].into()),
            Code::InvalidArgument,
        ),
        (
            "queries",
            with(&|r| r.queries = f32::NAN.to_le_bytes().repeat(16).into()),
            Code::InvalidArgument,
        ),
        (
            "queries",
            with(&|r| {
                r.queries = vec![0u8; 64].into();
                r.trigger = pb::Trigger::AfterPrefill as i32;
            }),
            Code::InvalidArgument,
        ),
        (
            "every_tokens",
            with(&|r| r.trigger = pb::Trigger::EveryTokens as i32),
            Code::InvalidArgument,
        ),
        ("every_tokens", with(&|r| r.every_tokens = 4), Code::InvalidArgument),
        ("trigger", with(&|r| r.trigger = 99), Code::InvalidArgument),
        (
            "policy",
            with(&|r| {
                r.policy.as_mut().unwrap().scorer = Some(Scorer::H2o(pb::H2oPolicy {
                    window_tokens: 4,
                    normalize: false,
                }))
            }),
            Code::FailedPrecondition,
        ),
    ];
    for (field, req, code) in cases {
        let (got, message) = status_of(client.apply_policy("s", req).await.unwrap_err());
        assert_eq!(got, code, "{field}: {message}");
        assert!(message.starts_with(field), "{field}: {message}");
    }
    let report = |layer: u32, heads: std::ops::Range<u32>, w: Vec<f32>, decay: f64| pb::ReportAttentionRequest {
        tenant: String::new(),
        sequence_id: "s".into(),
        layer,
        kv_head_start: heads.start,
        kv_head_count: heads.len() as u32,
        token_weights: w,
        page_weights: vec![],
        decay,
    };
    let reports = vec![
        ("token_weights", report(0, 0..2, vec![], 0.0)),
        ("token_weights", report(0, 0..2, vec![0.1; 3], 0.0)),
        ("token_weights", report(0, 0..2, vec![0.1; 34], 0.0)),
        (
            "token_weights",
            report(0, 0..2, [vec![0.1; 15], vec![-1.0]].concat(), 0.0),
        ),
        (
            "token_weights",
            report(0, 0..2, [vec![0.1; 15], vec![f32::INFINITY]].concat(), 0.0),
        ),
        ("decay", report(0, 0..2, vec![0.1; 32], 1.5)),
        ("layer", report(2, 0..2, vec![0.1; 32], 0.0)),
        ("kv_head_count", report(0, 0..3, vec![0.1; 48], 0.0)),
    ];
    let mut raw = kvtier_client::pb::kv_tier_client::KvTierClient::connect(format!("http://{}", server.addr))
        .await
        .unwrap();
    for (field, req) in reports {
        let status = raw.report_attention(req).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {}", status.message());
        assert!(status.message().starts_with(field), "{field}: {}", status.message());
    }
    let after = (
        client.get_sequence("s").await.unwrap(),
        pages(&mut client, "s", 0).await,
    );
    assert_eq!(before, after);
}
