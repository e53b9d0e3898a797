#![warn(missing_docs)]
//! The kvtier engine: sequences of pages across the device, host and NVMe
//! tiers, every page in one of four explicit states.
//!
//! Synchronous and thread-safe: callers on an async runtime run operations
//! on blocking threads. `store/` composes the components (its module
//! comment maps each operation and each component to its file, and states
//! the one lock order).

mod access_trace;
mod accounts;
mod catalog;
mod cost;
mod device;
mod durability;
mod error;
mod histogram;
mod host;
mod lease;
mod named;
mod page;
mod page_buf;
mod policy;
mod prefetch;
mod reader;
mod simulate;
mod stats;
mod store;
#[cfg(test)]
mod testing;

pub use access_trace::{
    Access, HeadPages, SwapTiming, TRACE_FORMAT, TraceConfig, TraceHeader, TraceRecord, TraceStatus, check_sample,
    tier_letter,
};
pub use accounts::{Limits, OverLimit, Quota, Usage};
pub use catalog::HeadRange;
pub use device::{DevicePolicy, SwapReport};
pub use durability::{Acknowledged, Durability, Recovered};
pub use error::{ManifestError, StoreError, StoreResult};
pub use histogram::{Histogram, HistogramSnapshot, LATENCY_BOUNDS};
pub use host::HostPolicy;
pub use kvtier_core::policy::{PolicyAction, PolicySpec, Trigger};
pub use kvtier_tiers::{EngineChoice, NvmeConfig, Tier, TierError, TierKind};
pub use lease::{MAX_LEASE, random_id};
pub use page_buf::PageBuf;
pub use policy::PolicyOutcome;
pub use reader::PageContent;
pub use simulate::{DeviceSimulation, HostSimulation};
pub use stats::{
    DeviceHits, IndexMemory, Latency, PrefetchCounts, SequenceInfo, StateCounts, StatsSnapshot, TierBytes, TierStats,
    TransitionCount,
};
pub use store::{
    AppendOutcome, AppendTiming, AppendTokens, ApplyPolicy, AttentionWeights, Created, DeviceCache, ExportedPage,
    FetchCursor, FetchPages, FetchedChunk, FetchedPage, HeadAttention, HeadSelection, LaneAt, Miss, MovedContent,
    PageList, PageSelection, PutOutcome, PutPages, ReportAttention, SelectPages, SelectTiming, SelectedPage, Selection,
    SequenceExport, SetPageState, Store, StoreConfig, TransitionOutcome, attend_room, data_bound, index_scan_bytes,
};

/// Whether this process may use io_uring (for tests that pick an engine).
pub fn uring_available() -> Result<(), String> {
    kvtier_tiers::NvmeTier::uring_available()
}
