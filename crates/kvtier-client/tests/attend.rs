//! A selection that attends in the store (`attend`), over gRPC and over a
//! region's socket, against a model: for the pages the same selection
//! chooses, and the step's own token where the call appends one, each
//! query head's softmax over the tokens the test wrote (a summary's rows
//! weighted by their counts, gone pages left out), computed here in f64.
//! Conflicting fields are refused by name, with nothing appended.

mod common;

use kvtier_client::{Client, ClientError, SelectRequest, ShmRegion, actions, pb};
use tonic::Code;

const LAYERS: u32 = 2;
const KV_HEADS: u32 = 2;
const GROUP: u32 = 2;
const D: usize = 16;
const PAGE: u32 = 8;
const TOKENS: u32 = 70;

/// Element `i` of token `t`'s K (`half` 0) or V (1) row in (layer, head):
/// a multiple of 1/64 in [-2, 2), exact in every dtype.
fn element(layer: u32, head: u32, t: u32, half: u32, i: usize) -> f32 {
    let mut x = u64::from(layer) << 48 ^ u64::from(head) << 40 ^ u64::from(t) << 16 ^ u64::from(half) << 12 ^ i as u64;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    ((x % 256) as f32 - 128.0) / 64.0
}

fn encode(dtype: pb::DType, values: impl Iterator<Item = f32>) -> Vec<u8> {
    values
        .flat_map(|v| match dtype {
            pb::DType::DtypeF32 => v.to_le_bytes().to_vec(),
            _ => half::f16::from_f32(v).to_le_bytes().to_vec(),
        })
        .collect()
}

/// Every head's rows of `layer`, as PutPages takes them.
fn layer_kv(dtype: pb::DType, layer: u32) -> Vec<u8> {
    let mut out = Vec::new();
    for h in 0..KV_HEADS {
        for half in 0..2 {
            out.extend(encode(
                dtype,
                (0..TOKENS).flat_map(|t| (0..D).map(move |i| element(layer, h, t, half, i))),
            ));
        }
    }
    out
}

/// Sequence "s": every layer's `TOKENS` tokens, as the test writes them.
async fn store_all(c: &mut Client, dtype: pb::DType) {
    let layout = kvtier_client::layout(LAYERS, KV_HEADS, KV_HEADS * GROUP, D as u32, dtype, PAGE);
    c.create_sequence("s", layout, vec![]).await.unwrap();
    for layer in 0..LAYERS {
        c.put_pages("s", layer, 0..KV_HEADS, 0, TOKENS, layer_kv(dtype, layer).into())
            .await
            .unwrap();
    }
}

/// A key or value row, and the tokens it stands for.
struct Row {
    k: Vec<f64>,
    v: Vec<f64>,
    count: f64,
}

/// The rows the model attends over for one head's chosen pages (of a lane
/// of `len` tokens): the test's own for a kept page, the server's for a
/// summary (its means are the server's to choose), none for a gone one.
fn model_rows(dtype: pb::DType, layer: u32, len: u32, head: &pb::HeadSelection, read: &[pb::Page]) -> Vec<Row> {
    let mut rows = Vec::new();
    for chosen in &head.pages {
        let Some(page) = read.iter().find(|p| p.kv_head == head.kv_head && p.page == chosen.page) else {
            continue;
        };
        if page.summary_counts.is_empty() {
            let first = page.page * PAGE;
            rows.extend((first..(first + PAGE).min(len)).map(|t| token_row(layer, head.kv_head, t)));
        } else {
            let m = page.summary_counts.len();
            let at = |r: usize, i: usize| f64::from(common::value(dtype, &page.kv, r * D + i));
            for (r, &count) in page.summary_counts.iter().enumerate() {
                rows.push(Row {
                    k: (0..D).map(|i| at(r, i)).collect(),
                    v: (0..D).map(|i| at(m + r, i)).collect(),
                    count: f64::from(count),
                });
            }
        }
    }
    rows
}

/// Token `t`'s rows in (layer, head), as the test wrote them.
fn token_row(layer: u32, head: u32, t: u32) -> Row {
    let row = |half| (0..D).map(|i| f64::from(element(layer, head, t, half, i))).collect();
    Row {
        k: row(0),
        v: row(1),
        count: 1.0,
    }
}

