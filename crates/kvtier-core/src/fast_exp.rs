//! `e^x` over a slice, eight at a time where the CPU has AVX2: the
//! softmax of two-stage and sketch ranking takes one per (token, query
//! head), thousands per lane, and libm's one call each was a sixth of a
//! lane's rank time. Cephes' single-precision method: `x = n·ln 2 + r`
//! with `|r| ≤ ln 2 / 2`, a degree-5 polynomial for `e^r`, `2^n` put in
//! the exponent bits. Relative error about 2e-7 over the clamped range;
//! every kernel runs the same operations in the same order (no fused
//! multiply-add), so all give the same bits.

use crate::score::Kernel;

/// Inputs are clamped here: below, `e^x` is not a normal f32; above, it
/// overflows.
const LOW: f32 = -87.3;
const HIGH: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split in two, so that `n · ln 2` subtracts exactly.
const LN2_HIGH: f32 = 0.693_359_4;
const LN2_LOW: f32 = -2.121_944_4e-4;
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// Replaces every `x` of `xs` with `e^x` (clamped to the normal range).
pub fn exp_in_place(xs: &mut [f32]) {
    exp_in_place_with(Kernel::detect(), xs);
}

/// [`exp_in_place`] with an explicit kernel (for tests). A kernel the CPU
/// lacks falls back to scalar.
pub fn exp_in_place_with(kernel: Kernel, xs: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512) && Kernel::Avx2.supported() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        done = unsafe { avx2::exp8(xs) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
    for x in &mut xs[done..] {
        *x = exp(*x);
    }
}

fn exp(x: f32) -> f32 {
    // NaN as the vector kernel's max/min leave it: the low end.
    let x = if x.is_nan() { LOW } else { x.clamp(LOW, HIGH) };
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HIGH - n * LN2_LOW;
    let mut p = P[0];
    for c in &P[1..] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{HIGH, LN2_HIGH, LN2_LOW, LOG2E, LOW, P};

    /// `e^x` of the whole eights of `xs`, in place; returns how many.
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn exp8(xs: &mut [f32]) -> usize {
        let whole = xs.len() / 8 * 8;
        let set = _mm256_set1_ps;
        for chunk in xs[..whole].chunks_exact_mut(8) {
            // SAFETY: `chunk` is 8 f32 long.
            let x = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
            let x = _mm256_min_ps(_mm256_max_ps(x, set(LOW)), set(HIGH));
            let n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, set(LOG2E)), set(0.5)));
            let r = _mm256_sub_ps(
                _mm256_sub_ps(x, _mm256_mul_ps(n, set(LN2_HIGH))),
                _mm256_mul_ps(n, set(LN2_LOW)),
            );
            let mut p = set(P[0]);
            for &c in &P[1..] {
                p = _mm256_add_ps(_mm256_mul_ps(p, r), set(c));
            }
            let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), set(1.0));
            let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
            let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
            // SAFETY: as the load.
            unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), e) };
        }
        whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Within 1e-6 relative of f64's `exp`, the same bits from every
        /// kernel, at any length (whole eights and the rest).
        #[test]
        fn every_kernel_is_exp(xs in proptest::collection::vec(-100.0f32..90.0, 0..40)) {
            let mut first: Option<Vec<f32>> = None;
            for kernel in Kernel::available() {
                let mut got = xs.clone();
                exp_in_place_with(kernel, &mut got);
                for (&x, &g) in xs.iter().zip(&got) {
                    let want = f64::from(x.clamp(LOW, HIGH)).exp();
                    prop_assert!((f64::from(g) - want).abs() <= 1e-6 * want, "{kernel:?}: e^{x} = {g}, not {want}");
                }
                match &first {
                    Some(f) => prop_assert_eq!(f, &got, "{:?} differs", kernel),
                    None => first = Some(got),
                }
            }
        }
    }

    #[test]
    fn zero_is_one_and_extremes_stay_finite_the_same_everywhere() {
        let xs = [
            0.0,
            f32::MIN,
            f32::MAX,
            -88.0,
            1.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -f32::NAN,
        ];
        let mut first: Option<Vec<f32>> = None;
        for kernel in Kernel::available() {
            // Eight and one more: both paths of the vector kernel.
            let mut got: Vec<f32> = xs.to_vec();
            exp_in_place_with(kernel, &mut got);
            assert_eq!(got[0], 1.0);
            assert!(got.iter().all(|x| x.is_finite() && *x > 0.0), "{kernel:?}: {got:?}");
            let bits: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
            match &first {
                Some(f) => assert_eq!(f.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), bits, "{kernel:?}"),
                None => first = Some(got),
            }
        }
    }
}
