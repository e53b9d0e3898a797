//! The host tier as a cache over NVMe: new pages land here, least recently
//! used pages migrate to NVMe under pressure (synchronously when an
//! allocation finds the tier full, in the background between the
//! watermarks), and nothing here is ever dropped to make room without an
//! NVMe copy.
//!
//! Locks: the LRU is held only to update or pop one entry, never while a
//! page's placement lock is taken (a reader touches the LRU after releasing
//! the page; migration pops its victims one entry at a time). `migrating`
//! is held for a whole migration, so that a second allocation waits for
//! the first one's room instead of finding its victims taken.

mod policy;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::Reason;
use kvtier_sync::{Mutex, MutexGuard, Rank};
use kvtier_tiers::{Slot, Tier, TierError, TierKind};

use crate::accounts::Account;
use crate::durability::{Durable, Keep};
use crate::page::{LruVictims, PageLru, PhysPage, touch_lru};
use crate::{StoreError, StoreResult};
pub use policy::HostPolicy;

/// Pages migrated per batch when making room in host memory.
const MIGRATION_BATCH: usize = 64;

/// Most main-queue pages one migration passes over for their second
/// chances: past it, the least recent go whatever their chances (a bound
/// on the work done under the migration lock when most pages have one).
const MOST_PASSED_OVER: usize = 16 * MIGRATION_BATCH;

/// Time a foreground call spent making host room: waiting for a migration
/// already running, and migrating itself.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct MigrationTime {
    pub(crate) waited: Duration,
    pub(crate) moving: Duration,
}

#[derive(Debug)]
pub(crate) struct HostCache {
    tier: Arc<dyn Tier>,
    /// Host pages in line to migrate, least recently used first: all of
    /// them under the LRU policy; under the frequency policy S3-FIFO's
    /// small queue, where every page starts.
    lru: PageLru,
    /// The frequency policy's main queue: pages that had a second chance
    /// when their turn came in the small queue (empty under LRU).
    main: PageLru,
    policy: HostPolicy,
    migrating: Mutex<()>,
    /// Above this share of capacity the background migrates ...
    high: f64,
    /// ... down to this one.
    low: f64,
}

impl HostCache {
    pub(crate) fn new(tier: Arc<dyn Tier>, policy: HostPolicy, high_watermark: f64, low_watermark: f64) -> Self {
        Self {
            tier,
            lru: Mutex::new(Rank::HostLru, lru::LruCache::unbounded()),
            main: Mutex::new(Rank::HostMain, lru::LruCache::unbounded()),
            policy,
            migrating: Mutex::new(Rank::HostMigration, ()),
            high: high_watermark,
            low: low_watermark,
        }
    }

    pub(crate) fn tier(&self) -> &Arc<dyn Tier> {
        &self.tier
    }

    /// A host slot of `len` bytes for one of `owner`'s pages. Past the
    /// owner's host quota, its own least recently used pages migrate to NVMe
    /// first (refused when none can); when the host is full, anyone's. Full
    /// only when both tiers are; a failed migration (ENOSPC, EIO) is
    /// reported as itself.
    pub(crate) fn allocate(
        &self,
        len: u64,
        durable: &Durable,
        spent: &mut MigrationTime,
        owner: &Arc<Account>,
    ) -> StoreResult<Slot> {
        while !owner.fits(TierKind::Host, len) && durable.nvme().is_some() {
            let one = self.migrating.lock();
            if !matches!(self.relieve_locked(len, durable, &one, Some(owner)), Ok(n) if n > 0) {
                break;
            }
        }
        owner.slot(TierKind::Host, len, false, || self.allocate_room(len, durable, spent))
    }

