//! A lane's sketch rows, page by page, each page's either resident or
//! *spilled*: left to be derived again from the page's key rows wherever
//! its bytes are (on NVMe, for the pages the store spills). Memory is held
//! by chunks of pages; a chunk most of whose pages are spilled gives its
//! memory back and keeps its few resident pages *loose*, each its own
//! allocation — so a page that must keep its sketch (evicted: no bytes to
//! derive it from) costs its own rows, not a whole chunk.

use std::collections::BTreeMap;

/// Pages per chunk. Small enough that the old, NVMe-cold part of a long
/// lane frees most of its chunks; large enough that a chunk is one
/// allocation of tens of KiB.
pub const SKETCH_CHUNK_PAGES: usize = 64;

/// A held chunk whose resident pages fall to this many gives its memory
/// back, keeping them loose.
pub const SKETCH_LOOSE_KEPT: usize = SKETCH_CHUNK_PAGES / 16;

/// A chunk not held keeps at most this many resident pages loose (a
/// quarter of it: the sketches rankings read back, which the next steps'
/// rankings mostly want again); one more and it is held again.
pub const SKETCH_LOOSE_MAX: usize = SKETCH_CHUNK_PAGES / 4;

/// Sketch rows of `entry_bytes` per page, in chunks of
/// [`SKETCH_CHUNK_PAGES`].
#[derive(Debug, Clone)]
pub struct SketchColumn {
    entry_bytes: usize,
    /// `None`: the chunk's memory is given back; its resident pages (at
    /// most `SKETCH_LOOSE_MAX`) are in `loose`.
    chunks: Vec<Option<Vec<u8>>>,
    /// The resident pages of chunks not held, by page.
    loose: BTreeMap<usize, Box<[u8]>>,
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
            loose: BTreeMap::new(),
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

    /// Bytes held in memory: whole chunks (spilled pages in them
    /// included) and loose pages.
    pub fn resident_bytes(&self) -> usize {
        // A loose page also costs its map entry (key and pointer).
        let loose = self.entry_bytes + std::mem::size_of::<(usize, Box<[u8]>)>();
        self.chunks.iter().flatten().map(Vec::capacity).sum::<usize>() + self.loose.len() * loose
    }

    /// Page `page`'s rows, or `None` when spilled. Panics past the end.
    pub fn get(&self, page: usize) -> Option<&[u8]> {
        if self.spilled[page] {
            return None;
        }
        Some(match &self.chunks[page / SKETCH_CHUNK_PAGES] {
            Some(chunk) => {
                let at = page % SKETCH_CHUNK_PAGES * self.entry_bytes;
                &chunk[at..at + self.entry_bytes]
            }
            None => &self.loose[&page],
        })
    }

    /// Page `page`'s rows to write; the page must be resident.
    pub fn get_mut(&mut self, page: usize) -> &mut [u8] {
        assert!(!self.spilled[page], "writing the sketch of a spilled page");
        let entry_bytes = self.entry_bytes;
        match &mut self.chunks[page / SKETCH_CHUNK_PAGES] {
            Some(chunk) => {
                let at = page % SKETCH_CHUNK_PAGES * entry_bytes;
                &mut chunk[at..at + entry_bytes]
            }
            None => self
                .loose
                .get_mut(&page)
                .expect("a resident page of a chunk not held is loose"),
        }
    }

