//! Budget allocators (docs/CONCEPTS.md §5): how a total page budget is split over
//! lanes, over any scorer.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use super::LanePlanInput;
use super::plan::{KeepOrder, page_score};

/// How a total page budget is split over lanes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Allocator {
    /// Every lane the same budget.
    Uniform,
    /// PyramidKV (Cai et al. 2024): per-lane budgets decrease linearly from
    /// the first layer to the last. With `avg` the mean per-lane budget, the
    /// last layer gets `avg / beta` (`beta` 20 in the paper) and the first
    /// `2 * avg - last`, so the mean, hence the total, is preserved (exactly
    /// when every layer has the same number of heads; otherwise the shares
    /// are scaled to the total). A `beta` below 1 would invert the pyramid
    /// and counts as 1, i.e. uniform.
    Pyramid {
        /// Ratio of the mean per-lane budget to the last layer's; below 1
        /// counts as 1.
        beta: f64,
    },
    /// Ada-KV (Feng et al. 2024): each layer gets its uniform share; within
    /// a layer that budget goes to the pages with the highest (normalised)
    /// scores across all its heads, after each head gets at least
    /// `floor * layer budget / heads` pages (Ada-KV's safeguard, alpha 0.2 in
    /// its experiments). Protected pages outrank every score, taken round
    /// robin across heads by priority.
    Ada {
        /// Share of an even split of the layer budget that each head is
        /// guaranteed; clamped to `0..=1` (NaN counts as 0).
        floor: f64,
    },
}

impl Allocator {
    /// The allocator called `name` (`uniform`, `pyramid`, `ada`), with its
    /// reference defaults.
    pub fn defaults(name: &str) -> Option<Self> {
        Some(match name {
            "uniform" => Allocator::Uniform,
            "pyramid" => Allocator::Pyramid { beta: 20.0 },
            "ada" => Allocator::Ada { floor: 0.2 },
            _ => return None,
        })
    }

    /// The name [`Allocator::defaults`] knows this allocator by.
    pub fn name(&self) -> &'static str {
        match self {
            Allocator::Uniform => "uniform",
            Allocator::Pyramid { .. } => "pyramid",
            Allocator::Ada { .. } => "ada",
        }
    }

    /// Each lane's budget: at most its pages, `min(total, all pages)` in all.
    pub(super) fn budgets(&self, lanes: &[LanePlanInput], orders: &[KeepOrder], total: usize) -> Vec<usize> {
        let caps: Vec<usize> = lanes.iter().map(|lane| lane.pages).collect();
        let even = vec![1.0; lanes.len()];
        match *self {
            Allocator::Uniform => share(&even, &caps, total),
            Allocator::Pyramid { beta } => share(&pyramid(lanes, beta), &caps, total),
            Allocator::Ada { floor } => ada(lanes, orders, &share(&even, &caps, total), floor),
        }
    }
}

/// Splits `total` in proportion to `weights`, no share above its cap. Shares
/// that would exceed their caps are capped and the rest split again among
/// the others (water filling), so budget one lane cannot use goes to the
/// others; the remainder of the rounding goes to the largest fractions, ties
/// to the lower index. Non-positive weights get nothing until every positive
/// one is full, then an even split.
fn share(weights: &[f64], caps: &[usize], total: usize) -> Vec<usize> {
    let mut out = vec![0; caps.len()];
    let mut remaining = total.min(caps.iter().sum());
    let mut open: Vec<usize> = (0..caps.len()).filter(|&i| caps[i] > 0).collect();
    let weight = |i: usize| {
        if weights[i] > 0.0 && weights[i].is_finite() {
            weights[i]
        } else {
            0.0
        }
    };
    while remaining > 0 {
        let sum: f64 = open.iter().map(|&i| weight(i)).sum();
        let ideal = |i: usize| {
            if sum > 0.0 {
                remaining as f64 * weight(i) / sum
            } else {
                remaining as f64 / open.len() as f64
            }
        };
        let (full, rest): (Vec<usize>, Vec<usize>) = open.iter().partition(|&&i| ideal(i) >= caps[i] as f64);
        if full.is_empty() {
            let mut fractions = Vec::with_capacity(rest.len());
            for &i in &rest {
                let x = ideal(i);
                out[i] = x as usize;
                fractions.push((x - x.floor(), i));
            }
            let given: usize = rest.iter().map(|&i| out[i]).sum();
            fractions.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            for &(_, i) in fractions.iter().take(remaining.saturating_sub(given)) {
                out[i] += 1;
            }
            break;
        }
        for &i in &full {
            out[i] = caps[i];
            remaining -= caps[i];
        }
        open = rest;
    }
    out
}

