//! Physical pages and their placement across tiers.

use std::sync::{Arc, RwLock};

use kvtier_core::{ColdTier, Lane, Layout, LogicalPage, PageState, PhysId, TenantId};
use kvtier_tiers::{Slot, Tier, TierError};

/// The bytes of one page of one lane: K rows `[page_size][head_dim]` at
/// offset 0, V rows at `page_size · row_bytes`. Partial pages use the same
/// slot size so that appends fill them in place.
#[derive(Debug)]
pub(crate) struct PhysPage {
    /// Unique for the store's lifetime; keys the device LRU.
    pub(crate) id: u64,
    /// Kept for shared pages, so a sequence that attaches the page gets its
    /// digest without reading the page.
    pub(crate) digest: Option<Box<[u8]>>,
    pub(crate) place: RwLock<Placement>,
}

/// Where a physical page's bytes are. The backing copy always exists; the
/// device copy is an inclusive cache of it (dropping it loses nothing).
#[derive(Debug)]
pub(crate) struct Placement {
    pub(crate) device: Option<Slot>,
    pub(crate) backing: Backing,
}

#[derive(Debug)]
pub(crate) enum Backing {
    Host(Slot),
}

impl Placement {
    pub(crate) fn state(&self) -> PageState {
        match self.device {
            Some(_) => PageState::Hot,
            None => PageState::Cold(self.backing.tier()),
        }
    }
}

impl Backing {
    pub(crate) fn tier(&self) -> ColdTier {
        match self {
            Backing::Host(_) => ColdTier::Host,
        }
    }

    pub(crate) fn slot(&self) -> &Slot {
        match self {
            Backing::Host(slot) => slot,
        }
    }

    pub(crate) fn slot_mut(&mut self) -> &mut Slot {
        match self {
            Backing::Host(slot) => slot,
        }
    }
}

/// A logical page's handle on its physical page: the refcount entry and the
/// page itself (so that reads need not consult the refcount table).
#[derive(Debug)]
pub(crate) struct PageRef {
    pub(crate) id: PhysId,
    pub(crate) page: Arc<PhysPage>,
}

/// A summarised page: `counts.len()` rows, K then V, in a host slot.
#[derive(Debug)]
pub(crate) struct SummaryPage {
    pub(crate) counts: Vec<u32>,
    pub(crate) slot: Slot,
}

pub(crate) type StoreLane = Lane<PageRef, SummaryPage>;
pub(crate) type StorePage = LogicalPage<PageRef, SummaryPage>;

/// Identity of a shareable page: the same prefix (hash chain entry) of the
/// same model layout, in the same tenant, for the same lane.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ShareKey {
    pub(crate) tenant: TenantId,
    pub(crate) layout: Arc<Layout>,
    pub(crate) hash: Arc<[u8]>,
    pub(crate) lane: u32,
}

/// Writes K and V rows (`[n][head_dim]` each) starting at row `first_row`.
pub(crate) fn write_rows(
    tier: &dyn Tier,
    slot: &mut Slot,
    layout: &Layout,
    first_row: u32,
    keys: &[u8],
    values: &[u8],
) -> Result<(), TierError> {
    let row = layout.row_bytes() as u64;
    let v_base = u64::from(layout.page_size()) * row;
    tier.write(slot, u64::from(first_row) * row, keys)?;
    tier.write(slot, v_base + u64::from(first_row) * row, values)
}

/// Reads the first `rows` rows of K then of V into one buffer.
pub(crate) fn read_rows(tier: &dyn Tier, slot: &Slot, layout: &Layout, rows: u32) -> Result<Vec<u8>, TierError> {
    let n = rows as usize * layout.row_bytes();
    let mut out = vec![0u8; 2 * n];
    let (k, v) = out.split_at_mut(n);
    tier.read(slot, 0, k)?;
    tier.read(slot, u64::from(layout.page_size()) * layout.row_bytes() as u64, v)?;
    Ok(out)
}
