//! A lane's sketch rows, page by page, each page's either resident or
//! *spilled*: left to be derived again from the page's key rows wherever
//! its bytes are (on NVMe, for the pages the store spills). Memory is
//! given back by whole chunks, once every page of one is spilled, so a
//! page that comes back costs its chunk again only when it is the first.

/// Pages per chunk: a chunk is freed when all of them are spilled. Small
/// enough that the old, NVMe-cold part of a long lane frees most of its
/// chunks; large enough that a chunk is one allocation of tens of KiB.
pub const SKETCH_CHUNK_PAGES: usize = 64;

/// Sketch rows of `entry_bytes` per page, in chunks of
/// [`SKETCH_CHUNK_PAGES`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SketchColumn {
    entry_bytes: usize,
    /// `None`: every page of the chunk is spilled.
    chunks: Vec<Option<Vec<u8>>>,
    spilled: Vec<bool>,
    /// Pages spilled, of `spilled.len()`.
    spilled_pages: usize,
}

impl SketchColumn {
    /// An empty column of `entry_bytes` per page.
    pub fn new(entry_bytes: usize) -> Self {
        Self {
            entry_bytes,
            chunks: Vec::new(),
            spilled: Vec::new(),
            spilled_pages: 0,
        }
    }

    /// Pages held, resident or spilled.
    pub fn len(&self) -> usize {
        self.spilled.len()
    }

    /// Whether no page is held.
    pub fn is_empty(&self) -> bool {
        self.spilled.is_empty()
    }

    /// Pages spilled.
    pub fn spilled_pages(&self) -> usize {
        self.spilled_pages
    }

    /// Bytes held in memory (whole chunks, spilled pages in them included).
    pub fn resident_bytes(&self) -> usize {
        self.chunks.iter().flatten().map(Vec::capacity).sum()
    }

    /// Page `page`'s rows, or `None` when spilled. Panics past the end.
    pub fn get(&self, page: usize) -> Option<&[u8]> {
        if self.spilled[page] {
            return None;
        }
        let chunk = self.chunks[page / SKETCH_CHUNK_PAGES]
            .as_ref()
            .expect("a resident page's chunk is kept");
        let at = page % SKETCH_CHUNK_PAGES * self.entry_bytes;
        Some(&chunk[at..at + self.entry_bytes])
    }

    /// Page `page`'s rows to write; the page must be resident.
    pub fn get_mut(&mut self, page: usize) -> &mut [u8] {
        assert!(!self.spilled[page], "writing the sketch of a spilled page");
        let at = page % SKETCH_CHUNK_PAGES * self.entry_bytes;
        let chunk = self.chunks[page / SKETCH_CHUNK_PAGES]
            .as_mut()
            .expect("a resident page's chunk is kept");
        &mut chunk[at..at + self.entry_bytes]
    }

    /// Appends a resident page of zeroed rows and returns them.
    pub fn push_zeroed(&mut self) -> &mut [u8] {
        let page = self.push(false);
        self.chunk_of(page);
        self.get_mut(page)
    }

    /// Appends a spilled page.
    pub fn push_spilled(&mut self) {
        let page = self.push(true);
        if self.chunks.len() <= page / SKETCH_CHUNK_PAGES {
            self.chunks.push(None);
        }
    }

    fn push(&mut self, spilled: bool) -> usize {
        self.spilled.push(spilled);
        self.spilled_pages += usize::from(spilled);
        self.spilled.len() - 1
    }

    /// The chunk holding `page`, made (zeroed) or grown to hold it.
    fn chunk_of(&mut self, page: usize) -> &mut Vec<u8> {
        let c = page / SKETCH_CHUNK_PAGES;
        if self.chunks.len() <= c {
            self.chunks.push(None);
        }
        let held = (self.spilled.len() - c * SKETCH_CHUNK_PAGES).min(SKETCH_CHUNK_PAGES) * self.entry_bytes;
        let entry_bytes = self.entry_bytes;
        let chunk = self.chunks[c].get_or_insert_with(|| {
            // The first chunk grows as needed (most lanes stay short);
            // later ones are made whole.
            Vec::with_capacity(if c == 0 { 0 } else { SKETCH_CHUNK_PAGES * entry_bytes })
        });
        if chunk.len() < held {
            chunk.resize(held, 0);
        }
        chunk
    }

    /// Marks page `page` spilled, freeing its chunk when it is the last
    /// resident page of it. Returns whether the page was resident.
    pub fn spill(&mut self, page: usize) -> bool {
        if std::mem::replace(&mut self.spilled[page], true) {
            return false;
        }
        self.spilled_pages += 1;
        let c = page / SKETCH_CHUNK_PAGES;
        let end = ((c + 1) * SKETCH_CHUNK_PAGES).min(self.spilled.len());
        if self.spilled[c * SKETCH_CHUNK_PAGES..end].iter().all(|&s| s) {
            self.chunks[c] = None;
        }
        true
    }

    /// Makes page `page` resident again with `rows` (at most a page's
    /// rows; the rest zeroed). Returns whether it was spilled.
    pub fn restore(&mut self, page: usize, rows: &[u8]) -> bool {
        if !std::mem::replace(&mut self.spilled[page], false) {
            return false;
        }
        self.spilled_pages -= 1;
        let entry_bytes = self.entry_bytes;
        let at = page % SKETCH_CHUNK_PAGES * entry_bytes;
        let slot = &mut self.chunk_of(page)[at..at + entry_bytes];
        slot[..rows.len()].copy_from_slice(rows);
        slot[rows.len()..].fill(0);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Push(u8),
        PushSpilled,
        Spill(usize),
        Restore(usize, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => any::<u8>().prop_map(Op::Push),
            1 => Just(Op::PushSpilled),
            3 => any::<usize>().prop_map(Op::Spill),
            2 => (any::<usize>(), any::<u8>()).prop_map(|(p, v)| Op::Restore(p, v)),
        ]
    }

    proptest! {
        /// Against a plain vector of optional rows: every page reads back
        /// what it was given, and a chunk's memory is held exactly while
        /// one of its pages is resident.
        #[test]
        fn behaves_like_a_vector_of_optional_rows(ops in proptest::collection::vec(op(), 1..600)) {
            const E: usize = 3;
            let mut column = SketchColumn::new(E);
            let mut model: Vec<Option<[u8; E]>> = Vec::new();
            for op in ops {
                match op {
                    Op::Push(v) => {
                        column.push_zeroed()[0] = v;
                        model.push(Some([v, 0, 0]));
                    }
                    Op::PushSpilled => {
                        column.push_spilled();
                        model.push(None);
                    }
                    Op::Spill(p) if !model.is_empty() => {
                        let p = p % model.len();
                        prop_assert_eq!(column.spill(p), model[p].is_some());
                        model[p] = None;
                    }
                    Op::Restore(p, v) if !model.is_empty() => {
                        let p = p % model.len();
                        prop_assert_eq!(column.restore(p, &[v, v]), model[p].is_none());
                        model[p].get_or_insert([v, v, 0]);
                    }
                    _ => {}
                }
            }
            for (p, want) in model.iter().enumerate() {
                prop_assert_eq!(column.get(p), want.as_ref().map(|r| &r[..]));
            }
            prop_assert_eq!(column.spilled_pages(), model.iter().filter(|r| r.is_none()).count());
            for (c, chunk) in model.chunks(SKETCH_CHUNK_PAGES).enumerate() {
                prop_assert_eq!(column.chunks[c].is_some(), chunk.iter().any(Option::is_some), "chunk {}", c);
            }
        }
    }
}
