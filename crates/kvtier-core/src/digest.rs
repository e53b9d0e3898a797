//! Per-page key digests: the element-wise minimum and maximum of a page's
//! keys, kept in the key dtype. Min and max of representable values are
//! representable, so a digest is exact, never rounded.

use crate::DType;
use crate::chunked::ChunkedEntries;

/// Pages per chunk of a [`DigestColumn`].
pub const DIGEST_CHUNK_PAGES: usize = 256;

/// The digests of one lane (stored layer, KV head), one entry per page, laid
/// out as `[page][min row | max row]` in chunks of [`DIGEST_CHUNK_PAGES`]
/// contiguous entries, so that scoring a lane is a few sequential reads and
/// growing it never moves what is there: opening a page costs the same at
/// any context length (a doubling vector would copy and fault in the whole
/// column on the step that crosses a power of two).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DigestColumn {
    dtype: DType,
    head_dim: usize,
    entries: ChunkedEntries,
}

impl DigestColumn {
    /// An empty column for keys of `dtype` with `head_dim` elements per row.
    pub fn new(dtype: DType, head_dim: usize) -> Self {
        Self {
            dtype,
            head_dim,
            entries: ChunkedEntries::new(2 * head_dim * dtype.size(), DIGEST_CHUNK_PAGES),
        }
    }

