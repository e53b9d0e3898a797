//! A query's estimated logit on every sketched token (docs/CONCEPTS.md
//! §3.2): `q·k̂ = zero · Σq + scale · Σ_r q_r · code_r`, for each token of a
//! run of sketch rows and each query head of a group, one pass over the
//! rows. On x86-64 with AVX2 and FMA the codes are widened to f32 in
//! registers (16 channels per 8 code bytes); elsewhere a scalar kernel computes the
//! same sums in another order. Results are saturated to the finite f32
//! range, so a softmax over them never meets `inf − inf`.

use crate::score::Kernel;
use crate::sketch::{code, row_bytes, scale_zero};

/// `out[t · g + j]` = the estimate of `queries[j] · key_t` for every sketch
/// row `t` of `rows` and query `j` of `queries` (`[g][head_dim]`).
pub fn sketch_logits(head_dim: usize, rows: &[u8], queries: &[f32], out: &mut [f32]) {
    sketch_logits_with(Kernel::detect(), head_dim, rows, queries, out);
}

/// [`sketch_logits`] with an explicit kernel (for tests and benchmarks). A
/// kernel the CPU lacks falls back to scalar.
pub fn sketch_logits_with(kernel: Kernel, head_dim: usize, rows: &[u8], queries: &[f32], out: &mut [f32]) {
    let n = row_bytes(head_dim);
    assert!(head_dim > 0 && rows.len().is_multiple_of(n), "whole sketch rows");
    assert!(queries.len().is_multiple_of(head_dim), "queries of whole rows");
    let group = queries.len() / head_dim;
    assert_eq!(out.len(), rows.len() / n * group, "one output per (token, query)");
    let sums: Vec<f32> = queries.chunks_exact(head_dim).map(|q| q.iter().sum()).collect();
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // AVX-512 machines run the AVX2 sketch kernel.
        Kernel::Avx2 | Kernel::Avx512 if Kernel::Avx2.supported() && std::arch::is_x86_feature_detected!("fma") => {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above); the
            // lengths were checked against each other, as `avx2::logits`
            // requires.
            unsafe { avx2::logits(head_dim, rows, queries, &sums, out) }
        }
        _ => scalar(head_dim, rows, queries, &sums, out),
    }
    for v in out.iter_mut() {
        *v = if v.is_nan() { 0.0 } else { v.clamp(-f32::MAX, f32::MAX) };
    }
}