    /// A host slot of `len` bytes, migrating anyone's pages for room.
    fn allocate_room(&self, len: u64, durable: &Durable, spent: &mut MigrationTime) -> Result<Slot, TierError> {
        loop {
            match self.tier.allocate(len) {
                Err(full @ TierError::Full { .. }) => {
                    if durable.nvme().is_none() {
                        return Err(full);
                    }
                    let waiting = Instant::now();
                    let one = self.migrating.lock();
                    spent.waited += waiting.elapsed();
                    let moving = Instant::now();
                    let moved = self.relieve_locked(len, durable, &one, None);
                    spent.moving += moving.elapsed();
                    drop(one);
                    match moved {
                        // Nothing left to move; a migration that ran
                        // meanwhile may still have made room.
                        Ok(0) => return self.tier.allocate(len),
                        Ok(_) => {}
                        Err(StoreError::ResourceExhausted(e) | StoreError::Unavailable(e)) => return Err(e),
                        Err(_) => return Err(full),
                    }
                }
                other => return other,
            }
        }
    }

    /// Keeps host memory between the watermarks: above the high one, least
    /// recently used pages migrate to NVMe until the low one.
    pub(crate) fn rebalance(&self, durable: &Durable) {
        if durable.nvme().is_none() {
            return;
        }
        let capacity = self.tier.capacity_bytes() as f64;
        let (high, low) = ((capacity * self.high) as u64, (capacity * self.low) as u64);
        if self.tier.used_bytes() <= high {
            return;
        }
        // Read once per round: a concurrent free may shrink `used` between
        // two reads, and the excess must not underflow.
        while let Some(excess) = self.tier.used_bytes().checked_sub(low).filter(|&e| e > 0) {
            let one = self.migrating.lock();
            if !matches!(self.relieve_locked(excess, durable, &one, None), Ok(n) if n > 0) {
                break;
            }
        }
    }

    /// Migrates least recently used host pages (of `owner` only, if given)
    /// to NVMe until about `bytes` (at least one batch) are free; returns
    /// the pages migrated.
    fn relieve_locked(
        &self,
        bytes: u64,
        durable: &Durable,
        _migrating: &MutexGuard<'_, ()>,
        owner: Option<&Arc<Account>>,
    ) -> StoreResult<usize> {
        let Chosen {
            mut victims,
            small,
            main,
        } = self.choose(bytes, owner);
        // Pages created together (one write, one lane's run) have adjacent
        // ids: allocating their NVMe slots in id order keeps them adjacent on
        // disk too, so the reads of a later step can run sequentially.
        victims.sort_by_key(|p| p.id);
        // A page a reader touched while it was out of line is back in the
        // small queue already: taken twice, it would be copied twice.
        victims.dedup_by_key(|p| p.id);
        touch_lru(&self.lru, small.iter());
        touch_lru(&self.main, main.iter());
        // ... and one moving to the main queue leaves the small one.
        {
            let mut small = self.lru.lock();
            for page in &main {
                small.pop(&page.id);
            }
        }
        let moved = durable.write_copies(&victims, Keep::Nothing, Reason::CapacityPressure);
        // Pages that did not move keep their place in line.
        let kept: Vec<Arc<PhysPage>> = victims
            .into_iter()
            .filter(|p| p.place.read().host().is_some())
            .collect();
        self.touch(&kept);
        if let Err(e) = &moved {
            tracing::warn!(error = %e, "could not migrate host pages to nvme");
        }
        moved
    }

