//! A lane is the append-only run of pages of one (stored layer, KV head) of
//! one sequence, with the index (digest, key sketches) of every page.

use crate::chunked::ChunkedVec;
use crate::{DType, DigestColumn, PageIndex, Reason};

/// What a logical page maps to. `P` is the owner's reference to a physical
/// page (its placement tells hot from cold), `S` its summary storage.
#[derive(Debug)]
pub enum LogicalPage<P, S> {
    /// The original K/V, in the physical page `P` (hot or cold).
    Physical(P),
    /// Replaced by a summary kept in `S`.
    Summary(S),
    /// Deleted, for this reason; the positions still count.
    Gone(Reason),
}

/// One lane: its pages in position order, its token count and the index of
/// every page. Only the last page may be partial.
#[derive(Debug)]
pub struct Lane<P, S> {
    page_size: u32,
    tokens: u64,
    pages: ChunkedVec<LogicalPage<P, S>>,
    index: PageIndex,
}

/// Where `n` appended tokens go: `fill` rows into the partial last page, then
/// new pages holding `new_pages[i]` rows each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendPlan {
    /// Rows that go into the partial last page (0 if there is none).
    pub fill: u32,
    /// Rows of each new page, in order; all are `page_size` but the last.
    pub new_pages: Vec<u32>,
}

impl<P, S> Lane<P, S> {
    /// An empty lane for keys of `dtype` and `head_dim` elements, in pages of
    /// `page_size` tokens.
    pub fn new(dtype: DType, head_dim: usize, page_size: u32) -> Self {
        Self {
            page_size,
            tokens: 0,
            pages: ChunkedVec::default(),
            index: PageIndex::new(dtype, head_dim, page_size),
        }
    }

    /// Positions held, `0..tokens`, whatever the state of their pages.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Pages held, whatever their state (summarised and gone ones included).
    pub fn num_pages(&self) -> usize {
        self.pages.len()
    }

    /// Every page in position order.
    pub fn pages(&self) -> impl Iterator<Item = &LogicalPage<P, S>> {
        self.pages.iter()
    }

    /// Page `page`'s mapping, or `None` past the last page.
    pub fn page(&self, page: usize) -> Option<&LogicalPage<P, S>> {
        self.pages.get(page)
    }

    /// The digest of every page, in page order.
    pub fn digests(&self) -> &DigestColumn {
        self.index.digests()
    }

    /// The resident index (digests and key sketches) of every page.
    pub fn index(&self) -> &PageIndex {
        &self.index
    }

    /// Valid rows of page `page` (the last page may be partial).
    pub fn rows_in(&self, page: usize) -> u32 {
        let p = u64::from(self.page_size);
        self.tokens.saturating_sub(page as u64 * p).min(p) as u32
    }

    /// Rows still free in the last page (0 when it is full or there is none).
    pub fn room_in_last(&self) -> u32 {
        match self.tokens % u64::from(self.page_size) {
            0 => 0,
            used => self.page_size - used as u32,
        }
    }

    /// Where `n` more tokens would go; changes nothing.
    pub fn plan_append(&self, n: u32) -> AppendPlan {
        let fill = n.min(self.room_in_last());
        let mut rest = n - fill;
        let mut new_pages = Vec::new();
        while rest > 0 {
            let rows = rest.min(self.page_size);
            new_pages.push(rows);
            rest -= rows;
        }
        AppendPlan { fill, new_pages }
    }

    /// Opens a new page holding `keys.len() / row` rows. The last page must
    /// be full.
    pub fn push_page(&mut self, page: LogicalPage<P, S>, keys: &[u8]) {
        let rows = keys.len() / self.key_row_bytes();
        self.check_push(rows);
        self.index.open_page(keys);
        self.pages.push(page);
        self.tokens += rows as u64;
    }

    /// Opens a new page of `rows` rows whose index entry
    /// ([`PageIndex::entry`]) is already known (a shared page, a page
    /// recovered from a manifest).
    pub fn push_known(&mut self, page: LogicalPage<P, S>, entry: &[u8], rows: u32) {
        self.check_push(rows as usize);
        self.index.push_entry(entry, rows);
        self.pages.push(page);
        self.tokens += u64::from(rows);
    }

