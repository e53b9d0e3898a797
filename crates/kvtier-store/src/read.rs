//! Reads: pages by (layer, KV-head range, page list) with their state.

use std::sync::Arc;

use kvtier_core::{Layout, LogicalPage, PageState, Reason, SequenceKey};

use crate::page::{PhysPage, StoreLane};
use crate::sequence::HeadRange;
use crate::stats::Counters;
use crate::sync::read;
use crate::{Store, StoreError, StoreResult};

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
            PageList::PerHead(_) => format!("per_head_pages[{i}].pages[{j}]"),
            _ => format!("pages[{j}]"),
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

#[derive(Debug, Clone, PartialEq)]
pub enum PageContent {
    /// The original bytes: K rows `[rows][head_dim]` then V rows.
    Original(Vec<u8>),
    /// `counts.len()` summary rows, K then V, each standing for `counts[i]`
    /// tokens.
    Summary { counts: Vec<u32>, kv: Vec<u8> },
    /// No bytes; why they are gone.
    Gone(Reason),
}

/// Where a chunked fetch resumes: the `head`-th head of the range, the
/// `index`-th page of its list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FetchCursor {
    pub head: usize,
    pub index: usize,
}

impl Store {
    /// Reads logical pages: each one's state and bytes (the original, the
    /// summary, or why it is gone). Originals on NVMe are read in one batch.
    /// Hot pages are collected in `hot` so the caller can mark them used.
    pub(crate) fn read_pages(
        &self,
        layout: &Layout,
        pages: &[(&StoreLane, usize)],
        hot: &mut Vec<Arc<PhysPage>>,
    ) -> StoreResult<Vec<(PageState, PageContent)>> {
        let mut out = Vec::with_capacity(pages.len());
        let mut originals = Vec::new();
        for (i, &(lane, p)) in pages.iter().enumerate() {
            out.push(match lane.page(p).expect("page index checked by the caller") {
                LogicalPage::Physical(r) => {
                    let state = read(&r.page.place).state();
                    if state == PageState::Hot {
                        hot.push(Arc::clone(&r.page));
                    }
                    originals.push((i, (Arc::clone(&r.page), lane.rows_in(p))));
                    (state, PageContent::Gone(Reason::Integrity))
                }
                LogicalPage::Summary(s) => {
                    let mut kv = vec![0u8; s.slot.len() as usize];
                    self.host.read(&s.slot, 0, &mut kv)?;
                    (
                        PageState::Summary,
                        PageContent::Summary {
                            counts: s.counts.clone(),
                            kv,
                        },
                    )
                }
                LogicalPage::Gone(reason) => (PageState::Gone, PageContent::Gone(*reason)),
            });
        }
        let (index, requests): (Vec<usize>, Vec<_>) = originals.into_iter().unzip();
        let bytes = self.read_originals(layout, &requests)?;
        for ((i, bytes), (page, _)) in index.into_iter().zip(bytes).zip(&requests) {
            out[i] = match bytes {
                Some(b) => (out[i].0, PageContent::Original(b)),
                None => {
                    let reason = read(&page.place).lost.unwrap_or(Reason::Integrity);
                    (PageState::Gone, PageContent::Gone(reason))
                }
            };
        }
        Ok(out)
    }

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
        self.with_sequence(key, |seq| {
            seq.check_layer("layer", req.layer)?;
            let heads = seq.check_heads(req.heads)?;
            let layout = &seq.layout;
            let lanes: Vec<(u32, usize)> = seq.lanes_of(req.layer, heads).collect();
            if let PageList::PerHead(lists) = req.pages
                && lists.len() != lanes.len()
            {
                return Err(StoreError::invalid(
                    "per_head_pages",
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
            let mut chosen: Vec<(u32, usize, usize)> = Vec::new(); // (kv head, lane, page)
            let mut bytes = 0usize;
            let mut cursor = from;
            'heads: while let Some(&(h, lane_index)) = lanes.get(cursor.head) {
                let lane = &seq.lanes[lane_index];
                let list = req.pages.of(cursor.head);
                let count = list.map_or(lane.num_pages(), <[u32]>::len);
                while cursor.index < count {
                    let p = list.map_or(cursor.index as u32, |pages| pages[cursor.index]) as usize;
                    let size = match lane.page(p).expect("checked above") {
                        LogicalPage::Physical(_) => 2 * lane.rows_in(p) as usize * layout.row_bytes(),
                        LogicalPage::Summary(s) => s.slot.len() as usize,
                        LogicalPage::Gone(_) => 0,
                    };
                    if !chosen.is_empty() && bytes + size > max_bytes {
                        break 'heads;
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
            let mut hot = Vec::new();
            let items: Vec<(&StoreLane, usize)> = chosen.iter().map(|&(_, l, p)| (&seq.lanes[l], p)).collect();
            let read_back = self.read_pages(layout, &items, &mut hot)?;
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
            self.touch_device(hot);
            Counters::add(&self.counters.bytes_read, bytes as u64);
            let more = cursor.head < lanes.len();
            Ok((out, more.then_some(cursor)))
        })
    }
}
