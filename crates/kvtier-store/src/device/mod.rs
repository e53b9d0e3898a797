//! The device tier as a cache of the backing tiers: the hot set, which
//! page to demote (LRU) when the device needs room, swap-in of selected
//! pages in batches, the background workers that run late swap-ins and
//! prefetches, and the accounting of hits, misses and prefetches.
//!
//! Inclusive by default: a hot page keeps its backing copy, so demotion
//! only drops the device copy. Exclusive: a swap-in moves the page (its
//! host copy is freed; an NVMe copy, being durable, stays), and demoting a
//! device-only page copies it back down first.
//!
//! Locks: the LRU is held only to update or pop one entry, never while a
//! page's placement lock is taken.

mod accounting;
mod policy;
mod swapin;
#[cfg(test)]
mod tests;
mod workers;

use std::sync::Arc;

use kvtier_core::Reason;
use kvtier_sync::{Mutex, Rank};
use kvtier_tiers::{Slot, Tier, TierError, TierKind};

pub use policy::DevicePolicy;
pub use swapin::SwapReport;
pub(crate) use workers::Workers;

use crate::StoreResult;
use crate::accounts::Account;
use crate::host::HostCache;
use crate::page::{LruVictims, PageLru, PhysPage, touch_lru};
use crate::stats::Counters;
use policy::{Admitted, LastChosen, Resident, Reuse, Score};

/// How many of a tenant's least recently used hot pages one scan of the LRU
/// collects when the tenant is past its device quota.
const DEMOTION_CANDIDATES: usize = 64;

#[derive(Debug)]
pub(crate) struct HotSet {
    tier: Arc<dyn Tier>,
    /// Hot pages that may be demoted, least recently used first: every hot
    /// page under `Lru`, the stream region under `Loop`.
    lru: PageLru,
    /// A swap-in moves the page instead of copying it.
    exclusive: bool,
    policy: DevicePolicy,
    /// The loop policy's resident subset (empty under `Lru`).
    resident: Mutex<Resident>,
    reuse: Reuse,
    /// The loop policy's last selection of each (sequence, layer).
    last_chosen: Mutex<LastChosen>,
    workers: Arc<Workers>,
    counters: Arc<Counters>,
}

