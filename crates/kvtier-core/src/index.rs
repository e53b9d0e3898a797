//! A lane's resident page index (docs/CONCEPTS.md §3.1): per page its Quest
//! digest (min and max rows, the sound bound) and one int4 sketch per
//! token. Everything selection reads; none of it needs the page. (A page's
//! cuboid is a function of its sketches, computed when a selection asks for
//! it rather than kept: it would cost as much memory as the digest.)
//!
//! A page's *entry* — what a shared page carries and what the manifest
//! records — is its digest followed by the sketch rows of its tokens.

use crate::chunked::ChunkedEntries;
use crate::sketch::{self, cuboid_entry};
use crate::{DIGEST_CHUNK_PAGES, DType, DigestColumn};

/// The resident index of one lane: a digest per page and `page_size` key
/// sketch rows per page, both in page order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageIndex {
    digests: DigestColumn,
    /// `page_size` sketch rows per page; rows past a partial last page's
    /// end are zero.
    sketches: ChunkedEntries,
    page_size: usize,
}

impl PageIndex {
    /// An empty index for keys of `dtype` and `head_dim` elements, in pages
    /// of `page_size` tokens.
    pub fn new(dtype: DType, head_dim: usize, page_size: u32) -> Self {
        let page_size = page_size as usize;
        Self {
            digests: DigestColumn::new(dtype, head_dim),
            sketches: ChunkedEntries::new(page_size * sketch::row_bytes(head_dim), DIGEST_CHUNK_PAGES),
            page_size,
        }
    }

    /// The per-page min/max digests.
    pub fn digests(&self) -> &DigestColumn {
        &self.digests
    }

    /// The cuboids of pages `0..pages` (each of its first `rows(page)`
    /// sketched rows) as digest entries `[c − ρ][c + ρ]`, in page order.
    pub fn cuboids(&self, pages: usize, rows: impl Fn(usize) -> usize) -> Vec<u8> {
        let (dtype, d) = (self.digests.dtype(), self.digests.head_dim());
        let n = self.sketch_row_bytes();
        let entry = self.digests.entry_bytes();
        let mut out = vec![0u8; pages * entry];
        for (p, out) in out.chunks_exact_mut(entry).enumerate() {
            cuboid_entry(dtype, d, &self.sketch(p)[..rows(p) * n], out);
        }
        out
    }

    /// Page `page`'s `page_size` sketch rows.
    pub fn sketch(&self, page: usize) -> &[u8] {
        self.sketches.get(page)
    }

    /// Bytes of one token's sketch row.
    pub fn sketch_row_bytes(&self) -> usize {
        sketch::row_bytes(self.digests.head_dim())
    }

    /// Tokens per page, and so sketch rows kept per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Bytes of an entry of a page of `rows` tokens (of a full page: its
    /// resident index).
    pub fn entry_len(dtype: DType, head_dim: usize, rows: u32) -> usize {
        2 * head_dim * dtype.size() + rows as usize * sketch::row_bytes(head_dim)
    }

    /// The entry of a page holding `keys` (`[rows][head_dim]`, at least one
    /// row): what [`Self::entry`] gives once the page is indexed.
    pub fn entry_of(dtype: DType, head_dim: usize, keys: &[u8]) -> Vec<u8> {
        let mut digest = DigestColumn::new(dtype, head_dim);
        digest.open_page(keys);
        let mut entry = digest.entry(0).to_vec();
        entry.extend(sketch::encode(dtype, head_dim, keys));
        entry
    }

    /// Indexes a new page from its first key rows.
    pub fn open_page(&mut self, keys: &[u8]) {
        self.digests.open_page(keys);
        self.sketches.push_zeroed();
        self.add_rows(self.digests.pages() - 1, 0, keys);
    }

    /// Folds key rows `from..` of page `page` into its index.
    pub fn extend_page(&mut self, page: usize, from: u32, keys: &[u8]) {
        self.digests.extend_page(page, keys);
        self.add_rows(page, from as usize, keys);
    }

    fn add_rows(&mut self, page: usize, from: usize, keys: &[u8]) {
        let (dtype, d) = (self.digests.dtype(), self.digests.head_dim());
        let n = sketch::row_bytes(d);
        let rows = keys.len() / (d * dtype.size());
        assert!(from + rows <= self.page_size, "rows beyond the page");
        let slots = self.sketches.get_mut(page);
        sketch::encode_into(dtype, d, keys, &mut slots[from * n..(from + rows) * n]);
    }

    /// Page `page`'s entry for its first `rows` rows.
    pub fn entry(&self, page: usize, rows: u32) -> Vec<u8> {
        let mut entry = self.digests.entry(page).to_vec();
        entry.extend_from_slice(&self.sketch(page)[..rows as usize * self.sketch_row_bytes()]);
        entry
    }

    /// Indexes a new page from its entry ([`Self::entry_len`] bytes for its
    /// rows); returns the rows.
    pub fn push_entry(&mut self, entry: &[u8]) -> u32 {
        let digest = self.digests.entry_bytes();
        let n = self.sketch_row_bytes();
        assert!(
            entry.len() > digest && (entry.len() - digest).is_multiple_of(n),
            "index entry of a digest and whole sketch rows"
        );
        let rows = (entry.len() - digest) / n;
        assert!(rows <= self.page_size, "index entry of at most page_size rows");
        self.digests.push_entry(&entry[..digest]);
        self.sketches.push_zeroed()[..rows * n].copy_from_slice(&entry[digest..]);
        rows as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// However a page's rows arrive — at once, in pieces, or as the
        /// entry of a page indexed elsewhere — its index is the same.
        #[test]
        fn the_index_does_not_depend_on_how_rows_arrive(
            d in 1usize..20,
            page_size in 1u32..9,
            splits in proptest::collection::vec(1usize..4, 1..6),
            values in proptest::collection::vec(-8.0f32..8.0, 400),
        ) {
            for dtype in DType::ALL {
                let rows: usize = splits.iter().sum::<usize>().min(page_size as usize);
                let all = dtype.encode(&values[..rows * d]);
                let row = d * dtype.size();
                let mut whole = PageIndex::new(dtype, d, page_size);
                whole.open_page(&all);
                let mut pieces = PageIndex::new(dtype, d, page_size);
                let mut at = 0;
                for s in &splits {
                    let s = (*s).min(rows - at);
                    if s == 0 { break; }
                    let part = &all[at * row..(at + s) * row];
                    if at == 0 { pieces.open_page(part) } else { pieces.extend_page(0, at as u32, part) }
                    at += s;
                }
                let mut shared = PageIndex::new(dtype, d, page_size);
                prop_assert_eq!(shared.push_entry(&PageIndex::entry_of(dtype, d, &all)), rows as u32);
                prop_assert_eq!(&whole, &pieces);
                prop_assert_eq!(&whole, &shared);
                prop_assert_eq!(whole.entry(0, rows as u32), PageIndex::entry_of(dtype, d, &all));
                prop_assert_eq!(whole.entry(0, rows as u32).len(), PageIndex::entry_len(dtype, d, rows as u32));
            }
        }
    }
}
