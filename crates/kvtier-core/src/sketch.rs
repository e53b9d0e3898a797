//! Per-token int4 key sketches (docs/CONCEPTS.md §3.2): each key row kept as
//! 4-bit codes over its own range, so that a query's logit on every token
//! can be estimated from a quarter of the key's bytes (f16 keys) without
//! reading the page.
//!
//! A sketch row is `[codes: ⌈d/2⌉ bytes][scale: f16][zero: f16]`, little-
//! endian; channel `2i` is the low nibble of code byte `i`, `2i + 1` the high
//! one. Key element `r` is approximately `zero + scale · code_r`, with `zero`
//! the row's minimum and `scale` its range / 15, both rounded to f16 and
//! saturated to its finite range (keys beyond ±65504, possible in f32 and
//! bf16, are clamped there: the sketch is an estimator, the Quest digest
//! stays the sound bound).

use half::f16;

use crate::DType;

/// Largest code: 4 bits.
const LEVELS: f32 = 15.0;

/// Bytes of one token's sketch for keys of `head_dim` elements.
pub const fn row_bytes(head_dim: usize) -> usize {
    head_dim.div_ceil(2) + 4
}

fn saturate(v: f32) -> f16 {
    f16::from_f32(v.clamp(-f16::MAX.to_f32(), f16::MAX.to_f32()))
}

/// Writes the sketch of one key row, widened to f32 (`head_dim` values),
/// into `out` ([`row_bytes`] long).
fn encode_values(key: &[f32], out: &mut [u8]) {
    let head_dim = key.len();
    let limit = f16::MAX.to_f32();
    let (lo, hi) = key.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
        (lo.min(v), hi.max(v))
    });
    let zero = saturate(lo);
    let scale = saturate((hi.clamp(-limit, limit) - zero.to_f32()) / LEVELS);
    let (z, s) = (zero.to_f32(), scale.to_f32());
    let tail = head_dim.div_ceil(2);
    let codes = &mut out[..tail];
    codes.fill(0);
    if s > 0.0 {
        for (r, &v) in key.iter().enumerate() {
            let code = ((v.clamp(-limit, limit) - z) / s).round().clamp(0.0, LEVELS) as u8;
            codes[r / 2] |= code << (4 * (r % 2));
        }
    }
    out[tail..tail + 2].copy_from_slice(&scale.to_le_bytes());
    out[tail + 2..tail + 4].copy_from_slice(&zero.to_le_bytes());
}

/// Writes the sketch rows of `keys` (`[rows][head_dim]` of `dtype`) into
/// `out` (`rows ×` [`row_bytes`]).
pub fn encode_into(dtype: DType, head_dim: usize, keys: &[u8], out: &mut [u8]) {
    let key_row = head_dim * dtype.size();
    let mut values = vec![0f32; head_dim];
    for (key, row) in keys
        .chunks_exact(key_row)
        .zip(out.chunks_exact_mut(row_bytes(head_dim)))
    {
        dtype.widen(key, &mut values);
        encode_values(&values, row);
    }
}

/// The sketch rows of `keys` (`[rows][head_dim]` of `dtype`).
pub fn encode(dtype: DType, head_dim: usize, keys: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; keys.len() / (head_dim * dtype.size()) * row_bytes(head_dim)];
    encode_into(dtype, head_dim, keys, &mut out);
    out
}

/// The row's scale and zero.
pub fn scale_zero(head_dim: usize, row: &[u8]) -> (f32, f32) {
    let at = head_dim.div_ceil(2);
    let get = |i: usize| f16::from_le_bytes([row[i], row[i + 1]]).to_f32();
    (get(at), get(at + 2))
}

/// Code of channel `r`.
pub fn code(row: &[u8], r: usize) -> u8 {
    (row[r / 2] >> (4 * (r % 2))) & 0x0f
}