    /// Appends a resident page of zeroed rows and returns them.
    pub fn push_zeroed(&mut self) -> &mut [u8] {
        let page = self.push(false);
        self.hold(page / SKETCH_CHUNK_PAGES);
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

    /// The pages of chunk `c`.
    fn pages_of(&self, c: usize) -> std::ops::Range<usize> {
        c * SKETCH_CHUNK_PAGES..((c + 1) * SKETCH_CHUNK_PAGES).min(self.spilled.len())
    }

    /// Resident pages of chunk `c`.
    fn resident_in(&self, c: usize) -> usize {
        self.spilled[self.pages_of(c)].iter().filter(|&&s| !s).count()
    }

    /// Holds chunk `c` (made zeroed, or grown to its pages), its loose
    /// pages moved in.
    fn hold(&mut self, c: usize) {
        if self.chunks.len() <= c {
            self.chunks.push(None);
        }
        let pages = self.pages_of(c);
        let entry_bytes = self.entry_bytes;
        let chunk = self.chunks[c].get_or_insert_with(|| {
            // The first chunk grows as needed (most lanes stay short);
            // later ones are made whole.
            Vec::with_capacity(if c == 0 { 0 } else { SKETCH_CHUNK_PAGES * entry_bytes })
        });
        if chunk.len() < pages.len() * entry_bytes {
            chunk.resize(pages.len() * entry_bytes, 0);
        }
        let loose: Vec<usize> = self.loose.range(pages).map(|(&p, _)| p).collect();
        for p in loose {
            let rows = self.loose.remove(&p).expect("listed just now");
            let at = p % SKETCH_CHUNK_PAGES * entry_bytes;
            chunk[at..at + entry_bytes].copy_from_slice(&rows);
        }
    }

    /// Gives chunk `c`'s memory back, its resident pages kept loose.
    fn release(&mut self, c: usize) {
        let Some(chunk) = self.chunks[c].take() else { return };
        for p in self.pages_of(c).filter(|&p| !self.spilled[p]) {
            let at = p % SKETCH_CHUNK_PAGES * self.entry_bytes;
            self.loose.insert(p, chunk[at..at + self.entry_bytes].into());
        }
    }

    /// Marks page `page` spilled; its chunk gives its memory back once at
    /// most [`SKETCH_LOOSE_KEPT`] of its pages stay resident. Returns
    /// whether the page was resident.
    pub fn spill(&mut self, page: usize) -> bool {
        if std::mem::replace(&mut self.spilled[page], true) {
            return false;
        }
        self.spilled_pages += 1;
        let c = page / SKETCH_CHUNK_PAGES;
        if self.chunks[c].is_none() {
            self.loose.remove(&page);
        } else if self.resident_in(c) <= SKETCH_LOOSE_KEPT {
            self.release(c);
        }
        true
    }

    /// Like [`Self::restore`], but only where it costs the page's own rows:
    /// into a held chunk, or loose while its chunk keeps fewer than
    /// [`SKETCH_LOOSE_MAX`]; never makes a chunk held. Returns whether the
    /// page was spilled and is resident now.
    pub fn readmit(&mut self, page: usize, rows: &[u8]) -> bool {
        let c = page / SKETCH_CHUNK_PAGES;
        if !self.spilled[page] || (self.chunks[c].is_none() && self.resident_in(c) >= SKETCH_LOOSE_MAX) {
            return false;
        }
        self.restore(page, rows)
    }

    /// Makes page `page` resident again with `rows` (at most a page's
    /// rows; the rest zeroed): loose while its chunk is not held and has
    /// few resident pages. Returns whether it was spilled.
    pub fn restore(&mut self, page: usize, rows: &[u8]) -> bool {
        if !std::mem::replace(&mut self.spilled[page], false) {
            return false;
        }
        self.spilled_pages -= 1;
        let c = page / SKETCH_CHUNK_PAGES;
        if self.chunks[c].is_none() {
            self.loose.insert(page, vec![0; self.entry_bytes].into());
            if self.resident_in(c) > SKETCH_LOOSE_MAX {
                self.hold(c);
            }
        } else {
            // Grown to pages spilled when pushed.
            self.hold(c);
        }
        let slot = self.get_mut(page);
        slot[..rows.len()].copy_from_slice(rows);
        slot[rows.len()..].fill(0);
        true
    }
}

/// Equal when every page is alike, resident with the same rows or
/// spilled, however its memory is held (in a chunk, or loose).
impl PartialEq for SketchColumn {
    fn eq(&self, other: &Self) -> bool {
        self.entry_bytes == other.entry_bytes
            && self.spilled == other.spilled
            && (0..self.len()).all(|p| self.get(p) == other.get(p))
    }
}

impl Eq for SketchColumn {}

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
        Readmit(usize, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => any::<u8>().prop_map(Op::Push),
            1 => Just(Op::PushSpilled),
            3 => any::<usize>().prop_map(Op::Spill),
            2 => (any::<usize>(), any::<u8>()).prop_map(|(p, v)| Op::Restore(p, v)),
            2 => (any::<usize>(), any::<u8>()).prop_map(|(p, v)| Op::Readmit(p, v)),
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
                    Op::Readmit(p, v) if !model.is_empty() => {
                        let p = p % model.len();
                        let held = column.chunks[p / SKETCH_CHUNK_PAGES].is_some();
                        let taken = column.readmit(p, &[v, v]);
                        prop_assert!(!taken || model[p].is_none());
                        prop_assert_eq!(column.chunks[p / SKETCH_CHUNK_PAGES].is_some(), held, "never holds a chunk");
                        if taken {
                            model[p] = Some([v, v, 0]);
                        }
                    }
                    _ => {}
                }
            }
            for (p, want) in model.iter().enumerate() {
                prop_assert_eq!(column.get(p), want.as_ref().map(|r| &r[..]));
            }
            prop_assert_eq!(column.spilled_pages(), model.iter().filter(|r| r.is_none()).count());
            // Memory: a chunk not held keeps only a few pages, loose; a
            // loose page belongs to a chunk not held.
            for (c, chunk) in model.chunks(SKETCH_CHUNK_PAGES).enumerate() {
                let resident = chunk.iter().filter(|r| r.is_some()).count();
                if column.chunks[c].is_none() {
                    prop_assert!(resident <= SKETCH_LOOSE_MAX, "chunk {} keeps {} loose", c, resident);
                    prop_assert_eq!(column.loose.range(column.pages_of(c)).count(), resident);
                } else {
                    prop_assert_eq!(column.loose.range(column.pages_of(c)).count(), 0);
                }
            }
        }
    }
}
