//! The host tier as a cache over NVMe: new pages land here, least recently
//! used pages migrate to NVMe under pressure (synchronously when an
//! allocation finds the tier full, in the background between the
//! watermarks), and nothing here is ever dropped to make room without an
//! NVMe copy.
//!
//! Between the watermarks: a round opens at the allocation (or a write's
//! pages joining the queues) that takes memory past the high one, less
//! the pages already chosen, sized then (what is above the low one); the
//! pages allocated or written after it choose its pages, two each, in the
//! policy's order (reads choose nothing), marking them `in_round`; the
//! store's rounds thread, woken once a batch is chosen, migrates them. Not
//! on a timer, and not chasing the writes that go on meanwhile: which
//! pages migrate, and where the next round opens, are then a function of
//! the calls alone, so that a replay of them (`kvtier tune`'s simulation,
//! which runs this code) migrates the same pages the store does, and no
//! call pays for more than its own pages' worth of choosing.
//!
//! Locks: the LRU is held only to update or pop one entry, never while a
//! page's placement lock is taken (a reader touches the LRU after releasing
//! the page; migration pops its victims one entry at a time). `migrating`
//! is held for a whole migration, so that a second allocation waits for
//! the first one's room instead of finding its victims taken. The round's
//! chosen pages (`round`) are a leaf, taken alone; one thread chooses at a
//! time (`choosing`), and pays the choices the others owe.

mod policy;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
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

/// Pages chosen for the round open per page allocated or touched, at most:
/// a written page is both, so the round's choice stays well ahead of the
/// writes that fill memory, and no call pays for more than its own pages'
/// worth (counting pages, not calls, a replay that batches its calls
/// differently chooses the same).
const CHOSEN_PER_PAGE: usize = 2;

/// How many pages one choice takes: at least `fewest` (room asked for or
/// not), at most `most`.
#[derive(Debug, Clone, Copy)]
struct Take {
    fewest: usize,
    most: usize,
}

