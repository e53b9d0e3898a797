//! The Quest upper bound of a query's score over a page, for every page of a
//! lane at once:
//!
//! `U(q, P) = Σ_r max(q_r·max_r, q_r·min_r)`  (= `q_r·max_r` when `q_r ≥ 0`,
//! `q_r·min_r` otherwise), an upper bound of `max_{k∈P} q·k`.
//!
//! Computed in f32 straight from the digest bytes in their key dtype: one
//! sequential pass over the column, each page's digest read once for all
//! query heads of the group. On x86-64 an explicit SIMD kernel runs, 16
//! lanes with AVX-512F, 8 with AVX2 and F16C (`simd.rs`, dtype conversion
//! in registers); elsewhere a scalar kernel computes the same sums. They
//! differ only in summation order.
//!
//! Every score is finite for finite keys and queries: an f32 sum that
//! overflows (keys or queries near ±3.4e38; a page with +inf and −inf terms
//! would otherwise score NaN and rank last) is summed again in f64, where no
//! product of two f32 values overflows, and saturated to the f32 range.

use crate::DType;

/// Which kernel [`score_column`] uses on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Portable scalar code; runs everywhere.
    Scalar,
    /// 8 lanes with AVX2 and F16C (x86-64).
    Avx2,
    /// 16 lanes: ~30 % more digest bytes per second than AVX2 on one core
    /// of this project's EPYC VMs, and a decode step's rank ~20 % faster.
    Avx512,
}

impl Kernel {
    /// The fastest kernel this CPU supports.
    pub fn detect() -> Self {
        [Kernel::Avx512, Kernel::Avx2]
            .into_iter()
            .find(|k| k.supported())
            .unwrap_or(Kernel::Scalar)
    }

    /// Whether this CPU can run the kernel.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        let (avx2, avx512) = {
            let avx2 = std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c");
            (avx2, avx2 && std::arch::is_x86_feature_detected!("avx512f"))
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (avx2, avx512) = (false, false);
        match self {
            Kernel::Scalar => true,
            Kernel::Avx2 => avx2,
            Kernel::Avx512 => avx512,
        }
    }

    /// Every kernel this CPU can run, for tests that compare them.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Kernel> {
        let all = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512];
        let (run, not): (Vec<Kernel>, Vec<Kernel>) = all.into_iter().partition(|k| k.supported());
        if !not.is_empty() {
            println!("not available here, so not tested: {not:?}");
        }
        run
    }

    /// Lower-case name (`scalar`, `avx2`, `avx512`), for logs and benchmarks.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512",
        }
    }
}

/// Scores every page of a digest column (`[page][min row | max row]` in
/// `dtype`) against `queries` (`[g][head_dim]` f32): `out[page · g + j]` is
/// `U(queries[j], page)`.
pub fn score_column(dtype: DType, head_dim: usize, digests: &[u8], queries: &[f32], out: &mut [f32]) {
    score_column_with(Kernel::detect(), dtype, head_dim, digests, queries, out);
}

