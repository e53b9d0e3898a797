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
    /// Page indices, each read for every head in `heads`; `None` reads every
    /// page of every head.
    pub pages: Option<&'a [u32]>,
    /// Also return each page's digest.
    pub with_digests: bool,
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
            if let Some(pages) = req.pages {
                for (i, &p) in pages.iter().enumerate() {
                    if let Some((h, lane)) = lanes
                        .iter()
                        .find(|(_, lane)| p as usize >= seq.lanes[*lane].num_pages())
                    {
                        return Err(StoreError::invalid(
                            format!("pages[{i}]"),
                            format!(
                                "is {p}, but layer {} KV head {h} holds {} pages",
                                req.layer,
                                seq.lanes[*lane].num_pages()
                            ),
                        ));
                    }
                }
            }
            let mut chosen: Vec<(u32, usize, usize)> = Vec::new(); // (kv head, lane, page)
            let mut bytes = 0usize;
            let mut cursor = from;
            'heads: while let Some(&(h, lane_index)) = lanes.get(cursor.head) {
                let lane = &seq.lanes[lane_index];
                let count = req.pages.map_or(lane.num_pages(), <[u32]>::len);
                while cursor.index < count {
                    let p = req.pages.map_or(cursor.index as u32, |pages| pages[cursor.index]) as usize;
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
