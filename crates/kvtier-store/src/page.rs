//! Physical pages and their placement across tiers.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use kvtier_core::{ColdTier, Lane, Layout, LogicalPage, PageState, PhysId, Reason, TenantId};
use kvtier_tiers::{Slot, Tier, TierError};

use crate::accounts::{Account, PageCharge};
use crate::sync::lock;

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
    /// Promoted by a prefetch and not yet used by a selection.
    pub(crate) prefetched: AtomicBool,
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
            place: RwLock::new(place),
            pins: AtomicU32::new(0),
            prefetched: AtomicBool::new(false),
            charge,
        }
    }

    /// The tenant the page belongs to.
    pub(crate) fn owner(&self) -> &Arc<Account> {
        self.charge.owner()
    }

    pub(crate) fn pinned(&self) -> bool {
        self.pins.load(Ordering::Acquire) > 0
    }
}

/// A cache's least-recently-used order of its pages (the host cache's, the
/// device's), keyed by page id.
pub(crate) type PageLru = Mutex<lru::LruCache<u64, Weak<PhysPage>>>;

/// Marks `pages` as just used in `lru`. A page in line already only moves
/// to the front: no new weak reference, no old one dropped (each an atomic
/// on the page, thousands of them in a decode step).
pub(crate) fn touch_lru<'a>(lru: &PageLru, pages: impl IntoIterator<Item = &'a Arc<PhysPage>>) {
    let mut lru = lock(lru);
    for page in pages {
        if lru.get(&page.id).is_none() {
            lru.put(page.id, Arc::downgrade(page));
        }
    }
}

/// Takes a page LRU's entries out, least recently used first: any page, or
/// only `owner`'s (a tenant past its quota makes room from its own pages).
#[derive(Debug)]
pub(crate) struct LruVictims<'a> {
    lru: &'a PageLru,
    /// The owner's candidates, found in one pass over the LRU.
    owned: Option<std::vec::IntoIter<u64>>,
}

impl<'a> LruVictims<'a> {
    /// With an owner, up to `n` of its pages are candidates.
    pub(crate) fn new(lru: &'a PageLru, owner: Option<&Arc<Account>>, n: usize) -> Self {
        let owned = owner.map(|o| least_recent_of(lru, o, n).into_iter());
        Self { lru, owned }
    }

    /// The next entry, taken out of the LRU.
    pub(crate) fn pop(&mut self) -> Option<(u64, Weak<PhysPage>)> {
        match &mut self.owned {
            None => lock(self.lru).pop_lru(),
            Some(ids) => ids.find_map(|id| lock(self.lru).pop_entry(&id)),
        }
    }
}

/// The ids of up to `n` of `owner`'s pages in a page LRU, least recently
/// used first: one pass over the LRU, for a tenant past its quota.
fn least_recent_of(lru: &PageLru, owner: &Arc<Account>, n: usize) -> Vec<u64> {
    // The pages seen are dropped after the LRU's lock: the last reference
    // to a page may go here, and freeing its slots takes other locks.
    let mut seen = Vec::new();
    let mut ids = Vec::new();
    {
        let lru = lock(lru);
        for (id, weak) in lru.iter().rev() {
            let Some(page) = weak.upgrade() else { continue };
            if owner.owns(&page) {
                ids.push(*id);
            }
            seen.push(page);
            if ids.len() == n {
                break;
            }
        }
    }
    drop(seen);
    ids
}

/// Pins pages for as long as it lives.
#[derive(Debug)]
pub(crate) struct Pins(Vec<Arc<PhysPage>>);

impl Pins {
    pub(crate) fn new(pages: Vec<Arc<PhysPage>>) -> Self {
        for p in &pages {
            p.pins.fetch_add(1, Ordering::AcqRel);
        }
        Self(pages)
    }

    pub(crate) fn pages(&self) -> &[Arc<PhysPage>] {
        &self.0
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        for p in &self.0 {
            p.pins.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Where a physical page's bytes are. At least one of the host and NVMe
/// copies exists unless the page is lost; the device copy is an inclusive
/// cache (dropping it loses nothing), and so is a host copy next to an NVMe
/// copy.
#[derive(Debug)]
pub(crate) struct Placement {
    pub(crate) device: Option<Slot>,
    pub(crate) host: Option<Slot>,
    pub(crate) nvme: Option<NvmeCopy>,
    /// The NVMe copy from before rows were last appended: no longer a copy
    /// of the page, but still the manifest's record of its first rows
    /// (appends never change rows already written). It is kept until a
    /// current copy replaces it, so a crash in between recovers those rows.
    pub(crate) durable_prefix: Option<NvmeCopy>,
    /// Valid token rows in the page.
    pub(crate) rows: u32,
    /// Bumped by every change of the page's bytes, so that a copy taken
    /// without the lock can tell whether it is still current.
    pub(crate) version: u64,
    /// The bytes are gone for every sequence sharing the page (a failed
    /// checksum or read); the page is never served again.
    pub(crate) lost: Option<Reason>,
}

/// A page's copy on NVMe, with the CRC32C of the slot's page bytes and the
/// token rows it holds.
#[derive(Debug, Clone)]
pub(crate) struct NvmeCopy {
    pub(crate) slot: Arc<Slot>,
    pub(crate) crc: u32,
    pub(crate) rows: u32,
}

impl Placement {
    pub(crate) fn new(device: Option<Slot>, host: Slot, rows: u32) -> Self {
        Self {
            device,
            host: Some(host),
            nvme: None,
            durable_prefix: None,
            rows,
            version: 0,
            lost: None,
        }
    }

    pub(crate) fn state(&self) -> PageState {
        match (self.lost, &self.device, &self.host, &self.nvme) {
            (Some(_), ..) => PageState::Gone,
            (None, Some(_), ..) => PageState::Hot,
            (None, None, Some(_), _) => PageState::Cold(ColdTier::Host),
            (None, None, None, Some(_)) => PageState::Cold(ColdTier::Nvme),
            // Not lost yet without a copy: never the case, and never served
            // if it were.
            (None, None, None, None) => PageState::Gone,
        }
    }

    /// The cold tier holding the page's backing copy (host preferred).
    pub(crate) fn backing_tier(&self) -> Option<ColdTier> {
        match (&self.host, &self.nvme) {
            (Some(_), _) => Some(ColdTier::Host),
            (None, Some(_)) => Some(ColdTier::Nvme),
            (None, None) => None,
        }
    }

    /// The page's bytes changed: copies elsewhere are stale.
    pub(crate) fn touch_bytes(&mut self) {
        self.version += 1;
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
        LogicalPage::Physical(r) => r.page.place.read().unwrap_or_else(|p| p.into_inner()).state(),
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

/// The first `rows` K rows then V rows of a whole page's bytes.
pub(crate) fn rows_of(page: &[u8], layout: &Layout, rows: u32) -> Vec<u8> {
    let n = rows as usize * layout.row_bytes();
    let v = layout.page_size() as usize * layout.row_bytes();
    [&page[..n], &page[v..v + n]].concat()
}

/// Reads the first `rows` rows of K then of V into `dst`, which is exactly
/// that long.
pub(crate) fn read_rows_into(
    tier: &dyn Tier,
    slot: &Slot,
    layout: &Layout,
    rows: u32,
    dst: &mut [MaybeUninit<u8>],
) -> Result<(), TierError> {
    let n = rows as usize * layout.row_bytes();
    let (k, v) = dst.split_at_mut(n);
    tier.read_uninit(slot, 0, k)?;
    tier.read_uninit(slot, u64::from(layout.page_size()) * layout.row_bytes() as u64, v)
}
