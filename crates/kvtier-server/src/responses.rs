//! Response streams: pages and selections as messages within the message
//! limit, each holding its in-flight bytes until tonic has taken it, and a
//! long fetch read chunk by chunk as room allows.

use std::sync::Arc;

use kvtier_core::select::Aggregation;
use kvtier_core::{Layout, SequenceKey};
use kvtier_proto::v1 as pb;
use kvtier_store::{FetchCursor, FetchPages, FetchedPage, PageContent, PageList, Selection, Store, StoreResult};
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::blocking::blocking;
use crate::gate::RequestBytes;
use crate::inflight::{Held, Holding, InFlight};
use crate::shm::Window;
use crate::status::to_status;
use crate::{chunk, convert};

pub(crate) fn page_to_pb(p: FetchedPage) -> pb::Page {
    let (state, cold_tier) = convert::state_to_pb(p.state);
    let mut page = pb::Page {
        kv_head: p.kv_head,
        page: p.page,
        state: state as i32,
        cold_tier: cold_tier as i32,
        tokens: p.rows,
        digest: p.digest.map(Into::into).unwrap_or_default(),
        ..Default::default()
    };
    match p.content {
        PageContent::Original(kv) => page.kv = kv.into(),
        PageContent::Summary { counts, kv } => {
            page.kv = kv.into();
            page.summary_counts = counts;
        }
        PageContent::Gone(reason) => page.gone_reason = convert::reason_to_pb(reason) as i32,
    }
    page
}

/// Response messages, each with the in-flight bytes it holds until sent.
pub(crate) type Held_<T> = Result<(T, Option<Held>), Status>;
/// The first chunk's messages straight from the handler (no task, no
/// channel when the read fits one chunk: a fetch's latency is mostly
/// hand-offs between threads), then chunks sent by a task as it reads them.
pub(crate) type FetchStream = Holding<
    tokio_stream::adapters::Chain<
        tokio_stream::Iter<std::vec::IntoIter<Held_<pb::FetchPagesResponse>>>,
        ReceiverStream<Held_<pb::FetchPagesResponse>>,
    >,
>;
pub(crate) type SelectStream = Holding<tokio_stream::Iter<std::vec::IntoIter<Held_<pb::SelectPagesResponse>>>>;

/// Messages with `held` attached to the last: a chunk's bytes are held
/// until its last message is handed on.
pub(crate) fn holding<T>(messages: Vec<T>, mut held: Option<Held>) -> Vec<Held_<T>> {
    let last = messages.len().saturating_sub(1);
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| Ok((m, if i == last { held.take() } else { None })))
        .collect()
}