    /// Element type of the keys and so of the digests.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements per key row (and per min or max row).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    fn row_bytes(&self) -> usize {
        self.head_dim * self.dtype.size()
    }

    /// Bytes of one page's digest: `2 · head_dim` elements.
    pub fn entry_bytes(&self) -> usize {
        self.entries.entry_bytes()
    }

    /// Number of pages with a digest.
    pub fn pages(&self) -> usize {
        self.entries.len()
    }

    /// Bytes of all entries.
    pub fn byte_len(&self) -> usize {
        self.entries.byte_len()
    }

    /// The entries in page order: every chunk holds [`DIGEST_CHUNK_PAGES`]
    /// entries but the last.
    pub fn chunks(&self) -> impl Iterator<Item = &[u8]> {
        self.entries.chunks()
    }

    /// Page `page`'s digest: min row then max row.
    pub fn entry(&self, page: usize) -> &[u8] {
        self.entries.get(page)
    }

    fn entry_mut(&mut self, page: usize) -> &mut [u8] {
        self.entries.get_mut(page)
    }

    /// Element-wise minimum of page `page`'s keys (`head_dim` elements).
    pub fn min_row(&self, page: usize) -> &[u8] {
        &self.entry(page)[..self.row_bytes()]
    }

    /// Element-wise maximum of page `page`'s keys (`head_dim` elements).
    pub fn max_row(&self, page: usize) -> &[u8] {
        &self.entry(page)[self.row_bytes()..]
    }

    /// Appends a zeroed entry for a new last page and returns it.
    fn push_zeroed(&mut self) -> &mut [u8] {
        self.entries.push_zeroed()
    }

    /// Appends the digest of a new page from its first key rows
    /// (`[rows][head_dim]`, at least one row).
    pub fn open_page(&mut self, keys: &[u8]) {
        let row = self.row_bytes();
        assert!(
            keys.len() >= row && keys.len().is_multiple_of(row),
            "open_page needs whole key rows"
        );
        let entry = self.push_zeroed();
        entry[..row].copy_from_slice(&keys[..row]);
        entry[row..].copy_from_slice(&keys[..row]);
        self.extend_page(self.pages() - 1, &keys[row..]);
    }

    /// Appends a digest computed elsewhere (a shared page's).
    pub fn push_entry(&mut self, entry: &[u8]) {
        assert_eq!(entry.len(), self.entry_bytes(), "digest entry size");
        self.push_zeroed().copy_from_slice(entry);
    }

    /// Folds further key rows of page `page` into its digest.
    pub fn extend_page(&mut self, page: usize, keys: &[u8]) {
        if keys.is_empty() {
            return;
        }
        let (dtype, row, d) = (self.dtype, self.row_bytes(), self.head_dim);
        let (min, max) = self.entry_mut(page).split_at_mut(row);
        // Folded in f32 (each element widened once) and stored back: every
        // value came from the dtype, so storing it is exact.
        let (mut lo, mut hi, mut key) = (vec![0f32; d], vec![0f32; d], vec![0f32; d]);
        dtype.widen(min, &mut lo);
        dtype.widen(max, &mut hi);
        for bytes in keys.chunks_exact(row) {
            dtype.widen(bytes, &mut key);
            for ((lo, hi), &v) in lo.iter_mut().zip(hi.iter_mut()).zip(&key) {
                *lo = lo.min(v);
                *hi = hi.max(v);
            }
        }
        for (i, (&lo, &hi)) in lo.iter().zip(&hi).enumerate() {
            dtype.put_f32(min, i, lo);
            dtype.put_f32(max, i, hi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_and_extend_equal_a_one_shot_digest() {
        for dtype in DType::ALL {
            let rows = [[1.0f32, -2.0, 3.5], [0.5, 4.0, -1.0], [2.0, 0.0, 3.5]];
            let flat: Vec<f32> = rows.iter().flatten().copied().collect();
            let mut once = DigestColumn::new(dtype, 3);
            once.open_page(&dtype.encode(&flat));
            let mut stepwise = DigestColumn::new(dtype, 3);
            stepwise.open_page(&dtype.encode(&rows[0]));
            stepwise.extend_page(0, &dtype.encode(&flat[3..]));
            assert_eq!(once, stepwise);
            assert_eq!(dtype.to_f32_vec(once.min_row(0)), [0.5, -2.0, -1.0]);
            assert_eq!(dtype.to_f32_vec(once.max_row(0)), [2.0, 4.0, 3.5]);
        }
    }

    proptest::proptest! {
        /// A digest is the element-wise min and max of its page's keys,
        /// exactly, however the rows arrived.
        #[test]
        fn the_digest_is_the_exact_elementwise_min_and_max(
            d in 1usize..20,
            rows in 1usize..9,
            split in 1usize..9,
            values in proptest::collection::vec(-70000.0f32..70000.0, 180),
        ) {
            for dtype in DType::ALL {
                let keys = dtype.encode(&values[..rows * d]);
                let stored = dtype.to_f32_vec(&keys);
                let mut c = DigestColumn::new(dtype, d);
                let first = split.min(rows) * d * dtype.size();
                c.open_page(&keys[..first]);
                c.extend_page(0, &keys[first..]);
                for i in 0..d {
                    let column = stored.iter().skip(i).step_by(d);
                    let lo = column.clone().fold(f32::INFINITY, |a, &b| a.min(b));
                    let hi = column.fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    proptest::prop_assert_eq!(dtype.get_f32(c.min_row(0), i), lo);
                    proptest::prop_assert_eq!(dtype.get_f32(c.max_row(0), i), hi);
                }
            }
        }
    }

    #[test]
    fn pages_are_independent() {
        let d = DType::F32;
        let mut c = DigestColumn::new(d, 2);
        c.open_page(&d.encode(&[1.0, 1.0]));
        c.open_page(&d.encode(&[-1.0, 5.0]));
        c.extend_page(0, &d.encode(&[0.0, 2.0]));
        assert_eq!(c.pages(), 2);
        assert_eq!(d.to_f32_vec(c.entry(0)), [0.0, 1.0, 1.0, 2.0]);
        assert_eq!(d.to_f32_vec(c.entry(1)), [-1.0, 5.0, -1.0, 5.0]);
        assert_eq!(c.byte_len(), 2 * c.entry_bytes());
    }

    #[test]
    fn chunks_hold_every_entry_in_page_order() {
        let d = DType::F32;
        let mut c = DigestColumn::new(d, 1);
        let n = 2 * DIGEST_CHUNK_PAGES + 3;
        for p in 0..n {
            c.open_page(&d.encode(&[p as f32]));
        }
        let sizes: Vec<usize> = c.chunks().map(|k| k.len() / c.entry_bytes()).collect();
        assert_eq!(sizes, [DIGEST_CHUNK_PAGES, DIGEST_CHUNK_PAGES, 3]);
        let flat: Vec<f32> = c.chunks().flat_map(|k| d.to_f32_vec(k)).collect();
        let want: Vec<f32> = (0..n).flat_map(|p| [p as f32, p as f32]).collect();
        assert_eq!(flat, want);
        c.extend_page(DIGEST_CHUNK_PAGES + 1, &d.encode(&[-7.0]));
        assert_eq!(
            d.to_f32_vec(c.entry(DIGEST_CHUNK_PAGES + 1)),
            [-7.0, (DIGEST_CHUNK_PAGES + 1) as f32]
        );
        assert_eq!(c.byte_len(), n * c.entry_bytes());
    }
}