/// PyramidKV's per-lane weights, relative to a mean of 1: linear in the
/// position of the lane's layer among the distinct layers.
fn pyramid(lanes: &[LanePlanInput], beta: f64) -> Vec<f64> {
    let layers: Vec<usize> = lanes
        .iter()
        .map(|lane| lane.layer)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if layers.len() < 2 {
        return vec![1.0; lanes.len()];
    }
    let last = 1.0 / beta.max(1.0);
    let first = 2.0 - last;
    let steps = (layers.len() - 1) as f64;
    lanes
        .iter()
        .map(|lane| first - (first - last) * layers.partition_point(|&l| l < lane.layer) as f64 / steps)
        .collect()
}

/// A page a head could take beyond its floor.
struct Candidate {
    lane: usize,
    head: usize,
    rank: usize,
    protected: bool,
    score: f64,
}

impl Candidate {
    /// Protected pages first, round robin by priority; then by score. Ties to
    /// the lower head, then lane; never equal, so the selection is unique.
    fn order(a: &Self, b: &Self) -> Ordering {
        let by_value = match (a.protected, b.protected) {
            (true, true) => a.rank.cmp(&b.rank),
            (false, false) => b.score.total_cmp(&a.score),
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
        };
        by_value
            .then(a.head.cmp(&b.head))
            .then(a.lane.cmp(&b.lane))
            .then(a.rank.cmp(&b.rank))
    }
}

