//! Pages come back bit-exact over real gRPC, in every dtype and across
//! layouts, writer/reader head splits, chunked streams and appends; digests
//! always equal min/max recomputed from the stored keys.

mod common;

use common::{LaneData, TestServer, random_kv, size_of, value};
use kvtier_client::{Client, pb};

const DTYPES: [pb::DType; 3] = [pb::DType::DtypeF32, pb::DType::DtypeF16, pb::DType::DtypeBf16];

struct Case {
    layers: u32,
    kv_heads: u32,
    query_heads: u32,
    head_dim: u32,
    page_size: u32,
    tokens: u32,
    groups: Vec<pb::LayerGroup>,
}

fn cases() -> Vec<Case> {
    vec![
        // SmolLM2-like GQA, partial last page.
        Case {
            layers: 2,
            kv_heads: 3,
            query_heads: 9,
            head_dim: 64,
            page_size: 16,
            tokens: 70,
            groups: vec![],
        },
        // Token-level pages.
        Case {
            layers: 1,
            kv_heads: 2,
            query_heads: 2,
            head_dim: 8,
            page_size: 1,
            tokens: 9,
            groups: vec![],
        },
        // Odd sizes everywhere.
        Case {
            layers: 3,
            kv_heads: 1,
            query_heads: 5,
            head_dim: 3,
            page_size: 7,
            tokens: 15,
            groups: vec![],
        },
        // Llama-3-8B head shape, shared-KV layer pair (layers 1 and 2).
        Case {
            layers: 3,
            kv_heads: 2,
            query_heads: 8,
            head_dim: 128,
            page_size: 32,
            tokens: 64,
            groups: vec![pb::LayerGroup {
                first_layer: 1,
                num_layers: 2,
            }],
        },
    ]
}

/// Stored KV layers: layers of one group share the first layer's lane.
fn stored_layer(case: &Case, layer: u32) -> u32 {
    case.groups
        .iter()
        .find(|g| (g.first_layer..g.first_layer + g.num_layers).contains(&layer))
        .map_or(layer, |g| g.first_layer)
}

