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
//!   displaces a prefix other requests share. A member no selection chose
//!   for a few steps (the query moved on) is the first to give its place
//!   to a hot page chosen lately (not one only a client's prefetch
//!   brought), whatever its count, unless it is shared by more requests:
//!   otherwise pages of earlier steps keep the query's new ones out, and a
//!   device larger than a step's pages misses more than LRU does
//!   (bench/results/tune-validation.md). Giving up its place, a page stays
//!   hot, in the stream region. Only an explicit swap-in takes a resident
//!   page's room: a selection's misses beyond the stream region stay cold,
//!   so the subset keeps hitting, and a prefetch never makes its room by
//!   demoting a member. When prefetches arrive in time the stream region
//!   alone serves every layer; the subset is what still hits when they do
//!   not (a slow link, a drifting query).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crate::page::PhysPage;

/// Choices (pages any selection chose) after which every page's count
/// halves (lazily, on its next choice): recent reuse counts more than old.
const AGE_EVERY: u64 = 1 << 16;

/// Steps without a choice after which a resident page is left behind: the
/// first to give up its place, whatever its count. Fewer lets a page the
/// query visits every few steps go; more keeps pages the query has moved
/// away from. On the recorded traces of bench/results/tune-validation.md, 1
/// to 16 gave the same miss ratio within 0.01 at every size, 4 and 6 the
/// lowest.
const STALE_AFTER_STEPS: u64 = 4;

/// Members admitted longest ago that an admission looks at for one the
/// loop left behind (a bound on the work under the subset's lock).
const LEFT_BEHIND_LOOKED_AT: usize = 8;

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

/// How often selections chose each page, aged, and when last: a page's
/// word packs the clock at its last choice (high 40 bits; the clock counts
/// every page any selection chose) with its count, which halves once per
/// epoch of [`AGE_EVERY`] choices it missed.
#[derive(Debug, Default)]
pub(crate) struct Reuse {
    selections: AtomicU64,
    /// Pages one decode step chooses over every (sequence, layer): the
    /// length of the loop, in the clock's units.
    loop_pages: AtomicU64,
}

/// A page's word: the clock at its last choice (48 bits: at 15 M choices a
/// second it wraps after 217 days, and the arithmetic below wraps with it)
/// and its count (16 bits, saturating: counts halve every [`AGE_EVERY`]
/// choices, so they stay below 2^17 anyway).
const COUNT_BITS: u32 = 16;
const COUNT_MAX: u64 = (1 << COUNT_BITS) - 1;
const CLOCK_MASK: u64 = (1 << (64 - COUNT_BITS)) - 1;

impl Reuse {
    /// Counts a selection of `page`.
    pub(crate) fn count(&self, page: &PhysPage) {
        let now = self.selections.fetch_add(1, Ordering::Relaxed) + 1;
        // Aged and counted in one step: another selection's count may land
        // between the load and the store.
        let _ = page.reuse.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |packed| {
            Some(pack(now, aged(packed, now).saturating_add(1)))
        });
    }

    /// `page`'s claim on the subset, without counting: its sharers while
    /// selections still choose it (counted in this epoch or the last), and
    /// its aged count.
    pub(crate) fn score(&self, page: &PhysPage) -> Score {
        let (packed, now) = (
            page.reuse.load(Ordering::Relaxed),
            self.selections.load(Ordering::Relaxed),
        );
        let chosen_lately = packed & COUNT_MAX > 0 && epochs_missed(packed, now) <= 1;
        Score {
            shared: if chosen_lately { page.sharers() } else { 0 },
            reuse: aged(packed, now),
        }
    }

    /// Whether no selection chose `page` over the last
    /// [`STALE_AFTER_STEPS`] steps (the loop came round without it; a page
    /// never chosen is stale once a loop is seen).
    pub(crate) fn stale(&self, page: &PhysPage) -> bool {
        let packed = page.reuse.load(Ordering::Relaxed);
        match self.loop_pages.load(Ordering::Relaxed) {
            0 => false, // no loop seen yet
            _ if packed & COUNT_MAX == 0 => true,
            step => elapsed(packed, self.selections.load(Ordering::Relaxed)) > STALE_AFTER_STEPS * step,
        }
    }

    /// The pages one step chooses changed by `delta` (a (sequence, layer)'s
    /// last selection replaced or forgotten).
    pub(crate) fn loop_changed(&self, delta: i64) {
        let _ = self.loop_pages.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            Some(n.saturating_add_signed(delta))
        });
    }
}

