//! The device tier as an inclusive cache of the backing tiers: which hot
//! pages to demote (LRU) when the device needs room.

use std::sync::{Arc, Weak};

use kvtier_core::{PageState, Reason};
use kvtier_tiers::{Slot, TierError};

use crate::Store;
use crate::page::PhysPage;
use crate::sync::{lock, write};

impl Store {
    /// A device slot of `len` bytes, demoting least recently used hot pages
    /// while the device is full. Demotion only drops the device copy (the
    /// backing copy stays), so nothing is lost.
    pub(crate) fn allocate_device(&self, len: u64) -> Result<Slot, TierError> {
        loop {
            match self.device.allocate(len) {
                Err(TierError::Full { .. }) if self.demote_lru() => continue,
                other => return other,
            }
        }
    }

    /// Demotes the least recently used hot page that is not pinned; false
    /// when none is left.
    fn demote_lru(&self) -> bool {
        let mut pinned = Vec::new();
        let demoted = loop {
            let Some((id, weak)) = lock(&self.device_lru).pop_lru() else {
                break false;
            };
            // A page freed since it was cached has already released its slot.
            let Some(page) = weak.upgrade() else { continue };
            if page.pinned() {
                pinned.push((id, weak));
                continue;
            }
            let mut place = write(&page.place);
            // Demotion may not drop the only copy: a device copy without a
            // backing copy stays.
            if place.backing_tier().is_some() && place.device.take().is_some() {
                let to = place.state();
                drop(place);
                self.counters
                    .transition(PageState::Hot, to, Reason::CapacityPressure, 1);
                self.note_wasted(&page);
                break true;
            }
        };
        // Pinned pages keep their place at the least recently used end.
        let mut lru = lock(&self.device_lru);
        for (id, weak) in pinned {
            lru.put(id, weak);
            lru.demote(&id);
        }
        demoted
    }

    /// Marks pages as just used on the device.
    pub(crate) fn touch_device(&self, pages: impl IntoIterator<Item = Arc<PhysPage>>) {
        let mut lru = lock(&self.device_lru);
        for page in pages {
            lru.put(page.id, Arc::downgrade(&page));
        }
    }

    pub(crate) fn forget_device(&self, page_ids: impl IntoIterator<Item = u64>) {
        let mut lru = lock(&self.device_lru);
        for id in page_ids {
            lru.pop(&id);
        }
    }
}

pub(crate) type DeviceLru = lru::LruCache<u64, Weak<PhysPage>>;