/// One query's softmax over `rows`: its output and log-sum-exp.
fn model(q: &[f32], rows: &[Row], scale: f64) -> (Vec<f64>, f64) {
    let logits: Vec<f64> = rows
        .iter()
        .map(|r| r.k.iter().zip(q).map(|(k, q)| k * f64::from(*q)).sum::<f64>() * scale + r.count.ln())
        .collect();
    let top = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = logits.iter().map(|l| (l - top).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut out = vec![0.0; D];
    for (w, r) in weights.iter().zip(rows) {
        out.iter_mut().zip(&r.v).for_each(|(o, v)| *o += w / total * v);
    }
    (out, top + total.ln())
}

fn queries(seed: u32, heads: u32) -> Vec<f32> {
    (0..heads as usize * D)
        .map(|i| element(99, seed, i as u32, 0, i) * 0.75)
        .collect()
}

async fn select(
    c: &mut Client,
    region: &mut ShmRegion,
    local: bool,
    req: &SelectRequest,
) -> kvtier_client::SelectResult {
    match local {
        false => c.select_pages("s", req).await.unwrap(),
        true => c.select_pages_local(region, "s", req).await.unwrap(),
    }
}

#[tokio::test]
async fn each_query_head_gets_the_softmax_over_what_it_chose() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, mut c, mut region) = common::with_region(dir.path()).await;
    let mut cases = 0;
    for dtype in [pb::DType::DtypeF32, pb::DType::DtypeF16] {
        let _ = c.drop_sequence("s").await;
        store_all(&mut c, dtype).await;
        // Layer 0: a summary on head 0, a gone page on head 1.
        c.set_page_state("s", 0..1, 0..1, 2..3, actions::summarize(3))
            .await
            .unwrap();
        c.set_page_state("s", 0..1, 1..2, 4..5, actions::evict()).await.unwrap();
        // Tokens per (layer, KV head): appends grow them.
        let mut len = [[TOKENS; KV_HEADS as usize]; LAYERS as usize];
        for seed in 0..24u32 {
            let layer = seed % LAYERS;
            let aggregation = [
                pb::Aggregation::Max,
                pb::Aggregation::Mean,
                pb::Aggregation::PerQueryHead,
            ][seed as usize % 3];
            let mode = [pb::SelectionMode::Quest, pb::SelectionMode::TwoStage][seed as usize / 3 % 2];
            let (heads, first) = if seed % 4 == 3 { (1, 1) } else { (KV_HEADS, 0) };
            let base = SelectRequest {
                aggregation,
                mode,
                sink_pages: 1,
                window_pages: 1,
                softmax_scale: if seed % 2 == 0 { 0.0 } else { 0.4 },
                ..SelectRequest::new(layer, first..first + heads, queries(seed, heads * GROUP), 2 + seed % 8)
            };
            let local = seed % 2 == 1;
            let read = select(
                &mut c,
                &mut region,
                false,
                &SelectRequest {
                    include_data: true,
                    ..base.clone()
                },
            )
            .await;
            // Every third call over every head appends the step's own token, which it attends too.
            let appends = seed % 3 == 1 && heads == KV_HEADS;
            let append = appends.then(|| pb::AppendAfterSelection {
                num_tokens: 1,
                kv: (first..first + heads)
                    .flat_map(|h| {
                        let t = len[layer as usize][h as usize];
                        (0..2).flat_map(move |half| encode(dtype, (0..D).map(move |i| element(layer, h, t, half, i))))
                    })
                    .collect::<Vec<u8>>()
                    .into(),
                position: None,
                persist: false,
            });
            let attending = SelectRequest {
                attend: true,
                append,
                ..base.clone()
            };
            let got = select(&mut c, &mut region, local, &attending).await;
            assert_eq!(got.heads, read.heads, "the same choice, attending or not");
            assert!(got.pages.is_empty(), "an attending selection returns no page");
            let scale = if base.softmax_scale == 0.0 {
                1.0 / (D as f64).sqrt()
            } else {
                f64::from(base.softmax_scale)
            };
            let mut expected = Vec::new();
            for head in &read.heads {
                let stored = len[layer as usize][head.kv_head as usize];
                let mut rows = model_rows(dtype, layer, stored, head, &read.pages);
                if appends {
                    rows.push(token_row(layer, head.kv_head, stored));
                }
                let chose: Vec<u32> = match head.query_head {
                    Some(q) => vec![q],
                    None => (head.kv_head * GROUP..(head.kv_head + 1) * GROUP).collect(),
                };
                for q in chose {
                    let at = (q - first * GROUP) as usize * D;
                    let tokens = rows.iter().map(|r| r.count).sum::<f64>() as u64;
                    expected.push((q, model(&base.queries[at..at + D], &rows, scale), tokens));
                }
            }
            assert_eq!(got.attention.len(), expected.len());
            for (a, (q, (out, lse), tokens)) in got.attention.iter().zip(&expected) {
                assert_eq!((a.query_head, a.tokens), (*q, *tokens), "seed {seed}");
                assert!(
                    (f64::from(a.lse) - lse).abs() < 1e-4 * (1.0 + lse.abs()),
                    "seed {seed}: lse {} vs {lse}",
                    a.lse
                );
                let values: Vec<f32> = a
                    .out
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                for (g, w) in values.iter().zip(out) {
                    assert!(
                        (f64::from(*g) - w).abs() < 1e-4 * (1.0 + w.abs()),
                        "seed {seed}: {values:?} vs {out:?}"
                    );
                }
            }
            if appends {
                (first..first + heads).for_each(|h| len[layer as usize][h as usize] += 1);
            }
            cases += 1;
        }
    }
    assert_eq!(cases, 48);
}

