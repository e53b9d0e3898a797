//! Per-page key digests: the element-wise minimum and maximum of a page's
//! keys, kept in the key dtype. Min and max of representable values are
//! representable, so a digest is exact, never rounded.

use crate::DType;

/// The digests of one lane (stored layer, KV head), one entry per page, laid
/// out contiguously as `[page][min row | max row]` so that scoring a lane is
/// one sequential read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DigestColumn {
    dtype: DType,
    head_dim: usize,
    bytes: Vec<u8>,
}

impl DigestColumn {
    pub fn new(dtype: DType, head_dim: usize) -> Self {
        Self {
            dtype,
            head_dim,
            bytes: Vec::new(),
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    fn row_bytes(&self) -> usize {
        self.head_dim * self.dtype.size()
    }

    /// Bytes of one page's digest: `2 · head_dim` elements.
    pub fn entry_bytes(&self) -> usize {
        2 * self.row_bytes()
    }

    pub fn pages(&self) -> usize {
        self.bytes.len() / self.entry_bytes()
    }

    /// The whole column, `pages() · entry_bytes()` bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Page `page`'s digest: min row then max row.
    pub fn entry(&self, page: usize) -> &[u8] {
        let n = self.entry_bytes();
        &self.bytes[page * n..(page + 1) * n]
    }

    pub fn min_row(&self, page: usize) -> &[u8] {
        &self.entry(page)[..self.row_bytes()]
    }

    pub fn max_row(&self, page: usize) -> &[u8] {
        &self.entry(page)[self.row_bytes()..]
    }

    /// Appends the digest of a new page from its first key rows
    /// (`[rows][head_dim]`, at least one row).
    pub fn open_page(&mut self, keys: &[u8]) {
        let row = self.row_bytes();
        assert!(
            keys.len() >= row && keys.len().is_multiple_of(row),
            "open_page needs whole key rows"
        );
        self.bytes.extend_from_slice(&keys[..row]);
        self.bytes.extend_from_slice(&keys[..row]);
        let page = self.pages() - 1;
        self.extend_page(page, &keys[row..]);
    }

    /// Appends a digest computed elsewhere (a shared page's).
    pub fn push_entry(&mut self, entry: &[u8]) {
        assert_eq!(entry.len(), self.entry_bytes(), "digest entry size");
        self.bytes.extend_from_slice(entry);
    }

    /// Folds further key rows of page `page` into its digest.
    pub fn extend_page(&mut self, page: usize, keys: &[u8]) {
        let (dtype, row, es) = (self.dtype, self.row_bytes(), self.dtype.size());
        let n = self.entry_bytes();
        let (min, max) = self.bytes[page * n..(page + 1) * n].split_at_mut(row);
        for key in keys.chunks_exact(row) {
            for i in 0..self.head_dim {
                let v = dtype.get_f32(key, i);
                let src = &key[i * es..(i + 1) * es];
                if v < dtype.get_f32(min, i) {
                    min[i * es..(i + 1) * es].copy_from_slice(src);
                }
                if v > dtype.get_f32(max, i) {
                    max[i * es..(i + 1) * es].copy_from_slice(src);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; values.len() * dtype.size()];
        for (i, v) in values.iter().enumerate() {
            dtype.put_f32(&mut out, i, *v);
        }
        out
    }

    #[test]
    fn open_and_extend_equal_a_one_shot_digest() {
        for dtype in DType::ALL {
            let rows = [[1.0f32, -2.0, 3.5], [0.5, 4.0, -1.0], [2.0, 0.0, 3.5]];
            let flat: Vec<f32> = rows.iter().flatten().copied().collect();
            let mut once = DigestColumn::new(dtype, 3);
            once.open_page(&encode(dtype, &flat));
            let mut stepwise = DigestColumn::new(dtype, 3);
            stepwise.open_page(&encode(dtype, &rows[0]));
            stepwise.extend_page(0, &encode(dtype, &flat[3..]));
            assert_eq!(once, stepwise);
            assert_eq!(dtype.to_f32_vec(once.min_row(0)), [0.5, -2.0, -1.0]);
            assert_eq!(dtype.to_f32_vec(once.max_row(0)), [2.0, 4.0, 3.5]);
        }
    }

    #[test]
    fn pages_are_independent() {
        let d = DType::F32;
        let mut c = DigestColumn::new(d, 2);
        c.open_page(&encode(d, &[1.0, 1.0]));
        c.open_page(&encode(d, &[-1.0, 5.0]));
        c.extend_page(0, &encode(d, &[0.0, 2.0]));
        assert_eq!(c.pages(), 2);
        assert_eq!(d.to_f32_vec(c.entry(0)), [0.0, 1.0, 1.0, 2.0]);
        assert_eq!(d.to_f32_vec(c.entry(1)), [-1.0, 5.0, -1.0, 5.0]);
        assert_eq!(c.as_bytes().len(), 2 * c.entry_bytes());
    }
}
