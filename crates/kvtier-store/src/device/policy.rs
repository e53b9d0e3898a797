//! Which hot pages the device keeps when it needs room.
//!
//! A decode step visits layers 0..L−1 in the same order every step: a loop,
//! which is LRU's worst case (and FIFO's, ARC's, …): once the loop is longer
//! than the cache, every page is gone before its next use, and a device
//! smaller than one step's pages serves no hit at all. The best a cache can
//! do on a loop is keep a fixed subset (hit ratio about capacity ÷ loop)
//! and stream the rest ahead of use. [`DevicePolicy::Loop`] does that:
//!
//! - the **stream region**, least recently used first, sized to twice the
//!   largest selection seen (one layer's pages): room for the layer being
//!   served and the next one, which the store prefetches while this one is
//!   served (what layer l+1 chose last step; the last layer's next is the
//!   next step's first). Demand swap-ins and new pages go here too;
//! - a **resident subset**, the rest of the device: first the hot pages
//!   other requests share (attached through the hash chain or a shared
//!   put: one count per request, not per use), then those selections chose
//!   most often (each selection counts once, with aging, so a page that
//!   stops being chosen loses its place, its sharing with it). A burst of
//!   one-off prompts, however often their steps choose their pages, never
//!   displaces a prefix other requests share. Only an explicit
//!   swap-in takes a resident page's room: a selection's misses beyond the
//!   stream region stay cold, so the subset keeps hitting, and a prefetch
//!   never displaces it. When prefetches arrive in time the stream region
//!   alone serves every layer; the subset is what still hits when they do
//!   not (a slow link, a drifting query).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crate::page::PhysPage;

/// Selections after which every page's count halves (lazily, on its next
/// selection): recent reuse counts more than old.
const AGE_EVERY: u64 = 1 << 16;

/// How the device chooses the page to demote when it needs room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DevicePolicy {
    /// The least recently used page that is not pinned.
    #[default]
    Lru,
    /// A resident subset of the most reused pages plus a stream region
    /// (least recently used first) that layer-ahead prefetches fill.
    Loop,
}

crate::named::named_choices!(DevicePolicy { Lru => "lru", Loop => "loop" });

/// How often selections chose each page, aged: a page's count is packed
/// with the epoch it was last updated in (high 32 bits), and halves once
/// per epoch it missed.
#[derive(Debug, Default)]
pub(crate) struct Reuse {
    selections: AtomicU64,
}

impl Reuse {
    fn epoch(&self) -> u32 {
        (self.selections.load(Ordering::Relaxed) / AGE_EVERY) as u32
    }

    /// Counts a selection of `page`.
    pub(crate) fn count(&self, page: &PhysPage) {
        self.selections.fetch_add(1, Ordering::Relaxed);
        let epoch = self.epoch();
        // Aged and counted in one step: another selection's count may land
        // between the load and the store.
        let _ = page.reuse.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |packed| {
            Some(pack(epoch, aged(packed, epoch).saturating_add(1)))
        });
    }

    /// `page`'s claim on the subset, without counting: its sharers while
    /// selections still choose it (counted in this epoch or the last), and
    /// its aged count.
    pub(crate) fn score(&self, page: &PhysPage) -> Score {
        let (packed, epoch) = (page.reuse.load(Ordering::Relaxed), self.epoch());
        let chosen_lately = packed as u32 > 0 && epoch.saturating_sub((packed >> 32) as u32) <= 1;
        Score {
            shared: if chosen_lately { page.sharers() } else { 0 },
            reuse: aged(packed, epoch),
        }
    }
}

/// A page's claim on the resident subset, compared sharers first: requests
/// beyond the first that attached it, then how often selections chose it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Score {
    pub(crate) shared: u8,
    pub(crate) reuse: u32,
}

fn pack(epoch: u32, count: u32) -> u64 {
    (u64::from(epoch) << 32) | u64::from(count)
}

fn aged(packed: u64, epoch: u32) -> u32 {
    let (then, count) = ((packed >> 32) as u32, packed as u32);
    count.checked_shr(epoch.saturating_sub(then)).unwrap_or(0)
}

/// The loop policy's resident subset: page ids by score, within the
/// device's bytes less the stream region's. Scores are as of admission
/// (and refreshed on each admission attempt), so the lowest is the first
/// to give up its place.
#[derive(Debug)]
pub(crate) struct Resident {
    device: u64,
    /// Kept for the stream region: twice the largest selection seen.
    stream: u64,
    bytes: u64,
    members: HashMap<u64, (Score, u64, Weak<PhysPage>)>,
    by_score: BTreeSet<(Score, u64)>,
}

/// What an admission did.
#[derive(Debug)]
pub(crate) enum Admitted {
    /// The page is resident (it was, or it took free room).
    Yes,
    /// It took the place of this page, now in the stream region.
    Displaced(u64, Weak<PhysPage>),
    /// Its score is below every resident page's: it stays in the stream.
    No,
}

impl Resident {
    /// A subset of a device of `device` bytes (0: none, the `Lru` policy).
    pub(crate) fn new(device: u64) -> Self {
        Self {
            device,
            stream: 0,
            bytes: 0,
            members: HashMap::new(),
            by_score: BTreeSet::new(),
        }
    }

    fn capacity(&self) -> u64 {
        self.device.saturating_sub(self.stream)
    }

    /// A selection of `bytes` was made: the stream region keeps room for
    /// two. Returns the pages that leave the subset for it (still hot).
    pub(crate) fn fit_stream(&mut self, bytes: u64) -> Vec<Weak<PhysPage>> {
        let mut left = Vec::new();
        if 2 * bytes > self.stream {
            self.stream = 2 * bytes;
            while self.bytes > self.capacity() {
                match self.pop_lowest() {
                    Some((_, weak)) => left.push(weak),
                    None => break,
                }
            }
        }
        left
    }