/// [`score_column`] with an explicit kernel (for tests and benchmarks). A
/// kernel the CPU lacks falls back to scalar.
pub fn score_column_with(
    kernel: Kernel,
    dtype: DType,
    head_dim: usize,
    digests: &[u8],
    queries: &[f32],
    out: &mut [f32],
) {
    let entry = 2 * head_dim * dtype.size();
    assert!(
        head_dim > 0 && digests.len().is_multiple_of(entry),
        "digest column of whole entries"
    );
    assert!(queries.len().is_multiple_of(head_dim), "queries of whole rows");
    let (pages, group) = (digests.len() / entry, queries.len() / head_dim);
    assert_eq!(out.len(), pages * group, "one output per (page, query)");
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 if kernel.supported() => {
            // SAFETY: the CPU supports AVX-512F, AVX2 and F16C (checked just
            // above), and the lengths were checked against each other, as
            // `simd::score_avx512` requires.
            unsafe { simd::score_avx512(dtype, head_dim, digests, queries, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 if kernel.supported() => {
            // SAFETY: as above, for AVX2 and F16C.
            unsafe { simd::score_avx2(dtype, head_dim, digests, queries, out) }
        }
        _ => scalar(dtype, head_dim, digests, queries, out),
    }
    // Overflow is rare: one branch-free pass finds whether any score needs
    // the slow sum (a loop that branches per score cost ~8% of a scan).
    if out.iter().fold(false, |any, s| any | !s.is_finite()) {
        for (at, score) in out.iter_mut().enumerate() {
            if !score.is_finite() {
                *score = saturated(dtype, head_dim, digests, queries, at);
            }
        }
    }
}

/// Score `at` (page `at / group`, query `at % group`) summed in f64 and
/// saturated to the finite f32 range.
fn saturated(dtype: DType, head_dim: usize, digests: &[u8], queries: &[f32], at: usize) -> f32 {
    let group = queries.len() / head_dim;
    let (page, j) = (at / group, at % group);
    let row = head_dim * dtype.size();
    let entry = &digests[page * 2 * row..(page + 1) * 2 * row];
    let (mut min, mut max) = (vec![0f32; head_dim], vec![0f32; head_dim]);
    dtype.widen(&entry[..row], &mut min);
    dtype.widen(&entry[row..], &mut max);
    let q = &queries[j * head_dim..(j + 1) * head_dim];
    let sum: f64 = q
        .iter()
        .zip(min.iter().zip(&max))
        .map(|(&q, (&lo, &hi))| {
            let q = f64::from(q);
            (q * f64::from(hi)).max(q * f64::from(lo))
        })
        .sum();
    sum.clamp(-f64::from(f32::MAX), f64::from(f32::MAX)) as f32
}

fn scalar(dtype: DType, head_dim: usize, digests: &[u8], queries: &[f32], out: &mut [f32]) {
    let group = queries.len() / head_dim;
    let row = head_dim * dtype.size();
    let (mut min, mut max) = (vec![0f32; head_dim], vec![0f32; head_dim]);
    for (page, entry) in digests.chunks_exact(2 * row).enumerate() {
        dtype.widen(&entry[..row], &mut min);
        dtype.widen(&entry[row..], &mut max);
        for (j, q) in queries.chunks_exact(head_dim).enumerate() {
            out[page * group + j] = q
                .iter()
                .zip(min.iter().zip(&max))
                .map(|(q, (lo, hi))| (q * hi).max(q * lo))
                .sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DigestColumn;
    use proptest::prelude::*;

    #[test]
    fn the_worked_example_from_the_issue() {
        // Page minima [[0,-5],[2,-1]], maxima [[4,1],[3,6]], q = [2,-3].
        for dtype in DType::ALL {
            let digests = dtype.encode(&[0.0, -5.0, 4.0, 1.0, 2.0, -1.0, 3.0, 6.0]);
            for kernel in Kernel::available() {
                let mut out = [0f32; 2];
                score_column_with(kernel, dtype, 2, &digests, &[2.0, -3.0], &mut out);
                assert_eq!(out, [23.0, 9.0], "{dtype} {kernel:?}");
            }
        }
    }

    /// Keys in a page, the digest built by `DigestColumn`, and the check that
    /// the computed bound is at least the best exact score minus the f32
    /// summation error bound γ_{d+1} · Σ|terms|.
    fn check_bound(dtype: DType, d: usize, pages: &[Vec<f32>], queries: &[f32]) -> Result<(), TestCaseError> {
        let mut column = DigestColumn::new(dtype, d);
        let mut stored: Vec<Vec<f32>> = Vec::new();
        for keys in pages {
            let bytes = dtype.encode(keys);
            column.open_page(&bytes);
            stored.push(dtype.to_f32_vec(&bytes)); // the keys as stored (rounded to dtype)
        }
        let group = queries.len() / d;
        for kernel in Kernel::available() {
            let mut out = vec![0f32; pages.len() * group];
            let whole: Vec<u8> = column.chunks().flatten().copied().collect();
            score_column_with(kernel, dtype, d, &whole, queries, &mut out);
            for (p, keys) in stored.iter().enumerate() {
                for (j, q) in queries.chunks_exact(d).enumerate() {
                    let best = keys
                        .chunks_exact(d)
                        .map(|k| k.iter().zip(q).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>())
                        .fold(f64::NEG_INFINITY, f64::max);
                    let lo = dtype.to_f32_vec(column.min_row(p));
                    let hi = dtype.to_f32_vec(column.max_row(p));
                    let magnitude: f64 = (0..d)
                        .map(|i| f64::from((q[i] * hi[i]).abs().max((q[i] * lo[i]).abs())))
                        .sum();
                    let gamma = (d as f64 + 1.0) * f64::from(f32::EPSILON);
                    let bound = f64::from(out[p * group + j]);
                    prop_assert!(
                        bound >= best - gamma * magnitude,
                        "{kernel:?} {dtype} page {p} query {j}: bound {bound} < best {best}"
                    );
                }
            }
        }
        Ok(())
    }

    fn dtype() -> impl Strategy<Value = DType> {
        prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::Bf16)]
    }

    /// A value with occasional outlier channels, exact zeros and extremes
    /// that f16 and bf16 can still represent.
    fn element() -> impl Strategy<Value = f32> {
        prop_oneof![
            6 => -4.0f32..4.0,
            1 => Just(0.0f32),
            1 => prop_oneof![Just(-60000.0f32), Just(60000.0f32), Just(6.1e-5f32), Just(-6.1e-5f32)],
            1 => -300.0f32..300.0,
        ]
    }

    proptest! {
        #[test]
        fn the_bound_is_never_below_the_best_key(
            dtype in dtype(),
            d in prop_oneof![1usize..20, Just(48usize), Just(64usize), Just(80usize), Just(128usize)],
            rows in proptest::collection::vec(1usize..17, 1..6),
            group in 1usize..7,
            seed in proptest::collection::vec(element(), 4096),
        ) {
            let mut it = seed.iter().cycle().copied();
            let pages: Vec<Vec<f32>> = rows.iter().map(|r| (0..r * d).map(|_| it.next().unwrap()).collect()).collect();
            let queries: Vec<f32> = (0..group * d).map(|_| it.next().unwrap()).collect();
            check_bound(dtype, d, &pages, &queries)?;
        }

        #[test]
        fn simd_and_scalar_agree(
            dtype in dtype(),
            d in prop_oneof![1usize..40, Just(48usize), Just(64usize), Just(80usize), Just(128usize)],
            pages in 1usize..9,
            group in 1usize..10,
            seed in proptest::collection::vec(-2.0f32..2.0, 2048),
        ) {
            let mut it = seed.iter().cycle().copied();
            let digests = dtype.encode(&(0..pages * 2 * d).map(|_| it.next().unwrap()).collect::<Vec<_>>());
            let queries: Vec<f32> = (0..group * d).map(|_| it.next().unwrap()).collect();
            let mut scalar = vec![0f32; pages * group];
            let mut simd = scalar.clone();
            score_column_with(Kernel::Scalar, dtype, d, &digests, &queries, &mut scalar);
            for kernel in Kernel::available() {
                score_column_with(kernel, dtype, d, &digests, &queries, &mut simd);
                for (a, b) in scalar.iter().zip(&simd) {
                    prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{kernel:?}: {a} vs {b}");
                }
            }
        }
    }

    /// The largest finite value of `dtype`.
    fn max_finite(dtype: DType) -> f32 {
        match dtype {
            DType::F32 => f32::MAX,
            DType::F16 => half::f16::MAX.to_f32(),
            DType::Bf16 => half::bf16::MAX.to_f32(),
        }
    }

    proptest! {
        /// Keys and queries at the ends of the range: every score finite,
        /// and still at least the best key's score (saturated to f32).
        #[test]
        fn scores_stay_finite_at_the_extremes(
            dtype in dtype(),
            d in prop_oneof![1usize..20, Just(64usize), Just(128usize)],
            pages in 1usize..5,
            group in 1usize..4,
            keys in proptest::collection::vec(0usize..6, 2048),
            queries in proptest::collection::vec(0usize..6, 512),
        ) {
            let m = max_finite(dtype);
            let key_values = [m, -m, m / 2.0, -m / 2.0, 0.0, 1.0];
            let query_values = [f32::MAX, -f32::MAX, 1e30, -1.0, 0.0, 1.0];
            let mut k = keys.iter().cycle().map(|&i| key_values[i]);
            let stored: Vec<Vec<f32>> = (0..pages).map(|_| (0..4 * d).map(|_| k.next().unwrap()).collect()).collect();
            let mut q = queries.iter().cycle().map(|&i| query_values[i]);
            let queries: Vec<f32> = (0..group * d).map(|_| q.next().unwrap()).collect();
            let mut column = DigestColumn::new(dtype, d);
            for keys in &stored {
                column.open_page(&dtype.encode(keys));
            }
            let whole: Vec<u8> = column.chunks().flatten().copied().collect();
            for kernel in Kernel::available() {
                let mut out = vec![0f32; pages * group];
                score_column_with(kernel, dtype, d, &whole, &queries, &mut out);
                for (p, keys) in stored.iter().enumerate() {
                    for (j, q) in queries.chunks_exact(d).enumerate() {
                        let bound = out[p * group + j];
                        prop_assert!(bound.is_finite(), "{kernel:?} {dtype} page {p} query {j}: {bound}");
                        let best = keys
                            .chunks_exact(d)
                            .map(|k| k.iter().zip(q).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>())
                            .fold(f64::NEG_INFINITY, f64::max)
                            .clamp(-f64::from(f32::MAX), f64::from(f32::MAX));
                        // f32 rounding of a finite sum: γ_{d+1} of the terms' magnitudes.
                        let magnitude: f64 = (0..d).map(|i| f64::from(q[i]).abs() * f64::from(m)).sum();
                        let slack = (d as f64 + 1.0) * f64::from(f32::EPSILON) * magnitude;
                        prop_assert!(
                            f64::from(bound) >= best - slack,
                            "{kernel:?} {dtype} page {p} query {j}: bound {bound} < best {best}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn opposite_infinite_terms_do_not_make_a_page_rank_last() {
        // In f32, page 0 sums +inf and -inf (NaN); its true bound is 0,
        // above page 1's -2.
        for dtype in DType::ALL {
            let m = max_finite(dtype);
            let digests = dtype.encode(&[m, -m, m, -m, -1.0, -1.0, -1.0, -1.0]);
            for kernel in Kernel::available() {
                let mut out = [0f32; 2];
                score_column_with(kernel, dtype, 2, &digests, &[f32::MAX, f32::MAX], &mut out);
                assert!(out.iter().all(|s| s.is_finite()), "{dtype} {kernel:?}: {out:?}");
                assert!(out[0] > out[1], "{dtype} {kernel:?}: {out:?}");
            }
        }
    }

    #[test]
    fn adversarial_pages_keep_the_bound() {
        // Outlier channel, a query with zero components, extremes of f16.
        let d = 8;
        let mut keys = vec![0.01f32; 3 * d];
        keys[5] = 900.0; // outlier channel in the first key
        keys[d + 5] = -900.0;
        keys[2 * d] = -65504.0;
        let mut q = vec![0.0f32; d];
        q[5] = -1.0;
        q[0] = 1e-3;
        for dtype in [DType::F16, DType::F32] {
            check_bound(dtype, d, &[keys.clone()], &q).unwrap();
        }
        // bf16 extremes.
        let keys = [3.0e38f32, -3.0e38, 1.0, -1.0];
        check_bound(DType::Bf16, 2, &[keys.to_vec()], &[1e-30, -1e-30]).unwrap();
    }
}
