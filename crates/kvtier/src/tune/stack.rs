//! Byte-weighted LRU stack distances (Mattson et al., 1970) in one pass:
//! for every access, the bytes of the distinct other items touched since
//! the same item's previous access. An LRU cache of C bytes hits an access
//! exactly when that distance plus the item's own size is at most C, so
//! one pass gives the exact miss ratio at every cache size.
//!
//! The distinct bytes between two accesses are a range sum over a Fenwick
//! tree indexed by access time, in which each item's size sits at its most
//! recent access: O(log n) per access.
//!
//! Of a stream sampled by item hash at rate R (SHARDS, Waldspurger et al.,
//! FAST '15), the distinct bytes between two accesses of a kept item are
//! about R times the full stream's: `scale` = 1/R scales them back.

use std::collections::HashMap;
use std::hash::Hash;

/// Sums over access times.
#[derive(Debug)]
struct Fenwick(Vec<i64>);

impl Fenwick {
    fn add(&mut self, at: usize, delta: i64) {
        let mut i = at + 1;
        while i < self.0.len() {
            self.0[i] += delta;
            i += i & i.wrapping_neg();
        }
    }

    /// What was added after time `at`, up to `now` (excluded).
    fn distance(&self, at: usize, now: usize) -> i64 {
        self.prefix(now) - self.prefix(at + 1)
    }

    /// The sum over times `0..end`.
    fn prefix(&self, end: usize) -> i64 {
        let (mut i, mut sum) = (end, 0);
        while i > 0 {
            sum += self.0[i];
            i -= i & i.wrapping_neg();
        }
        sum
    }
}

/// An item's place in the stack.
#[derive(Debug, Clone, Copy)]
struct Last {
    at: usize,
    bytes: u64,
    /// The largest distance it has had since `at`, as of the last free.
    peak: u64,
}

/// The stack distances of one access stream, and the cache size each
/// counted access needs to hit.
#[derive(Debug)]
pub(crate) struct StackDistances<K> {
    /// Each live item's most recent access, its size, and the most
    /// distinct bytes that have stood above it since (frees lower what
    /// stands above an item, but an LRU cache does not take back what it
    /// evicted while more did).
    last: HashMap<K, Last>,
    tree: Fenwick,
    now: usize,
    /// For each counted access that is not the item's first: the smallest
    /// cache (bytes) in which it hits.
    needs: Vec<u64>,
    /// Counted first accesses: misses at every size.
    cold: u64,
    /// What the distinct bytes seen between accesses stand for (1/R of a
    /// stream sampled at rate R).
    scale: f64,
}

impl<K: Hash + Eq> StackDistances<K> {
    /// For a stream of at most `accesses` accesses, sampled at rate
    /// 1/`scale` (1: the whole stream).
    pub(crate) fn new(accesses: usize, scale: f64) -> Self {
        Self {
            last: HashMap::new(),
            tree: Fenwick(vec![0; accesses + 1]),
            now: 0,
            needs: Vec::new(),
            cold: 0,
            scale,
        }
    }

    /// One access of `item` (`bytes` large). `counted`: whether it is one
    /// whose hit or miss the curve reports (a read), or only one that
    /// places the item in the cache (a write). Returns the smallest cache
    /// in which it hits (`None`: a first access, a miss at every size).
    pub(crate) fn access(&mut self, item: K, bytes: u64, counted: bool) -> Option<u64> {
        let t = self.now;
        self.now += 1;
        debug_assert!(t + 1 < self.tree.0.len(), "more accesses than the stream was sized for");
        let previous = self.last.insert(item, Last { at: t, bytes, peak: 0 });
        let need = previous.map(|p| {
            let between = (self.tree.distance(p.at, t) as u64).max(p.peak);
            self.tree.add(p.at, -(p.bytes as i64));
            (between as f64 * self.scale).round() as u64 + bytes
        });
        if counted {
            match need {
                Some(need) => self.needs.push(need),
                None => self.cold += 1,
            }
        }
        self.tree.add(t, bytes as i64);
        need
    }

