//! Reads: pages by (layer, KV-head range, page list) with their state.

use std::sync::Arc;

use kvtier_core::{LogicalPage, PageState, Reason, SequenceKey};

use crate::page::read_rows;
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
}

#[derive(Debug, Clone, PartialEq)]
pub struct FetchedPage {
    pub kv_head: u32,
    pub page: u32,
    pub state: PageState,
    /// Valid token rows of the page (the last page may be partial).
    pub rows: u32,
    pub content: PageContent,
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

impl Store {
    /// Reads pages bit-exact as written. Summaries come back as summaries and
    /// gone pages as a per-page status; neither fails the call.
    pub fn fetch_pages(&self, key: &SequenceKey, req: FetchPages<'_>) -> StoreResult<Vec<FetchedPage>> {
        self.with_sequence(key, |seq| {
            seq.check_layer("layer", req.layer)?;
            let heads = seq.check_heads(req.heads)?;
            let layout = &seq.layout;
            let lanes: Vec<(u32, usize)> = seq.lanes_of(req.layer, heads).collect();
            if let Some(pages) = req.pages {
                for (i, &p) in pages.iter().enumerate() {
                    if let Some((h, lane)) = lanes.iter().find(|(_, lane)| p as usize >= seq.lanes[*lane].num_pages()) {
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
            let mut out = Vec::new();
            let mut hot = Vec::new();
            let mut bytes = 0u64;
            for &(h, lane_index) in &lanes {
                let lane = &seq.lanes[lane_index];
                let all: Vec<u32>;
                let pages = match req.pages {
                    Some(pages) => pages,
                    None => {
                        all = (0..lane.num_pages() as u32).collect();
                        &all
                    }
                };
                for &p in pages {
                    let rows = lane.rows_in(p as usize);
                    let (state, content) = match lane.page(p as usize).expect("checked above") {
                        LogicalPage::Physical(r) => {
                            let place = read(&r.page.place);
                            let data = read_rows(&*self.host, place.backing.slot(), layout, rows)?;
                            if place.device.is_some() {
                                hot.push(Arc::clone(&r.page));
                            }
                            (place.state(), PageContent::Original(data))
                        }
                        LogicalPage::Summary(s) => {
                            let mut kv = vec![0u8; s.slot.len() as usize];
                            self.host.read(&s.slot, 0, &mut kv)?;
                            let counts = s.counts.clone();
                            (PageState::Summary, PageContent::Summary { counts, kv })
                        }
                        LogicalPage::Gone(reason) => (PageState::Gone, PageContent::Gone(*reason)),
                    };
                    if let PageContent::Original(d) | PageContent::Summary { kv: d, .. } = &content {
                        bytes += d.len() as u64;
                    }
                    out.push(FetchedPage {
                        kv_head: h,
                        page: p,
                        state,
                        rows,
                        content,
                    });
                }
            }
            self.touch_device(hot);
            Counters::add(&self.counters.bytes_read, bytes);
            Ok(out)
        })
    }
}