impl HotSet {
    pub(crate) fn new(tier: Arc<dyn Tier>, exclusive: bool, policy: DevicePolicy, counters: Arc<Counters>) -> Self {
        let resident = match policy {
            DevicePolicy::Lru => 0,
            DevicePolicy::Loop => tier.capacity_bytes(),
        };
        Self {
            tier,
            lru: Mutex::new(Rank::DeviceLru, lru::LruCache::unbounded()),
            exclusive,
            policy,
            resident: Mutex::new(Rank::DeviceResident, Resident::new(resident)),
            reuse: Reuse::default(),
            last_chosen: Mutex::new(Rank::DeviceLastChosen, LastChosen::new()),
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
    ///
    /// Under the loop policy a resident page is demoted only when no other
    /// is left, and only when `take_resident` (an explicit swap-in; a
    /// selection's misses beyond the stream region stay cold and are read
    /// from where they are, so the subset keeps hitting).
    pub(crate) fn allocate(
        &self,
        len: u64,
        host: &HostCache,
        owner: &Arc<Account>,
        take_resident: bool,
    ) -> StoreResult<Slot> {
        let demote = |owner| self.demote_lru(host, owner) || (take_resident && self.demote_resident(host, owner));
        while !owner.fits(TierKind::Device, len) && demote(Some(owner)) {}
        owner.slot(TierKind::Device, len, false, || {
            loop {
                match self.tier.allocate(len) {
                    Err(TierError::Full { .. }) if demote(None) => continue,
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
            match self.demote(&page, host) {
                Demotion::Done => break true,
                Demotion::KeptHot => pinned.push((id, weak)),
                Demotion::Gone => {}
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

    /// The lowest-scored resident page (of `owner`, if given) that is not
    /// pinned, demoted; false when none is left.
    fn demote_resident(&self, host: &HostCache, owner: Option<&Arc<Account>>) -> bool {
        let mut kept = Vec::new();
        let demoted = loop {
            let Some((_, weak)) = self.resident.lock().pop_lowest() else {
                break false;
            };
            let Some(page) = weak.upgrade() else { continue };
            if page.pinned() || owner.is_some_and(|o| !page.owned_by(o)) {
                kept.push(page);
                continue;
            }
            match self.demote(&page, host) {
                Demotion::Done => break true,
                Demotion::KeptHot => kept.push(page),
                Demotion::Gone => {}
            }
        };
        // Back in the subset (a page they displace rejoins the LRU).
        self.admit(kept.iter());
        demoted
    }

    /// Drops `page`'s device copy, after copying a device-only page down:
    /// demotion may not drop the only copy.
    fn demote(&self, page: &Arc<PhysPage>, host: &HostCache) -> Demotion {
        if page.place.read().backing_tier().is_none() && !self.copy_down(page, host) {
            return Demotion::KeptHot; // no host room now
        }
        let mut place = page.place.write();
        if page.pinned() {
            return Demotion::KeptHot; // pinned since
        }
        match place.drop_device() {
            Some((change, slot)) => {
                drop(place);
                drop(slot);
                self.counters.counted(change.from, change.to, Reason::CapacityPressure);
                self.note_wasted(page);
                Demotion::Done
            }
            None => Demotion::Gone,
        }
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
            .slot(TierKind::Host, len, true, || host.allocate_if_room(len))
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

    /// Marks pages as just used on the device (a resident page has no
    /// place in the LRU: it is not a candidate).
    pub(crate) fn touch<'a>(&self, pages: impl IntoIterator<Item = &'a Arc<PhysPage>>) {
        match self.policy {
            DevicePolicy::Lru => touch_lru(&self.lru, pages),
            DevicePolicy::Loop => {
                let streamed: Vec<&Arc<PhysPage>> = {
                    let resident = self.resident.lock();
                    pages.into_iter().filter(|p| !resident.contains(p.id)).collect()
                };
                touch_lru(&self.lru, streamed);
            }
        }
    }

    /// Forgets freed pages and pages no longer hot.
    pub(crate) fn forget(&self, page_ids: impl IntoIterator<Item = u64> + Clone) {
        {
            let mut lru = self.lru.lock();
            for id in page_ids.clone() {
                lru.pop(&id);
            }
        }
        if self.policy == DevicePolicy::Loop {
            let mut resident = self.resident.lock();
            for id in page_ids {
                resident.remove(id);
            }
        }
    }

    /// What a selection of `chosen` pages of (`key`, `layer`) does to the
    /// device, in order: a use (`used`: not a speculative query) is counted
    /// and considered for the resident subset, `swap_in` runs, and the
    /// pages to prefetch for the next layer come back (what it chose last
    /// time that is not hot: the loop policy's layer-ahead; none under
    /// `Lru`). The store and the simulation both serve selections this way.
    pub(crate) fn serve_selection<R>(
        &self,
        (key, layer, layers): (&kvtier_core::SequenceKey, u32, u32),
        chosen: &[Arc<PhysPage>],
        used: bool,
        swap_in: impl FnOnce() -> R,
    ) -> (R, Vec<Arc<PhysPage>>) {
        if used {
            self.note_chosen(chosen);
            self.selected(chosen);
        }
        let swapped = swap_in();
        let ahead = self
            .chosen_ahead(key, layer, layers, chosen)
            .into_iter()
            .filter(|p| p.place.read().state() != kvtier_core::PageState::Hot)
            .collect();
        (swapped, ahead)
    }

    /// A selection chose `pages` (its swap-in, if any, comes after): the
    /// loop policy counts each once and considers the hot ones for the
    /// resident subset.
    pub(crate) fn selected(&self, pages: &[Arc<PhysPage>]) {
        if self.policy != DevicePolicy::Loop {
            return;
        }
        for page in pages {
            self.reuse.count(page);
        }
        let bytes = pages.iter().map(|p| p.layout.page_bytes() as u64).sum();
        let left = self.resident.lock().fit_stream(bytes);
        let left: Vec<Arc<PhysPage>> = left.iter().filter_map(std::sync::Weak::upgrade).collect();
        touch_lru(&self.lru, left.iter());
        let (hot, cold): (Vec<&Arc<PhysPage>>, Vec<&Arc<PhysPage>>) =
            pages.iter().partition(|p| p.place.read().device().is_some());
        // A member that lost its device copy in a race with a demotion
        // (admitted as it left the LRU) gives its place back here.
        {
            let mut resident = self.resident.lock();
            for page in cold {
                resident.remove(page.id);
            }
        }
        self.admit(hot);
    }

    /// Considers hot `pages` for the resident subset: an admitted page
    /// leaves the LRU, a displaced one rejoins it (still hot).
    fn admit<'a>(&self, pages: impl IntoIterator<Item = &'a Arc<PhysPage>>) {
        let (mut joined, mut left) = (Vec::new(), Vec::new());
        {
            let mut resident = self.resident.lock();
            for page in pages {
                let score = self.reuse.score(page);
                let gives_way = |member: &PhysPage| self.gives_way(member, page, score);
                match resident.admit(page, score, gives_way) {
                    Admitted::Yes => joined.push(page.id),
                    Admitted::Displaced(id, weak) => {
                        joined.push(page.id);
                        left.extend(weak.upgrade().filter(|_| id != page.id));
                    }
                    Admitted::No => {}
                }
            }
        }
        {
            let mut lru = self.lru.lock();
            for id in joined {
                lru.pop(&id);
            }
        }
        touch_lru(&self.lru, left.iter());
    }

    /// Whether resident `member` gives its place to `page` (with `score`):
    /// the loop left the member behind, `page` was chosen lately (not only
    /// brought by a client's prefetch no selection chose), and the member is
    /// not shared by more requests.
    fn gives_way(&self, member: &PhysPage, page: &PhysPage, score: Score) -> bool {
        self.reuse.stale(member) && !self.reuse.stale(page) && self.reuse.score(member).shared <= score.shared
    }

    /// The loop policy's layer-ahead list: records what (`key`, `layer`)
    /// chose and returns what the next layer chose last time (the layer
    /// after the last wraps to 0, the next step's first), so that the
    /// caller can prefetch it. Empty under `Lru`.
    fn chosen_ahead(
        &self,
        key: &kvtier_core::SequenceKey,
        layer: u32,
        layers: u32,
        chosen: &[Arc<PhysPage>],
    ) -> Vec<Arc<PhysPage>> {
        if self.policy != DevicePolicy::Loop {
            return Vec::new();
        }
        let next = (layer + 1) % layers.max(1);
        let mut last = self.last_chosen.lock();
        let replaced = last.insert((key.clone(), layer), chosen.iter().map(Arc::downgrade).collect());
        self.reuse
            .loop_changed(chosen.len() as i64 - replaced.map_or(0, |r| r.len() as i64));
        last.get(&(key.clone(), next))
            .map(|pages| pages.iter().filter_map(std::sync::Weak::upgrade).collect())
            .unwrap_or_default()
    }

    /// Forgets a dropped sequence's layer-ahead lists.
    pub(crate) fn forget_sequence(&self, key: &kvtier_core::SequenceKey, layers: u32) {
        let mut last = self.last_chosen.lock();
        for layer in 0..layers {
            if let Some(gone) = last.remove(&(key.clone(), layer)) {
                self.reuse.loop_changed(-(gone.len() as i64));
            }
        }
    }
}

/// What demoting one page did.
enum Demotion {
    /// Its device copy is gone; the device has room.
    Done,
    /// It stays hot (pinned, or a device-only page with no host room).
    KeptHot,
    /// It had no device copy any more.
    Gone,
}