    /// The pages to migrate for about `bytes` (at least one batch), taken
    /// out of their queues, and those to put back at the most recent end
    /// of each: pinned pages, and under the frequency policy the pages
    /// passed over, into the main queue: the small queue's that hold a
    /// second chance, and the main queue's that spent one.
    fn choose(&self, bytes: u64, owner: Option<&Arc<Account>>) -> Chosen {
        let mut chosen = Chosen::default();
        let mut freed = 0u64;
        let mut passed_over = Vec::new();
        let wanted = |victims: &Vec<Arc<PhysPage>>, freed: u64| {
            (freed < bytes || victims.len() < MIGRATION_BATCH) && victims.len() < 4 * MIGRATION_BATCH
        };
        // Past the bound on pages passed over, the rest of the room comes
        // from them, least recent first, with no more popped.
        let mut capped = false;
        let frequency = self.policy == HostPolicy::Frequency;
        for (turn, queue) in self.queues_in_turn().into_iter().enumerate() {
            let from_main = std::ptr::eq(queue, &self.main);
            let mut candidates = LruVictims::new(queue, owner, 4 * MIGRATION_BATCH);
            // A batch fills from the queue whose turn it is; the other gives
            // only the room still asked for (a host of few batches would
            // otherwise empty its main queue to fill one).
            let more = |victims: &Vec<Arc<PhysPage>>, freed: u64| match turn {
                0 => wanted(victims, freed),
                _ => freed < bytes && victims.len() < 4 * MIGRATION_BATCH,
            };
            while more(&chosen.victims, freed) {
                if passed_over.len() >= MOST_PASSED_OVER {
                    capped = true;
                    break;
                }
                let Some((_, weak)) = candidates.pop() else { break };
                let Some(page) = weak.upgrade() else { continue };
                if page.pinned() {
                    if from_main { &mut chosen.main } else { &mut chosen.small }.push(page);
                    continue;
                }
                let place = page.place.read();
                let (Some(host), None) = (place.host(), place.lost()) else {
                    continue; // no host copy to migrate: out of line
                };
                let reserved = host.reserved();
                drop(place);
                // Attached again: into the main queue (from the small one),
                // or back to its most recent end for one chance (in it).
                let deferred = frequency
                    && if from_main {
                        page.spend_chance()
                    } else {
                        page.has_chance()
                    };
                if deferred {
                    passed_over.push((page, reserved));
                } else {
                    freed += reserved;
                    chosen.victims.push(page);
                }
            }
        }
        // Chances only reorder: when the room asked for is not found
        // without them, the pages passed over go too, least recent first
        // (and a whole batch, once capped).
        let mut passed_over = passed_over.into_iter();
        let more = |victims: &Vec<Arc<PhysPage>>, freed: u64| match capped {
            true => wanted(victims, freed),
            false => freed < bytes && victims.len() < 4 * MIGRATION_BATCH,
        };
        while more(&chosen.victims, freed) {
            let Some((page, reserved)) = passed_over.next() else {
                break;
            };
            freed += reserved;
            chosen.victims.push(page);
        }
        chosen.main.extend(passed_over.map(|(page, _)| page));
        chosen
    }

    /// The queues victims are taken from, in turn: under the frequency
    /// policy the small queue first, unless the main queue holds more than
    /// its share (S3-FIFO's 90%, in pages).
    fn queues_in_turn(&self) -> Vec<&PageLru> {
        match self.policy {
            HostPolicy::Lru => vec![&self.lru],
            HostPolicy::Frequency => {
                let main = self.main.lock().len();
                let small = self.lru.lock().len();
                if main * 10 > (main + small) * 9 {
                    vec![&self.main, &self.lru]
                } else {
                    vec![&self.lru, &self.main]
                }
            }
        }
    }

    /// Marks pages as just used in host memory (in the main queue if they
    /// are in it, else in the LRU). Never called with a page's placement
    /// lock held.
    pub(crate) fn touch<'a>(&self, pages: impl IntoIterator<Item = &'a Arc<PhysPage>>) {
        match self.policy {
            HostPolicy::Lru => touch_lru(&self.lru, pages),
            HostPolicy::Frequency => {
                let rest: Vec<&Arc<PhysPage>> = {
                    let mut main = self.main.lock();
                    pages.into_iter().filter(|p| main.get(&p.id).is_none()).collect()
                };
                touch_lru(&self.lru, rest);
            }
        }
    }

    /// Forgets freed pages.
    pub(crate) fn forget(&self, ids: impl IntoIterator<Item = u64> + Clone) {
        for queue in [&self.lru, &self.main] {
            let mut queue = queue.lock();
            for id in ids.clone() {
                queue.pop(&id);
            }
        }
    }
}

/// What one migration takes and puts back (see [`HostCache::choose`]).
#[derive(Default)]
struct Chosen {
    victims: Vec<Arc<PhysPage>>,
    /// Back at the most recent end of the LRU (the small queue).
    small: Vec<Arc<PhysPage>>,
    /// Back at the most recent end of the main queue.
    main: Vec<Arc<PhysPage>>,
}
