//! Packing typed K/V into the wire layout and back: per KV head, K rows
//! `[token][head_dim]` then V rows, little-endian; heads concatenated.

use bytes::{BufMut, Bytes, BytesMut};
use half::{bf16, f16};

use crate::pb;

/// An element type kvtier stores.
pub trait Element: Copy + Send + Sync + 'static {
    /// The element type as a layout names it.
    const DTYPE: pb::DType;
    /// Bytes per element.
    const SIZE: usize;
    /// Appends the element to `out`, little-endian.
    fn put(self, out: &mut BytesMut);
    /// The element in the first `SIZE` bytes of `bytes`, little-endian;
    /// panics if there are fewer.
    fn get(bytes: &[u8]) -> Self;
}

impl Element for f32 {
    const DTYPE: pb::DType = pb::DType::DtypeF32;
    const SIZE: usize = 4;
    fn put(self, out: &mut BytesMut) {
        out.put_f32_le(self);
    }
    fn get(bytes: &[u8]) -> Self {
        f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }
}

impl Element for f16 {
    const DTYPE: pb::DType = pb::DType::DtypeF16;
    const SIZE: usize = 2;
    fn put(self, out: &mut BytesMut) {
        out.put_slice(&self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        f16::from_le_bytes([bytes[0], bytes[1]])
    }
}

impl Element for bf16 {
    const DTYPE: pb::DType = pb::DType::DtypeBf16;
    const SIZE: usize = 2;
    fn put(self, out: &mut BytesMut) {
        out.put_slice(&self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        bf16::from_le_bytes([bytes[0], bytes[1]])
    }
}

/// Why [`pack_kv`] or [`unpack_rows`] refused its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    /// `k` or `v` does not hold `heads × tokens × head_dim` elements.
    #[error("{what} holds {actual} elements, but {heads} heads × {tokens} tokens × head_dim {head_dim} = {expected}")]
    Shape {
        /// Which slice: `"k"` or `"v"`.
        what: &'static str,
        /// Elements it holds.
        actual: usize,
        /// Elements it should hold: `heads × tokens × head_dim`.
        expected: usize,
        /// KV heads asked for.
        heads: usize,
        /// Tokens per head asked for.
        tokens: usize,
        /// Elements per row.
        head_dim: usize,
    },
    /// The bytes do not split into K rows and as many V rows (or `head_dim`
    /// is 0).
    #[error("{actual} bytes are not a whole number of {head_dim}-wide K and V rows of {size}-byte elements")]
    Bytes {
        /// Bytes given.
        actual: usize,
        /// Elements per row.
        head_dim: usize,
        /// Bytes per element.
        size: usize,
    },
}

/// Packs `k` and `v`, each `[heads][tokens][head_dim]` (the usual layout of
/// a worker's K and V tensors), into one `kv` field.
pub fn pack_kv<T: Element>(k: &[T], v: &[T], heads: usize, tokens: usize, head_dim: usize) -> Result<Bytes, PackError> {
    let expected = heads * tokens * head_dim;
    for (what, x) in [("k", k), ("v", v)] {
        if x.len() != expected {
            return Err(PackError::Shape {
                what,
                actual: x.len(),
                expected,
                heads,
                tokens,
                head_dim,
            });
        }
    }
    let per_head = tokens * head_dim;
    let mut out = BytesMut::with_capacity(2 * expected * T::SIZE);
    for h in 0..heads {
        for x in [k, v] {
            for e in &x[h * per_head..(h + 1) * per_head] {
                e.put(&mut out);
            }
        }
    }
    Ok(out.freeze())
}

/// Splits one page's (or summary's) bytes, K rows then V rows, into typed K
/// and V, each `[rows][head_dim]`.
pub fn unpack_rows<T: Element>(kv: &[u8], head_dim: usize) -> Result<(Vec<T>, Vec<T>), PackError> {
    let row = head_dim * T::SIZE;
    if row == 0 || !kv.len().is_multiple_of(2 * row) {
        return Err(PackError::Bytes {
            actual: kv.len(),
            head_dim,
            size: T::SIZE,
        });
    }
    let (k, v) = kv.split_at(kv.len() / 2);
    let decode = |b: &[u8]| b.chunks_exact(T::SIZE).map(T::get).collect();
    Ok((decode(k), decode(v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_is_head_major_k_then_v() {
        // 2 heads, 1 token, head_dim 2.
        let k = [1.0f32, 2.0, 3.0, 4.0];
        let v = [5.0f32, 6.0, 7.0, 8.0];
        let kv = pack_kv(&k, &v, 2, 1, 2).unwrap();
        let back: Vec<f32> = kv.chunks_exact(4).map(f32::get).collect();
        assert_eq!(back, [1.0, 2.0, 5.0, 6.0, 3.0, 4.0, 7.0, 8.0]);
        let (k0, v0) = unpack_rows::<f32>(&kv[..16], 2).unwrap();
        assert_eq!((k0, v0), (vec![1.0, 2.0], vec![5.0, 6.0]));
    }

    #[test]
    fn shapes_are_checked() {
        let e = pack_kv(&[f16::ZERO; 3], &[f16::ZERO; 4], 1, 2, 2).unwrap_err();
        assert!(matches!(
            e,
            PackError::Shape {
                what: "k",
                actual: 3,
                expected: 4,
                ..
            }
        ));
        assert!(unpack_rows::<bf16>(&[0u8; 6], 2).is_err());
    }
}