    /// Leaves page `page`'s sketches to be derived from its key rows
    /// again (the store does so for pages whose bytes are on NVMe only);
    /// returns whether they were resident.
    pub fn spill_sketch(&mut self, page: usize) -> bool {
        self.index.spill_sketch(page)
    }

    /// Makes page `page`'s sketches resident again from its key rows
    /// `keys` (`[rows_in(page)][head_dim]`); returns whether they were
    /// spilled.
    pub fn restore_sketch(&mut self, page: usize, keys: &[u8]) -> bool {
        assert_eq!(
            keys.len(),
            self.rows_in(page) as usize * self.key_row_bytes(),
            "a page's key rows"
        );
        self.index.restore_sketch(page, keys)
    }

    /// Takes back page `page`'s spilled sketch rows (`[rows_in(page)]`)
    /// as a ranking derived them, where that costs only their own memory
    /// ([`SketchColumn::readmit`](crate::sketch_column::SketchColumn::readmit));
    /// returns whether they were taken.
    pub fn readmit_sketch(&mut self, page: usize, rows: &[u8]) -> bool {
        assert_eq!(
            rows.len(),
            self.rows_in(page) as usize * self.index.sketch_row_bytes(),
            "a page's sketch rows"
        );
        self.index.readmit_sketch(page, rows)
    }

    /// Page `page`'s index entry, for its rows.
    pub fn index_entry(&self, page: usize) -> Vec<u8> {
        self.index.entry(page, self.rows_in(page))
    }

    fn key_row_bytes(&self) -> usize {
        self.index.digests().entry_bytes() / 2
    }

    fn check_push(&self, rows: usize) {
        assert!(self.room_in_last() == 0, "a new page needs a full last page");
        assert!(
            rows >= 1 && rows <= self.page_size as usize,
            "a page holds 1..=page_size rows"
        );
    }

    /// Adds key rows to the partial last page, whose storage the caller has
    /// already written.
    pub fn extend_last(&mut self, keys: &[u8]) {
        let rows = keys.len() / self.key_row_bytes();
        assert!(rows as u32 <= self.room_in_last(), "rows beyond the last page");
        let last = self.pages.len() - 1;
        self.index.extend_page(last, self.rows_in(last), keys);
        self.tokens += rows as u64;
    }

    /// Replaces page `page`'s mapping, returning the old one. Digest and
    /// length stay: a summarised or gone page still counts its positions.
    pub fn replace(&mut self, page: usize, new: LogicalPage<P, S>) -> LogicalPage<P, S> {
        std::mem::replace(self.pages.get_mut(page).expect("page index in range"), new)
    }

    /// Takes every page out (when the sequence is dropped).
    pub fn take_pages(&mut self) -> impl Iterator<Item = LogicalPage<P, S>> + use<P, S> {
        self.pages.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestLane = Lane<u32, ()>;

    fn rows(n: usize) -> Vec<u8> {
        (0..n * 2 * 4).map(|i| (i % 7) as u8).collect()
    }

    #[test]
    fn appends_fill_the_partial_page_first() {
        let mut lane = TestLane::new(DType::F32, 2, 4);
        assert_eq!(
            lane.plan_append(9),
            AppendPlan {
                fill: 0,
                new_pages: vec![4, 4, 1]
            }
        );
        lane.push_page(LogicalPage::Physical(0), &rows(3));
        assert_eq!((lane.tokens(), lane.room_in_last()), (3, 1));
        assert_eq!(
            lane.plan_append(6),
            AppendPlan {
                fill: 1,
                new_pages: vec![4, 1]
            }
        );
        lane.extend_last(&rows(1));
        assert_eq!((lane.tokens(), lane.room_in_last()), (4, 0));
        lane.push_page(LogicalPage::Physical(1), &rows(2));
        assert_eq!((lane.rows_in(0), lane.rows_in(1), lane.rows_in(2)), (4, 2, 0));
        assert_eq!(lane.digests().pages(), 2);
    }

    #[test]
    #[should_panic(expected = "a new page needs a full last page")]
    fn a_new_page_after_a_partial_one_is_a_bug() {
        let mut lane = TestLane::new(DType::F32, 2, 4);
        lane.push_page(LogicalPage::Physical(0), &rows(3));
        lane.push_page(LogicalPage::Physical(1), &rows(1));
    }
}
