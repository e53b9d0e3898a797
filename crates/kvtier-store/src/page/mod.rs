//! Physical pages and their placement across tiers. `placement.rs` owns
//! where a page's bytes are: its transitions are the only writers of a
//! placement (see its module comment for the invariant).

mod lru;
mod pins;
mod placement;
mod rows;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};

use kvtier_core::{Lane, Layout, LogicalPage, PageState, PhysId, Reason, TenantId};
use kvtier_sync::{Rank, RwLock};
use kvtier_tiers::Slot;

pub(crate) use lru::{LruVictims, PageLru, touch_lru};
pub(crate) use pins::Pins;
pub(crate) use placement::{AppendRefused, Lost, MemoryCopy, NvmeCopy, Placement};
pub(crate) use rows::{read_rows_into, rows_of, write_rows};

use crate::accounts::{Account, PageCharge};

/// Second chances a page can hold under the host's frequency policy:
/// requests beyond the first that attached it, capped so that a prefix no
/// longer used ages out in a few passes (S3-FIFO's two-bit frequency).
const MAX_CHANCES: u8 = 3;

/// The bytes of one page of one lane: K rows `[page_size][head_dim]` at
/// offset 0, V rows at `page_size · row_bytes`. Partial pages use the same
/// slot size so that appends fill them in place.
#[derive(Debug)]
pub(crate) struct PhysPage {
    /// Unique for the store's lifetime, and kept across restarts by the
    /// manifest; keys the LRUs.
    pub(crate) id: u64,
    pub(crate) layout: Arc<Layout>,
    /// Kept for shared pages, so a sequence that attaches the page gets its
    /// index entry (digest and sketches) without reading the page.
    pub(crate) index_entry: Option<Box<[u8]>>,
    pub(crate) place: RwLock<Placement>,
    /// Holders that need the page to stay where it is (a swap-in in flight,
    /// a lease): a pinned page is never demoted, migrated or moved.
    pub(crate) pins: AtomicU32,
    /// Where a prefetch of the page stands (queued, or made hot and not
    /// used yet) and its kind: bits owned by `device/accounting.rs`.
    pub(crate) prefetch: AtomicU8,
    /// How often selections chose the page, aged (the device's loop policy
    /// packs an epoch and a count here: `device/policy.rs`).
    pub(crate) reuse: AtomicU64,
    /// Requests beyond the first that attached the page, capped: the host's
    /// frequency policy spends one each time the page's turn to migrate
    /// comes (`host/policy.rs`).
    chances: AtomicU8,
    /// The same count, never spent: the device's loop policy ranks pages
    /// other requests share above one request's (`device/policy.rs`).
    sharers: AtomicU8,
    /// Chosen for host memory's round and not yet taken to migrate: no
    /// later choice takes it again (`host/`).
    pub(crate) in_round: AtomicBool,
    /// Its metadata, charged to the tenant whose quotas its slots count
    /// against too (pages are shared only within a tenant).
    charge: PageCharge,
}

impl PhysPage {
    pub(crate) fn new(
        id: u64,
        layout: Arc<Layout>,
        index_entry: Option<Box<[u8]>>,
        place: Placement,
        charge: PageCharge,
    ) -> Self {
        Self {
            id,
            layout,
            index_entry,
            place: RwLock::new(Rank::Placement, place),
            pins: AtomicU32::new(0),
            prefetch: AtomicU8::new(0),
            reuse: AtomicU64::new(0),
            chances: AtomicU8::new(0),
            sharers: AtomicU8::new(0),
            in_round: AtomicBool::new(false),
            charge,
        }
    }

    /// Another request (sequence) took a reference to the page: one more
    /// second chance and one more sharer, each up to [`MAX_CHANCES`].
    pub(crate) fn attached_again(&self) {
        for count in [&self.chances, &self.sharers] {
            let _ = count.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                (c < MAX_CHANCES).then_some(c + 1)
            });
        }
    }

    /// Requests beyond the first that attached the page (capped).
    pub(crate) fn sharers(&self) -> u8 {
        self.sharers.load(Ordering::Relaxed)
    }

    /// Whether the page holds a second chance.
    pub(crate) fn has_chance(&self) -> bool {
        self.chances.load(Ordering::Relaxed) > 0
    }

    /// Spends one second chance; false when none was left.
    pub(crate) fn spend_chance(&self) -> bool {
        self.chances
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_sub(1))
            .is_ok()
    }

    /// The tenant the page belongs to.
    pub(crate) fn owner(&self) -> &Arc<Account> {
        self.charge.owner()
    }

    /// Whether the page is one of `tenant`'s.
    pub(crate) fn owned_by(&self, tenant: &Arc<Account>) -> bool {
        Arc::ptr_eq(self.owner(), tenant)
    }

    pub(crate) fn pinned(&self) -> bool {
        self.pins.load(Ordering::Acquire) > 0
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
    /// Why the page was summarised (it is reported gone with this reason
    /// if the summary is ever lost).
    pub(crate) reason: Reason,
}

pub(crate) type StoreLane = Lane<PageRef, SummaryPage>;
pub(crate) type StorePage = LogicalPage<PageRef, SummaryPage>;

/// A logical page's state: a physical page's placement says hot or cold.
pub(crate) fn state_of(page: &StorePage) -> PageState {
    match page {
        LogicalPage::Physical(r) => r.page.place.read().state(),
        LogicalPage::Summary(_) => PageState::Summary,
        LogicalPage::Gone(_) => PageState::Gone,
    }
}

/// Identity of a shareable page: the same prefix (hash chain entry) of the
/// same model layout, in the same tenant, for the same lane.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ShareKey {
    pub(crate) tenant: TenantId,
    pub(crate) layout: Arc<Layout>,
    pub(crate) hash: Arc<[u8]>,
    pub(crate) lane: u32,
}
