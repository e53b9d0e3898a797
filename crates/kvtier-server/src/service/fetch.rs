//! `FetchPages`: a fetch checked and sized before it reads, then its pages
//! as messages within the message limit, inline (chunk by chunk as the
//! server has room in flight) or placed in the caller's shm window.

use std::sync::Arc;

use kvtier_core::{Layout, SequenceKey, wire};
use kvtier_proto::v1 as pb;
use kvtier_store::{FetchCursor, FetchPages, PageList, Store, StoreResult};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::{KvTierService, open_seq};
use crate::auth::Caller;
use crate::blocking::sized;
use crate::gate::RequestBytes;
use crate::inflight::{Holding, InFlight};
use crate::moves::{Access, Permit};
use crate::responses::{Held_, PIPELINED_BYTES, holding, inline_pages, read_to_bytes};
use crate::shm::Window;
use crate::status::{invalid, to_status};
use crate::{chunk, convert};

/// The first chunk's messages straight from the handler (no task, no
/// channel when the read fits one chunk: a fetch's latency is mostly
/// hand-offs between threads), then chunks sent by a task as it reads them.
pub(crate) type FetchStream = Holding<
    tokio_stream::adapters::Chain<
        tokio_stream::Iter<std::vec::IntoIter<Held_<pb::FetchPagesResponse>>>,
        ReceiverStream<Held_<pb::FetchPagesResponse>>,
    >,
>;

pub(super) async fn fetch_pages(
    svc: &KvTierService,
    request: Request<pb::FetchPagesRequest>,
) -> Result<Response<FetchStream>, Status> {
    // The request lives as long as its stream, and so does its charge.
    let request_bytes = request.extensions().get::<RequestBytes>().cloned();
    let (caller, incarnation, r) = open_seq(request)?;
    // Held as long as the stream reads: the sequence does not move away
    // under it.
    let (_, permit) = svc
        .located(&caller, &r.tenant, &r.sequence_id, incarnation, Access::Read)
        .await?;
    let (job, window) = svc.plan_fetch(&caller, r, request_bytes)?;
    let (tx, rx) = mpsc::channel(1);
    if let Some(mut window) = window {
        // The bytes go to the client's memory, so none are held here in
        // flight.
        let (key, bound, max_bytes) = (job.key.clone(), job.bound, job.max_bytes);
        let pages = sized(&svc.store, &key, bound, move |s| job.read_to_window(s, &mut window)).await?;
        let messages = holding(page_messages(pages, max_bytes)?, None);
        return Ok(Response::new(Holding::new(
            tokio_stream::iter(messages).chain(ReceiverStream::new(rx)),
        )));
    }
    let job = Arc::new(job);
    let max_bytes = job.max_bytes;
    // The first chunk is read before the stream starts, so a bad request
    // fails the call itself rather than the stream.
    let held = svc.in_flight.hold("a fetch chunk", job.room).await?;
    let (first, next) = {
        let reader = Arc::clone(&job);
        sized(&svc.store, &job.key, job.room, move |s| {
            reader.read(s, FetchCursor::default())
        })
        .await?
    };
    let first = holding(page_messages(first, max_bytes)?, Some(held));
    if let Some(from) = next {
        let (store, in_flight) = (Arc::clone(&svc.store), Arc::clone(&svc.in_flight));
        tokio::spawn(send_chunks(store, in_flight, job, from, tx, permit));
    }
    Ok(Response::new(Holding::new(
        tokio_stream::iter(first).chain(ReceiverStream::new(rx)),
    )))
}

pub(super) fn fetch_pages_local(
    svc: &KvTierService,
    caller: &Caller,
    r: pb::FetchPagesRequest,
) -> Result<Vec<pb::FetchPagesResponse>, Status> {
    let (job, window) = svc.plan_fetch(caller, r, None)?;
    let _permit = svc.enter(&job.key, Access::Read)?;
    let Some(mut window) = window else {
        return Err(invalid(
            wire::SHM,
            "is required over the shm socket, which carries no page bytes",
        ));
    };
    let pages = job.read_to_window(&svc.store, &mut window).map_err(to_status)?;
    page_messages(pages, job.max_bytes)
}

impl KvTierService {
    /// A fetch, checked: its job, and the shm window it names, checked
    /// against the region for everything the fetch can read.
    fn plan_fetch(
        &self,
        caller: &Caller,
        mut r: pb::FetchPagesRequest,
        request_bytes: Option<RequestBytes>,
    ) -> Result<(FetchJob, Option<Window>), Status> {
        let key = self.key(caller, &r.tenant, &r.sequence_id)?;
        let max_bytes = chunk::limit(r.max_chunk_bytes, self.max_message_bytes)?;
        if !r.pages.is_empty() && !r.per_head_pages.is_empty() {
            return Err(invalid(
                wire::PER_HEAD_PAGES,
                "give either pages or per_head_pages, not both",
            ));
        }
        let shm = r.shm.take();
        let shape = self.shape(&key)?;
        let job = FetchJob::new(request_bytes, key, r, max_bytes, &shape);
        let window = match shm {
            Some(w) => Some(self.regions.window(&job.key.tenant, &w, job.bound)?),
            None => None,
        };
        Ok((job, window))
    }
}

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
    _permit: Option<Permit>,
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
