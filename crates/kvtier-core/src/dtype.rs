//! The element types of keys and values, and their little-endian encoding.

use half::{bf16, f16};

/// Element type of keys and values. Every byte on the wire and in every tier
/// is little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 single precision, 4 bytes.
    F32,
    /// IEEE 754 half precision, 2 bytes.
    F16,
    /// bfloat16 (the top half of an f32), 2 bytes.
    Bf16,
}

impl DType {
    /// All three dtypes, widest first.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Lower-case name (`f32`, `f16`, `bf16`), as printed by `Display`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }

    /// Value of element `i` of a little-endian buffer of this type, widened
    /// exactly to f32 (every f16 and bf16 value is representable in f32).
    #[inline]
    pub fn get_f32(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
            DType::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            DType::Bf16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        }
    }

    /// Stores `value` rounded to nearest-even into element `i`.
    #[inline]
    pub fn put_f32(self, bytes: &mut [u8], i: usize, value: f32) {
        match self {
            DType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&value.to_le_bytes()),
            DType::F16 => bytes[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(value).to_le_bytes()),
            DType::Bf16 => bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(value).to_le_bytes()),
        }
    }

    /// Widens `out.len()` elements of a little-endian buffer into `out`.
    pub fn widen(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            DType::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            DType::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            DType::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
            }
        }
    }

    /// `values` rounded to this type, little-endian.
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; values.len() * self.size()];
        for (i, v) in values.iter().enumerate() {
            self.put_f32(&mut out, i, *v);
        }
        out
    }

    /// Widens a whole little-endian buffer to f32.
    pub fn to_f32_vec(self, bytes: &[u8]) -> Vec<f32> {
        (0..bytes.len() / self.size()).map(|i| self.get_f32(bytes, i)).collect()
    }

    /// Index of the first element that is NaN or infinite, if any.
    pub fn first_non_finite(self, bytes: &[u8]) -> Option<usize> {
        (0..bytes.len() / self.size()).find(|&i| !self.get_f32(bytes, i).is_finite())
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_are_exact_for_representable_values() {
        for dtype in DType::ALL {
            let mut buf = vec![0u8; 3 * dtype.size()];
            for (i, v) in [-2.5f32, 0.0, 1024.0].iter().enumerate() {
                dtype.put_f32(&mut buf, i, *v);
                assert_eq!(dtype.get_f32(&buf, i), *v, "{dtype}");
            }
        }
    }

    #[test]
    fn non_finite_values_are_found() {
        let mut buf = vec![0u8; 4 * 2];
        DType::F16.put_f32(&mut buf, 2, f32::NAN);
        assert_eq!(DType::F16.first_non_finite(&buf), Some(2));
        DType::F16.put_f32(&mut buf, 2, 1.0);
        assert_eq!(DType::F16.first_non_finite(&buf), None);
        // 1e6 overflows f16 to infinity.
        DType::F16.put_f32(&mut buf, 1, 1e6);
        assert_eq!(DType::F16.first_non_finite(&buf), Some(1));
    }
}
