//! Response streams: pages and selections as messages within the message
//! limit, each holding its in-flight bytes until tonic has taken it, and a
//! long fetch read chunk by chunk as room allows.

use std::ops::Range;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use kvtier_core::rank::Ranking;
use kvtier_core::{Layout, SequenceKey};
use kvtier_proto::v1 as pb;
use kvtier_store::{
    FetchCursor, FetchPages, FetchedPage, PageBuf, PageContent, PageList, SelectPages, Selection, Store, StoreResult,
};
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::blocking::{INLINE_BYTES, sized};
use crate::gate::RequestBytes;
use crate::inflight::{Held, Holding, InFlight};
use crate::shm::Window;
use crate::{chunk, convert};

/// A read page as a message, its bytes placed by `place` (inline, or where
/// they went in a shared-memory window).
pub(crate) fn page_to_pb<B>(p: FetchedPage<B>, place: impl FnOnce(&mut pb::Page, B)) -> pb::Page {
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
        PageContent::Original(kv) => place(&mut page, kv),
        PageContent::Summary { counts, kv } => {
            place(&mut page, kv);
            page.summary_counts = counts;
        }
        PageContent::Gone(reason) => page.gone_reason = convert::reason_to_pb(reason) as i32,
    }
    page
}

/// Runs a read into a new buffer of `room` bytes, which the tiers copy
/// into once, without zeroing it first; the read's result and its bytes,
/// which pages' messages then share.
pub(crate) fn read_to_bytes<T>(
    room: usize,
    read: impl FnOnce(&mut PageBuf<'_>) -> StoreResult<T>,
) -> StoreResult<(T, Bytes)> {
    let mut bytes = BytesMut::with_capacity(room);
    let mut buf = PageBuf::new(bytes.spare_capacity_mut());
    let out = read(&mut buf)?;
    let used = buf.used();
    assert!(used <= bytes.capacity());
    // SAFETY: the read succeeded, so the first `used` bytes of the spare
    // capacity are initialised (`PageBuf`'s invariant; `read` is one of this
    // module's store calls, which fill the buffer they are given), and
    // `used` is at most the capacity (asserted).
    unsafe { bytes.set_len(used) };
    Ok((out, bytes.freeze()))
}

/// Pages read into `bytes`, as messages carrying their bytes.
pub(crate) fn inline_pages(pages: Vec<FetchedPage<Range<usize>>>, bytes: &Bytes) -> Vec<pb::Page> {
    pages
        .into_iter()
        .map(|p| page_to_pb(p, |page, r| page.kv = bytes.slice(r)))
        .collect()
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

/// The digest bytes a selection of `kv_heads` heads scans: every page's
/// min and max rows.
pub(crate) fn index_scanned(
    kv_heads: u32,
    budget_pages: u32,
    ranking: &Ranking,
    (layout, tokens): &(Arc<Layout>, u64),
) -> usize {
    let heads = kv_heads.min(layout.num_kv_heads()) as usize;
    kvtier_store::index_scan_bytes(layout, *tokens, budget_pages as usize, ranking).saturating_mul(heads)
}

/// A selection with its data read straight into `window`, or into a new
/// buffer of `room` bytes when there is none; the pages' messages apart.
pub(crate) fn select_into(
    store: &Arc<Store>,
    key: &SequenceKey,
    req: SelectPages<'_>,
    window: Option<&mut Window>,
    room: usize,
) -> StoreResult<(Selection<Range<usize>>, Vec<pb::Page>)> {
    Ok(match window {
        Some(w) => {
            let mut selection = store.select_pages_into(key, req, &mut w.buf())?;
            let pages = w.pages(std::mem::take(&mut selection.data));
            (selection, pages)
        }
        None => {
            let (mut selection, bytes) = read_to_bytes(room, |buf| store.select_pages_into(key, req, buf))?;
            let pages = inline_pages(std::mem::take(&mut selection.data), &bytes);
            (selection, pages)
        }
    })
}

/// A selection as response messages within `limit`: the totals with as
/// many heads as fit, the remaining heads, then the pages.
pub(crate) fn select_messages<B>(
    selection: Selection<B>,
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
        mode: convert::mode_to_pb(selection.mode) as i32,
    };
    let heads = selection.heads.iter().map(convert::head_selection_to_pb).collect();
    let mut head_runs = chunk::fit(heads, first.encoded_len(), limit, "KV head's selection")?.into_iter();
    // Pages in messages of the same size as an inline fetch's chunks, so
    // that the client receives one while the server encodes the next.
    let data = chunk::fit_within(data, 0, PIPELINED_BYTES, limit, "page")?;
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

/// The most page bytes one chunk of an inline fetch reads, below the
/// request's message limit: the client receives a chunk while the server
/// reads and encodes the next. In one message, a fetch's pages were all
/// read, then all encoded, before its first byte left. llama3-8b 8K
/// fetches (2.1 MB), placed, p50: ~830 µs in one message, ~740 in 1 MiB
/// chunks, 640–700 in 128–512 KiB ones. At [`INLINE_BYTES`] a chunk is also
/// read on its task's worker, as a small fetch is, without a hand-off to
/// another thread: 256 KiB chunks read on a blocking thread took 740–750 µs,
/// with `block_in_place` 710–760, on the worker 630–650. Like a small fetch,
/// a chunk whose sequence's writer is under way steps off the worker first
/// (`blocking::sized`); one there may still wait for the NVMe reads of at
/// most 256 KiB of pages.
pub(crate) const PIPELINED_BYTES: usize = INLINE_BYTES;

/// The most one inline chunk of a fetch whose messages may take `max_bytes`
/// reads.
fn chunk_bytes(max_bytes: usize) -> usize {
    max_bytes.min(PIPELINED_BYTES)
}

/// A fetch being streamed.
pub(crate) struct FetchJob {
    _request_bytes: Option<RequestBytes>,
    pub(crate) key: SequenceKey,
    request: pb::FetchPagesRequest,
    per_head: Vec<Vec<u32>>,
    pub(crate) max_bytes: usize,
    /// The most page bytes the whole fetch reads.
    pub(crate) bound: usize,
    /// The buffer one chunk's page bytes are read into.
    pub(crate) room: usize,
}

impl FetchJob {
    /// A fetch of `request` (whose `shm` is taken) from a sequence of this
    /// shape, in chunks of at most `max_bytes`.
    pub(crate) fn new(
        request_bytes: Option<RequestBytes>,
        key: SequenceKey,
        mut request: pb::FetchPagesRequest,
        max_bytes: usize,
        (layout, tokens): &(Arc<Layout>, u64),
    ) -> Self {
        let per_head: Vec<Vec<u32>> = std::mem::take(&mut request.per_head_pages)
            .into_iter()
            .map(|l| l.pages)
            .collect();
        // Every page it lists (every page, when it lists none) of the heads
        // it names, whole.
        let heads = request.kv_head_count.min(layout.num_kv_heads());
        let pages = match (request.pages.is_empty(), per_head.is_empty()) {
            (false, _) => request.pages.len() as u64 * u64::from(heads),
            (true, false) => per_head.iter().map(|l| l.len() as u64).sum(),
            (true, true) => tokens.div_ceil(u64::from(layout.page_size())) * u64::from(heads),
        };
        let bound = usize::try_from(pages.saturating_mul(layout.page_bytes() as u64)).unwrap_or(usize::MAX);
        // A chunk holds at least one page, whatever max_bytes says (a page
        // too large for a message is refused as its messages are made), and
        // whatever the pages were when the call began.
        let room = bound.min(chunk_bytes(max_bytes)).max(layout.page_bytes());
        Self {
            _request_bytes: request_bytes,
            key,
            request,
            per_head,
            max_bytes,
            bound,
            room,
        }
    }

    fn pages(&self) -> FetchPages<'_> {
        let r = &self.request;
        let pages = match (r.pages.is_empty(), self.per_head.is_empty()) {
            (false, _) => PageList::Same(&r.pages),
            (true, false) => PageList::PerHead(&self.per_head),
            (true, true) => PageList::All,
        };
        FetchPages {
            layer: r.layer,
            heads: convert::heads(r.kv_head_start, r.kv_head_count),
            pages,
            with_digests: r.include_digests,
        }
    }

    /// Reads every page chunk by chunk straight into `window`; the pages'
    /// messages, saying where their bytes are.
    pub(crate) fn read_to_window(&self, store: &Store, window: &mut Window) -> StoreResult<Vec<pb::Page>> {
        let mut read = Vec::new();
        let mut from = FetchCursor::default();
        let mut buf = window.buf();
        loop {
            let (chunk, next) = store.fetch_chunk_into(&self.key, self.pages(), from, self.max_bytes, &mut buf)?;
            read.extend(chunk);
            match next {
                Some(n) => from = n,
                None => break,
            }
        }
        Ok(window.pages(read))
    }

    /// One chunk from `from` on as messages carrying their bytes; where
    /// the next starts.
    pub(crate) fn read(&self, store: &Store, from: FetchCursor) -> StoreResult<(Vec<pb::Page>, Option<FetchCursor>)> {
        let ((pages, next), bytes) = read_to_bytes(self.room, |buf| {
            store.fetch_chunk_into(&self.key, self.pages(), from, chunk_bytes(self.max_bytes), buf)
        })?;
        Ok((inline_pages(pages, &bytes), next))
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
            held = in_flight.hold("a fetch chunk", job.room) => held,
            () = tx.closed() => return,
        };
        let read = async {
            let held = held?;
            let reader = Arc::clone(&job);
            let (pages, next) = sized(&store, &job.key, job.room, move |s| reader.read(s, from)).await?;
            Ok::<_, Status>((holding(page_messages(pages, job.max_bytes)?, Some(held)), next))
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

/// Pages as fetch response messages within `limit`.
pub(crate) fn page_messages(pages: Vec<pb::Page>, limit: usize) -> Result<Vec<pb::FetchPagesResponse>, Status> {
    let runs = chunk::fit(pages, 0, limit, "page")?;
    Ok(runs.into_iter().map(|pages| pb::FetchPagesResponse { pages }).collect())
}
