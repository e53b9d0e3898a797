//! A selection that attends instead of returning its pages
//! (docs/CONCEPTS.md §3.4): the chosen pages are read into the store's own
//! buffer and each query head's attention over them
//! ([`kvtier_core::attend`]) is the answer, a row of values and a
//! log-sum-exp per query head in place of the pages' bytes.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use kvtier_core::attend::{PageRows, PartialAttention, attend};
use kvtier_core::{DType, Layout, SequenceKey};

use super::Store;
use super::select::{SelectPages, Selection};
use crate::page_buf::PageBuf;
use crate::reader::PageContent;
use crate::{StoreError, StoreResult};

/// One query head's attention over the rows its selection chose.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadAttention {
    /// The query head (over the whole layer, not the request's range).
    pub query_head: u32,
    /// Its output, log-sum-exp and tokens, over the store's rows only.
    pub attention: PartialAttention,
}

/// The most bytes an attending selection of at most `data_bound` page
/// bytes holds: the pages, and their rows widened to f32 where the
/// layout's dtype is narrower (f32 rows are read where they lie).
pub fn attend_room(layout: &Layout, data_bound: usize) -> usize {
    let widened = match layout.dtype() {
        DType::F32 => 0,
        d => data_bound / d.size() * 4,
    };
    data_bound.saturating_add(widened)
}

impl Store {
    /// Selects as [`Store::select_pages`] does and attends over the chosen
    /// pages with the request's queries, scaled by its ranking's softmax
    /// scale: [`Selection::attention`] holds one result per query head of
    /// the request's KV heads, and no page data is returned. Gone pages
    /// are left out, a summary row counts as its tokens. `own`: rows not
    /// stored yet that the queries also see, after the chosen pages (a
    /// decode step's own tokens, appended by the same call once it has
    /// answered), laid out as an append's (per KV head of the request,
    /// its K rows then its V rows).
    pub fn select_attending(
        self: &Arc<Self>,
        key: &SequenceKey,
        req: SelectPages<'_>,
        own: Option<&[u8]>,
    ) -> StoreResult<Selection<Range<usize>>> {
        let start = Instant::now();
        let req = SelectPages { with_data: true, ..req };
        let ((mut selection, layout), bytes) = self.catalog.read(key, |seq| {
            PageBuf::read_owned(req.data_bound(seq), |buf| {
                Ok((self.select_locked(seq, req, buf)?, Arc::clone(&seq.layout)))
            })
        })?;
        // The rows are a buffer of the call's own: attending holds no
        // lock, so the sequence's writers (other workers' appends; the
        // step's own comes after the answer) do not wait for it.
        let attending = Instant::now();
        selection.attention = attend_selection(&layout, &req, &selection, &bytes, own)?;
        selection.timing.attend_us = super::micros(attending.elapsed());
        selection.data.clear();
        self.timed(&mut selection, req.swap_in, start);
        Ok(selection)
    }
}

/// Each selection head's query heads attending over the pages it chose
/// that were read (`bytes` holds them at their ranges), then over its KV
/// head's `own` rows.
fn attend_selection(
    layout: &Layout,
    req: &SelectPages<'_>,
    selection: &Selection<Range<usize>>,
    bytes: &[u8],
    own: Option<&[u8]>,
) -> StoreResult<Vec<HeadAttention>> {
    let (d, group) = (layout.head_dim() as usize, layout.group_size());
    let row_pair = 2 * layout.row_bytes();
    let mut read: BTreeMap<(u32, u32), PageRows<'_>> = BTreeMap::new();
    for p in &selection.data {
        let page = match &p.content {
            // Ranges of the buffer the read filled, as `FetchedPage::owned` reads them.
            PageContent::Original(r) => PageRows {
                kv: &bytes[r.clone()],
                counts: None,
            },
            PageContent::Summary { counts, kv } => PageRows {
                kv: &bytes[kv.clone()],
                counts: Some(counts.as_slice()),
            },
            PageContent::Gone(_) => continue,
        };
        // The kernel pairs each K row with its V row and a summary's count.
        let held = page.counts.map_or(page.kv.len() / row_pair, <[u32]>::len);
        if page.kv.len() != held * row_pair {
            return Err(StoreError::Internal(format!(
                "KV head {} page {}: {} bytes are not {held} K and V rows of {} bytes",
                p.kv_head,
                p.page,
                page.kv.len(),
                row_pair / 2
            )));
        }
        read.insert((p.kv_head, p.page), page);
    }
    let per_head = own.map_or(0, |own| own.len() / req.heads.count.max(1) as usize);
    if own.is_some_and(|own| per_head * req.heads.count as usize != own.len()) {
        return Err(StoreError::Internal(format!(
            "{} bytes of own rows are not the same for each of {} KV heads",
            own.map_or(0, <[u8]>::len),
            req.heads.count
        )));
    }
    let scale = req.ranking.scale(d);
    let mut out = Vec::new();
    for head in &selection.heads {
        // Its KV head's place in the request, and which of the group's
        // query heads chose (all of them, aggregated).
        let lane = (head.kv_head - req.heads.start) as usize;
        let first = head.kv_head * group;
        let heads = match head.query_head {
            Some(q) => q..q + 1,
            None => first..first + group,
        };
        let at = lane * group as usize + (heads.start - first) as usize;
        let queries = &req.queries[at * d..(at + heads.len()) * d];
        let own = own.map(|own| PageRows {
            kv: &own[lane * per_head..(lane + 1) * per_head],
            counts: None,
        });
        let pages: Vec<PageRows<'_>> = head
            .pages
            .iter()
            .filter_map(|p| read.get(&(head.kv_head, p.page)).copied())
            .chain(own)
            .collect();
        let attended = attend(layout.dtype(), d, scale, queries, &pages);
        out.extend(
            heads
                .zip(attended)
                .map(|(query_head, attention)| HeadAttention { query_head, attention }),
        );
    }
    Ok(out)
}
