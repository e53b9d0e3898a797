//! Query-driven selection (DESIGN.md §3): score every page of each lane in
//! the head range through its digest, choose the top pages, report them in
//! position order with bound and state, count the gone ones that would have
//! been chosen, and optionally read the chosen pages.

use kvtier_core::score::score_column;
use kvtier_core::select::{Aggregation, Budget, Shard, select};
use kvtier_core::{LogicalPage, PageState, SequenceKey};

use crate::read::{FetchedPage, PageContent};
use crate::sequence::{HeadRange, Sequence};
use crate::stats::Counters;
use crate::sync::read;
use crate::{Store, StoreError, StoreResult};

#[derive(Debug, Clone, Copy)]
pub struct SelectPages<'a> {
    pub layer: u32,
    pub heads: HeadRange,
    /// Post-RoPE queries of the query heads of `heads` (GQA group after
    /// group), `[query head][head_dim]`.
    pub queries: &'a [f32],
    pub budget: Budget,
    pub aggregation: Aggregation,
    /// Context-parallel caller; `None` selects over the whole lane.
    pub shard: Option<Shard>,
    /// Also read the selected pages (gone pages have no data).
    pub with_data: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SelectedPage {
    pub page: u32,
    /// The score the page was ranked by: `U` aggregated over the group (or
    /// one query head's `U`).
    pub bound: f32,
    pub state: PageState,
}

/// The choice for one KV head (or one query head, without aggregation).
#[derive(Debug, Clone, PartialEq)]
pub struct HeadSelection {
    pub kv_head: u32,
    pub query_head: Option<u32>,
    /// In position order. Gone pages are listed (never served with data).
    pub pages: Vec<SelectedPage>,
    /// Chosen pages that are gone: the quality cost of eviction, visible.
    pub selected_but_gone: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub heads: Vec<HeadSelection>,
    /// With `with_data`: every selected page that is not gone, once per
    /// (KV head, page), by KV head then position.
    pub data: Vec<FetchedPage>,
    /// Pages scored (lane pages × KV heads) and the digest bytes read.
    pub pages_scored: u64,
    pub digest_bytes: u64,
}

impl Store {
    pub fn select_pages(&self, key: &SequenceKey, req: SelectPages<'_>) -> StoreResult<Selection> {
        self.with_sequence(key, |seq| self.select_locked(seq, req))
    }

