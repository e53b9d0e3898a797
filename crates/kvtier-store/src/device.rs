//! The device tier as an inclusive cache of the backing tiers: which hot
//! pages to demote (LRU) when the device needs room.

use std::sync::{Arc, Weak};

use kvtier_core::{PageState, Reason};
use kvtier_tiers::{Slot, TierError};

use crate::Store;
use crate::page::PhysPage;
use crate::sync::{lock, read, write};

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
            // Demotion may not drop the only copy: a page held only on the
            // device (exclusive caching) is copied down to host first.
            if read(&page.place).backing_tier().is_none() && !self.copy_down(&page) {
                pinned.push((id, weak)); // no host room now; keep it hot
                continue;
            }
            let mut place = write(&page.place);
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

    /// Gives a device-only page a host copy; false if there is no host room
    /// (demotion never makes room below it by force).
    fn copy_down(&self, page: &Arc<PhysPage>) -> bool {
        let place = read(&page.place);
        let Some(device) = &place.device else { return true };
        let mut bytes = vec![0u8; device.len() as usize];
        if self.device.read(device, 0, &mut bytes).is_err() {
            return false;
        }
        let version = place.version;
        drop(place);
        let Ok(mut slot) = self.host.allocate(bytes.len() as u64) else {
            return false;
        };
        if self.host.write(&mut slot, 0, &bytes).is_err() {
            return false;
        }
        let mut place = write(&page.place);
        if place.version != version || place.host.is_some() {
            return place.host.is_some();
        }
        place.host = Some(slot);
        drop(place);
        self.touch_host([page]);
        true
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
