//! Miniature tiers that run the store's own policy code, for `kvtier
//! tune` to predict each policy's miss ratio at any size where no exact
//! model exists: the device under the loop policy (`device.rs`), host
//! memory under either host policy (`host.rs`).
//!
//! Every page is 64 bytes whatever the trace's shape: a policy sees pages,
//! not bytes, as long as pages are of one size, so a tier of N pages is
//! simulated by one of N tiny pages.

mod device;
mod host;

use std::sync::Arc;

use kvtier_core::{DType, Layout, LayoutSpec, TenantId};
use kvtier_tiers::{ArenaTier, Slot, Tier};

use crate::accounts::{Account, Accounts, Limits};
use crate::page::{PhysPage, Placement};
use crate::stats::Counters;
use crate::{StoreError, StoreResult};
pub use device::DeviceSimulation;
pub use host::HostSimulation;

/// Bytes of a simulated page: the arena's alignment, so that N pages fill
/// exactly N slots.
const PAGE_BYTES: u64 = 64;

/// What every miniature has: one owner of its pages, a layout of one
/// 64-byte page, and the counters its policy code reports to.
#[derive(Debug)]
struct Miniature {
    counters: Arc<Counters>,
    accounts: Arc<Accounts>,
    owner: Arc<Account>,
    layout: Arc<Layout>,
    /// Pages made so far (their ids).
    made: u64,
}

impl Miniature {
    fn new() -> StoreResult<Self> {
        let accounts = Accounts::new(Limits::default());
        let owner = accounts.account(&TenantId::parse("tenant", "simulation").map_err(StoreError::from)?);
        let layout = Layout::new(LayoutSpec {
            num_layers: 1,
            num_kv_heads: 1,
            num_query_heads: 1,
            head_dim: 8,
            dtype: DType::F16,
            page_size: 2,
            layer_groups: vec![],
        })
        .map_err(StoreError::from)?;
        debug_assert_eq!(layout.page_bytes() as u64, PAGE_BYTES);
        Ok(Self {
            counters: Arc::new(Counters::default()),
            accounts,
            owner,
            layout: Arc::new(layout),
            made: 0,
        })
    }

    /// A tier of `pages` pages (at least one): the device's or host
    /// memory's arena, or one standing in for NVMe.
    fn arena(pages: u64, make: fn(u64) -> Result<ArenaTier, kvtier_tiers::TierError>) -> StoreResult<Arc<dyn Tier>> {
        Ok(Arc::new(
            make(pages.max(1) * PAGE_BYTES).map_err(StoreError::ResourceExhausted)?,
        ))
    }

    /// A new page just written: in host memory (`host`), on the device too
    /// with `device`.
    fn page(&mut self, device: Option<Slot>, host: Slot) -> Arc<PhysPage> {
        let charge = self.accounts.page_charge(&self.owner, 0);
        let place = Placement::written(device, host, self.layout.page_size());
        self.made += 1;
        Arc::new(PhysPage::new(self.made, Arc::clone(&self.layout), None, place, charge))
    }
}
