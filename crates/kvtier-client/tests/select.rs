//! SelectPages over real gRPC against a brute-force reference computed from
//! the raw keys; partial pages, gone pages, data, tensor- and
//! context-parallel callers, and the multi-server merge.

mod common;

use common::{LaneData, TestServer, size_of, value};
use kvtier_client::{Client, Part, Partitioned, SelectRequest, actions, pb};
use std::time::Instant;

const D: usize = 8;
const PAGE: usize = 4;
const KV_HEADS: u32 = 3;
const GROUP: usize = 3;

fn layout(dtype: pb::DType) -> pb::Layout {
    kvtier_client::layout(1, KV_HEADS, KV_HEADS * GROUP as u32, D as u32, dtype, PAGE as u32)
}

/// A Quest selection (the mode these references model; the server's
/// default is another).
fn quest(layer: u32, kv_heads: std::ops::Range<u32>, queries: Vec<f32>, budget_pages: u32) -> SelectRequest {
    SelectRequest {
        mode: pb::SelectionMode::Quest,
        ..SelectRequest::new(layer, kv_heads, queries, budget_pages)
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Small integers as floats: exact products and sums, frequent ties.
    fn small(&mut self) -> f32 {
        (self.next() % 7) as f32 - 3.0
    }
}

/// Writes `tokens` tokens of small-integer keys; returns each head's data.
async fn write(client: &mut Client, seq: &str, dtype: pb::DType, tokens: usize, rng: &mut Rng) -> Vec<LaneData> {
    client.create_sequence(seq, layout(dtype), vec![]).await.unwrap();
    let mut kv = Vec::new();
    let mut lanes = vec![LaneData::default(); KV_HEADS as usize];
    for lane in &mut lanes {
        let mut k = vec![0u8; tokens * D * size_of(dtype)];
        for i in 0..tokens * D {
            put(dtype, &mut k, i, rng.small());
        }
        let v = common::finite_elements(dtype, tokens * D, rng.next());
        kv.extend_from_slice(&k);
        kv.extend_from_slice(&v);
        lane.keys = k;
        lane.values = v;
    }
    client
        .put_pages(seq, 0, 0..KV_HEADS, 0, tokens as u32, kv.into())
        .await
        .unwrap();
    lanes
}

fn put(dtype: pb::DType, bytes: &mut [u8], i: usize, v: f32) {
    match dtype {
        pb::DType::DtypeF32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
        pb::DType::DtypeF16 => bytes[2 * i..2 * i + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
        _ => bytes[2 * i..2 * i + 2].copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
    }
}

/// The reference: bounds from the raw keys (not the server's digests), the
/// rule of docs/CONCEPTS.md §3 by full sort.
fn reference(dtype: pb::DType, lane: &LaneData, queries: &[f32], k: usize, s: usize, w: usize) -> Vec<(u32, f32)> {
    let tokens = lane.keys.len() / (D * size_of(dtype));
    let n = tokens.div_ceil(PAGE);
    let bound = |p: usize, q: &[f32]| -> f32 {
        (0..D)
            .map(|i| {
                let column = (p * PAGE..((p + 1) * PAGE).min(tokens)).map(|t| value(dtype, &lane.keys, t * D + i));
                let (lo, hi) = column.fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
                (q[i] * hi).max(q[i] * lo)
            })
            .sum()
    };
    let scores: Vec<f32> = (0..n)
        .map(|p| {
            queries
                .chunks_exact(D)
                .map(|q| bound(p, q))
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect();
    if n <= k {
        return (0..n).map(|p| (p as u32, scores[p])).collect();
    }
    let forced = |p: usize| p < s || p + w >= n;
    let mut rest: Vec<usize> = (0..n).filter(|&p| !forced(p)).collect();
    rest.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b)));
    let mut chosen: Vec<usize> = (0..n).filter(|&p| forced(p)).collect();
    let room = k - chosen.len();
    chosen.extend(rest.into_iter().take(room));
    chosen.sort();
    chosen.into_iter().map(|p| (p as u32, scores[p])).collect()
}

fn queries(rng: &mut Rng, heads: usize) -> Vec<f32> {
    (0..heads * GROUP * D).map(|_| rng.small()).collect()
}

fn pages_of(h: &pb::HeadSelection) -> Vec<(u32, f32)> {
    h.pages.iter().map(|p| (p.page, p.bound)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selection_matches_a_brute_force_reference() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let mut rng = Rng(7);
    let mut case = 0;
    for dtype in [pb::DType::DtypeF32, pb::DType::DtypeF16, pb::DType::DtypeBf16] {
        for tokens in [1usize, 3, 4, 17, 40, 61] {
            let seq = format!("s{case}");
            case += 1;
            let lanes = write(&mut client, &seq, dtype, tokens, &mut rng).await;
            for (k, s, w) in [(1, 0, 0), (3, 1, 1), (5, 0, 2), (6, 2, 0), (20, 1, 1)] {
                let q = queries(&mut rng, KV_HEADS as usize);
                let req = SelectRequest {
                    sink_pages: s,
                    window_pages: w,
                    ..quest(0, 0..KV_HEADS, q.clone(), k)
                };
                let got = client.select_pages(&seq, &req).await.unwrap();
                assert_eq!(got.heads.len(), KV_HEADS as usize);
                for (h, head) in got.heads.iter().enumerate() {
                    let group_q = &q[h * GROUP * D..(h + 1) * GROUP * D];
                    let want = reference(dtype, &lanes[h], group_q, k as usize, s as usize, w as usize);
                    assert_eq!(
                        pages_of(head),
                        want,
                        "{dtype:?} tokens {tokens} k {k} s {s} w {w} head {h}"
                    );
                    assert_eq!(head.selected_but_gone, 0);
                }
                // A tensor-parallel reader of heads 1..3 gets the same answer.
                let tp = SelectRequest {
                    kv_heads: 1..3,
                    queries: q[GROUP * D..].to_vec(),
                    ..req.clone()
                };
                let part = client.select_pages(&seq, &tp).await.unwrap();
                assert_eq!(part.heads, got.heads[1..]);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_pages_gone_pages_data_and_aggregations() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let dtype = pb::DType::DtypeF32;
    client.create_sequence("p", layout(dtype), vec![]).await.unwrap();
    // Every key is -1: with a positive query every bound is negative unless
    // padding zeros leak into the partial last page's digest.
    let tokens = 2 * PAGE + 1;
    let keys: Vec<f32> = vec![-1.0; KV_HEADS as usize * tokens * D];
    let values: Vec<f32> = (0..KV_HEADS as usize * tokens * D).map(|i| i as f32).collect();
    let kv = kvtier_client::pack_kv(&keys, &values, KV_HEADS as usize, tokens, D).unwrap();
    client
        .put_pages("p", 0, 0..KV_HEADS, 0, tokens as u32, kv)
        .await
        .unwrap();
    let q = vec![1.0f32; KV_HEADS as usize * GROUP * D];
    let got = client
        .select_pages("p", &quest(0, 0..KV_HEADS, q.clone(), 3))
        .await
        .unwrap();
    for head in &got.heads {
        assert_eq!(
            pages_of(head),
            [(0, -8.0), (1, -8.0), (2, -8.0)],
            "no padding slot in the partial page"
        );
    }

    // Evict page 1 of head 0: still chosen, listed as gone and counted, and
    // never served.
    client
        .set_page_state("p", 0..1, 0..1, 1..2, actions::evict())
        .await
        .unwrap();
    let req = SelectRequest {
        include_data: true,
        ..quest(0, 0..KV_HEADS, q.clone(), 3)
    };
    let asked = Instant::now();
    let got = client.select_pages("p", &req).await.unwrap();
    let round_trip = asked.elapsed().as_micros() as u64;
    assert_eq!(got.heads[0].selected_but_gone, 1);
    let t = got.timing;
    assert!(
        t.store_us >= t.rank_us + t.read_us + got.swap.host_us + got.swap.nvme_us,
        "the store's time covers its parts: {t:?}"
    );
    assert!(
        t.store_us <= t.server_us && t.server_us <= round_trip,
        "the server's time covers the store's and is within the call's ({round_trip} us): {t:?}"
    );
    assert_eq!(got.heads[0].pages[1].state(), pb::PageState::Gone);
    assert_eq!(got.heads[1].selected_but_gone, 0);
    assert_eq!(got.pages.len(), 3 * 3 - 1);
    assert!(!got.pages.iter().any(|p| p.kv_head == 0 && p.page == 1));
    let fetched = client.fetch_pages("p", 0, 0..KV_HEADS, vec![]).await.unwrap();
    for page in &got.pages {
        let same = fetched
            .iter()
            .find(|f| f.kv_head == page.kv_head && f.page == page.page)
            .unwrap();
        assert_eq!(page, same, "selected data equals fetched data");
    }
    // Per-head lists fetch exactly the selection's pages (a gone one as its
    // state alone, which the selection's data leaves out).
    let per_head_pages = got
        .heads
        .iter()
        .map(|h| pb::PageList {
            pages: h.pages.iter().map(|p| p.page).collect(),
        })
        .collect();
    let by_list = client
        .fetch(pb::FetchPagesRequest {
            sequence_id: "p".into(),
            kv_head_count: KV_HEADS,
            per_head_pages,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(by_list.len(), 3 * 3);
    let by_list: Vec<pb::Page> = by_list
        .into_iter()
        .filter(|p| p.state() != pb::PageState::Gone)
        .collect();
    assert_eq!(
        by_list, got.pages,
        "per-head fetch returns the selected pages in the same order"
    );

    // Per query head: one selection per query head, numbered globally.
    let req = SelectRequest {
        aggregation: pb::Aggregation::PerQueryHead,
        ..quest(0, 1..2, vec![1.0; GROUP * D], 2)
    };
    let got = client.select_pages("p", &req).await.unwrap();
    let heads: Vec<(u32, Option<u32>)> = got.heads.iter().map(|h| (h.kv_head, h.query_head)).collect();
    assert_eq!(heads, [(1, Some(3)), (1, Some(4)), (1, Some(5))]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_parallel_shares_union_to_the_unsharded_selection() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let mut rng = Rng(99);
    write(&mut client, "cp", pb::DType::DtypeBf16, 77, &mut rng).await; // 20 pages
    for world in 1..=8u32 {
        for ownership in [pb::Ownership::Contiguous, pb::Ownership::Strided] {
            let q = queries(&mut rng, KV_HEADS as usize);
            let req = SelectRequest {
                sink_pages: 1,
                window_pages: 2,
                ..quest(0, 0..KV_HEADS, q, 7)
            };
            let whole = client.select_pages("cp", &req).await.unwrap();
            let mut union: Vec<Vec<(u32, f32)>> = vec![Vec::new(); KV_HEADS as usize];
            for rank in 0..world {
                let shard = pb::ContextShard {
                    rank,
                    world,
                    ownership: ownership as i32,
                    scope: pb::Scope::Global as i32,
                };
                let share = client
                    .select_pages(
                        "cp",
                        &SelectRequest {
                            shard: Some(shard),
                            ..req.clone()
                        },
                    )
                    .await
                    .unwrap();
                for (h, head) in share.heads.iter().enumerate() {
                    union[h].extend(pages_of(head));
                }
                // Local scope stays within the rank's pages and fills its budget there.
                let local = pb::ContextShard {
                    scope: pb::Scope::Local as i32,
                    ..shard
                };
                let mine = client
                    .select_pages(
                        "cp",
                        &SelectRequest {
                            shard: Some(local),
                            ..req.clone()
                        },
                    )
                    .await
                    .unwrap();
                for head in &mine.heads {
                    for p in &head.pages {
                        let owned = match ownership {
                            pb::Ownership::Strided => p.page % world == rank,
                            _ => {
                                let (base, extra) = (20 / world, 20 % world);
                                let start = rank * base + rank.min(extra);
                                (start..start + base + u32::from(rank < extra)).contains(&p.page)
                            }
                        };
                        assert!(owned, "rank {rank}/{world} {ownership:?} got page {}", p.page);
                    }
                }
            }
            for (h, head) in whole.heads.iter().enumerate() {
                union[h].sort_by_key(|x| x.0);
                assert_eq!(union[h], pages_of(head), "world {world} {ownership:?} head {h}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_server_merge_equals_single_server_selection() {
    let single = TestServer::default().await;
    let servers = [
        TestServer::default().await,
        TestServer::default().await,
        TestServer::default().await,
    ];
    let mut one = single.client().await;
    let dtype = pb::DType::DtypeF16;
    let mut rng = Rng(5);
    let tokens = 93; // 24 pages, the last partial
    let lanes = write(&mut one, "whole", dtype, tokens, &mut rng).await;
    // Split by position: pages 0..5, 5..17, 17..24 on three servers.
    let bounds = [(0usize, 5usize), (5, 17), (17, 24)];
    let mut parts = Vec::new();
    let row = D * size_of(dtype);
    for (server, &(a, b)) in servers.iter().zip(&bounds) {
        let mut client = server.client().await;
        client.create_sequence("part", layout(dtype), vec![]).await.unwrap();
        let (t0, t1) = (a * PAGE, (b * PAGE).min(tokens));
        let mut kv = Vec::new();
        for lane in &lanes {
            kv.extend_from_slice(&lane.keys[t0 * row..t1 * row]);
            kv.extend_from_slice(&lane.values[t0 * row..t1 * row]);
        }
        client
            .put_pages("part", 0, 0..KV_HEADS, 0, (t1 - t0) as u32, kv.into())
            .await
            .unwrap();
        parts.push(Part {
            client,
            sequence_id: "part".into(),
            first_page: a as u32,
            pages: (b - a) as u32,
        });
    }
    let mut split = Partitioned::new(parts).unwrap();
    assert_eq!(split.pages(), 24);
    for (k, s, w) in [
        (1, 0, 0),
        (4, 1, 1),
        (6, 0, 3),
        (9, 6, 2),
        (24, 2, 2),
        (30, 0, 0),
        (8, 0, 8),
    ] {
        for (aggregation, mode) in [
            (pb::Aggregation::Max, pb::SelectionMode::Quest),
            (pb::Aggregation::Mean, pb::SelectionMode::Cuboid),
            (pb::Aggregation::PerQueryHead, pb::SelectionMode::Quest),
            (pb::Aggregation::Max, pb::SelectionMode::Cuboid),
        ] {
            let q = queries(&mut rng, KV_HEADS as usize);
            let req = SelectRequest {
                sink_pages: s,
                window_pages: w,
                aggregation,
                mode,
                ..quest(0, 0..KV_HEADS, q, k)
            };
            let want = one.select_pages("whole", &req).await.unwrap().heads;
            let got = split.select(&req).await.unwrap();
            assert_eq!(got, want, "k {k} s {s} w {w} {aggregation:?} {mode:?}");
        }
    }
    // Estimated masses are normalised per server: no exact merge.
    let req = SelectRequest {
        mode: pb::SelectionMode::TwoStage,
        ..quest(0, 0..KV_HEADS, queries(&mut rng, KV_HEADS as usize), 4)
    };
    let err = split.select(&req).await.unwrap_err().to_string();
    assert!(err.contains("mode:"), "{err}");
    // A reused ranking's scores are an earlier query's: no exact merge.
    let req = SelectRequest {
        reuse_similarity: 0.9,
        ..quest(0, 0..KV_HEADS, queries(&mut rng, KV_HEADS as usize), 4)
    };
    let err = split.select(&req).await.unwrap_err().to_string();
    assert!(err.contains("reuse_similarity:"), "{err}");
}

/// The estimated-mass modes over gRPC: each query head's masses over the
/// whole lane sum to one, the mode is echoed (two-stage when unnamed), and
/// a top-p selection keeps the fewest best pages that reach p.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mass_modes_estimate_a_distribution_and_honour_top_p() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let mut rng = Rng(11);
    let tokens = 41; // 11 pages, the last partial
    write(&mut client, "m", pb::DType::DtypeF16, tokens, &mut rng).await;
    let pages = tokens.div_ceil(PAGE) as u32;
    let q = queries(&mut rng, KV_HEADS as usize);
    let unnamed = client
        .select_pages("m", &SelectRequest::new(0, 0..KV_HEADS, q.clone(), 2))
        .await
        .unwrap();
    assert_eq!(unnamed.mode, pb::SelectionMode::TwoStage);
    let all = SelectRequest {
        mode: pb::SelectionMode::Sketch,
        aggregation: pb::Aggregation::PerQueryHead,
        ..SelectRequest::new(0, 0..KV_HEADS, q.clone(), pages)
    };
    let answer = client.select_pages("m", &all).await.unwrap();
    assert_eq!(answer.mode, pb::SelectionMode::Sketch);
    assert_eq!(answer.heads.len(), KV_HEADS as usize * GROUP);
    for head in &answer.heads {
        assert_eq!(head.pages.len(), pages as usize);
        let total: f32 = head.pages.iter().map(|p| p.bound).sum();
        assert!((total - 1.0).abs() < 1e-4, "{head:?}");
    }
    for p in [0.3f32, 0.6, 0.95] {
        let req = SelectRequest {
            top_p: p,
            min_pages: 1,
            ..all.clone()
        };
        let cut = client.select_pages("m", &req).await.unwrap();
        for (head, whole) in cut.heads.iter().zip(&answer.heads) {
            let mut masses: Vec<f32> = whole.pages.iter().map(|p| p.bound).collect();
            masses.sort_by(|a, b| b.total_cmp(a));
            let held: f32 = head.pages.iter().map(|p| p.bound).sum();
            let need = masses.iter().scan(0f32, |s, m| {
                *s += m;
                Some(*s)
            });
            let fewest = need.take_while(|&s| s < p - 1e-5).count() + 1;
            assert_eq!(head.pages.len(), fewest.min(pages as usize), "p {p}: {head:?}");
            assert!(held >= p - 1e-4, "p {p}: {held}");
        }
    }
}

/// Reuse over gRPC: the same queries again reuse every lane's ranking and
/// choose the same pages; a page opened since is chosen; queries that moved
/// past the threshold, or another budget, rank again; the default mode
/// takes the mean over the group, quest the max.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selection_reuses_its_lanes_last_ranking_while_the_queries_hold() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let mut rng = Rng(17);
    let data = write(&mut client, "r", pb::DType::DtypeF16, 40, &mut rng).await;
    let q = queries(&mut rng, KV_HEADS as usize);
    let req = SelectRequest {
        reuse_similarity: 0.99,
        ..SelectRequest::new(0, 0..KV_HEADS, q.clone(), 4)
    };
    let first = client.select_pages("r", &req).await.unwrap();
    assert_eq!(first.lanes_reused, 0);
    assert!(first.pages_scored > 0);
    let again = client.select_pages("r", &req).await.unwrap();
    assert_eq!(again.lanes_reused, KV_HEADS);
    assert_eq!((again.pages_scored, again.digest_bytes), (0, 0));
    let pages = |r: &kvtier_client::SelectResult| -> Vec<Vec<u32>> {
        r.heads
            .iter()
            .map(|h| h.pages.iter().map(|p| p.page).collect())
            .collect()
    };
    assert_eq!(pages(&again), pages(&first));
    // A new page (tokens 40..44): chosen by the reuse, as the newest.
    let row = D * size_of(pb::DType::DtypeF16);
    let mut kv = Vec::new();
    for lane in &data {
        kv.extend_from_slice(&lane.keys[..4 * row]);
        kv.extend_from_slice(&lane.values[..4 * row]);
    }
    client
        .append_tokens("r", 0, 0..KV_HEADS, 4, kv.into(), Some(40))
        .await
        .unwrap();
    let grown = client.select_pages("r", &req).await.unwrap();
    assert_eq!(grown.lanes_reused, KV_HEADS);
    assert!(pages(&grown).iter().all(|p| p.contains(&10)), "{:?}", pages(&grown));
    // Every query negated: cosine −1, ranked again.
    let moved = SelectRequest {
        queries: q.iter().map(|v| -v).collect(),
        ..req.clone()
    };
    assert_eq!(client.select_pages("r", &moved).await.unwrap().lanes_reused, 0);
    // Another budget: ranked again.
    let wider = SelectRequest {
        budget_pages: 5,
        ..moved.clone()
    };
    assert_eq!(client.select_pages("r", &wider).await.unwrap().lanes_reused, 0);
    // Unset aggregation: the mass modes' mean equals asking for it.
    let mean = SelectRequest {
        aggregation: pb::Aggregation::Mean,
        reuse_similarity: 0.0,
        ..req.clone()
    };
    let unset = SelectRequest {
        reuse_similarity: 0.0,
        ..req.clone()
    };
    let (a, b) = (
        client.select_pages("r", &mean).await.unwrap(),
        client.select_pages("r", &unset).await.unwrap(),
    );
    assert_eq!(a.heads, b.heads);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_selection_requests_name_their_field() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let mut rng = Rng(3);
    write(&mut client, "b", pb::DType::DtypeF32, 10, &mut rng).await;
    let ok = quest(0, 0..KV_HEADS, vec![0.5; KV_HEADS as usize * GROUP * D], 2);
    let mut nan = ok.clone();
    nan.queries[7] = f32::NAN;
    let cases = [
        (
            SelectRequest {
                queries: vec![0.5; 3],
                ..ok.clone()
            },
            "queries:",
        ),
        (nan, "queries:"),
        (
            SelectRequest {
                budget_pages: 0,
                ..ok.clone()
            },
            "budget_pages:",
        ),
        (
            SelectRequest {
                sink_pages: 2,
                window_pages: 1,
                ..ok.clone()
            },
            "sink_pages:",
        ),
        (
            SelectRequest {
                top_p: 0.9,
                ..ok.clone()
            },
            "top_p:",
        ),
        (
            SelectRequest {
                mode: pb::SelectionMode::Sketch,
                top_p: 1.5,
                ..ok.clone()
            },
            "top_p:",
        ),
        (
            SelectRequest {
                mode: pb::SelectionMode::TwoStage,
                top_p: 0.5,
                min_pages: 3,
                ..ok.clone()
            },
            "min_pages:",
        ),
        (
            SelectRequest {
                min_pages: 1,
                ..ok.clone()
            },
            "min_pages:",
        ),
        (
            SelectRequest {
                mode: pb::SelectionMode::TwoStage,
                candidates: 65,
                ..ok.clone()
            },
            "candidates:",
        ),
        (
            SelectRequest {
                mode: pb::SelectionMode::Sketch,
                softmax_scale: -1.0,
                ..ok.clone()
            },
            "softmax_scale:",
        ),
        (
            SelectRequest {
                reuse_similarity: 1.5,
                ..ok.clone()
            },
            "reuse_similarity:",
        ),
        (
            SelectRequest {
                reuse_similarity: -0.5,
                ..ok.clone()
            },
            "reuse_similarity:",
        ),
        (
            SelectRequest {
                reuse_similarity: f32::NAN,
                ..ok.clone()
            },
            "reuse_similarity:",
        ),
        (
            SelectRequest {
                kv_heads: 2..4,
                ..ok.clone()
            },
            "kv_head_count:",
        ),
        (SelectRequest { layer: 1, ..ok.clone() }, "layer:"),
        (
            SelectRequest {
                shard: Some(pb::ContextShard {
                    rank: 2,
                    world: 2,
                    ownership: 1,
                    scope: 1,
                }),
                ..ok.clone()
            },
            "shard.rank:",
        ),
        (
            SelectRequest {
                shard: Some(pb::ContextShard {
                    rank: 0,
                    world: 2,
                    ownership: 0,
                    scope: 1,
                }),
                ..ok.clone()
            },
            "shard.ownership:",
        ),
        (
            SelectRequest {
                shard: Some(pb::ContextShard {
                    rank: 0,
                    world: 0,
                    ownership: 1,
                    scope: 2,
                }),
                ..ok.clone()
            },
            "shard.world:",
        ),
    ];
    for (req, field) in cases {
        match client.select_pages("b", &req).await {
            Err(kvtier_client::ClientError::Status(s)) => {
                assert_eq!(s.code(), tonic::Code::InvalidArgument, "{}", s.message());
                assert!(
                    s.message().starts_with(field),
                    "{} should start with {field}",
                    s.message()
                );
            }
            other => panic!("expected INVALID_ARGUMENT for {field}, got {other:?}"),
        }
    }
    let mut raw = pb::SelectPagesRequest {
        sequence_id: "b".into(),
        kv_head_count: 1,
        queries: vec![0u8; 5].into(),
        budget_pages: 1,
        ..Default::default()
    };
    let status = client.raw().select_pages(raw.clone()).await.unwrap_err();
    assert!(status.message().starts_with("queries:"), "{}", status.message());
    raw.queries = vec![0u8; GROUP * D * 4].into();
    raw.aggregation = 42;
    let status = client.raw().select_pages(raw).await.unwrap_err();
    assert!(status.message().starts_with("aggregation:"), "{}", status.message());
}

/// Keys at the ends of each dtype's range: every bound is finite and the
/// ranking follows the true bounds. In f32, page 0's bound sums +inf and
/// −inf (NaN, which ranked it last); its true bound, 0, is the best.
#[tokio::test]
async fn keys_at_the_ends_of_the_range_get_finite_bounds_that_rank() {
    let server = TestServer::default().await;
    let mut c = server.client().await;
    for (i, (dtype, max)) in [
        (pb::DType::DtypeF32, f32::MAX),
        (pb::DType::DtypeF16, half::f16::MAX.to_f32()),
        (pb::DType::DtypeBf16, half::bf16::MAX.to_f32()),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("extremes-{i}");
        c.create_sequence(&name, kvtier_client::layout(1, 1, 1, 2, dtype, 2), vec![])
            .await
            .unwrap();
        // Page 0: both keys [max, -max]; page 1: both keys [-1, -1]. K then V.
        let keys = [max, -max, max, -max, -1.0, -1.0, -1.0, -1.0];
        let mut kv = Vec::new();
        for page in keys.chunks(4) {
            let bytes = |vals: &[f32]| -> Vec<u8> {
                vals.iter()
                    .flat_map(|&v| match dtype {
                        pb::DType::DtypeF32 => v.to_le_bytes().to_vec(),
                        pb::DType::DtypeF16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                        _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                    })
                    .collect()
            };
            kv.extend(bytes(page));
            kv.extend(bytes(&[0.0; 4]));
        }
        // PutPages takes one head's K rows of all tokens then V rows: write
        // page by page.
        let half_page = kv.len() / 2;
        c.put_pages(&name, 0, 0..1, 0, 2, kv[..half_page].to_vec().into())
            .await
            .unwrap();
        c.put_pages(&name, 0, 0..1, 1, 2, kv[half_page..].to_vec().into())
            .await
            .unwrap();
        let answer = c
            .select_pages(&name, &quest(0, 0..1, vec![f32::MAX, f32::MAX], 1))
            .await
            .unwrap();
        let chosen = &answer.heads[0].pages;
        assert_eq!(chosen.len(), 1);
        assert!(chosen[0].bound.is_finite(), "{dtype:?}: {chosen:?}");
        assert_eq!(
            chosen[0].page, 0,
            "{dtype:?}: the page of true bound 0 over the one of -2·max"
        );
    }
}
