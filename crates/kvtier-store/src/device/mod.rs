//! The device tier as a cache of the backing tiers: the hot set, which
//! page to demote (LRU) when the device needs room, swap-in of selected
//! pages in batches, the background workers that run late swap-ins and
//! prefetches, and the accounting of prefetches.
//!
//! Inclusive by default: a hot page keeps its backing copy, so demotion
//! only drops the device copy. Exclusive: a swap-in moves the page (its
//! host copy is freed; an NVMe copy, being durable, stays), and demoting a
//! device-only page copies it back down first.
//!
//! Locks: the LRU is held only to update or pop one entry, never while a
//! page's placement lock is taken.

mod swapin;
#[cfg(test)]
mod tests;
mod workers;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvtier_core::Reason;
use kvtier_sync::{Mutex, Rank};
use kvtier_tiers::{Slot, Tier, TierError, TierKind};

pub use swapin::SwapReport;
pub(crate) use workers::Workers;

use crate::StoreResult;
use crate::accounts::Account;
use crate::host::HostCache;
use crate::page::{LruVictims, PageLru, PhysPage, touch_lru};
use crate::stats::Counters;

/// How many of a tenant's least recently used hot pages one scan of the LRU
/// collects when the tenant is past its device quota.
const DEMOTION_CANDIDATES: usize = 64;

#[derive(Debug)]
pub(crate) struct HotSet {
    tier: Arc<dyn Tier>,
    lru: PageLru,
    /// A swap-in moves the page instead of copying it.
    exclusive: bool,
    workers: Arc<Workers>,
    counters: Arc<Counters>,
}

impl HotSet {
    pub(crate) fn new(tier: Arc<dyn Tier>, exclusive: bool, counters: Arc<Counters>) -> Self {
        Self {
            tier,
            lru: Mutex::new(Rank::DeviceLru, lru::LruCache::unbounded()),
            exclusive,
            workers: Workers::start(2),
            counters,
        }
    }

    pub(crate) fn tier(&self) -> &Arc<dyn Tier> {
        &self.tier
    }

    pub(crate) fn workers(&self) -> &Arc<Workers> {
        &self.workers
    }

    /// A device slot of `len` bytes for one of `owner`'s pages, demoting
    /// least recently used hot pages: the owner's own while it is past its
    /// device quota (refused when none is left), anyone's while the device
    /// is full. Demotion only drops the device copy (the backing copy
    /// stays), so nothing is lost.
    pub(crate) fn allocate(&self, len: u64, host: &HostCache, owner: &Arc<Account>) -> StoreResult<Slot> {
        while !owner.fits(TierKind::Device, len) && self.demote_lru(host, Some(owner)) {}
        owner.slot(TierKind::Device, len, false, || {
            loop {
                match self.tier.allocate(len) {
                    Err(TierError::Full { .. }) if self.demote_lru(host, None) => continue,
                    other => return other,
                }
            }
        })
    }

    /// Demotes the least recently used hot page (of `owner`, if given) that
    /// is not pinned; false when none is left.
    fn demote_lru(&self, host: &HostCache, owner: Option<&Arc<Account>>) -> bool {
        let mut pinned = Vec::new();
        // An owner's candidates come as a batch: pinned ones are skipped below.
        let mut candidates = LruVictims::new(&self.lru, owner, DEMOTION_CANDIDATES);
        let demoted = loop {
            let Some((id, weak)) = candidates.pop() else {
                break false;
            };
            // A page freed since it was cached has already released its slot.
            let Some(page) = weak.upgrade() else { continue };
            if page.pinned() {
                pinned.push((id, weak));
                continue;
            }
            // Demotion may not drop the only copy: a page held only on the
            // device (exclusive caching) is copied down to host first.
            if page.place.read().backing_tier().is_none() && !self.copy_down(&page, host) {
                pinned.push((id, weak)); // no host room now; keep it hot
                continue;
            }
            let mut place = page.place.write();
            if page.pinned() {
                continue; // pinned since: it stays hot
            }
            if let Some((change, slot)) = place.drop_device() {
                drop(place);
                drop(slot);
                self.counters.counted(change.from, change.to, Reason::CapacityPressure);
                self.note_wasted(&page);
                break true;
            }
        };
        // Pinned pages keep their place at the least recently used end.
        let mut lru = self.lru.lock();
        for (id, weak) in pinned {
            lru.put(id, weak);
            lru.demote(&id);
        }
        demoted
    }

    /// Gives a device-only page a host copy; false if there is no host room
    /// (demotion never makes room below it by force).
    fn copy_down(&self, page: &Arc<PhysPage>, host: &HostCache) -> bool {
        let place = page.place.read();
        let Some(device) = place.device() else { return true };
        let mut bytes = vec![0u8; device.len() as usize];
        if self.tier.read(device, 0, &mut bytes).is_err() {
            return false;
        }
        let version = place.version();
        drop(place);
        // Past the owner's host quota if need be: demotion must not stall.
        let len = bytes.len() as u64;
        let Ok(mut slot) = page
            .owner()
            .slot(TierKind::Host, len, true, || host.tier().allocate(len))
        else {
            return false;
        };
        if host.tier().write(&mut slot, 0, &bytes).is_err() {
            return false;
        }
        let installed = page.place.write().install_host(slot, version);
        match installed {
            Ok(_hot_still) => {
                host.touch([page]);
                true
            }
            // Another path gave it a host copy meanwhile, or it changed.
            Err(_) => page.place.read().host().is_some(),
        }
    }

    /// Marks pages as just used on the device.
    pub(crate) fn touch<'a>(&self, pages: impl IntoIterator<Item = &'a Arc<PhysPage>>) {
        touch_lru(&self.lru, pages);
    }

    pub(crate) fn forget(&self, page_ids: impl IntoIterator<Item = u64>) {
        let mut lru = self.lru.lock();
        for id in page_ids {
            lru.pop(&id);
        }
    }

    /// Counts a selection's use of pages a prefetch brought up.
    pub(crate) fn note_used(&self, pages: &[Arc<PhysPage>]) {
        let used = pages
            .iter()
            .filter(|p| p.prefetched.swap(false, Ordering::AcqRel))
            .count();
        Counters::add(&self.counters.prefetch_used, used as u64);
    }

    /// Counts prefetched pages that left the device, or were freed, unused.
    pub(crate) fn note_wasted(&self, page: &PhysPage) {
        if page.prefetched.swap(false, Ordering::AcqRel) {
            Counters::add(&self.counters.prefetch_wasted, 1);
        }
    }
}
