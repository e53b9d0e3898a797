//! A query's estimated logit on every sketched token (docs/CONCEPTS.md
//! §3.2): `q·k̂ = zero · Σq + scale · Σ_r q_r · code_r`, for each token of a
//! run of sketch rows and each query head of a group, one pass over the
//! rows.
//!
//! The codes are 4-bit, so the query is quantized too: each head to int8
//! over its own range (`q_r ≈ step · q8_r`, `step = max|q| / 127`), and
//! `Σ_r q8_r · code_r` is an exact integer. Its rounding error (at most
//! `step / 2` per channel) is far below the sketch's own (half a code step
//! of the key's range). Integers make every kernel agree bit for bit: on
//! x86-64 with AVX2, 64 channels of codes are multiplied with the query
//! bytes in registers (`maddubs`, unsigned codes by signed query bytes);
//! elsewhere a scalar kernel computes the same integers. Results are
//! saturated to the finite f32 range, so a softmax over them never meets
//! `inf − inf`.

use crate::score::Kernel;
use crate::sketch::{code, row_bytes, scale_zero};

/// Channels one AVX2 block covers: 32 code bytes.
const BLOCK: usize = 64;

/// A GQA group's queries, prepared once for scoring any number of sketch
/// rows.
#[derive(Debug, Clone)]
pub struct SketchQueries {
    head_dim: usize,
    group: usize,
    /// Per head, `Σ_r q_r` of the query as given (and three zeros).
    sums: Vec<f32>,
    /// Per head, the int8 step: `max|q_r| / 127` (0 for a zero query; and
    /// three zeros).
    steps: Vec<f32>,
    /// Per head, `head_dim` int8 values laid out as the codes are packed:
    /// in each whole block of 64 channels the 32 even channels (low
    /// nibbles), then the 32 odd ones (high nibbles); the tail channels in
    /// order.
    q8: Vec<i8>,
    kernel: Kernel,
}

impl SketchQueries {
    /// `queries` (`[group][head_dim]`), prepared for the fastest kernel
    /// this CPU has.
    pub fn new(head_dim: usize, queries: &[f32]) -> Self {
        Self::with_kernel(Kernel::detect(), head_dim, queries)
    }

    /// [`Self::new`] with an explicit kernel (for tests and benchmarks). A
    /// kernel the CPU lacks falls back to scalar.
    pub fn with_kernel(kernel: Kernel, head_dim: usize, queries: &[f32]) -> Self {
        assert!(head_dim > 0, "a positive head_dim");
        assert!(queries.len().is_multiple_of(head_dim), "queries of whole rows");
        let group = queries.len() / head_dim;
        let blocks = head_dim / BLOCK;
        let mut q8 = vec![0i8; queries.len()];
        let mut steps = Vec::with_capacity(group + 3);
        let mut sums = Vec::with_capacity(group + 3);
        for (q, out) in queries.chunks_exact(head_dim).zip(q8.chunks_exact_mut(head_dim)) {
            sums.push(q.iter().sum());
            let top = q.iter().fold(0f32, |m, v| m.max(v.abs()));
            let step = top / 127.0;
            steps.push(step);
            if step == 0.0 || !step.is_finite() {
                continue;
            }
            for (r, v) in q.iter().enumerate() {
                let at = if r < blocks * BLOCK {
                    let (b, c) = (r / BLOCK, r % BLOCK);
                    b * BLOCK + (c % 2) * (BLOCK / 2) + c / 2
                } else {
                    r
                };
                out[at] = (v / step).round().clamp(-127.0, 127.0) as i8;
            }
        }
        // Padded so that a kernel loads any four heads' from a head of the
        // group (the padding is never used).
        sums.extend([0.0; 3]);
        steps.extend([0.0; 3]);
        Self {
            head_dim,
            group,
            sums,
            steps,
            q8,
            kernel,
        }
    }

    /// `out[t · g + j]` = the estimate of `queries[j] · key_t` for every
    /// sketch row `t` of `rows` and query head `j`.
    pub fn logits(&self, rows: &[u8], out: &mut [f32]) {
        let n = row_bytes(self.head_dim);
        assert!(rows.len().is_multiple_of(n), "whole sketch rows");
        assert_eq!(out.len(), rows.len() / n * self.group, "one output per (token, query)");
        match self.kernel {
            #[cfg(target_arch = "x86_64")]
            // AVX-512 machines run the AVX2 sketch kernel.
            Kernel::Avx2 | Kernel::Avx512 if Kernel::Avx2.supported() => {
                // SAFETY: the CPU supports AVX2 and F16C (checked just above); the
                // lengths were checked against each other, as
                // `avx2::logits` requires.
                unsafe { avx2::logits(self, rows, out) }
            }
            _ => scalar(self, rows, out),
        }
        for v in out.iter_mut() {
            *v = if v.is_nan() { 0.0 } else { v.clamp(-f32::MAX, f32::MAX) };
        }
    }

