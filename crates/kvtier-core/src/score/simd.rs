//! The Quest kernel in SIMD registers, written once over the register
//! width: 8 f32 lanes with AVX2 and F16C, 16 with AVX-512F. Each page's min
//! and max rows are widened to f32 in registers once for up to four query
//! heads; each query keeps two accumulators (even and odd chunks), which
//! halves its chain of dependent additions.
//!
//! The generic parts are `#[inline(always)]` without target features of
//! their own: they are compiled only inside the two entry points, whose
//! features they take on, so each width's code uses only its own
//! instructions.

use std::arch::x86_64::*;

use crate::DType;

/// One register width: the operations the kernel needs. Callable only from
/// a function that enables the width's target features.
trait Width {
    type V: Copy;
    /// f32 lanes per register.
    const LANES: usize;
    unsafe fn zero() -> Self::V;
    /// # Safety
    /// `ptr` is valid for reading `LANES` values.
    unsafe fn load_f32(ptr: *const f32) -> Self::V;
    /// # Safety
    /// `ptr` is valid for reading `LANES` f16 values.
    unsafe fn load_f16(ptr: *const u8) -> Self::V;
    /// # Safety
    /// `ptr` is valid for reading `LANES` bf16 values.
    unsafe fn load_bf16(ptr: *const u8) -> Self::V;
    /// `acc + max(q · hi, q · lo)`, lane by lane.
    unsafe fn bound_add(acc: Self::V, q: Self::V, lo: Self::V, hi: Self::V) -> Self::V;
    /// The sum of `a`'s and `b`'s lanes.
    unsafe fn sum(a: Self::V, b: Self::V) -> f32;
}

struct Avx2;
struct Avx512;

impl Width for Avx2 {
    type V = __m256;
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: the caller enables AVX.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load_f32(ptr: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable values; unaligned load.
        unsafe { _mm256_loadu_ps(ptr) }
    }
    #[inline(always)]
    unsafe fn load_f16(ptr: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes and enables F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(ptr.cast())) }
    }
    #[inline(always)]
    unsafe fn load_bf16(ptr: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes and enables AVX2.
        // A bf16 is the top half of the f32 with the same bits.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(ptr.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
    #[inline(always)]
    unsafe fn bound_add(acc: __m256, q: __m256, lo: __m256, hi: __m256) -> __m256 {
        // SAFETY: the caller enables AVX.
        unsafe { _mm256_add_ps(acc, _mm256_max_ps(_mm256_mul_ps(q, hi), _mm256_mul_ps(q, lo))) }
    }
    #[inline(always)]
    unsafe fn sum(a: __m256, b: __m256) -> f32 {
        // SAFETY: the caller enables AVX.
        unsafe { horizontal_sum(_mm256_add_ps(a, b)) }
    }
}

impl Width for Avx512 {
    type V = __m512;
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: the caller enables AVX-512F.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load_f32(ptr: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable values; unaligned load.
        unsafe { _mm512_loadu_ps(ptr) }
    }
    #[inline(always)]
    unsafe fn load_f16(ptr: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 32 readable bytes and enables
        // AVX-512F (which converts f16 itself).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(ptr.cast())) }
    }
    #[inline(always)]
    unsafe fn load_bf16(ptr: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 32 readable bytes and enables
        // AVX-512F; widened as in the AVX2 kernel.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(ptr.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }
    #[inline(always)]
    unsafe fn bound_add(acc: __m512, q: __m512, lo: __m512, hi: __m512) -> __m512 {
        // SAFETY: the caller enables AVX-512F.
        unsafe { _mm512_add_ps(acc, _mm512_max_ps(_mm512_mul_ps(q, hi), _mm512_mul_ps(q, lo))) }
    }
    #[inline(always)]
    unsafe fn sum(a: __m512, b: __m512) -> f32 {
        // SAFETY: the caller enables AVX-512F.
        unsafe { _mm512_reduce_add_ps(_mm512_add_ps(a, b)) }
    }
}

/// A digest's element type, loaded a register at a time.
trait Element {
    const DTYPE: DType;
    /// # Safety
    /// As `W`'s load of this type.
    unsafe fn load<W: Width>(ptr: *const u8) -> W::V;
}

struct F32;
struct F16;
struct Bf16;

impl Element for F32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    unsafe fn load<W: Width>(ptr: *const u8) -> W::V {
        // SAFETY: forwarded from the caller.
        unsafe { W::load_f32(ptr.cast()) }
    }
}

impl Element for F16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    unsafe fn load<W: Width>(ptr: *const u8) -> W::V {
        // SAFETY: forwarded from the caller.
        unsafe { W::load_f16(ptr) }
    }
}

impl Element for Bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline(always)]
    unsafe fn load<W: Width>(ptr: *const u8) -> W::V {
        // SAFETY: forwarded from the caller.
        unsafe { W::load_bf16(ptr) }
    }
}

/// # Safety
/// The CPU supports AVX2 and F16C; `digests` holds whole entries of
/// `2 · head_dim` elements, `queries` whole rows of `head_dim`, and `out`
/// one slot per (page, query).
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn score_avx2(dtype: DType, head_dim: usize, digests: &[u8], queries: &[f32], out: &mut [f32]) {
    // SAFETY: forwarded from this function's contract.
    unsafe { score::<Avx2>(dtype, head_dim, digests, queries, out) }
}