/// Ada-KV within each layer, from the uniform per-lane shares `base`. A
/// head's candidates sort in its own keep order (protected by priority, then
/// by score), so the pages chosen are a prefix of each head's order and
/// counting them gives its budget.
fn ada(lanes: &[LanePlanInput], orders: &[KeepOrder], base: &[usize], floor: f64) -> Vec<usize> {
    let floor = if floor.is_nan() { 0.0 } else { floor.clamp(0.0, 1.0) };
    let mut layers: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, lane) in lanes.iter().enumerate() {
        layers.entry(lane.layer).or_default().push(i);
    }
    let mut budgets = vec![0; lanes.len()];
    for heads in layers.values() {
        let layer_budget: usize = heads.iter().map(|&i| base[i]).sum();
        let least = (floor * layer_budget as f64 / heads.len() as f64) as usize;
        let mut candidates = Vec::new();
        for &i in heads {
            budgets[i] = least.min(lanes[i].pages);
            let order = &orders[i];
            candidates.extend((budgets[i]..order.pages.len()).map(|rank| Candidate {
                lane: i,
                head: lanes[i].head,
                rank,
                protected: rank < order.protected,
                score: page_score(&lanes[i].scores, order.pages[rank]),
            }));
        }
        let extra = layer_budget - heads.iter().map(|&i| budgets[i]).sum::<usize>();
        if extra < candidates.len() {
            candidates.select_nth_unstable_by(extra, Candidate::order);
        }
        for candidate in &candidates[..extra] {
            budgets[candidate.lane] += 1;
        }
    }
    budgets
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{PageScores, plan};

    fn lane(layer: usize, head: usize, scores: Vec<f64>, protected: Vec<usize>) -> LanePlanInput {
        LanePlanInput {
            layer,
            head,
            pages: scores.len(),
            scores: PageScores { scores, protected },
        }
    }

    fn kept(lanes: &[LanePlanInput], total: usize, allocator: Allocator) -> Vec<usize> {
        plan(lanes, total, &allocator).iter().map(Vec::len).collect()
    }

    #[test]
    fn defaults_round_trip_their_names() {
        for name in ["uniform", "pyramid", "ada"] {
            assert_eq!(Allocator::defaults(name).unwrap().name(), name);
        }
        assert_eq!(Allocator::defaults("even"), None);
    }

    #[test]
    fn share_fills_caps_and_gives_the_remainder_to_the_lower_index() {
        assert_eq!(share(&[1.0; 3], &[10, 10, 10], 10), vec![4, 3, 3]);
        // Lane 0 can use 1 page: the other 9 are split between the rest.
        assert_eq!(share(&[1.0; 3], &[1, 10, 10], 10), vec![1, 5, 4]);
        assert_eq!(share(&[1.0; 3], &[1, 2, 3], 100), vec![1, 2, 3]);
        assert_eq!(share(&[0.0, 1.0], &[5, 2], 4), vec![2, 2]);
        assert_eq!(share(&[], &[], 4), Vec::<usize>::new());
    }

    #[test]
    fn uniform_splits_evenly() {
        let lanes: Vec<_> = (0..3).map(|h| lane(0, h, vec![0.0; 10], vec![])).collect();
        assert_eq!(kept(&lanes, 10, Allocator::Uniform), vec![4, 3, 3]);
    }

    #[test]
    fn pyramid_decreases_linearly_and_preserves_the_total() {
        // 4 layers of 2 heads, 100 pages each on average.
        let lanes: Vec<_> = (0..8).map(|i| lane(i / 2, i % 2, vec![0.0; 1000], vec![])).collect();
        let budgets = kept(&lanes, 800, Allocator::defaults("pyramid").unwrap());
        // Last 100/20 = 5, first 2·100 − 5 = 195, steps of 190/3.
        assert_eq!(budgets, vec![195, 195, 132, 132, 68, 68, 5, 5]);
        assert_eq!(budgets.iter().sum::<usize>(), 800);
        // One layer, or beta 1: uniform.
        assert_eq!(kept(&lanes[..2], 9, Allocator::Pyramid { beta: 20.0 }), vec![5, 4]);
        assert_eq!(kept(&lanes, 800, Allocator::Pyramid { beta: 0.5 }), vec![100; 8]);
    }

    #[test]
    fn ada_gives_the_layer_budget_to_the_largest_masses() {
        let concentrated = [vec![0.25; 4], vec![0.0; 6]].concat();
        let spread = vec![0.1; 10];
        let lanes = [lane(0, 0, concentrated, vec![]), lane(0, 1, spread, vec![])];
        // Uniform keeps 0.75 + 0.3 of the mass; Ada 1.0 + 0.2.
        assert_eq!(kept(&lanes, 6, Allocator::Uniform), vec![3, 3]);
        let keep = plan(&lanes, 6, &Allocator::Ada { floor: 0.0 });
        assert_eq!(keep, vec![vec![0, 1, 2, 3], vec![0, 1]]);
        assert_eq!(kept(&lanes, 6, Allocator::Ada { floor: 1.0 }), vec![3, 3]);
    }

    #[test]
    fn ada_floor_guarantees_each_head_a_share() {
        let lanes = [lane(0, 0, vec![0.0; 10], vec![]), lane(0, 1, vec![0.1; 10], vec![])];
        assert_eq!(kept(&lanes, 6, Allocator::Ada { floor: 0.0 }), vec![0, 6]);
        // floor(0.4 · 6 / 2) = 1 page at least.
        assert_eq!(kept(&lanes, 6, Allocator::Ada { floor: 0.4 }), vec![1, 5]);
        assert_eq!(kept(&lanes, 6, Allocator::defaults("ada").unwrap()), vec![0, 6]);
    }

    #[test]
    fn ada_keeps_layers_apart_and_protected_pages_first() {
        let lanes = [
            lane(0, 0, vec![0.0; 10], vec![9]),
            lane(0, 1, vec![0.1; 10], vec![]),
            lane(1, 0, vec![0.5; 4], vec![]),
            lane(1, 1, vec![0.0; 4], vec![]),
        ];
        // Each layer keeps its uniform share, 3 + 3 and 3 + 3 pages.
        let keep = plan(&lanes, 12, &Allocator::Ada { floor: 0.0 });
        assert_eq!(keep, vec![vec![9], vec![0, 1, 2, 3, 4], vec![0, 1, 2, 3], vec![0, 1]]);
    }
}