/// The most page bytes a selection with data can return: its budget per
/// KV head (per query head, with that aggregation), at most every page of
/// the longest lane, for each KV head asked.
/// Heads the layout does not have count as none: the store refuses them.
pub(crate) fn selection_bound(
    budget_pages: u32,
    kv_heads: u32,
    aggregation: Aggregation,
    (layout, tokens): (Layout, u64),
) -> usize {
    let per_head = match aggregation {
        Aggregation::PerQueryHead => u64::from(budget_pages) * u64::from(layout.group_size()),
        Aggregation::Max | Aggregation::Mean => u64::from(budget_pages),
    };
    let pages = per_head.min(tokens.div_ceil(u64::from(layout.page_size())));
    let heads = u64::from(kv_heads.min(layout.num_kv_heads()));
    let bytes = pages.saturating_mul(heads).saturating_mul(layout.page_bytes() as u64);
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

/// The digest bytes a selection of `kv_heads` heads scans: every page's
/// min and max rows.
pub(crate) fn digests_scanned(kv_heads: u32, (layout, tokens): &(Layout, u64)) -> usize {
    let heads = kv_heads.min(layout.num_kv_heads());
    let pages = tokens.div_ceil(u64::from(layout.page_size())) * u64::from(heads);
    usize::try_from(pages.saturating_mul(2 * layout.row_bytes() as u64)).unwrap_or(usize::MAX)
}

/// A selection's pages as messages, their bytes moved to `window` when the
/// call names one.
pub(crate) fn data_pages(selection: &mut Selection, window: Option<&mut Window>) -> Result<Vec<pb::Page>, Status> {
    let mut pages: Vec<pb::Page> = std::mem::take(&mut selection.data)
        .into_iter()
        .map(page_to_pb)
        .collect();
    if let Some(window) = window {
        for page in &mut pages {
            window.take_page(page).map_err(to_status)?;
        }
    }
    Ok(pages)
}

/// A selection as response messages within `limit`: the totals with as
/// many heads as fit, the remaining heads, then the pages.
pub(crate) fn select_messages(
    selection: Selection,
    data: Vec<pb::Page>,
    limit: usize,
) -> Result<Vec<pb::SelectPagesResponse>, Status> {
    let first = pb::SelectPagesResponse {
        heads: vec![],
        pages_scored: selection.pages_scored,
        digest_bytes: selection.digest_bytes,
        pages: vec![],
        swap: Some(convert::swap_to_pb(&selection.swap)),
        prefetch_queued: selection.prefetch_queued,
        lease_id: selection.lease.map_or(0, |(id, _)| id),
        lease_expires_in_ms: selection.lease.map_or(0, |(_, at)| {
            at.saturating_duration_since(std::time::Instant::now()).as_millis() as u64
        }),
        timing: Some(convert::timing_to_pb(&selection.timing)),
    };
    let heads = selection.heads.iter().map(convert::head_selection_to_pb).collect();
    let mut head_runs = chunk::fit(heads, first.encoded_len(), limit, "KV head's selection")?.into_iter();
    let data = chunk::fit(data, 0, limit, "page")?;
    let first = pb::SelectPagesResponse {
        heads: head_runs.next().unwrap_or_default(),
        ..first
    };
    let more_heads = head_runs.map(|heads| pb::SelectPagesResponse {
        heads,
        ..Default::default()
    });
    let pages = data.into_iter().map(|pages| pb::SelectPagesResponse {
        pages,
        ..Default::default()
    });
    Ok(std::iter::once(first).chain(more_heads).chain(pages).collect())
}

/// A fetch being streamed.
pub(crate) struct FetchJob {
    pub(crate) _request_bytes: Option<RequestBytes>,
    pub(crate) key: SequenceKey,
    pub(crate) request: pb::FetchPagesRequest,
    pub(crate) per_head: Vec<Vec<u32>>,
    pub(crate) max_bytes: usize,
}

impl FetchJob {
    /// The most page bytes the fetch reads: the pages it lists (every
    /// page, when it lists none) of the heads it names, whole.
    pub(crate) fn bound(&self, (layout, tokens): (Layout, u64)) -> usize {
        let r = &self.request;
        let heads = r.kv_head_count.min(layout.num_kv_heads());
        let pages = match (r.pages.is_empty(), self.per_head.is_empty()) {
            (false, _) => r.pages.len() as u64 * u64::from(heads),
            (true, false) => self.per_head.iter().map(|l| l.len() as u64).sum(),
            (true, true) => tokens.div_ceil(u64::from(layout.page_size())) * u64::from(heads),
        };
        usize::try_from(pages.saturating_mul(layout.page_bytes() as u64)).unwrap_or(usize::MAX)
    }

    /// Reads every page chunk by chunk, each page's bytes written to
    /// `window`; the pages' messages, without their bytes.
    pub(crate) fn read_to_window(&self, store: &Store, window: &mut Window) -> StoreResult<Vec<pb::Page>> {
        let mut pages = Vec::new();
        let mut from = FetchCursor::default();
        loop {
            let (chunk, next) = self.read(store, from)?;
            for page in chunk {
                let mut page = page_to_pb(page);
                window.take_page(&mut page)?;
                pages.push(page);
            }
            match next {
                Some(n) => from = n,
                None => return Ok(pages),
            }
        }
    }

    pub(crate) fn read(
        &self,
        store: &Store,
        from: FetchCursor,
    ) -> StoreResult<(Vec<FetchedPage>, Option<FetchCursor>)> {
        let r = &self.request;
        let pages = match (r.pages.is_empty(), self.per_head.is_empty()) {
            (false, _) => PageList::Same(&r.pages),
            (true, false) => PageList::PerHead(&self.per_head),
            (true, true) => PageList::All,
        };
        let req = FetchPages {
            layer: r.layer,
            heads: convert::heads(r.kv_head_start, r.kv_head_count),
            pages,
            with_digests: r.include_digests,
        };
        store.fetch_chunk(&self.key, req, from, self.max_bytes)
    }
}

/// The chunks of a fetch after the first, each read once the server has
/// room for it in flight, until the last or until the client goes away.
pub(crate) async fn send_chunks(
    store: Arc<Store>,
    in_flight: Arc<InFlight>,
    job: Arc<FetchJob>,
    mut from: FetchCursor,
    tx: mpsc::Sender<Held_<pb::FetchPagesResponse>>,
) {
    loop {
        // A stream whose client went away waits for nothing.
        let held = tokio::select! {
            held = in_flight.hold("a fetch chunk", job.max_bytes) => held,
            () = tx.closed() => return,
        };
        let read = async {
            let held = held?;
            let reader = Arc::clone(&job);
            let (pages, next) = blocking(Arc::clone(&store), move |s| reader.read(s, from)).await?;
            Ok::<_, Status>((holding(fetch_messages(pages, job.max_bytes)?, Some(held)), next))
        };
        let (messages, next) = match read.await {
            Ok(chunk) => chunk,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
        };
        for msg in messages {
            if tx.send(msg).await.is_err() {
                return; // the client went away
            }
        }
        let Some(n) = next else { return };
        from = n;
    }
}

/// One chunk of fetched pages as response messages within `limit`.
pub(crate) fn fetch_messages(pages: Vec<FetchedPage>, limit: usize) -> Result<Vec<pb::FetchPagesResponse>, Status> {
    page_messages(pages.into_iter().map(page_to_pb).collect(), limit)
}

/// Pages as fetch response messages within `limit`.
pub(crate) fn page_messages(pages: Vec<pb::Page>, limit: usize) -> Result<Vec<pb::FetchPagesResponse>, Status> {
    let runs = chunk::fit(pages, 0, limit, "page")?;
    Ok(runs.into_iter().map(|pages| pb::FetchPagesResponse { pages }).collect())
}
