//! Store calls off the async runtime, unless they are small.

use std::sync::Arc;

use kvtier_core::SequenceKey;
use kvtier_store::{Store, StoreResult};
use tonic::Status;

use crate::status::to_status;

/// Work up to this many bytes (page bytes copied, digest bytes scanned)
/// runs on the handler's own worker. Handing a call to a blocking thread
/// and back costs two cross-thread wake-ups, measured at 30–200 µs on these
/// VMs (a parked vCPU has to be woken): more than copying this much, and a
/// small fetch's whole budget.
pub(crate) const INLINE_BYTES: usize = 256 << 10;

/// Runs a store call on a blocking thread: copies of many megabytes must
/// not stall the runtime's workers.
pub(crate) async fn blocking<T, F>(store: Arc<Store>, f: F) -> Result<T, Status>
where
    T: Send + 'static,
    F: FnOnce(&Arc<Store>) -> StoreResult<T> + Send + 'static,
{
    tokio::task::spawn_blocking(move || f(&store))
        .await
        .map_err(|e| Status::internal(format!("store task failed: {e}")))?
        .map_err(to_status)
}

/// Runs a store call on sequence `key` whose work is at most `bytes` where
/// it is cheapest: here when small; when large, or when the sequence's
/// writer holds it (an append may hold it across NVMe I/O), still on this
/// thread, which first hands its other tasks to another worker
/// (`block_in_place`): the call's response is encoded where its pages were
/// read, without the two cross-thread wake-ups of a blocking thread, and
/// no other call waits behind it. A runtime of one thread (tests) has no
/// worker to hand them to: a blocking thread there. A small read that
/// finds its pages on NVMe still waits for them here; at most
/// [`INLINE_BYTES`] of them, which is a few device reads. So may one whose
/// sequence's writer came just after the look (the look is a hint).
pub(crate) async fn sized<T, F>(store: &Arc<Store>, key: &SequenceKey, bytes: usize, f: F) -> Result<T, Status>
where
    T: Send + 'static,
    F: FnOnce(&Arc<Store>) -> StoreResult<T> + Send + 'static,
{
    if bytes <= INLINE_BYTES && !store.would_wait(key) {
        return f(store).map_err(to_status);
    }
    match tokio::runtime::Handle::current().runtime_flavor() {
        tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(|| f(store)).map_err(to_status),
        _ => blocking(Arc::clone(store), f).await,
    }
}

/// Runs `f`, which may wait for a sequence's writer, where the wait stalls
/// no other task: on a worker of a multi-thread runtime after it hands its
/// other tasks to another thread (`block_in_place`); elsewhere (an shm
/// socket's thread, a one-thread runtime in tests) as it is.
pub(crate) fn may_wait<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}