    /// Head `j`'s int8 query.
    fn head(&self, j: usize) -> &[i8] {
        &self.q8[j * self.head_dim..(j + 1) * self.head_dim]
    }

    /// `Σ q8 · code` over the tail channels (past the whole blocks) of `row`.
    fn tail_dot(&self, row: &[u8], q: &[i8]) -> i32 {
        let start = self.head_dim / BLOCK * BLOCK;
        (start..self.head_dim)
            .map(|r| i32::from(q[r]) * i32::from(code(row, r)))
            .sum()
    }

    /// The logit of head `j` on a row of `scale` and `zero` whose integer
    /// dot product is `dot`.
    fn finish(&self, j: usize, (scale, zero): (f32, f32), dot: i32) -> f32 {
        zero * self.sums[j] + scale * (self.steps[j] * dot as f32)
    }
}

fn scalar(q: &SketchQueries, rows: &[u8], out: &mut [f32]) {
    let (d, group) = (q.head_dim, q.group);
    let blocks = d / BLOCK;
    for (t, row) in rows.chunks_exact(row_bytes(d)).enumerate() {
        let scale_zero = scale_zero(d, row);
        for j in 0..group {
            let head = q.head(j);
            let mut dot = 0i32;
            for b in 0..blocks {
                let (even, odd) = head[b * BLOCK..(b + 1) * BLOCK].split_at(BLOCK / 2);
                for (i, &byte) in row[b * BLOCK / 2..(b + 1) * BLOCK / 2].iter().enumerate() {
                    dot += i32::from(byte & 0x0f) * i32::from(even[i]) + i32::from(byte >> 4) * i32::from(odd[i]);
                }
            }
            dot += q.tail_dot(row, head);
            out[t * group + j] = q.finish(j, scale_zero, dot);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BLOCK, SketchQueries};
    use crate::sketch::row_bytes;

    /// # Safety
    /// The CPU supports AVX2 and F16C; `rows` holds whole sketch rows of the
    /// queries' `head_dim`, and `out` one slot per (row, query head).
    pub(super) unsafe fn logits(q: &SketchQueries, rows: &[u8], out: &mut [f32]) {
        let mut first = 0;
        while first < q.group {
            // SAFETY: forwarded from this function's contract; `first + N <= group`.
            unsafe {
                first += match q.group - first {
                    1 => block::<1>(q, rows, first, out),
                    2 => block::<2>(q, rows, first, out),
                    3 => block::<3>(q, rows, first, out),
                    _ => block::<4>(q, rows, first, out),
                };
            }
        }
    }

    /// Query heads `first..first + N` against every row; returns `N`.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn block<const N: usize>(q: &SketchQueries, rows: &[u8], first: usize, out: &mut [f32]) -> usize {
        let (d, group) = (q.head_dim, q.group);
        let blocks = d / BLOCK;
        let heads: [&[i8]; N] = std::array::from_fn(|j| q.head(first + j));
        let tail = blocks * BLOCK < d;
        let (steps, sums) = (q.steps.as_ptr(), q.sums.as_ptr());
        let nibble = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        for (t, row) in rows.chunks_exact(row_bytes(d)).enumerate() {
            let mut acc = [_mm256_setzero_si256(); N];
            for b in 0..blocks {
                // SAFETY: block `b`'s 32 code bytes lie inside the row's
                // codes (`32 (b + 1) <= head_dim / 2`), and its 64 query
                // bytes inside each head's `head_dim`.
                unsafe {
                    let packed = _mm256_loadu_si256(row.as_ptr().add(b * BLOCK / 2).cast());
                    let low = _mm256_and_si256(packed, nibble);
                    let high = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), nibble);
                    for j in 0..N {
                        let even = _mm256_loadu_si256(heads[j].as_ptr().add(b * BLOCK).cast());
                        let odd = _mm256_loadu_si256(heads[j].as_ptr().add(b * BLOCK + BLOCK / 2).cast());
                        // Pairs of code × query byte: at most 2 · 15 · 127
                        // each, and two of them summed: no i16 saturates.
                        let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, even), _mm256_maddubs_epi16(high, odd));
                        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            // SAFETY: the row's scale and zero are its last 4 bytes.
            let (scale, zero) = unsafe { scale_zero_f16c(row) };
            let at = t * group + first;
            if !tail {
                // The logits at once (up to four, the missing accumulators
                // zero), the same operations as `finish`.
                let mut four = [_mm256_setzero_si256(); 4];
                four[..N].copy_from_slice(&acc);
                let dots = _mm_cvtepi32_ps(sum4(&four));
                // SAFETY: `steps` and `sums` hold heads `first..first + 4`
                // (padded past the group: `SketchQueries::with_kernel`).
                let logits = unsafe {
                    let estimate = _mm_mul_ps(_mm_set1_ps(scale), _mm_mul_ps(_mm_loadu_ps(steps.add(first)), dots));
                    _mm_add_ps(_mm_mul_ps(_mm_set1_ps(zero), _mm_loadu_ps(sums.add(first))), estimate)
                };
                let mut lanes = [0f32; 4];
                // SAFETY: `lanes` holds four f32.
                unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), logits) };
                out[at..at + N].copy_from_slice(&lanes[..N]);
                continue;
            }
            for j in 0..N {
                let dot = sum_i32(acc[j]) + q.tail_dot(row, heads[j]);
                out[at + j] = q.finish(first + j, (scale, zero), dot);
            }
        }
        N
    }

    /// The row's scale and zero (its last 4 bytes: two f16), widened in
    /// one instruction.
    ///
    /// # Safety
    /// The CPU supports F16C; `row` is a whole sketch row.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn scale_zero_f16c(row: &[u8]) -> (f32, f32) {
        let at = row.len() - 4;
        let bits = u32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]]);
        let wide = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
        (_mm_cvtss_f32(wide), _mm_cvtss_f32(_mm_shuffle_ps::<0b01>(wide, wide)))
    }

    /// The horizontal sums of the first four accumulators, sharing their
    /// additions.
    #[target_feature(enable = "avx2")]
    fn sum4(acc: &[__m256i]) -> __m128i {
        let fold = |v: __m256i| _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let ab = _mm_hadd_epi32(fold(acc[0]), fold(acc[1]));
        let cd = _mm_hadd_epi32(fold(acc[2]), fold(acc[3]));
        _mm_hadd_epi32(ab, cd)
    }

    #[target_feature(enable = "avx2")]
    fn sum_i32(v: __m256i) -> i32 {
        let pair = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let quad = _mm_add_epi32(pair, _mm_unpackhi_epi64(pair, pair));
        _mm_cvtsi128_si32(_mm_add_epi32(quad, _mm_shuffle_epi32::<0b01>(quad)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::sketch::{decode_row, encode};
    use proptest::prelude::*;

    proptest! {
        /// Every kernel gives the same bits, and equals the dot product
        /// with the decoded sketch (in f64) up to the query's int8 rounding:
        /// at most half a step per channel, times the row's scale and code,
        /// plus f32 summation error.
        #[test]
        fn kernels_agree_and_equal_the_decoded_dot_product(
            d in prop_oneof![1usize..40, Just(64usize), Just(100usize), Just(128usize), Just(192usize)],
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
            let mut first: Option<Vec<f32>> = None;
            for kernel in Kernel::available() {
                let mut out = vec![0f32; tokens * group];
                SketchQueries::with_kernel(kernel, d, &queries).logits(&rows, &mut out);
                match &first {
                    Some(f) => prop_assert_eq!(f, &out, "{:?} differs from the first kernel", kernel),
                    None => first = Some(out.clone()),
                }
                let mut key = vec![0f32; d];
                for (t, row) in rows.chunks_exact(n).enumerate() {
                    decode_row(d, row, &mut key);
                    let (scale, _) = scale_zero(d, row);
                    for (j, q) in queries.chunks_exact(d).enumerate() {
                        let want: f64 = q.iter().zip(&key).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                        let step = q.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                        let rounding: f64 = (0..d).map(|r| f64::from(step) / 2.0 * f64::from(scale) * f64::from(code(row, r))).sum();
                        let magnitude: f64 = q.iter().zip(&key).map(|(a, b)| f64::from(a.abs()) * (f64::from(b.abs()) + 4.0)).sum();
                        let got = f64::from(out[t * group + j]);
                        prop_assert!((got - want).abs() <= rounding + 1e-5 * (1.0 + magnitude), "{kernel:?} d={d}: {got} vs {want} (rounding {rounding})");
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
        for queries in [vec![f32::MAX; d], vec![0.0; d], vec![-f32::MAX; d]] {
            for kernel in Kernel::available() {
                let mut out = [0f32];
                SketchQueries::with_kernel(kernel, d, &queries).logits(&rows, &mut out);
                assert!(out[0].is_finite(), "{kernel:?}: {out:?}");
            }
        }
    }
}