/// The key a sketch row stands for, widened to f32.
pub fn decode_row(head_dim: usize, row: &[u8], out: &mut [f32]) {
    let (scale, zero) = scale_zero(head_dim, row);
    for (r, o) in out.iter_mut().enumerate().take(head_dim) {
        *o = zero + scale * f32::from(code(row, r));
    }
}

/// The cuboid of a page's sketched keys (ArkVale's box): per channel the
/// centre `c` (the mean) and the radius `ρ` (the mean of `|k − c|`), written
/// as a digest entry `[c − ρ][c + ρ]` in `dtype`, so that the Quest kernel
/// scores it as `q·c + |q|·ρ`. Not a bound: a tighter, unsound estimate.
pub fn cuboid_entry(dtype: DType, head_dim: usize, rows: &[u8], out: &mut [u8]) {
    let n = row_bytes(head_dim);
    let count = (rows.len() / n).max(1) as f32;
    let mut key = vec![0f32; head_dim];
    let mut centre = vec![0f32; head_dim];
    for row in rows.chunks_exact(n) {
        decode_row(head_dim, row, &mut key);
        centre.iter_mut().zip(&key).for_each(|(c, k)| *c += k);
    }
    centre.iter_mut().for_each(|c| *c /= count);
    let mut radius = vec![0f32; head_dim];
    for row in rows.chunks_exact(n) {
        decode_row(head_dim, row, &mut key);
        radius
            .iter_mut()
            .zip(key.iter().zip(&centre))
            .for_each(|(r, (k, c))| *r += (k - c).abs());
    }
    for (r, (c, rho)) in centre.iter().zip(&radius).enumerate() {
        let rho = rho / count;
        dtype.put_f32(out, r, c - rho);
        dtype.put_f32(out, head_dim + r, c + rho);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every element comes back within half a step of the row's own
        /// scale (plus the f16 rounding of zero and scale).
        #[test]
        fn decoding_is_within_half_a_step(
            d in 1usize..70,
            values in proptest::collection::vec(-40.0f32..40.0, 70),
        ) {
            for dtype in DType::ALL {
                let key = dtype.encode(&values[..d]);
                let row = encode(dtype, d, &key);
                prop_assert_eq!(row.len(), row_bytes(d));
                let mut back = vec![0f32; d];
                decode_row(d, &row, &mut back);
                let (scale, _) = scale_zero(d, &row);
                let exact = dtype.to_f32_vec(&key);
                let hi = exact.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in exact.iter().zip(&back) {
                    let slack = scale / 2.0 + 1e-3 * hi + 1e-3;
                    prop_assert!((a - b).abs() <= slack, "{dtype} d={d}: {a} vs {b} (scale {scale})");
                }
            }
        }
    }

    #[test]
    fn a_constant_row_is_exact_and_extremes_saturate() {
        let d = 5;
        let row = encode(DType::F32, d, &DType::F32.encode(&[2.5; 5]));
        let mut back = vec![0f32; d];
        decode_row(d, &row, &mut back);
        assert_eq!(back, [2.5; 5]);
        let row = encode(DType::F32, d, &DType::F32.encode(&[3e38, -3e38, 0.0, 1.0, -1.0]));
        decode_row(d, &row, &mut back);
        assert!(back.iter().all(|v| v.is_finite()), "{back:?}");
        let (scale, _) = scale_zero(d, &row);
        assert_eq!(back[1], -65504.0);
        assert!((back[0] - 65504.0).abs() <= scale, "{back:?}");
    }

    #[test]
    fn the_cuboid_is_mean_and_mean_absolute_deviation() {
        // Two rows whose sketches are exact (each spans 0..15 in unit steps).
        let d = 2;
        let keys = DType::F32.encode(&[0.0, 15.0, 15.0, 0.0]);
        let rows = encode(DType::F32, d, &keys);
        let mut entry = vec![0u8; 2 * d * 4];
        cuboid_entry(DType::F32, d, &rows, &mut entry);
        // Centre 7.5 in both channels, radius 7.5.
        assert_eq!(DType::F32.to_f32_vec(&entry), [0.0, 0.0, 15.0, 15.0]);
    }
}
