//! Store calls off the async runtime.

use std::sync::Arc;

use kvtier_store::{Store, StoreResult};
use tonic::Status;

use crate::status::to_status;

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
