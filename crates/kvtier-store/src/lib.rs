//! The kvtier engine: sequences of pages across the device, host and (later)
//! NVMe tiers, every page in one of four explicit states.
//!
//! Synchronous and thread-safe: callers on an async runtime run operations
//! on blocking threads. Per-sequence locks serialise writers of one sequence;
//! different sequences proceed in parallel, and byte copies happen outside
//! the global page-table lock.

mod device;
mod durability;
mod error;
mod lease;
mod movement;
mod page;
mod policy;
mod read;
mod select;
mod sequence;
mod stats;
mod store;
mod swapin;
mod sync;
mod transition;
mod write;

pub use durability::{Acknowledged, Durability, ManifestError, Recovered};
pub use error::{StoreError, StoreResult};
pub use kvtier_tiers::{EngineChoice, NvmeConfig, Tier, TierError, TierKind};
pub use lease::MAX_LEASE;
pub use policy::{ApplyPolicy, AttentionWeights, PolicyAction, PolicyOutcome, PolicySpec, ReportAttention, Trigger};
pub use read::{FetchCursor, FetchPages, FetchedPage, PageContent, PageList};
pub use select::{HeadSelection, Miss, SelectPages, SelectTiming, SelectedPage, Selection};
pub use sequence::HeadRange;
pub use stats::{SequenceInfo, StateCounts, StatsSnapshot, TierBytes, TierStats, TransitionCount};
pub use store::{Created, DeviceCache, Store, StoreConfig};
pub use swapin::SwapReport;
pub use transition::{PageSelection, SetPageState, TransitionOutcome};
pub use write::{AppendOutcome, AppendTiming, AppendTokens, PutOutcome, PutPages};

/// Whether this process may use io_uring (for tests that pick an engine).
pub fn uring_available() -> Result<(), String> {
    kvtier_tiers::NvmeTier::uring_available()
}