fn pack(clock: u64, count: u32) -> u64 {
    ((clock & CLOCK_MASK) << COUNT_BITS) | u64::from(count).min(COUNT_MAX)
}

/// Choices since the one `packed` records (modulo the clock's width).
fn elapsed(packed: u64, now: u64) -> u64 {
    now.wrapping_sub(packed >> COUNT_BITS) & CLOCK_MASK
}

/// Epoch boundaries crossed since the choice `packed` records.
fn epochs_missed(packed: u64, now: u64) -> u64 {
    ((packed >> COUNT_BITS) % AGE_EVERY + elapsed(packed, now)) / AGE_EVERY
}

fn aged(packed: u64, now: u64) -> u32 {
    let count = (packed & COUNT_MAX) as u32;
    u32::try_from(epochs_missed(packed, now))
        .ok()
        .and_then(|m| count.checked_shr(m))
        .unwrap_or(0)
}

/// A page's claim on the resident subset, compared sharers first: requests
/// beyond the first that attached it, then how often selections chose it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Score {
    pub(crate) shared: u8,
    pub(crate) reuse: u32,
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
    /// Members by their last admission (a choice or a swap-in), oldest
    /// first: the first place to look for a page the loop left behind.
    by_recency: lru::LruCache<u64, ()>,
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
            by_recency: lru::LruCache::unbounded(),
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

    /// Makes page `id` (of `bytes`, with `score`) resident if there is room,
    /// or in place of one of the [`LEFT_BEHIND_LOOKED_AT`] members admitted
    /// longest ago that `gives_way` (the loop left it behind), or else of
    /// the lowest-scored member if `page` scores above it.
    pub(crate) fn admit(
        &mut self,
        page: &Arc<PhysPage>,
        score: Score,
        gives_way: impl Fn(&PhysPage) -> bool,
    ) -> Admitted {
        let (id, bytes) = (page.id, page.layout.page_bytes() as u64);
        if let Some((old, ..)) = self.members.get(&id) {
            self.by_score.remove(&(*old, id));
            self.by_score.insert((score, id));
            self.members.insert(id, (score, bytes, Arc::downgrade(page)));
            self.by_recency.promote(&id);
            return Admitted::Yes;
        }
        if self.bytes + bytes <= self.capacity() {
            self.insert(page, score);
            return Admitted::Yes;
        }
        let left_behind = self
            .by_recency
            .iter()
            .rev()
            .take(LEFT_BEHIND_LOOKED_AT)
            .map(|(&oldest, _)| oldest)
            .find(|oldest| {
                self.members
                    .get(oldest)
                    .is_some_and(|(_, _, weak)| weak.upgrade().is_none_or(|p| gives_way(&p)))
            });
        let lowest = self
            .by_score
            .first()
            .filter(|(lowest, _)| *lowest < score)
            .map(|&(_, id)| id);
        let Some(victim) = left_behind.or(lowest) else {
            return Admitted::No;
        };
        let freed = self.members.get(&victim).map_or(0, |m| m.1);
        if self.bytes - freed + bytes > self.capacity() {
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
        self.by_recency.put(page.id, ());
        self.bytes += bytes;
    }

    /// Page `id` leaves the subset (demoted, freed, or displaced).
    pub(crate) fn remove(&mut self, id: u64) -> Option<Weak<PhysPage>> {
        let (score, bytes, weak) = self.members.remove(&id)?;
        self.by_score.remove(&(score, id));
        self.by_recency.pop(&id);
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

    /// A subset of a device of `n` pages, and pages 1..=n.
    fn subset(n: u64) -> (crate::testing::Parts, Vec<Arc<PhysPage>>, Resident) {
        let parts = crate::testing::Parts::new(1, 8, false);
        let pages = (1..=n).map(|id| parts.page(id)).collect();
        (parts, pages, Resident::new(n * crate::testing::PAGE_BYTES))
    }

    fn reuse(reuse: u32) -> Score {
        Score { shared: 0, reuse }
    }

    #[test]
    fn the_subset_keeps_the_highest_scores_within_its_bytes() {
        let (_parts, pages, mut r) = subset(5);
        let page_bytes = crate::testing::PAGE_BYTES;
        assert!(r.fit_stream(page_bytes).is_empty(), "2 pages kept for the stream");
        assert!(matches!(r.admit(&pages[0], reuse(5), |_| false), Admitted::Yes));
        assert!(matches!(r.admit(&pages[1], reuse(2), |_| false), Admitted::Yes));
        assert!(matches!(r.admit(&pages[2], reuse(7), |_| false), Admitted::Yes));
        assert!(
            matches!(r.admit(&pages[3], reuse(1), |_| false), Admitted::No),
            "below every member"
        );
        assert!(matches!(
            r.admit(&pages[4], reuse(6), |_| false),
            Admitted::Displaced(2, _)
        ));
        assert!(!r.contains(2) && r.contains(5));
        assert!(
            matches!(r.admit(&pages[0], reuse(9), |_| false), Admitted::Yes),
            "a member's score is refreshed"
        );
        assert_eq!(r.pop_lowest().map(|(id, _)| id), Some(5));
        r.remove(3);
        assert_eq!(r.bytes, page_bytes);
        // A larger selection takes room from the subset, lowest first.
        assert!(matches!(r.admit(&pages[2], reuse(7), |_| false), Admitted::Yes));
        assert!(matches!(r.admit(&pages[4], reuse(8), |_| false), Admitted::Yes));
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
    fn a_member_the_loop_left_behind_gives_its_place_first() {
        let (_parts, pages, mut r) = subset(4);
        let page_bytes = crate::testing::PAGE_BYTES;
        r.fit_stream(page_bytes);
        let high = Score { shared: 0, reuse: 9 };
        assert!(matches!(r.admit(&pages[0], high, |_| false), Admitted::Yes));
        assert!(matches!(r.admit(&pages[1], high, |_| false), Admitted::Yes));
        let left_behind = |p: &PhysPage| p.id == 1;
        // Page 1, admitted first, gives way: a page chosen once takes its place.
        assert!(matches!(
            r.admit(&pages[2], reuse(1), left_behind),
            Admitted::Displaced(1, _)
        ));
        // The look goes past members that do not give way (2, the oldest now).
        assert!(matches!(
            r.admit(&pages[3], reuse(1), |p| p.id == 3),
            Admitted::Displaced(3, _)
        ));
        // None gives way: scores decide, and 1 is below both.
        assert!(matches!(r.admit(&pages[2], reuse(1), |_| false), Admitted::No));
        assert!(r.contains(2) && r.contains(4));
    }

    #[test]
    fn a_page_is_stale_once_the_loop_came_round_without_it() {
        let parts = crate::testing::Parts::new(1, 8, false);
        let (page, other) = (parts.page(1), parts.page(2));
        let counts = Reuse::default();
        counts.count(&page);
        for _ in 0..100 {
            counts.count(&other);
        }
        assert!(!counts.stale(&page), "no loop seen: nothing is stale");
        counts.loop_changed(10);
        assert!(counts.stale(&page), "100 choices are more than 4 steps of 10");
        counts.loop_changed(15);
        assert!(!counts.stale(&page), "and fewer than 4 steps of 25");
        counts.count(&page);
        assert!(!counts.stale(&other) && !counts.stale(&page));
    }

    #[test]
    fn the_clock_wraps_without_a_page_looking_old() {
        let parts = crate::testing::Parts::new(1, 8, false);
        let page = parts.page(1);
        let counts = Reuse::default();
        counts.selections.store(CLOCK_MASK - 2, Ordering::Relaxed);
        counts.loop_changed(10);
        for _ in 0..10 {
            counts.count(&page);
        }
        // The wrap is an epoch boundary: the 2 counts before it halved once.
        assert_eq!(counts.score(&page).reuse, 9);
        assert!(!counts.stale(&page));
        page.attached_again();
        assert_eq!(counts.score(&page).shared, 1, "chosen lately across the wrap");
    }

    #[test]
    fn counts_halve_per_epoch_missed() {
        let at = |epoch: u64| epoch * AGE_EVERY;
        assert_eq!(aged(pack(at(3), 8), at(3) + 5), 8);
        assert_eq!(aged(pack(at(3), 8), at(5)), 2);
        assert_eq!(aged(pack(0, 8), at(40)), 0);
    }
}