    fn select_locked(&self, seq: &Sequence, req: SelectPages<'_>) -> StoreResult<Selection> {
        seq.check_layer("layer", req.layer)?;
        let heads = seq.check_heads(req.heads)?;
        check_request(seq, &req)?;
        let layout = &seq.layout;
        let (d, group) = (layout.head_dim() as usize, layout.group_size() as usize);
        let mut out = Selection {
            heads: Vec::new(),
            data: Vec::new(),
            pages_scored: 0,
            digest_bytes: 0,
        };
        let mut hot = Vec::new();
        let mut bytes_read = 0u64;
        for (i, (h, lane_index)) in seq.lanes_of(req.layer, heads).enumerate() {
            let lane = &seq.lanes[lane_index];
            let n = lane.num_pages();
            let queries = &req.queries[i * group * d..(i + 1) * group * d];
            let mut scores = vec![0f32; n * group];
            score_column(layout.dtype(), d, lane.digests().as_bytes(), queries, &mut scores);
            out.pages_scored += n as u64;
            out.digest_bytes += lane.digests().as_bytes().len() as u64;
            let state = |p: usize| match lane.page(p).expect("selected pages exist") {
                LogicalPage::Physical(r) => read(&r.page.place).state(),
                LogicalPage::Summary(_) => PageState::Summary,
                LogicalPage::Gone(_) => PageState::Gone,
            };
            let per_head: Vec<(Option<u32>, Vec<f32>)> = match req.aggregation {
                Aggregation::Max => vec![(None, fold(&scores, group, |a, b| a.max(b), 1.0))],
                Aggregation::Mean => vec![(None, fold(&scores, group, |a, b| a + b, 1.0 / group as f32))],
                Aggregation::PerQueryHead => (0..group)
                    .map(|g| {
                        let q = (h as usize * group + g) as u32;
                        (Some(q), scores.iter().skip(g).step_by(group).copied().collect())
                    })
                    .collect(),
            };
            let mut chosen_any = vec![false; n];
            for (query_head, ranked) in per_head {
                let chosen = select(&ranked, req.budget, req.shard);
                let pages: Vec<SelectedPage> = chosen
                    .iter()
                    .map(|&p| {
                        chosen_any[p] = true;
                        SelectedPage {
                            page: p as u32,
                            bound: ranked[p],
                            state: state(p),
                        }
                    })
                    .collect();
                let selected_but_gone = pages.iter().filter(|p| p.state == PageState::Gone).count() as u32;
                out.heads.push(HeadSelection {
                    kv_head: h,
                    query_head,
                    pages,
                    selected_but_gone,
                });
            }
            if req.with_data {
                let wanted: Vec<usize> = (0..n).filter(|&p| chosen_any[p]).collect();
                let items: Vec<_> = wanted.iter().map(|&p| (lane, p)).collect();
                for (&p, (state, content)) in wanted.iter().zip(self.read_pages(layout, &items, &mut hot)?) {
                    if let PageContent::Original(d) | PageContent::Summary { kv: d, .. } = &content {
                        bytes_read += d.len() as u64;
                    }
                    if state != PageState::Gone {
                        out.data.push(FetchedPage {
                            kv_head: h,
                            page: p as u32,
                            state,
                            rows: lane.rows_in(p),
                            content,
                            digest: None,
                        });
                    }
                }
            }
        }
        self.touch_device(hot);
        Counters::add(&self.counters.bytes_read, bytes_read);
        Ok(out)
    }
}

/// One score per page from `group` scores per page.
fn fold(scores: &[f32], group: usize, combine: impl Fn(f32, f32) -> f32, scale: f32) -> Vec<f32> {
    scores
        .chunks_exact(group)
        .map(|g| g[1..].iter().fold(g[0], |a, &b| combine(a, b)) * scale)
        .collect()
}

fn check_request(seq: &Sequence, req: &SelectPages<'_>) -> StoreResult<()> {
    let layout = &seq.layout;
    let (d, group) = (layout.head_dim() as usize, layout.group_size() as usize);
    let expected = req.heads.count as usize * group * d;
    if req.queries.len() != expected {
        return Err(StoreError::invalid(
            "queries",
            format!(
                "holds {} f32 values, but {} KV heads × {group} query heads each × head_dim {d} = {expected}",
                req.queries.len(),
                req.heads.count
            ),
        ));
    }
    if let Some(i) = req.queries.iter().position(|q| !q.is_finite()) {
        return Err(StoreError::invalid(
            "queries",
            format!(
                "element {i} (query head {} of the request, dim {}) is not finite",
                i / d,
                i % d
            ),
        ));
    }
    let b = req.budget;
    if b.pages == 0 {
        return Err(StoreError::invalid("budget_pages", "must be at least 1"));
    }
    if b.sinks + b.window > b.pages {
        return Err(StoreError::invalid(
            "sink_pages",
            format!(
                "sink_pages ({}) + window_pages ({}) exceed budget_pages ({}); they count against the budget",
                b.sinks, b.window, b.pages
            ),
        ));
    }
    if let Some(s) = req.shard {
        if s.world == 0 || s.world > 4096 {
            return Err(StoreError::invalid(
                "shard.world",
                format!("is {}, must be in 1..=4096", s.world),
            ));
        }
        if s.rank >= s.world {
            return Err(StoreError::invalid(
                "shard.rank",
                format!("is {}, must be below world ({})", s.rank, s.world),
            ));
        }
    }
    Ok(())
}
