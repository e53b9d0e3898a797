//! Selection over a sequence whose pages are split by position across
//! several servers. Each server ranks its own pages; the client merges their
//! answers into exactly the selection one server holding everything would
//! make (the global top-k is contained in the union of the local top-k).

use std::collections::BTreeMap;

use crate::client::Result;
use crate::{Client, ClientError, SelectRequest, pb};

/// One server's contiguous part of a sequence: global pages
/// `first_page..first_page + pages`, stored there as local pages `0..pages`.
#[derive(Debug, Clone)]
pub struct Part {
    /// A client of the server that holds the part (its tenant set).
    pub client: Client,
    /// The part's sequence id on that server.
    pub sequence_id: String,
    /// The part's first page in the whole sequence.
    pub first_page: u32,
    /// How many pages the part holds.
    pub pages: u32,
}

/// A sequence split by position over servers, parts in position order with
/// no gaps.
#[derive(Debug, Clone)]
pub struct Partitioned {
    parts: Vec<Part>,
}

/// A candidate from one server, in global page numbers.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    page: u32,
    bound: f32,
    state: i32,
    cold_tier: i32,
    miss: i32,
}

impl Partitioned {
    /// Parts must be contiguous from page 0 in order.
    pub fn new(parts: Vec<Part>) -> std::result::Result<Self, String> {
        let mut next = 0u32;
        for (i, p) in parts.iter().enumerate() {
            if p.first_page != next {
                return Err(format!("part {i} starts at page {}, expected {next}", p.first_page));
            }
            next += p.pages;
        }
        Ok(Self { parts })
    }

    /// Pages in the whole sequence: every part's, summed.
    pub fn pages(&self) -> u32 {
        self.parts.iter().map(|p| p.pages).sum()
    }

    /// The exact global selection for `req` (no shard), with global page
    /// numbers, per (KV head, query head). Pages' data is not fetched.
    ///
    /// Merging needs scores that mean the same on every server: quest
    /// (the default here) or cuboid. Estimated masses are normalised over
    /// each server's own pages, so sketch, two-stage and top-p are refused.
    pub async fn select(&mut self, req: &SelectRequest) -> Result<Vec<pb::HeadSelection>> {
        let mode = match req.mode {
            pb::SelectionMode::Unspecified => pb::SelectionMode::Quest,
            m => m,
        };
        if matches!(mode, pb::SelectionMode::Sketch | pb::SelectionMode::TwoStage) || req.top_p != 0.0 {
            return Err(tonic::Status::invalid_argument(format!(
                "mode: merging selections across servers needs scores comparable across them \
                 (SELECTION_MODE_QUEST or SELECTION_MODE_CUBOID), not {} with top_p {}: \
                 estimated masses are normalised over each server's pages",
                mode.as_str_name(),
                req.top_p
            ))
            .into());
        }
        if req.append.is_some() {
            return Err(tonic::Status::invalid_argument(
                "append: a selection merged across servers appends nothing; append to the part that holds the \
                 sequence's end",
            )
            .into());
        }
        if req.attend {
            return Err(tonic::Status::invalid_argument(
                "attend: each server would attend over its own top pages, not the merged choice; select here, \
                 then fetch the chosen pages",
            )
            .into());
        }
        if req.reuse_similarity != 0.0 {
            return Err(tonic::Status::invalid_argument(
                "reuse_similarity: a merge compares every server's scores for this query; a reused ranking's \
                 are an earlier query's",
            )
            .into());
        }
        let n = self.pages();
        let (k, s, w) = (req.budget_pages, req.sink_pages, req.window_pages);
        let forced = |p: u32| p < s || p + w >= n;
        let forced_total = (0..n).filter(|&p| forced(p)).count() as u32;
        let room = k.saturating_sub(forced_total);
        // (kv head, query head) → candidates from every part.
        let mut merged: BTreeMap<(u32, Option<u32>), Vec<Candidate>> = BTreeMap::new();
        for part in &mut self.parts {
            if part.pages == 0 {
                continue;
            }
            let (a, b) = (part.first_page, part.first_page + part.pages);
            let local_forced = (a..b).filter(|&p| forced(p)).count() as u32;
            // Global sinks and window fall on a prefix and a suffix of the part.
            let prefix = s.saturating_sub(a).min(part.pages);
            let suffix = b.saturating_sub(n.saturating_sub(w)).min(part.pages);
            let (sinks, window) = if prefix + suffix > part.pages {
                (part.pages, 0)
            } else {
                (prefix, suffix)
            };
            let local = SelectRequest {
                mode,
                budget_pages: local_forced + room,
                sink_pages: sinks,
                window_pages: window,
                shard: None,
                include_data: false,
                // Swapping in or leasing local candidates that the merge may
                // drop would waste device room.
                swap_in: false,
                deadline: None,
                prefetch_pages: 0,
                lease_ms: 0,
                append: None,
                ..req.clone()
            };
            if local.budget_pages == 0 {
                continue;
            }
            let answer = part.client.select_pages(&part.sequence_id, &local).await?;
            for head in answer.heads {
                let out = merged.entry((head.kv_head, head.query_head)).or_default();
                for p in head.pages {
                    if p.page >= part.pages {
                        return Err(ClientError::Status(tonic::Status::out_of_range(format!(
                            "server for pages {a}..{b} returned local page {}",
                            p.page
                        ))));
                    }
                    out.push(Candidate {
                        page: a + p.page,
                        bound: p.bound,
                        state: p.state,
                        cold_tier: p.cold_tier,
                        miss: p.miss,
                    });
                }
            }
        }
        Ok(merged
            .into_iter()
            .map(|((kv_head, query_head), candidates)| {
                let (mut chosen, mut rest): (Vec<_>, Vec<_>) = candidates.into_iter().partition(|c| forced(c.page));
                rest.sort_by(|x, y| y.bound.total_cmp(&x.bound).then(x.page.cmp(&y.page)));
                chosen.extend(rest.into_iter().take(room as usize));
                chosen.sort_by_key(|c| c.page);
                let gone = chosen.iter().filter(|c| c.state == pb::PageState::Gone as i32).count() as u32;
                pb::HeadSelection {
                    kv_head,
                    query_head,
                    pages: chosen
                        .into_iter()
                        .map(|c| pb::SelectedPage {
                            page: c.page,
                            bound: c.bound,
                            state: c.state,
                            cold_tier: c.cold_tier,
                            miss: c.miss,
                        })
                        .collect(),
                    selected_but_gone: gone,
                }
            })
            .collect())
    }
}
