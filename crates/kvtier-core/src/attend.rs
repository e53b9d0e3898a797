//! Attention where the rows are (`SelectPagesRequest.attend`): a decode
//! step's attention over the rows a selection chose, computed by the
//! store, so that one row of values per query head crosses to the worker
//! instead of the pages. Each result is partial, over the store's rows
//! only: the softmax-weighted mean of their values and the log of the
//! softmax's normaliser (log-sum-exp), which is what merging it exactly
//! with rows held elsewhere (the step's own token, another
//! context-parallel rank's positions) takes:
//!
//! `out = (e^(lse₁−m)·out₁ + e^(lse₂−m)·out₂) / (e^(lse₁−m) + e^(lse₂−m))`,
//! `m = max(lse₁, lse₂)`.
//!
//! A summary row standing for `count` tokens gains `ln count` on its logit,
//! as in [`crate::policy::attention`]: a page of identical rows summarised
//! to one gets exactly the attention the page had.

use crate::DType;
use crate::fast_exp::exp_in_place;

/// One page's rows: K rows then as many V rows, in the page dtype
/// (`PageContent`'s layout), each standing for one token or, for a
/// summary, for `counts[i]`.
#[derive(Debug, Clone, Copy)]
pub struct PageRows<'a> {
    /// K rows `[rows][head_dim]`, then V rows.
    pub kv: &'a [u8],
    /// A summary's tokens per row; `None`: one each.
    pub counts: Option<&'a [u32]>,
}

/// One query head's attention over a set of rows.
#[derive(Debug, Clone, PartialEq)]
pub struct PartialAttention {
    /// `Σ softmax(logit)·v` over the rows, `head_dim` values; zeros
    /// without rows.
    pub out: Vec<f32>,
    /// `ln Σ e^logit`, logits scaled (and a summary row's `ln count`
    /// added); −∞ without rows, which a merge weights by zero.
    pub lse: f32,
    /// Tokens the rows stand for.
    pub tokens: u64,
}

/// The rows of one KV head's pages widened to f32 once, for every query
/// head of its group.
struct Rows {
    keys: Vec<f32>,
    values: Vec<f32>,
    /// `ln count` per row (0 for an original row).
    bias: Vec<f32>,
    tokens: u64,
}