#[tokio::test]
async fn attend_with_fields_it_replaces_is_refused_and_appends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, mut c, region) = common::with_region(dir.path()).await;
    let dtype = pb::DType::DtypeF32;
    store_all(&mut c, dtype).await;
    let base = SelectRequest {
        attend: true,
        append: Some(pb::AppendAfterSelection {
            num_tokens: 1,
            kv: encode(dtype, (0..2 * KV_HEADS as usize * D).map(|_| 0.5)).into(),
            position: Some(u64::from(TOKENS)),
            persist: false,
        }),
        ..SelectRequest::new(0, 0..KV_HEADS, queries(0, KV_HEADS * GROUP), 3)
    };
    for (req, field) in [
        (
            SelectRequest {
                include_data: true,
                ..base.clone()
            },
            "include_data",
        ),
        (
            SelectRequest {
                shm: Some(region.whole()),
                include_data: true,
                ..base.clone()
            },
            "include_data",
        ),
        (
            SelectRequest {
                shm: Some(region.whole()),
                ..base.clone()
            },
            "shm",
        ),
    ] {
        match c.select_pages("s", &req).await {
            Err(ClientError::Status(s)) => {
                assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
                assert!(s.message().starts_with(field), "{field}: {}", s.message());
            }
            other => panic!("{field}: {other:?}"),
        }
    }
    assert_eq!(c.get_sequence("s").await.unwrap().max_tokens, u64::from(TOKENS));
    match c
        .prefetch(
            "s",
            &SelectRequest {
                append: None,
                ..base.clone()
            },
        )
        .await
    {
        Err(ClientError::Status(s)) => assert!(s.message().starts_with("attend"), "{}", s.message()),
        other => panic!("prefetch: {other:?}"),
    }
    // Refused fields aside, the same request attends and appends.
    let got = c.select_pages("s", &base).await.unwrap();
    assert_eq!(got.attention.len(), (KV_HEADS * GROUP) as usize);
    assert_eq!(c.get_sequence("s").await.unwrap().max_tokens, u64::from(TOKENS) + 1);
}

#[tokio::test]
async fn an_attending_selection_holds_its_buffer_in_flight() {
    // Responses may hold 1 MiB at once.
    let config = kvtier_server::ServerConfig {
        max_message_bytes: 1 << 20,
        max_inflight_bytes: 2 << 20,
        ..kvtier_server::ServerConfig::default()
    };
    let server = common::TestServer::start_with(common::small_store(), config).await;
    let mut c = server.client().await;
    let (d, tokens) = (128usize, 2048u32);
    let dtype = pb::DType::DtypeF16;
    let layout = kvtier_client::layout(1, KV_HEADS, KV_HEADS * GROUP, d as u32, dtype, 16);
    c.create_sequence("s", layout, vec![]).await.unwrap();
    // 512 tokens at a time, every head's the same.
    let part = encode(
        dtype,
        (0..2 * KV_HEADS as usize * 512 * d).map(|i| (i % 7) as f32 / 8.0),
    );
    for first_page in (0..tokens / 16).step_by(32) {
        c.put_pages("s", 0, 0..KV_HEADS, first_page, 512, part.clone().into())
            .await
            .unwrap();
    }
    let queries: Vec<f32> = (0..(KV_HEADS * GROUP) as usize * d)
        .map(|i| (i % 5) as f32 / 10.0)
        .collect();
    // 128 pages of 8 KiB per head, and their rows widened to f32: 6 MiB.
    let all = SelectRequest {
        attend: true,
        ..SelectRequest::new(0, 0..KV_HEADS, queries.clone(), 128)
    };
    match c.select_pages("s", &all).await {
        Err(ClientError::Status(s)) => {
            assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
            assert!(s.message().contains("more than responses may hold"), "{}", s.message());
        }
        other => panic!("{other:?}"),
    }
    // 8 pages per head fit.
    let some = SelectRequest {
        attend: true,
        ..SelectRequest::new(0, 0..KV_HEADS, queries, 8)
    };
    assert_eq!(
        c.select_pages("s", &some).await.unwrap().attention.len(),
        (KV_HEADS * GROUP) as usize
    );
}