    /// `items` left the stream (freed): they take no room from here on, and
    /// the next access of one, if any, is a first one. Every item below
    /// one of them first notes the distance it had (O(live items): frees
    /// come in batches, a sequence's pages at a time).
    pub(crate) fn forget(&mut self, items: &[K]) {
        let Some(newest) = items.iter().filter_map(|k| self.last.get(k)).map(|l| l.at).max() else {
            return;
        };
        let (tree, now) = (&self.tree, self.now);
        for l in self.last.values_mut().filter(|l| l.at < newest) {
            l.peak = l.peak.max(tree.distance(l.at, now) as u64);
        }
        for item in items {
            if let Some(l) = self.last.remove(item) {
                self.tree.add(l.at, -(l.bytes as i64));
            }
        }
    }

    /// The miss-ratio curve: for each cache size, the share of counted
    /// accesses that miss.
    pub(crate) fn curve(mut self) -> MissCurve {
        self.needs.sort_unstable();
        MissCurve {
            needs: self.needs,
            cold: self.cold,
        }
    }
}

/// Miss ratios at any cache size.
#[derive(Debug, Clone)]
pub(crate) struct MissCurve {
    needs: Vec<u64>,
    cold: u64,
}

impl MissCurve {
    pub(crate) fn accesses(&self) -> u64 {
        self.needs.len() as u64 + self.cold
    }

    /// The share of counted accesses an LRU cache of `bytes` misses.
    pub(crate) fn miss_ratio(&self, bytes: u64) -> f64 {
        let hits = self.needs.partition_point(|&need| need <= bytes) as u64;
        let total = self.accesses();
        if total == 0 {
            0.0
        } else {
            (total - hits) as f64 / total as f64
        }
    }

    /// The smallest cache with a miss ratio at most `target`, if any.
    pub(crate) fn smallest_for(&self, target: f64) -> Option<u64> {
        let total = self.accesses();
        // Misses allowed, counted exactly (a ratio computed from counts
        // must meet itself).
        let allowed = (target * total as f64 + 1e-9).floor() as u64;
        match total.saturating_sub(allowed) as usize {
            0 => Some(0),
            h if h <= self.needs.len() => Some(self.needs[h - 1]),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// An LRU cache of `capacity` bytes simulated directly: hits of the
    /// counted accesses.
    fn simulate(stream: &[(u8, u64, bool, bool)], capacity: u64) -> (u64, u64) {
        let mut cache: Vec<(u8, u64)> = Vec::new(); // most recent last
        let (mut hits, mut counted) = (0, 0);
        for &(item, bytes, count, free) in stream {
            if free {
                cache.retain(|&(i, _)| i != item);
                continue;
            }
            let hit = cache.iter().position(|&(i, _)| i == item);
            if count {
                counted += 1;
                hits += u64::from(hit.is_some());
            }
            if let Some(i) = hit {
                cache.remove(i);
            }
            cache.push((item, bytes));
            while cache.iter().map(|&(_, b)| b).sum::<u64>() > capacity {
                cache.remove(0);
            }
        }
        (hits, counted)
    }

    proptest! {
        #[test]
        fn the_curve_equals_a_simulated_lru_at_every_size(
            stream in proptest::collection::vec((0u8..12, 1u64..5, any::<bool>(), 0u8..8), 1..200),
            capacity in 0u64..40,
        ) {
            // An item keeps one size, as a page does; one access in eight
            // frees it instead.
            let stream: Vec<(u8, u64, bool, bool)> =
                stream.iter().map(|&(i, _, c, f)| (i, u64::from(i % 4) + 1, c, f == 0)).collect();
            let mut d = StackDistances::new(stream.len(), 1.0);
            for &(item, bytes, counted, free) in &stream {
                if free {
                    d.forget(&[item]);
                } else {
                    d.access(item, bytes, counted);
                }
            }
            let curve = d.curve();
            let (hits, counted) = simulate(&stream, capacity);
            prop_assert_eq!(curve.accesses(), counted);
            let want = if counted == 0 { 0.0 } else { (counted - hits) as f64 / counted as f64 };
            prop_assert!((curve.miss_ratio(capacity) - want).abs() < 1e-12);
            if let Some(size) = curve.smallest_for(want) {
                prop_assert!(curve.miss_ratio(size) <= want + 1e-12);
                // The size the simulation had meets it, so the smallest is no larger.
                prop_assert!(size <= capacity);
            }
        }
    }
}
