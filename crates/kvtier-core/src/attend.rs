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

use std::borrow::Cow;

use crate::DType;
use crate::fast_exp::exp_in_place;
use crate::score::Kernel;

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

/// One page's rows as f32: the page's own bytes where they are f32 and
/// aligned (read in place), else widened once.
struct Floats<'a> {
    keys: Cow<'a, [f32]>,
    values: Cow<'a, [f32]>,
    /// `ln count` per row (0 for an original row).
    bias: Vec<f32>,
    tokens: u64,
}

impl<'a> Floats<'a> {
    fn of(dtype: DType, head_dim: usize, page: &PageRows<'a>) -> Self {
        let rows = page.kv.len() / (2 * head_dim * dtype.size());
        let (k, v) = page.kv.split_at(rows * head_dim * dtype.size());
        let floats = |bytes: &'a [u8]| match (dtype, bytemuck::try_cast_slice::<u8, f32>(bytes)) {
            (DType::F32, Ok(f)) if cfg!(target_endian = "little") => Cow::Borrowed(f),
            _ => {
                let mut out = vec![0.0; rows * head_dim];
                dtype.widen(bytes, &mut out);
                Cow::Owned(out)
            }
        };
        let (bias, tokens) = match page.counts {
            Some(counts) => (
                counts.iter().map(|&c| (c as f32).ln()).collect(),
                counts.iter().map(|&c| u64::from(c)).sum(),
            ),
            None => (vec![0.0; rows], rows as u64),
        };
        Floats {
            keys: floats(k),
            values: floats(v),
            bias,
            tokens,
        }
    }
}

/// Each query head of `queries` (`[heads][head_dim]`) attending over the
/// rows of `pages`, logits scaled by `scale`. Each row is loaded once for
/// every query head (a GQA group's share its KV head's rows).
pub fn attend(
    dtype: DType,
    head_dim: usize,
    scale: f32,
    queries: &[f32],
    pages: &[PageRows<'_>],
) -> Vec<PartialAttention> {
    let d = head_dim;
    let pages: Vec<Floats<'_>> = pages.iter().map(|p| Floats::of(dtype, d, p)).collect();
    let n: usize = pages.iter().map(|p| p.bias.len()).sum();
    let tokens = pages.iter().map(|p| p.tokens).sum();
    let heads = queries.len() / d;
    let mut out = vec![0.0f32; heads * d];
    let mut lse = vec![f32::NEG_INFINITY; heads];
    if n > 0 {
        weigh(&pages, queries, d, n, scale, &mut out, &mut lse);
    }
    out.chunks_exact(d)
        .zip(lse)
        .map(|(o, lse)| PartialAttention {
            out: o.to_vec(),
            lse,
            tokens,
        })
        .collect()
}

/// Every query head's softmax over the `n` rows of `pages` (`n` > 0):
/// its weighted values into `out` (`[head][d]`), its log-sum-exp into
/// `lse`. Compiled for AVX2 with FMA too, chosen at run time: the same
/// code, vectorised eight lanes wide.
fn weigh(pages: &[Floats<'_>], queries: &[f32], d: usize, n: usize, scale: f32, out: &mut [f32], lse: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if Kernel::Avx2.supported() && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { weigh_avx2(pages, queries, d, n, scale, out, lse) };
    }
    weigh_portable(pages, queries, d, n, scale, out, lse);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn weigh_avx2(pages: &[Floats<'_>], queries: &[f32], d: usize, n: usize, scale: f32, out: &mut [f32], lse: &mut [f32]) {
    weigh_portable(pages, queries, d, n, scale, out, lse);
}

#[inline(always)]
fn weigh_portable(
    pages: &[Floats<'_>],
    queries: &[f32],
    d: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    lse: &mut [f32],
) {
    // `[head][row]`: each K row loaded once for every query head.
    let mut logits = vec![0.0f32; lse.len() * n];
    let mut at = 0;
    for page in pages {
        for (i, (k, b)) in page.keys.chunks_exact(d).zip(&page.bias).enumerate() {
            for (h, q) in queries.chunks_exact(d).enumerate() {
                logits[h * n + at + i] = dot(q, k) * scale + b;
            }
        }
        at += page.bias.len();
    }
    for (l, lse) in logits.chunks_exact_mut(n).zip(lse.iter_mut()) {
        let top = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        l.iter_mut().for_each(|x| *x -= top);
        exp_in_place(l);
        let total: f32 = l.iter().sum();
        l.iter_mut().for_each(|x| *x /= total);
        *lse = top + total.ln();
    }
    let mut at = 0;
    for page in pages {
        for (i, v) in page.values.chunks_exact(d).enumerate() {
            for (h, o) in out.chunks_exact_mut(d).enumerate() {
                let w = logits[h * n + at + i];
                o.iter_mut().zip(v).for_each(|(o, x)| *o += w * x);
            }
        }
        at += page.bias.len();
    }
}

/// `a · b` in eight lanes, which the compiler keeps in vector registers
/// (one running sum would be a chain of dependent scalar adds).
#[inline(always)]
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
    fn misaligned_f32_rows_are_widened_as_read_in_place() {
        let tokens = vec![
            (vec![0.5f32, -1.0, 0.25], vec![1.0f32, 2.0, 3.0]),
            (vec![1.5f32, 0.0, -0.5], vec![-4.0f32, 0.5, 0.0]),
        ];
        let kv = page_bytes(DType::F32, &tokens);
        let mut shifted = vec![0u8; kv.len() + 1];
        shifted[1..].copy_from_slice(&kv);
        let q = [1.0f32, 0.5, -1.0];
        let read = |kv: &[u8]| attend(DType::F32, 3, 0.5, &q, &[PageRows { kv, counts: None }]);
        assert_eq!(read(&shifted[1..]), read(&kv));
        let (want, _) = model(&q, &tokens, 0.5);
        close(&read(&shifted[1..])[0].out, &want, 1e-6);
    }

    #[test]
    fn the_vector_build_agrees_with_the_portable_one() {
        let (d, n) = (64, 40);
        let values: Vec<f32> = (0..2 * n * d).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let kv = DType::F32.encode(&values);
        let pages = [Floats::of(DType::F32, d, &PageRows { kv: &kv, counts: None })];
        let queries: Vec<f32> = (0..3 * d).map(|i| ((i * 11 % 13) as f32 - 6.0) / 4.0).collect();
        let (mut a, mut b) = ((vec![0.0; 3 * d], vec![0.0; 3]), (vec![0.0; 3 * d], vec![0.0; 3]));
        weigh(&pages, &queries, d, n, 0.125, &mut a.0, &mut a.1);
        weigh_portable(&pages, &queries, d, n, 0.125, &mut b.0, &mut b.1);
        for (x, y) in a.0.iter().chain(&a.1).zip(b.0.iter().chain(&b.1)) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
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