/// A migration's choice: a batch at least, four at most.
const MIGRATION: Take = Take {
    fewest: MIGRATION_BATCH,
    most: 4 * MIGRATION_BATCH,
};

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
    /// The pages the rounds due migrate, chosen where each fell due, with
    /// the host bytes each held then.
    round: Mutex<Vec<(Arc<PhysPage>, u64)>>,
    /// Host bytes the pages chosen will free: memory counts as holding its
    /// used bytes less these, so that where the next round falls due does
    /// not depend on how far the background thread has got.
    due_bytes: AtomicU64,
    /// Bytes of the round open still to choose (0: none open).
    unchosen: AtomicU64,
    /// Choices owed by pages allocated or written while another thread
    /// was choosing (paid by whoever chooses next).
    owed: AtomicU64,
    /// A thread is choosing a round's pages (one at a time).
    choosing: AtomicBool,
    /// The background thread, woken when a round falls due.
    background: OnceLock<Thread>,
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
            round: Mutex::new(Rank::HostRound, Vec::new()),
            due_bytes: AtomicU64::new(0),
            unchosen: AtomicU64::new(0),
            owed: AtomicU64::new(0),
            choosing: AtomicBool::new(false),
            background: OnceLock::new(),
        }
    }

    /// The thread that runs the rounds that fall due ([`Self::rebalance`]).
    pub(crate) fn run_rounds_on(&self, thread: Thread) {
        // Set once, when the store starts its background thread.
        let _ = self.background.set(thread);
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
            // The pages chosen (some maybe the owner's) first.
            if matches!(self.run_round_locked(durable, &one), Ok(n) if n > 0) {
                continue;
            }
            if !matches!(self.relieve_locked(len, durable, &one, Some(owner)), Ok(n) if n > 0) {
                break;
            }
        }
        let slot = owner.slot(TierKind::Host, len, false, || self.allocate_room(len, durable, spent))?;
        self.fall_due_if_above(1);
        Ok(slot)
    }

    /// A host slot of `len` bytes if memory has room, never making any
    /// (for copies that are only worth it then: promotions on read,
    /// demotions from the device).
    pub(crate) fn allocate_if_room(&self, len: u64) -> Result<Slot, TierError> {
        let slot = self.tier.allocate(len)?;
        self.fall_due_if_above(1);
        Ok(slot)
    }

    /// After `pages` slots were taken, or written pages joined the queues.
    /// Past the high watermark (counting what the pages already chosen
    /// will free), a round opens of what is above the low one; while one
    /// is open, each such page owes [`CHOSEN_PER_PAGE`] choices of its
    /// pages, in the policy's order, and the rounds thread is woken to
    /// migrate them once a batch waits. So the calls alone, not that
    /// thread's timing, decide which pages go and where the next round
    /// opens, and no call pays for more than its own pages' worth. Reads
    /// choose nothing (a read of a page chosen but not yet moved finds it,
    /// which is timing; the fewer such, the better).
    fn fall_due_if_above(&self, pages: usize) {
        if self.unchosen.load(Ordering::Acquire) == 0 && self.held() <= self.watermark(self.high) {
            return;
        }
        self.owed.fetch_add((CHOSEN_PER_PAGE * pages) as u64, Ordering::AcqRel);
        // One chooser at a time; it pays what others owe too.
        while self.owed.load(Ordering::Acquire) > 0 {
            let Some(_choosing) = Choosing::take(&self.choosing) else {
                return;
            };
            let owed = self.owed.swap(0, Ordering::AcqRel) as usize;
            self.choose_for_round(owed);
        }
    }

    /// Chooses up to `most` pages of the round open (opening one if memory
    /// is past the high watermark), with [`Choosing`] held.
    fn choose_for_round(&self, most: usize) {
        let mut left = self.unchosen.load(Ordering::Acquire);
        if left == 0 {
            if self.held() <= self.watermark(self.high) {
                return;
            }
            left = self.held().saturating_sub(self.watermark(self.low));
        }
        let victims = match self.held() > self.watermark(self.low) {
            true => self.take_victims(left, None, Take { fewest: 0, most }),
            false => Vec::new(),
        };
        let bytes: u64 = victims.iter().map(|(_, held)| held).sum();
        // Nothing left to choose closes the round.
        let left = if victims.is_empty() {
            0
        } else {
            left.saturating_sub(bytes)
        };
        self.due_bytes.fetch_add(bytes, Ordering::AcqRel);
        self.unchosen.store(left, Ordering::Release);
        if left == 0 {
            self.owed.store(0, Ordering::Release);
        }
        self.hand_over(victims, left == 0);
    }

    /// Memory's used bytes less what the pages chosen will free.
    fn held(&self) -> u64 {
        self.tier
            .used_bytes()
            .saturating_sub(self.due_bytes.load(Ordering::Acquire))
    }

    /// The bytes at a watermark (a share of capacity).
    fn watermark(&self, share: f64) -> u64 {
        (self.tier.capacity_bytes() as f64 * share) as u64
    }

    /// Adds chosen pages to the round due; wakes the rounds thread once a
    /// batch waits (or the round's choice is `complete`).
    fn hand_over(&self, victims: Vec<(Arc<PhysPage>, u64)>, complete: bool) {
        if victims.is_empty() {
            return;
        }
        for (page, _) in &victims {
            page.in_round.store(true, Ordering::Release);
        }
        let waiting = {
            let mut round = self.round.lock();
            round.extend(victims);
            round.len()
        };
        if (complete || waiting >= MIGRATION_BATCH)
            && let Some(thread) = self.background.get()
        {
            thread.unpark();
        }
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
                    // A migration that ran while this call waited may have
                    // made room.
                    if let ok @ Ok(_) = self.tier.allocate(len) {
                        return ok;
                    }
                    // The pages chosen go first, where the rounds thread had
                    // not moved them yet (then the call tries again: where
                    // they had moved, it would have found that room); then
                    // a batch more of the round open; then a batch of its
                    // own.
                    let moving = Instant::now();
                    let moved = match self.run_round_locked(durable, &one) {
                        Ok(0) => {
                            if let Some(_choosing) = Choosing::take(&self.choosing) {
                                self.choose_for_round(MIGRATION.most);
                            }
                            match self.run_round_locked(durable, &one) {
                                Ok(0) => self.relieve_locked(len, durable, &one, None),
                                more => more,
                            }
                        }
                        chosen => chosen,
                    };
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

    /// Migrates the pages chosen, if any (the rounds thread's work; see
    /// the module's doc).
    pub(crate) fn rebalance(&self, durable: &Durable) {
        if self.due_bytes.load(Ordering::Acquire) == 0 {
            return;
        }
        let one = self.migrating.lock();
        // Failures are logged where they happen; the pages stay in line.
        let _ = self.run_round_locked(durable, &one);
    }

    /// Migrates the pages chosen; returns how many moved. The bytes due
    /// drop as each page's host slot frees, or at once for a page that
    /// no longer needs moving (chosen twice, freed since, its host copy
    /// gone another way) or could not move (back in line), so that memory
    /// less them never depends on how far the migration has got.
    fn run_round_locked(&self, durable: &Durable, migrating: &MutexGuard<'_, ()>) -> StoreResult<usize> {
        let mut round = std::mem::take(&mut *self.round.lock());
        if round.is_empty() {
            return Ok(0);
        }
        round.sort_by_key(|(page, _)| page.id);
        for (page, _) in &round {
            page.in_round.store(false, Ordering::Release);
        }
        let mut settled = 0u64;
        let mut moving: Vec<(Arc<PhysPage>, u64)> = Vec::with_capacity(round.len());
        for (page, held) in round {
            // The round's is the last reference: freed by its sequence.
            let freed = Arc::strong_count(&page) == 1;
            let twice = moving.last().is_some_and(|(p, _)| p.id == page.id);
            if freed || twice || page.place.read().host().is_none() {
                settled += held;
            } else {
                moving.push((page, held));
            }
        }
        self.due_bytes.fetch_sub(settled, Ordering::AcqRel);
        let pages: Vec<Arc<PhysPage>> = moving.iter().map(|(page, _)| Arc::clone(page)).collect();
        let mut freed = vec![false; moving.len()];
        let moved = self.migrate_noting(pages, durable, migrating, &mut |page| {
            if let Ok(i) = moving.binary_search_by_key(&page.id, |(p, _)| p.id)
                && !std::mem::replace(&mut freed[i], true)
            {
                self.due_bytes.fetch_sub(moving[i].1, Ordering::AcqRel);
            }
        });
        let kept: u64 = moving
            .iter()
            .zip(&freed)
            .filter(|(_, f)| !**f)
            .map(|((_, held), _)| held)
            .sum();
        self.due_bytes.fetch_sub(kept, Ordering::AcqRel);
        moved
    }

    /// Migrates least recently used host pages (of `owner` only, if given)
    /// to NVMe until about `bytes` (at least one batch) are free; returns
    /// the pages migrated.
    fn relieve_locked(
        &self,
        bytes: u64,
        durable: &Durable,
        migrating: &MutexGuard<'_, ()>,
        owner: Option<&Arc<Account>>,
    ) -> StoreResult<usize> {
        let victims = self.take_victims(bytes, owner, MIGRATION);
        let victims = victims.into_iter().map(|(page, _)| page).collect();
        self.migrate_noting(victims, durable, migrating, &mut |_| {})
    }

    /// The least recently used pages (of `owner` only, if given) for about
    /// `bytes` (as many as `take` says), out of line, each with the host
    /// bytes it holds; the pages passed over are back in their queues.
    fn take_victims(&self, bytes: u64, owner: Option<&Arc<Account>>, take: Take) -> Vec<(Arc<PhysPage>, u64)> {
        let Chosen {
            mut victims,
            small,
            main,
        } = self.choose(bytes, owner, take);
        // Pages created together (one write, one lane's run) have adjacent
        // ids: allocating their NVMe slots in id order keeps them adjacent on
        // disk too, so the reads of a later step can run sequentially.
        victims.sort_by_key(|(p, _)| p.id);
        // A page a reader touched while it was out of line is back in the
        // small queue already: taken twice, it would be copied twice.
        victims.dedup_by_key(|(p, _)| p.id);
        touch_lru(&self.lru, small.iter());
        touch_lru(&self.main, main.iter());
        // ... and one moving to the main queue leaves the small one.
        {
            let mut small = self.lru.lock();
            for page in &main {
                small.pop(&page.id);
            }
        }
        victims
    }

    /// Copies `victims` to NVMe and frees their host slots (calling
    /// `host_freed` with each just before); those that did not move go
    /// back in line.
    fn migrate_noting(
        &self,
        victims: Vec<Arc<PhysPage>>,
        durable: &Durable,
        _migrating: &MutexGuard<'_, ()>,
        host_freed: &mut dyn FnMut(&PhysPage),
    ) -> StoreResult<usize> {
        let moved = durable.write_copies_noting(&victims, Keep::Nothing, Reason::CapacityPressure, host_freed);
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

    /// The pages to migrate for about `bytes` (as many as `take` says),
    /// taken out of their queues, and those to put back at the most recent end
    /// of each: pinned pages, and under the frequency policy the pages
    /// passed over, into the main queue: the small queue's that hold a
    /// second chance, and the main queue's that spent one.
    fn choose(&self, bytes: u64, owner: Option<&Arc<Account>>, take: Take) -> Chosen {
        let mut chosen = Chosen::default();
        let mut freed = 0u64;
        let mut passed_over = Vec::new();
        let wanted = |victims: &Vec<(Arc<PhysPage>, u64)>, freed: u64| {
            (freed < bytes || victims.len() < take.fewest) && victims.len() < take.most
        };
        // Past the bound on pages passed over, the rest of the room comes
        // from them, least recent first, with no more popped.
        let mut capped = false;
        // Pinned pages cost a pop and a put-back each and count toward
        // nothing: a bound on them keeps a mostly pinned queue from being
        // walked whole by every choice.
        let mut pinned = 0;
        let frequency = self.policy == HostPolicy::Frequency;
        for (turn, queue) in self.queues_in_turn().into_iter().enumerate() {
            let from_main = std::ptr::eq(queue, &self.main);
            let mut candidates = LruVictims::new(queue, owner, 4 * MIGRATION_BATCH);
            // A batch fills from the queue whose turn it is; the other gives
            // only the room still asked for (a host of few batches would
            // otherwise empty its main queue to fill one).
            let more = |victims: &Vec<(Arc<PhysPage>, u64)>, freed: u64| match turn {
                0 => wanted(victims, freed),
                _ => freed < bytes && victims.len() < take.most,
            };
            while more(&chosen.victims, freed) {
                if passed_over.len() >= MOST_PASSED_OVER {
                    capped = true;
                    break;
                }
                let Some((_, weak)) = candidates.pop() else { break };
                let Some(page) = weak.upgrade() else { continue };
                // Out of line already: it migrates with the round.
                if page.in_round.load(Ordering::Acquire) {
                    continue;
                }
                if page.pinned() {
                    if from_main { &mut chosen.main } else { &mut chosen.small }.push(page);
                    pinned += 1;
                    if pinned >= MIGRATION_BATCH.max(4 * take.most) {
                        break;
                    }
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
                    chosen.victims.push((page, reserved));
                }
            }
        }
        // Chances only reorder: when the room asked for is not found
        // without them, the pages passed over go too, least recent first
        // (and a whole batch, once capped).
        let mut passed_over = passed_over.into_iter();
        let more = |victims: &Vec<(Arc<PhysPage>, u64)>, freed: u64| match capped {
            true => wanted(victims, freed),
            false => freed < bytes && victims.len() < take.most,
        };
        while more(&chosen.victims, freed) {
            let Some((page, reserved)) = passed_over.next() else {
                break;
            };
            freed += reserved;
            chosen.victims.push((page, reserved));
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

    /// Pages a write placed join the queues ([`Self::touch`]); like
    /// allocations, they count toward the round open (a write's pages
    /// cannot be chosen until they are in line). Never called with a
    /// page's placement lock, or any leaf, held.
    pub(crate) fn touch_written<'a>(&self, pages: impl IntoIterator<Item = &'a Arc<PhysPage>>) {
        let mut written = 0;
        self.touch(pages.into_iter().inspect(|_| written += 1));
        if written > 0 {
            self.fall_due_if_above(written);
        }
    }

    /// Marks pages as just used in host memory (in the main queue if they
    /// are in it, else in the LRU). Never called with a page's placement
    /// lock, or any leaf, held.
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
    /// With the host bytes each holds.
    victims: Vec<(Arc<PhysPage>, u64)>,
    /// Back at the most recent end of the LRU (the small queue).
    small: Vec<Arc<PhysPage>>,
    /// Back at the most recent end of the main queue.
    main: Vec<Arc<PhysPage>>,
}

/// The one thread choosing a round's pages: the flag is cleared when this
/// drops, even if the choosing panicked.
struct Choosing<'a>(&'a AtomicBool);

impl<'a> Choosing<'a> {
    /// The flag, if no other thread holds it.
    fn take(flag: &'a AtomicBool) -> Option<Self> {
        (!flag.swap(true, Ordering::AcqRel)).then_some(Self(flag))
    }
}

impl Drop for Choosing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