    pub(crate) fn contains(&self, id: u64) -> bool {
        self.members.contains_key(&id)
    }

    /// Makes page `id` (of `bytes`, with `score`) resident if there is room
    /// or it scores above the lowest resident page, which then leaves.
    pub(crate) fn admit(&mut self, page: &Arc<PhysPage>, score: Score) -> Admitted {
        let (id, bytes) = (page.id, page.layout.page_bytes() as u64);
        if let Some((old, ..)) = self.members.get(&id) {
            self.by_score.remove(&(*old, id));
            self.by_score.insert((score, id));
            self.members.insert(id, (score, bytes, Arc::downgrade(page)));
            return Admitted::Yes;
        }
        if self.bytes + bytes <= self.capacity() {
            self.insert(page, score);
            return Admitted::Yes;
        }
        let Some((lowest, victim)) = self.by_score.first().copied() else {
            return Admitted::No;
        };
        let freed = self.members.get(&victim).map_or(0, |m| m.1);
        if lowest >= score || self.bytes - freed + bytes > self.capacity() {
            return Admitted::No;
        }
        let Some(weak) = self.remove(victim) else {
            return Admitted::No;
        };
        self.insert(page, score);
        Admitted::Displaced(victim, weak)
    }

    fn insert(&mut self, page: &Arc<PhysPage>, score: Score) {
        let bytes = page.layout.page_bytes() as u64;
        self.members.insert(page.id, (score, bytes, Arc::downgrade(page)));
        self.by_score.insert((score, page.id));
        self.bytes += bytes;
    }

    /// Page `id` leaves the subset (demoted, freed, or displaced).
    pub(crate) fn remove(&mut self, id: u64) -> Option<Weak<PhysPage>> {
        let (score, bytes, weak) = self.members.remove(&id)?;
        self.by_score.remove(&(score, id));
        self.bytes -= bytes;
        Some(weak)
    }

    /// The lowest-scored resident page, taken out of the subset.
    pub(crate) fn pop_lowest(&mut self) -> Option<(u64, Weak<PhysPage>)> {
        let (_, id) = self.by_score.first().copied()?;
        self.remove(id).map(|w| (id, w))
    }
}

/// Per (sequence, layer), the pages its last selection chose, for the
/// layer-ahead prefetch of the next step.
pub(crate) type LastChosen = HashMap<(kvtier_core::SequenceKey, u32), Vec<Weak<PhysPage>>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn reuse(reuse: u32) -> Score {
        Score { shared: 0, reuse }
    }

    #[test]
    fn the_subset_keeps_the_highest_scores_within_its_bytes() {
        let parts = crate::testing::Parts::new(1, 8, false);
        let pages: Vec<_> = (1..=5).map(|id| parts.page(id)).collect();
        let page_bytes = crate::testing::PAGE_BYTES;
        let mut r = Resident::new(5 * page_bytes);
        assert!(r.fit_stream(page_bytes).is_empty(), "2 pages kept for the stream");
        assert!(matches!(r.admit(&pages[0], reuse(5)), Admitted::Yes));
        assert!(matches!(r.admit(&pages[1], reuse(2)), Admitted::Yes));
        assert!(matches!(r.admit(&pages[2], reuse(7)), Admitted::Yes));
        assert!(
            matches!(r.admit(&pages[3], reuse(1)), Admitted::No),
            "below every member"
        );
        assert!(matches!(r.admit(&pages[4], reuse(6)), Admitted::Displaced(2, _)));
        assert!(!r.contains(2) && r.contains(5));
        assert!(
            matches!(r.admit(&pages[0], reuse(9)), Admitted::Yes),
            "a member's score is refreshed"
        );
        assert_eq!(r.pop_lowest().map(|(id, _)| id), Some(5));
        r.remove(3);
        assert_eq!(r.bytes, page_bytes);
        // A larger selection takes room from the subset, lowest first.
        assert!(matches!(r.admit(&pages[2], reuse(7)), Admitted::Yes));
        assert!(matches!(r.admit(&pages[4], reuse(8)), Admitted::Yes));
        let left: Vec<u64> = r
            .fit_stream(2 * page_bytes)
            .iter()
            .filter_map(|w| w.upgrade())
            .map(|p| p.id)
            .collect();
        assert_eq!(left, vec![3, 5], "4 pages for the stream leave 1 for the subset");
    }

    #[test]
    fn a_shared_page_outranks_any_one_requests_page() {
        let parts = crate::testing::Parts::new(1, 8, false);
        let (shared, single) = (parts.page(1), parts.page(2));
        shared.attached_again();
        let reuse_counts = Reuse::default();
        for _ in 0..2 {
            reuse_counts.count(&shared);
        }
        for _ in 0..50 {
            reuse_counts.count(&single);
        }
        let (a, b) = (reuse_counts.score(&shared), reuse_counts.score(&single));
        assert_eq!((a.shared, a.reuse, b.shared, b.reuse), (1, 2, 0, 50));
        assert!(a > b, "sharing ranks first");
        // Never chosen, sharing gives no claim.
        let idle = parts.page(3);
        idle.attached_again();
        assert_eq!(reuse_counts.score(&idle), Score::default());
    }

    #[test]
    fn counts_halve_per_epoch_missed() {
        assert_eq!(aged(pack(3, 8), 3), 8);
        assert_eq!(aged(pack(3, 8), 5), 2);
        assert_eq!(aged(pack(0, 8), 40), 0);
    }
}
