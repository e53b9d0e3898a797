//! FetchPages: pages by (layer, KV-head range, page list) with their state,
//! in chunks of bounded size.

use kvtier_core::{LogicalPage, PageState, SequenceKey, wire};

use super::Store;
use crate::catalog::{HeadRange, Sequence};
use crate::page::StoreLane;
use crate::reader::PageContent;
use crate::stats::Counters;
use crate::{StoreError, StoreResult};

#[derive(Debug, Clone, Copy)]
pub struct FetchPages<'a> {
    pub layer: u32,
    pub heads: HeadRange,
    pub pages: PageList<'a>,
    /// Also return each page's digest.
    pub with_digests: bool,
}

/// Which pages of each head a fetch reads.
#[derive(Debug, Clone, Copy)]
pub enum PageList<'a> {
    /// Every page of every head.
    All,
    /// These pages of every head.
    Same(&'a [u32]),
    /// One list per head of the range, in order (what a selection chose).
    PerHead(&'a [Vec<u32>]),
}

impl<'a> PageList<'a> {
    /// The list for the `i`-th head of the range; `None` means all pages.
    fn of(&self, i: usize) -> Option<&'a [u32]> {
        match *self {
            PageList::All => None,
            PageList::Same(pages) => Some(pages),
            PageList::PerHead(lists) => Some(&lists[i]),
        }
    }

    /// The protobuf field path of entry `j` of head `i`'s list.
    fn field(&self, i: usize, j: usize) -> String {
        match self {
            PageList::PerHead(_) => wire::per_head_page(i, j),
            _ => wire::PAGES.at(j),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct FetchedPage {
    pub kv_head: u32,
    pub page: u32,
    pub state: PageState,
    /// Valid token rows of the page (the last page may be partial).
    pub rows: u32,
    pub content: PageContent,
    /// The page's key digest (min row, then max row), when asked for.
    pub digest: Option<Vec<u8>>,
}

/// Where a chunked fetch resumes: the `head`-th head of the range, the
/// `index`-th page of its list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FetchCursor {
    pub head: usize,
    pub index: usize,
}

impl Store {
    /// Reads pages bit-exact as written. Summaries come back as summaries and
    /// gone pages as a per-page status; neither fails the call.
    pub fn fetch_pages(&self, key: &SequenceKey, req: FetchPages<'_>) -> StoreResult<Vec<FetchedPage>> {
        self.fetch_chunk(key, req, FetchCursor::default(), usize::MAX)
            .map(|(pages, _)| pages)
    }

    /// Like [`Self::fetch_pages`], but stops before the page bytes would
    /// exceed `max_bytes` (returning at least one page) and says where to
    /// resume, so large reads stream in bounded memory.
    pub fn fetch_chunk(
        &self,
        key: &SequenceKey,
        req: FetchPages<'_>,
        from: FetchCursor,
        max_bytes: usize,
    ) -> StoreResult<(Vec<FetchedPage>, Option<FetchCursor>)> {
        self.catalog.read(key, |seq| {
            let lanes = check_fetch(seq, &req)?;
            let (chosen, cursor) = chunk(seq, &req, &lanes, from, max_bytes);
            let mut hot = Vec::new();
            let items: Vec<(&StoreLane, usize)> = chosen.iter().map(|&(_, l, p)| (&seq.lanes[l], p)).collect();
            let read_back = self.reader().contents(&seq.layout, &items, &mut hot)?;
            let out: Vec<FetchedPage> = chosen
                .iter()
                .zip(read_back)
                .map(|(&(h, l, p), (state, content))| FetchedPage {
                    kv_head: h,
                    page: p as u32,
                    state,
                    rows: seq.lanes[l].rows_in(p),
                    content,
                    digest: req.with_digests.then(|| seq.lanes[l].digests().entry(p).to_vec()),
                })
                .collect();
            self.device.touch(hot);
            let bytes: usize = out
                .iter()
                .map(|p| match &p.content {
                    PageContent::Original(kv) | PageContent::Summary { kv, .. } => kv.len(),
                    PageContent::Gone(_) => 0,
                })
                .sum();
            Counters::add(&self.counters.bytes_read, bytes as u64);
            let more = cursor.head < lanes.len();
            Ok((out, more.then_some(cursor)))
        })
    }
}

/// The (KV head, lane) pairs a fetch reads, after checking its page lists.
fn check_fetch(seq: &Sequence, req: &FetchPages<'_>) -> StoreResult<Vec<(u32, usize)>> {
    seq.check_layer(req.layer)?;
    let heads = seq.check_heads(req.heads)?;
    let lanes: Vec<(u32, usize)> = seq.lanes_of(req.layer, heads).collect();
    if let PageList::PerHead(lists) = req.pages
        && lists.len() != lanes.len()
    {
        return Err(StoreError::invalid(
            wire::PER_HEAD_PAGES,
            format!(
                "has {} lists for {} KV heads; give one per head",
                lists.len(),
                lanes.len()
            ),
        ));
    }
    for (i, &(h, lane)) in lanes.iter().enumerate() {
        let held = seq.lanes[lane].num_pages();
        if let Some((j, p)) = req
            .pages
            .of(i)
            .and_then(|l| l.iter().enumerate().find(|(_, p)| **p as usize >= held))
        {
            return Err(StoreError::invalid(
                req.pages.field(i, j),
                format!("is {p}, but layer {} KV head {h} holds {held} pages", req.layer),
            ));
        }
    }
    Ok(lanes)
}

/// What a fetched page costs beyond its bytes: its `FetchedPage` and its
/// message's fields, about.
const PAGE_OVERHEAD: usize = 64;

/// The (KV head, lane, page) a chunk reads from `from` on, stopping before
/// what they cost would pass `max_bytes` (at least one page), and where the
/// next chunk starts.
fn chunk(
    seq: &Sequence,
    req: &FetchPages<'_>,
    lanes: &[(u32, usize)],
    from: FetchCursor,
    max_bytes: usize,
) -> (Vec<(u32, usize, usize)>, FetchCursor) {
    let mut chosen = Vec::new();
    let mut bytes = 0usize;
    let mut cursor = from;
    while let Some(&(h, lane_index)) = lanes.get(cursor.head) {
        let lane = &seq.lanes[lane_index];
        let list = req.pages.of(cursor.head);
        let count = list.map_or(lane.num_pages(), <[u32]>::len);
        while cursor.index < count {
            let p = list.map_or(cursor.index as u32, |pages| pages[cursor.index]) as usize;
            // Every page costs something in memory and on the wire, gone
            // ones too (a list naming one gone page millions of times must
            // still come in chunks); digests and summaries' counts count.
            let digest = if req.with_digests {
                2 * seq.layout.row_bytes()
            } else {
                0
            };
            let size = PAGE_OVERHEAD
                + digest
                + match lane.page(p) {
                    Some(LogicalPage::Physical(_)) => 2 * lane.rows_in(p) as usize * seq.layout.row_bytes(),
                    Some(LogicalPage::Summary(s)) => s.slot.len() as usize + 4 * s.counts.len(),
                    Some(LogicalPage::Gone(_)) | None => 0,
                };
            if !chosen.is_empty() && bytes + size > max_bytes {
                return (chosen, cursor);
            }
            bytes += size;
            chosen.push((h, lane_index, p));
            cursor.index += 1;
        }
        cursor = FetchCursor {
            head: cursor.head + 1,
            index: 0,
        };
    }
    (chosen, cursor)
}
