//! A lane's resident page index (docs/CONCEPTS.md §3.1): per page its Quest
//! digest (min and max rows, the sound bound) and one int4 sketch per
//! token. Everything selection reads; none of it needs the page. (A page's
//! cuboid is a function of its sketches, computed when a selection asks for
//! it rather than kept: it would cost as much memory as the digest.)
//!
//! A page's *entry* — what a shared page carries and what the manifest
//! records — is its digest followed by the sketch rows of its tokens, or
//! its digest alone while its sketches are spilled (the store keeps the
//! sketches of NVMe-cold pages on NVMe, as the page's key rows).

use crate::sketch::{self, cuboid_entry};
use crate::sketch_column::SketchColumn;
use crate::{DType, DigestColumn};

/// The resident index of one lane: a digest per page and `page_size` key
/// sketch rows per page, both in page order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageIndex {
    digests: DigestColumn,
    /// `page_size` sketch rows per page, resident or spilled; rows past a
    /// partial last page's end are zero.
    sketches: SketchColumn,
    page_size: usize,
}

impl PageIndex {
    /// An empty index for keys of `dtype` and `head_dim` elements, in pages
    /// of `page_size` tokens.
    pub fn new(dtype: DType, head_dim: usize, page_size: u32) -> Self {
        let page_size = page_size as usize;
        Self {
            digests: DigestColumn::new(dtype, head_dim),
            sketches: SketchColumn::new(page_size * sketch::row_bytes(head_dim)),
            page_size,
        }
    }

    /// The per-page min/max digests.
    pub fn digests(&self) -> &DigestColumn {
        &self.digests
    }

    /// The cuboid of each page's sketch rows (`rows` holds each page's
    /// sketched rows, in page order) as digest entries `[c − ρ][c + ρ]`.
    pub fn cuboids<'a>(&self, rows: impl Iterator<Item = &'a [u8]>) -> Vec<u8> {
        let (dtype, d) = (self.digests.dtype(), self.digests.head_dim());
        let entry = self.digests.entry_bytes();
        let mut out = Vec::new();
        for rows in rows {
            let at = out.len();
            out.resize(at + entry, 0);
            cuboid_entry(dtype, d, rows, &mut out[at..]);
        }
        out
    }

    /// Page `page`'s `page_size` sketch rows, or `None` while spilled.
    pub fn sketch(&self, page: usize) -> Option<&[u8]> {
        self.sketches.get(page)
    }

    /// Pages whose sketches are spilled.
    pub fn spilled_pages(&self) -> usize {
        self.sketches.spilled_pages()
    }

    /// Bytes of sketch rows held in memory.
    pub fn resident_sketch_bytes(&self) -> usize {
        self.sketches.resident_bytes()
    }

    /// Leaves page `page`'s sketches to be derived from its key rows
    /// again; returns whether they were resident.
    pub fn spill_sketch(&mut self, page: usize) -> bool {
        self.sketches.spill(page)
    }

    /// Makes page `page`'s sketches resident again from its first key
    /// rows `keys`; returns whether they were spilled.
    pub fn restore_sketch(&mut self, page: usize, keys: &[u8]) -> bool {
        if self.sketches.get(page).is_some() {
            return false;
        }
        let (dtype, d) = (self.digests.dtype(), self.digests.head_dim());
        self.sketches.restore(page, &sketch::encode(dtype, d, keys))
    }

    /// Takes back page `page`'s spilled sketch rows as
    /// [`ColdSketches`](crate::rank::ColdSketches) derived them, where that
    /// costs only their own memory; returns whether they were taken.
    pub fn readmit_sketch(&mut self, page: usize, rows: &[u8]) -> bool {
        self.sketches.readmit(page, rows)
    }

    /// Reads every cache line of the digests and the resident sketches,
    /// bringing them into this core's caches ahead of a ranking.
    pub fn warm(&self) -> u8 {
        let mut x = 0u8;
        for chunk in self.digests.chunks() {
            x ^= chunk.iter().step_by(64).fold(0, |a, &b| a ^ b);
        }
        for page in 0..self.digests.pages() {
            if let Some(rows) = self.sketch(page) {
                x ^= rows.iter().step_by(64).fold(0, |a, &b| a ^ b);
            }
        }
        std::hint::black_box(x)
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

    /// Page `page`'s entry for its first `rows` rows: its digest and their
    /// sketch rows, or its digest alone while they are spilled.
    pub fn entry(&self, page: usize, rows: u32) -> Vec<u8> {
        let mut entry = self.digests.entry(page).to_vec();
        if let Some(sketch) = self.sketch(page) {
            entry.extend_from_slice(&sketch[..rows as usize * self.sketch_row_bytes()]);
        }
        entry
    }

    /// Indexes a new page of `rows` rows from its entry ([`Self::entry_len`]
    /// bytes for its rows, or the digest alone: its sketches spilled).
    pub fn push_entry(&mut self, entry: &[u8], rows: u32) {
        let digest = self.digests.entry_bytes();
        let n = self.sketch_row_bytes();
        let rows = rows as usize;
        assert!(
            (1..=self.page_size).contains(&rows),
            "index entry of 1..=page_size rows"
        );
        assert!(
            entry.len() == digest || entry.len() == digest + rows * n,
            "index entry of a digest and no or every row's sketch"
        );
        self.digests.push_entry(&entry[..digest]);
        if entry.len() == digest {
            self.sketches.push_spilled();
        } else {
            self.sketches.push_zeroed()[..rows * n].copy_from_slice(&entry[digest..]);
        }
    }

    /// Rows of an entry that holds its sketches; `None` for a digest alone
    /// or a length that is neither.
    pub fn entry_rows(&self, entry: &[u8]) -> Option<u32> {
        let digest = self.digests.entry_bytes();
        let n = self.sketch_row_bytes();
        let sketched = entry
            .len()
            .checked_sub(digest)
            .filter(|s| *s > 0 && s.is_multiple_of(n))?;
        u32::try_from(sketched / n)
            .ok()
            .filter(|r| *r as usize <= self.page_size)
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
                let entry = PageIndex::entry_of(dtype, d, &all);
                prop_assert_eq!(shared.entry_rows(&entry), Some(rows as u32));
                shared.push_entry(&entry, rows as u32);
                // Spilled (a digest alone, as a manifest may hold it) and
                // restored from the keys: the same index again.
                let mut spilled = PageIndex::new(dtype, d, page_size);
                spilled.push_entry(&entry[..2 * d * dtype.size()], rows as u32);
                prop_assert_eq!(spilled.sketch(0), None);
                prop_assert_eq!(spilled.entry(0, rows as u32), entry[..2 * d * dtype.size()].to_vec());
                prop_assert!(spilled.restore_sketch(0, &all));
                prop_assert_eq!(&spilled, &whole);
                prop_assert!(spilled.spill_sketch(0));
                prop_assert!(spilled.restore_sketch(0, &all));
                prop_assert_eq!(&spilled, &whole);
                prop_assert_eq!(&whole, &pieces);
                prop_assert_eq!(&whole, &shared);
                prop_assert_eq!(whole.entry(0, rows as u32), PageIndex::entry_of(dtype, d, &all));
                prop_assert_eq!(whole.entry(0, rows as u32).len(), PageIndex::entry_len(dtype, d, rows as u32));
            }
        }
    }
}
