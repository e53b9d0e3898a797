//! The bytes of messages in flight across all calls, bounded by
//! `max_inflight_bytes`: the memory the server spends on calls besides its
//! tiers and metadata. Half of it is for requests, half for responses, so
//! that neither can starve the other.
//!
//! A request message is charged when its header arrives, before tonic
//! buffers it, and refused at once when there is no room (its bytes are
//! already on their way; holding the connection would only stall it). A
//! response message is charged before the store reads its data, and waits
//! for room: responses go out as others finish, so a burst of large reads
//! queues instead of piling up in memory.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::Stream;
use tonic::Status;

/// Permits are KiB, so that a `u32` of them covers any message.
const UNIT: usize = 1024;

#[derive(Debug)]
pub(crate) struct InFlight {
    requests: Arc<Semaphore>,
    responses: Arc<Semaphore>,
    /// Bytes of each half.
    half: usize,
}

/// Bytes held in flight until dropped.
#[derive(Debug)]
pub(crate) struct Held {
    permit: OwnedSemaphorePermit,
}

impl Held {
    /// Holds `other`'s bytes too.
    pub(crate) fn merge(&mut self, other: Held) {
        self.permit.merge(other.permit);
    }
}

fn units(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(UNIT)).unwrap_or(u32::MAX)
}

impl InFlight {
    pub(crate) fn new(limit: usize) -> Arc<Self> {
        let half = (limit / 2).min((Semaphore::MAX_PERMITS / UNIT).saturating_mul(UNIT));
        Arc::new(Self {
            // Rounded up like every charge, so that a message of exactly the
            // half always fits.
            requests: Arc::new(Semaphore::new(half.div_ceil(UNIT))),
            responses: Arc::new(Semaphore::new(half.div_ceil(UNIT))),
            half,
        })
    }

    /// Room for a request message now, or a refusal.
    pub(crate) fn try_hold(&self, bytes: usize) -> Result<Held, Status> {
        Arc::clone(&self.requests)
            .try_acquire_many_owned(units(bytes))
            .map(|permit| Held { permit })
            .map_err(|_| {
                Status::resource_exhausted(format!(
                    "the requests in flight leave no room for {bytes} more bytes (they may hold \
                     {} bytes, half of max_inflight_bytes); retry",
                    self.half
                ))
            })
    }

    /// Room for `bytes` of a response, once other responses leave it.
    pub(crate) async fn hold(&self, what: &str, bytes: usize) -> Result<Held, Status> {
        self.check_response(what, bytes)?;
        Arc::clone(&self.responses)
            .acquire_many_owned(units(bytes))
            .await
            .map(|permit| Held { permit })
            .map_err(|_| Status::unavailable("the server is shutting down"))
    }

    /// Refuses a response larger than responses may ever hold at once.
    fn check_response(&self, what: &str, bytes: usize) -> Result<(), Status> {
        if units(bytes) as usize > self.half.div_ceil(UNIT) {
            return Err(Status::resource_exhausted(format!(
                "{what} of {bytes} bytes is more than responses may hold in flight at once \
                 ({} bytes, half of max_inflight_bytes)",
                self.half
            )));
        }
        Ok(())
    }
}

/// A response stream whose items carry the bytes they hold: an item's are
/// released when the next item is asked for (tonic has encoded it and handed
/// it on by then), or when the stream ends or is dropped.
///
/// It also lets the connection go first between items: each time it is
/// polled after handing on an item (for the next, or for the end) it
/// yields once first. Without that, a response whose messages
/// are all ready (a selection's data) was encoded whole before the
/// connection's task wrote its first byte, and the client could not receive
/// one message while the server encoded the next.
#[derive(Debug)]
pub(crate) struct Holding<S> {
    inner: S,
    last: Option<Held>,
    /// An item was handed on, and the stream has not yielded since.
    owes_yield: bool,
}

impl<S> Holding<S> {
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            last: None,
            owes_yield: false,
        }
    }
}

impl<S, T> Stream for Holding<S>
where
    S: Stream<Item = Result<(T, Option<Held>), Status>> + Unpin,
{
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<T, Status>>> {
        self.last = None;
        if std::mem::take(&mut self.owes_yield) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let next = ready!(Pin::new(&mut self.inner).poll_next(cx));
        self.owes_yield = next.is_some();
        Poll::Ready(next.map(|item| {
            item.map(|(message, held)| {
                self.last = held;
                message
            })
        }))
    }
}