impl Rows {
    fn widen(dtype: DType, head_dim: usize, pages: &[PageRows<'_>]) -> Self {
        let row_bytes = head_dim * dtype.size();
        let n: usize = pages.iter().map(|p| p.kv.len() / (2 * row_bytes)).sum();
        let mut rows = Rows {
            keys: vec![0.0; n * head_dim],
            values: vec![0.0; n * head_dim],
            bias: Vec::with_capacity(n),
            tokens: 0,
        };
        let mut at = 0;
        for page in pages {
            let count = page.kv.len() / (2 * row_bytes);
            let (k, v) = page.kv.split_at(count * row_bytes);
            let span = at * head_dim..(at + count) * head_dim;
            dtype.widen(k, &mut rows.keys[span.clone()]);
            dtype.widen(v, &mut rows.values[span]);
            match page.counts {
                Some(counts) => {
                    rows.bias.extend(counts.iter().map(|&c| (c as f32).ln()));
                    rows.tokens += counts.iter().map(|&c| u64::from(c)).sum::<u64>();
                }
                None => {
                    rows.bias.extend(std::iter::repeat_n(0.0, count));
                    rows.tokens += count as u64;
                }
            }
            at += count;
        }
        rows
    }
}

/// Each query head of `queries` (`[heads][head_dim]`) attending over the
/// rows of `pages`, logits scaled by `scale`.
pub fn attend(
    dtype: DType,
    head_dim: usize,
    scale: f32,
    queries: &[f32],
    pages: &[PageRows<'_>],
) -> Vec<PartialAttention> {
    let rows = Rows::widen(dtype, head_dim, pages);
    let mut logits = vec![0.0f32; rows.bias.len()];
    queries
        .chunks_exact(head_dim)
        .map(|q| attend_one(&rows, head_dim, scale, q, &mut logits))
        .collect()
}

fn attend_one(rows: &Rows, d: usize, scale: f32, q: &[f32], logits: &mut [f32]) -> PartialAttention {
    let mut out = vec![0.0f32; d];
    if logits.is_empty() {
        return PartialAttention {
            out,
            lse: f32::NEG_INFINITY,
            tokens: 0,
        };
    }
    for ((l, k), b) in logits.iter_mut().zip(rows.keys.chunks_exact(d)).zip(&rows.bias) {
        *l = dot(q, k) * scale + b;
    }
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    logits.iter_mut().for_each(|l| *l -= top);
    exp_in_place(logits);
    let total: f32 = logits.iter().sum();
    for (w, v) in logits.iter().zip(rows.values.chunks_exact(d)) {
        let w = w / total;
        out.iter_mut().zip(v).for_each(|(o, x)| *o += w * x);
    }
    PartialAttention {
        out,
        lse: top + total.ln(),
        tokens: rows.tokens,
    }
}

/// `a · b` in eight lanes, which the compiler keeps in vector registers
/// (one running sum would be a chain of dependent scalar adds).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The model: every token's row, in f64, one softmax over all of them.
    fn model(q: &[f32], tokens: &[(Vec<f32>, Vec<f32>)], scale: f64) -> (Vec<f64>, f64) {
        let logits: Vec<f64> = tokens
            .iter()
            .map(|(k, _)| k.iter().zip(q).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() * scale)
            .collect();
        let top = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = logits.iter().map(|l| (l - top).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut out = vec![0.0; q.len()];
        for (w, (_, v)) in weights.iter().zip(tokens) {
            for (o, x) in out.iter_mut().zip(v) {
                *o += w / total * f64::from(*x);
            }
        }
        (out, top + total.ln())
    }

    fn page_bytes(dtype: DType, rows: &[(Vec<f32>, Vec<f32>)]) -> Vec<u8> {
        let k: Vec<f32> = rows.iter().flat_map(|(k, _)| k.clone()).collect();
        let v: Vec<f32> = rows.iter().flat_map(|(_, v)| v.clone()).collect();
        [dtype.encode(&k), dtype.encode(&v)].concat()
    }

    /// Merges two partial results as a worker would.
    fn merge(a: &PartialAttention, b: &PartialAttention) -> Vec<f32> {
        let m = a.lse.max(b.lse);
        let (wa, wb) = ((a.lse - m).exp(), (b.lse - m).exp());
        a.out
            .iter()
            .zip(&b.out)
            .map(|(x, y)| (wa * x + wb * y) / (wa + wb))
            .collect()
    }

    fn close(got: &[f32], want: &[f64], tolerance: f64) {
        for (g, w) in got.iter().zip(want) {
            assert!(
                (f64::from(*g) - w).abs() <= tolerance * (1.0 + w.abs()),
                "{got:?} vs {want:?}"
            );
        }
    }

    fn row(d: usize) -> impl Strategy<Value = (Vec<f32>, Vec<f32>)> {
        (
            prop::collection::vec(-3.0f32..3.0, d),
            prop::collection::vec(-3.0f32..3.0, d),
        )
    }

    /// A token's K and V rows.
    type Token = (Vec<f32>, Vec<f32>);

    /// Head dim, tokens' rows, query heads, and where pages split them.
    fn case() -> impl Strategy<Value = (usize, Vec<Token>, Vec<f32>, Vec<usize>)> {
        (1usize..20, 1usize..4).prop_flat_map(|(d, heads)| {
            (
                Just(d),
                prop::collection::vec(row(d), 1..24),
                prop::collection::vec(-2.0f32..2.0, heads * d),
                prop::collection::vec(1usize..6, 1..8),
            )
        })
    }

    proptest! {
        /// Over pages split anywhere, and merged with rows held apart (the
        /// step's own), the result is one softmax over every token.
        #[test]
        fn partial_results_merge_into_the_whole_softmax(
            (d, rows, queries, splits) in case(),
            held in 0usize..3,
            scale in 0.05f32..1.0,
        ) {
            let held = held.min(rows.len() - 1);
            let stored = &rows[..rows.len() - held];
            let mut pages = Vec::new();
            let mut at = 0;
            for n in splits.iter().cycle() {
                if at == stored.len() {
                    break;
                }
                let end = (at + n).min(stored.len());
                pages.push(page_bytes(DType::F32, &stored[at..end]));
                at = end;
            }
            let views: Vec<PageRows> = pages.iter().map(|kv| PageRows { kv, counts: None }).collect();
            let store = attend(DType::F32, d, scale, &queries, &views);
            let own_rows = page_bytes(DType::F32, &rows[stored.len()..]);
            let own = attend(DType::F32, d, scale, &queries, &[PageRows { kv: &own_rows, counts: None }]);
            for (h, q) in queries.chunks_exact(d).enumerate() {
                let (want, _) = model(q, &rows, f64::from(scale));
                close(&merge(&store[h], &own[h]), &want, 1e-4);
                let (_, lse) = model(q, stored, f64::from(scale));
                prop_assert!((f64::from(store[h].lse) - lse).abs() < 1e-4 * (1.0 + lse.abs()));
                prop_assert_eq!(store[h].tokens, stored.len() as u64);
            }
        }
    }

    #[test]
    fn a_summary_row_counts_as_its_tokens() {
        let d = 3;
        let (a, b) = (vec![1.0f32, 0.5, -0.25], vec![0.75f32, -2.0, 1.5]);
        let (va, vb) = (vec![2.0f32, 0.0, 1.0], vec![-1.0f32, 4.0, 0.5]);
        let q = [0.3f32, -1.2, 2.0];
        let tokens: Vec<(Vec<f32>, Vec<f32>)> = (0..3)
            .map(|_| (a.clone(), va.clone()))
            .chain(std::iter::once((b.clone(), vb.clone())))
            .collect();
        let summary = page_bytes(DType::F32, &[(a.clone(), va.clone()), (b.clone(), vb.clone())]);
        let got = attend(
            DType::F32,
            d,
            0.5,
            &q,
            &[PageRows {
                kv: &summary,
                counts: Some(&[3, 1]),
            }],
        );
        let (want, lse) = model(&q, &tokens, 0.5);
        close(&got[0].out, &want, 1e-6);
        assert!((f64::from(got[0].lse) - lse).abs() < 1e-5);
        assert_eq!(got[0].tokens, 4);
    }

    #[test]
    fn half_precision_rows_widen_before_attending() {
        let d = 4;
        let tokens = vec![
            (vec![0.5f32, -1.0, 0.25, 2.0], vec![1.0f32, 2.0, 3.0, 4.0]),
            (vec![1.5f32, 0.0, -0.5, 0.75], vec![-4.0f32, 0.5, 0.0, 1.0]),
        ];
        let q = [1.0f32, 0.5, -1.0, 0.25];
        let (want, _) = model(&q, &tokens, 0.5);
        // Every value here is exact in both half types.
        for dtype in [DType::F16, DType::Bf16] {
            let kv = page_bytes(dtype, &tokens);
            let got = attend(dtype, d, 0.5, &q, &[PageRows { kv: &kv, counts: None }]);
            close(&got[0].out, &want, 1e-5);
        }
    }

    #[test]
    fn no_rows_weigh_nothing_in_a_merge() {
        let got = attend(DType::F32, 2, 1.0, &[1.0, 1.0], &[]);
        assert_eq!(got[0].lse, f32::NEG_INFINITY);
        assert_eq!(got[0].tokens, 0);
        let own = PartialAttention {
            out: vec![3.0, -1.0],
            lse: 0.5,
            tokens: 1,
        };
        assert_eq!(merge(&got[0], &own), vec![3.0, -1.0]);
    }
}