async fn check_pages(client: &mut Client, seq: &str, case: &Case, dtype: pb::DType, lanes: &[Vec<LaneData>]) {
    let row = case.head_dim as usize * size_of(dtype);
    for layer in 0..case.layers {
        let expected = &lanes[stored_layer(case, layer) as usize];
        // Read with a different head split than the writer used.
        for h in 0..case.kv_heads {
            let pages = client.fetch_pages(seq, layer, h..h + 1, vec![]).await.unwrap();
            let data = &expected[h as usize];
            let tokens = data.keys.len() / row;
            assert_eq!(pages.len(), tokens.div_ceil(case.page_size as usize));
            for p in &pages {
                assert_eq!(p.state(), pb::PageState::Hot);
                let want = data.page(p.page as usize, case.page_size as usize, row);
                assert_eq!(p.tokens as usize * 2 * row, want.len());
                assert!(
                    p.kv[..] == want[..],
                    "{dtype:?} layer {layer} head {h} page {} differs",
                    p.page
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_round_trip_bit_exact_in_every_dtype_and_layout() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    for (c, case) in cases().iter().enumerate() {
        for dtype in DTYPES {
            let seq = format!("case{c}-{dtype:?}");
            let mut layout = kvtier_client::layout(
                case.layers,
                case.kv_heads,
                case.query_heads,
                case.head_dim,
                dtype,
                case.page_size,
            );
            layout.layer_groups = case.groups.clone();
            client.create_sequence(&seq, layout, vec![]).await.unwrap();
            let mut lanes: Vec<Vec<LaneData>> =
                vec![vec![LaneData::default(); case.kv_heads as usize]; case.layers as usize];
            // Writer: first head alone, then the rest (a TP-2 writer), for
            // every stored layer.
            let mut writes = Vec::new();
            for layer in 0..case.layers {
                if stored_layer(case, layer) != layer {
                    continue;
                }
                let (first, rest) = lanes[layer as usize].split_at_mut(1);
                let kv = random_kv(
                    dtype,
                    case.head_dim as usize,
                    &mut [&mut first[0]],
                    case.tokens as usize,
                    u64::from(layer) * 7 + c as u64,
                );
                writes.push(client.page_write(&seq, layer, 0..1, 0, case.tokens, kv));
                if !rest.is_empty() {
                    let mut refs: Vec<&mut LaneData> = rest.iter_mut().collect();
                    let kv = random_kv(
                        dtype,
                        case.head_dim as usize,
                        &mut refs,
                        case.tokens as usize,
                        u64::from(layer) * 7 + 100,
                    );
                    writes.push(client.page_write(&seq, layer, 1..case.kv_heads, 0, case.tokens, kv));
                }
            }
            let put = client.put_page_stream(writes).await.unwrap();
            assert_eq!(put.pages_shared, 0);
            check_pages(&mut client, &seq, case, dtype, &lanes).await;
            let info = client.get_sequence(&seq).await.unwrap();
            assert_eq!(
                (info.tokens, info.max_tokens),
                (u64::from(case.tokens), u64::from(case.tokens))
            );
            client.drop_sequence(&seq).await.unwrap();
        }
    }
    let stats = client.stats().await.unwrap();
    assert_eq!(stats.physical_pages, 0, "every page freed after the drops");
    assert!(stats.tiers.iter().all(|t| t.used_bytes == 0));
}

/// Checks every page's digest against min/max of the keys the test wrote.
async fn check_digests(
    client: &mut Client,
    seq: &str,
    layer: u32,
    dtype: pb::DType,
    head_dim: usize,
    page_size: usize,
    lanes: &[LaneData],
) {
    let req = pb::FetchPagesRequest {
        sequence_id: seq.into(),
        layer,
        kv_head_start: 0,
        kv_head_count: lanes.len() as u32,
        include_digests: true,
        ..Default::default()
    };
    let pages = client.fetch(req).await.unwrap();
    for p in pages {
        let keys = &lanes[p.kv_head as usize].keys;
        let first = p.page as usize * page_size;
        let rows = p.tokens as usize;
        assert_eq!(p.digest.len(), 2 * head_dim * size_of(dtype));
        for i in 0..head_dim {
            let column = (first..first + rows).map(|t| value(dtype, keys, t * head_dim + i));
            let (min, max) = column.fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
            assert_eq!(value(dtype, &p.digest, i), min, "page {} dim {i} min", p.page);
            assert_eq!(
                value(dtype, &p.digest, head_dim + i),
                max,
                "page {} dim {i} max",
                p.page
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_across_page_boundaries_keep_bytes_and_digests_exact() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let (head_dim, page_size, heads) = (16usize, 8usize, 2u32);
    for dtype in DTYPES {
        let seq = format!("append-{dtype:?}");
        client
            .create_sequence(
                &seq,
                kvtier_client::layout(1, heads, 4, head_dim as u32, dtype, page_size as u32),
                vec![],
            )
            .await
            .unwrap();
        let mut lanes = vec![LaneData::default(); heads as usize];
        // A prefill of 13 tokens (one full page, one partial), then appends of
        // sizes that cross page boundaries in every way.
        let mut refs: Vec<&mut LaneData> = lanes.iter_mut().collect();
        let kv = random_kv(dtype, head_dim, &mut refs, 13, 1);
        client.put_pages(&seq, 0, 0..heads, 0, 13, kv).await.unwrap();
        let mut position = 13u64;
        for (step, n) in [1u32, 2, 8, 1, 17, 3, 5, 9].into_iter().enumerate() {
            let mut refs: Vec<&mut LaneData> = lanes.iter_mut().collect();
            let kv = random_kv(dtype, head_dim, &mut refs, n as usize, 10 + step as u64);
            let out = client
                .append_tokens(&seq, 0, 0..heads, n, kv, Some(position))
                .await
                .unwrap();
            position += u64::from(n);
            assert_eq!(out.tokens, position);
            check_digests(&mut client, &seq, 0, dtype, head_dim, page_size, &lanes).await;
        }
        let row = head_dim * size_of(dtype);
        for h in 0..heads {
            for p in client.fetch_pages(&seq, 0, h..h + 1, vec![]).await.unwrap() {
                assert!(p.kv[..] == lanes[h as usize].page(p.page as usize, page_size, row)[..]);
            }
        }
        // A retried append (same position) is refused, not applied twice.
        let mut scratch = vec![LaneData::default(); heads as usize];
        let mut refs: Vec<&mut LaneData> = scratch.iter_mut().collect();
        let kv = random_kv(dtype, head_dim, &mut refs, 1, 99);
        let err = client
            .append_tokens(&seq, 0, 0..heads, 1, kv, Some(position - 1))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("position"), "{err}");
        assert_eq!(client.get_sequence(&seq).await.unwrap().tokens, position);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_streams_return_the_same_pages() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    let dtype = pb::DType::DtypeBf16;
    client
        .create_sequence("s", kvtier_client::layout(1, 4, 4, 128, dtype, 16), vec![])
        .await
        .unwrap();
    let mut lanes = vec![LaneData::default(); 4];
    let mut refs: Vec<&mut LaneData> = lanes.iter_mut().collect();
    let kv = random_kv(dtype, 128, &mut refs, 1000, 5);
    client.put_pages("s", 0, 0..4, 0, 1000, kv).await.unwrap();
    let whole = client.fetch_pages("s", 0, 0..4, vec![]).await.unwrap();
    assert_eq!(whole.len(), 4 * 63);
    // One page is 8 KiB: chunks of 20 KiB hold two pages each.
    let req = pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: 4,
        max_chunk_bytes: 20 << 10,
        ..Default::default()
    };
    let chunked = client.fetch(req.clone()).await.unwrap();
    assert_eq!(chunked, whole);
    // Each chunk is as full as its limit allows: of the 62 full pages of
    // each head, 124 messages of two pages, or under the default 4 MiB the
    // server's own 256 KiB chunks of 31 pages (its cost, 64 bytes a page
    // over the bytes, leaves no room for a 32nd), so that the client
    // receives one while the next is read (a chunk once stopped short of
    // its last page, which then took a second read on another thread).
    for (max_chunk_bytes, messages) in [(20 << 10, 124), (0, 8)] {
        let req = pb::FetchPagesRequest {
            max_chunk_bytes,
            pages: (0..62).collect(),
            ..req.clone()
        };
        let mut stream = client.raw().fetch_pages(req).await.unwrap().into_inner();
        let mut sizes = Vec::new();
        while let Some(msg) = stream.message().await.unwrap() {
            sizes.push(msg.pages.len());
        }
        assert_eq!(sizes.len(), messages, "max_chunk_bytes {max_chunk_bytes}: {sizes:?}");
        assert_eq!(sizes.iter().sum::<usize>(), 4 * 62);
    }
    // Explicit page lists keep their order, per head.
    let listed = client.fetch_pages("s", 0, 2..4, vec![62, 0, 31]).await.unwrap();
    let order: Vec<(u32, u32)> = listed.iter().map(|p| (p.kv_head, p.page)).collect();
    assert_eq!(order, [(2, 62), (2, 0), (2, 31), (3, 62), (3, 0), (3, 31)]);
    assert_eq!(listed[0].tokens, 1000 - 62 * 16);
}