/// # Safety
/// As [`score_avx2`], and the CPU supports AVX-512F.
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(super) unsafe fn score_avx512(dtype: DType, head_dim: usize, digests: &[u8], queries: &[f32], out: &mut [f32]) {
    // SAFETY: forwarded from this function's contract.
    unsafe { score::<Avx512>(dtype, head_dim, digests, queries, out) }
}

/// # Safety
/// As the entry point that enables `W`'s features.
#[inline(always)]
unsafe fn score<W: Width>(dtype: DType, head_dim: usize, digests: &[u8], queries: &[f32], out: &mut [f32]) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match dtype {
            DType::F32 => columns::<W, F32>(head_dim, digests, queries, out),
            DType::F16 => columns::<W, F16>(head_dim, digests, queries, out),
            DType::Bf16 => columns::<W, Bf16>(head_dim, digests, queries, out),
        }
    }
}

/// Query heads in blocks of a fixed size, so that their accumulators are
/// plain registers.
///
/// # Safety
/// As [`score`].
#[inline(always)]
unsafe fn columns<W: Width, E: Element>(head_dim: usize, digests: &[u8], queries: &[f32], out: &mut [f32]) {
    let group = queries.len() / head_dim;
    let mut first = 0;
    while first < group {
        // SAFETY: forwarded from this function's contract; `first + N <= group`.
        unsafe {
            first += match group - first {
                1 => block::<W, E, 1>(head_dim, digests, queries, first, out),
                2 => block::<W, E, 2>(head_dim, digests, queries, first, out),
                3 => block::<W, E, 3>(head_dim, digests, queries, first, out),
                _ => block::<W, E, 4>(head_dim, digests, queries, first, out),
            };
        }
    }
}

/// Scores query heads `first..first + N` against every page; returns `N`.
///
/// # Safety
/// As [`score`], and `first + N <= group`.
#[inline(always)]
unsafe fn block<W: Width, E: Element, const N: usize>(
    head_dim: usize,
    digests: &[u8],
    queries: &[f32],
    first: usize,
    out: &mut [f32],
) -> usize {
    let group = queries.len() / head_dim;
    let size = E::DTYPE.size();
    let row = head_dim * size;
    // Whole registers of each row, in pairs; an odd last one goes to the
    // even accumulators, what is left of the row to a scalar tail.
    let chunks = head_dim / W::LANES;
    let q: [&[f32]; N] = std::array::from_fn(|j| &queries[(first + j) * head_dim..(first + j + 1) * head_dim]);
    for (page, entry) in digests.chunks_exact(2 * row).enumerate() {
        let (min, max) = (entry.as_ptr(), entry[row..].as_ptr());
        // SAFETY: the caller enables `W`'s features.
        let (mut even, mut odd) = unsafe { ([W::zero(); N], [W::zero(); N]) };
        for pair in 0..chunks / 2 {
            let (a, b) = (2 * pair * W::LANES, (2 * pair + 1) * W::LANES);
            // SAFETY: elements `a..b + LANES` lie within `head_dim`, so the
            // loads stay inside this entry's min and max rows and inside
            // each query row.
            unsafe {
                let (lo0, hi0) = (E::load::<W>(min.add(a * size)), E::load::<W>(max.add(a * size)));
                let (lo1, hi1) = (E::load::<W>(min.add(b * size)), E::load::<W>(max.add(b * size)));
                for j in 0..N {
                    even[j] = W::bound_add(even[j], W::load_f32(q[j].as_ptr().add(a)), lo0, hi0);
                    odd[j] = W::bound_add(odd[j], W::load_f32(q[j].as_ptr().add(b)), lo1, hi1);
                }
            }
        }
        if chunks % 2 == 1 {
            let a = (chunks - 1) * W::LANES;
            // SAFETY: as above, for elements `a..a + LANES`.
            unsafe {
                let (lo, hi) = (E::load::<W>(min.add(a * size)), E::load::<W>(max.add(a * size)));
                for j in 0..N {
                    even[j] = W::bound_add(even[j], W::load_f32(q[j].as_ptr().add(a)), lo, hi);
                }
            }
        }
        let (min, max) = entry.split_at(row);
        for j in 0..N {
            let tail: f32 = (chunks * W::LANES..head_dim)
                .map(|i| {
                    let (lo, hi) = (E::DTYPE.get_f32(min, i), E::DTYPE.get_f32(max, i));
                    (q[j][i] * hi).max(q[j][i] * lo)
                })
                .sum();
            // SAFETY: the caller enables `W`'s features.
            out[page * group + first + j] = unsafe { W::sum(even[j], odd[j]) } + tail;
        }
    }
    N
}

/// The sum of the eight lanes. Callable only where AVX is enabled (the
/// kernels), which the compiler checks.
#[inline]
#[target_feature(enable = "avx")]
fn horizontal_sum(v: __m256) -> f32 {
    let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
    _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps::<0b01>(quad, quad)))
}
