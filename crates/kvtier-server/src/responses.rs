//! What the fetch and selection responses share: pages as messages (their
//! bytes inline or placed in a shared-memory window), read into buffers
//! the tiers fill once, each message holding its in-flight bytes until
//! tonic has taken it.

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use kvtier_proto::v1 as pb;
use kvtier_store::{FetchedPage, PageBuf, PageContent, StoreResult};
use tonic::Status;

use crate::blocking::INLINE_BYTES;
use crate::convert;
use crate::inflight::Held;

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