fn scalar(head_dim: usize, rows: &[u8], queries: &[f32], sums: &[f32], out: &mut [f32]) {
    let group = queries.len() / head_dim;
    for (t, row) in rows.chunks_exact(row_bytes(head_dim)).enumerate() {
        let (scale, zero) = scale_zero(head_dim, row);
        for (j, q) in queries.chunks_exact(head_dim).enumerate() {
            let dot: f32 = q.iter().enumerate().map(|(r, q)| q * f32::from(code(row, r))).sum();
            out[t * group + j] = zero * sums[j] + scale * dot;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::score::horizontal_sum;
    use crate::sketch::{code, row_bytes, scale_zero};

    /// # Safety
    /// The CPU supports AVX2 and FMA; `rows` holds whole sketch rows of `head_dim`,
    /// `queries` whole rows of `head_dim`, `sums` one sum per query, and
    /// `out` one slot per (row, query).
    pub(super) unsafe fn logits(head_dim: usize, rows: &[u8], queries: &[f32], sums: &[f32], out: &mut [f32]) {
        let group = queries.len() / head_dim;
        let mut first = 0;
        while first < group {
            // SAFETY: forwarded from this function's contract; `first + N <= group`.
            unsafe {
                first += match group - first {
                    1 => block::<1>(head_dim, rows, queries, sums, first, out),
                    2 => block::<2>(head_dim, rows, queries, sums, first, out),
                    3 => block::<3>(head_dim, rows, queries, sums, first, out),
                    _ => block::<4>(head_dim, rows, queries, sums, first, out),
                };
            }
        }
    }

    /// Query heads `first..first + N` against every row; returns `N`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block<const N: usize>(
        head_dim: usize,
        rows: &[u8],
        queries: &[f32],
        sums: &[f32],
        first: usize,
        out: &mut [f32],
    ) -> usize {
        let group = queries.len() / head_dim;
        let blocks = head_dim / 16;
        let q: [&[f32]; N] = std::array::from_fn(|j| &queries[(first + j) * head_dim..(first + j + 1) * head_dim]);
        let nibble = _mm_set1_epi8(0x0f);
        for (t, row) in rows.chunks_exact(row_bytes(head_dim)).enumerate() {
            // Two accumulators per query (channels 0..8 and 8..16 of each
            // block) halve the chain of dependent multiply-adds.
            let mut even = [_mm256_setzero_ps(); N];
            let mut odd = [_mm256_setzero_ps(); N];
            for b in 0..blocks {
                // SAFETY: channels `16b..16b + 16` lie within `head_dim`: their
                // 8 code bytes start at `8b` inside the row's codes, and the
                // query loads stay inside each query row.
                unsafe {
                    let packed = _mm_loadl_epi64(row.as_ptr().add(8 * b).cast());
                    let low = _mm_and_si128(packed, nibble);
                    let high = _mm_and_si128(_mm_srli_epi16::<4>(packed), nibble);
                    // Channel order: low nibble of byte i, then its high nibble.
                    let codes = _mm_unpacklo_epi8(low, high);
                    let c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
                    let c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(codes)));
                    for j in 0..N {
                        let q0 = _mm256_loadu_ps(q[j].as_ptr().add(16 * b));
                        let q1 = _mm256_loadu_ps(q[j].as_ptr().add(16 * b + 8));
                        even[j] = _mm256_fmadd_ps(c0, q0, even[j]);
                        odd[j] = _mm256_fmadd_ps(c1, q1, odd[j]);
                    }
                }
            }
            let (scale, zero) = scale_zero(head_dim, row);
            for j in 0..N {
                let tail: f32 = (16 * blocks..head_dim).map(|r| q[j][r] * f32::from(code(row, r))).sum();
                let dot = horizontal_sum(_mm256_add_ps(even[j], odd[j])) + tail;
                out[t * group + first + j] = zero * sums[first + j] + scale * dot;
            }
        }
        N
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::sketch::{decode_row, encode};
    use proptest::prelude::*;

    proptest! {
        /// Every kernel equals the dot product with the decoded sketch
        /// (computed in f64), up to f32 summation error.
        #[test]
        fn kernels_equal_the_decoded_dot_product(
            d in prop_oneof![1usize..40, Just(64usize), Just(128usize)],
            tokens in 1usize..9,
            group in 1usize..10,
            seed in proptest::collection::vec(-3.0f32..3.0, 4096),
        ) {
            let mut it = seed.iter().cycle().copied();
            let keys: Vec<f32> = (0..tokens * d).map(|_| it.next().unwrap()).collect();
            let bytes: Vec<u8> = keys.iter().flat_map(|v| v.to_le_bytes()).collect();
            let rows = encode(DType::F32, d, &bytes);
            let queries: Vec<f32> = (0..group * d).map(|_| it.next().unwrap()).collect();
            let n = row_bytes(d);
            for kernel in Kernel::available() {
                let mut out = vec![0f32; tokens * group];
                sketch_logits_with(kernel, d, &rows, &queries, &mut out);
                let mut key = vec![0f32; d];
                for (t, row) in rows.chunks_exact(n).enumerate() {
                    decode_row(d, row, &mut key);
                    for (j, q) in queries.chunks_exact(d).enumerate() {
                        let want: f64 = q.iter().zip(&key).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                        let magnitude: f64 = q.iter().zip(&key).map(|(a, b)| f64::from(a.abs()) * (f64::from(b.abs()) + 4.0)).sum();
                        let got = f64::from(out[t * group + j]);
                        prop_assert!((got - want).abs() <= 1e-5 * (1.0 + magnitude), "{kernel:?} d={d}: {got} vs {want}");
                    }
                }
            }
        }
    }

    #[test]
    fn extreme_queries_give_finite_logits() {
        let d = 16;
        let keys: Vec<u8> = (0..d)
            .flat_map(|i| (if i % 2 == 0 { 60000.0f32 } else { -60000.0 }).to_le_bytes())
            .collect();
        let rows = encode(DType::F32, d, &keys);
        let queries = vec![f32::MAX; d];
        for kernel in Kernel::available() {
            let mut out = [0f32];
            sketch_logits_with(kernel, d, &rows, &queries, &mut out);
            assert!(out[0].is_finite(), "{kernel:?}: {out:?}");
        }
    }
}
