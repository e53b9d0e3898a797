//! The plan (docs/CONCEPTS.md §5): each lane's budget from the allocator, then the
//! lane's pages: protected first, in priority order, then the highest scores.

use super::{Allocator, PageScores};

/// One lane to plan.
#[derive(Debug, Clone, PartialEq)]
pub struct LanePlanInput {
    /// The lane's layer, its 0-based position among the planned layers. Only
    /// the order of the distinct values matters: PyramidKV slopes over them,
    /// Ada-KV groups heads by them.
    pub layer: usize,
    /// The lane's KV head; Ada-KV's ties go to the lower head.
    pub head: usize,
    /// Pages in the lane. Scores and protected pages past it are ignored;
    /// a missing score counts as 0.
    pub pages: usize,
    /// The lane's scores, from [`super::Scorer::score`].
    pub scores: PageScores,
}

/// Which pages of each lane to keep (sorted ascending, one list per lane of
/// `lanes`), given the total budget in pages over all lanes (usually the
/// per-lane budget times the lanes).
///
/// The allocator sets each lane's budget, never above its pages. Budget a
/// lane cannot use is redistributed to the others, the way the allocator
/// splits it, so `min(total, all pages)` pages are kept in all: a lane whose
/// budget covers its pages keeps them all. Within its budget a lane keeps
/// its protected pages first, in priority order, then its highest-scoring
/// pages, ties to the lower page. Deterministic.
pub fn plan(lanes: &[LanePlanInput], total_budget_pages: usize, allocator: &Allocator) -> Vec<Vec<usize>> {
    let orders: Vec<KeepOrder> = lanes.iter().map(KeepOrder::new).collect();
    let budgets = allocator.budgets(lanes, &orders, total_budget_pages);
    orders
        .into_iter()
        .zip(budgets)
        .map(|(order, budget)| {
            let mut keep = order.pages;
            keep.truncate(budget);
            keep.sort_unstable();
            keep
        })
        .collect()
}

/// The attention mass a kept set misses, `1 − p(kept)` with `p` the kept
/// share of `page_mass` (0 when there is no mass). For renormalised attention
/// `o_full − o_kept = (1 − p)(o_dropped − o_kept)`. `kept` holds distinct
/// pages; any past `page_mass` count nothing.
pub fn dropped_mass(page_mass: &[f64], kept: &[usize]) -> f64 {
    let total: f64 = page_mass.iter().sum();
    if total <= 0.0 {
        return 0.0;
    }
    let kept_mass: f64 = kept.iter().filter_map(|&page| page_mass.get(page)).sum();
    1.0 - kept_mass / total
}

/// A lane's pages in the order it keeps them, whatever its budget.
#[derive(Debug)]
pub(super) struct KeepOrder {
    pub(super) pages: Vec<usize>,
    /// How many of `pages`, from the front, are protected.
    pub(super) protected: usize,
}

impl KeepOrder {
    fn new(lane: &LanePlanInput) -> Self {
        let mut taken = vec![false; lane.pages];
        let mut pages = Vec::with_capacity(lane.pages);
        for &page in &lane.scores.protected {
            if page < lane.pages && !taken[page] {
                taken[page] = true;
                pages.push(page);
            }
        }
        let protected = pages.len();
        let mut rest: Vec<usize> = (0..lane.pages).filter(|&page| !taken[page]).collect();
        rest.sort_by(|&a, &b| {
            let (sa, sb) = (page_score(&lane.scores, a), page_score(&lane.scores, b));
            sb.total_cmp(&sa).then(a.cmp(&b))
        });
        pages.extend(rest);
        Self { pages, protected }
    }
}

/// A page's score for ranking: missing counts 0, NaN ranks last.
pub(super) fn page_score(scores: &PageScores, page: usize) -> f64 {
    match scores.scores.get(page) {
        Some(s) if s.is_nan() => f64::NEG_INFINITY,
        Some(&s) => s,
        None => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(scores: Vec<f64>, protected: Vec<usize>) -> LanePlanInput {
        LanePlanInput {
            layer: 0,
            head: 0,
            pages: scores.len(),
            scores: PageScores { scores, protected },
        }
    }

    fn keep(lane: LanePlanInput, budget: usize) -> Vec<usize> {
        plan(&[lane], budget, &Allocator::Uniform).remove(0)
    }

    #[test]
    fn protected_pages_come_first_in_priority_order() {
        let scores = vec![0.5, 0.3, 0.2, 0.0];
        assert_eq!(keep(lane(scores.clone(), vec![3]), 2), vec![0, 3]);
        assert_eq!(keep(lane(scores.clone(), vec![3]), 1), vec![3]);
        assert_eq!(keep(lane(scores.clone(), vec![3, 2, 1]), 2), vec![2, 3]);
        // Out-of-range and repeated protected pages are ignored.
        assert_eq!(keep(lane(scores, vec![7, 3, 3]), 2), vec![0, 3]);
    }

    #[test]
    fn scores_rank_the_rest_with_ties_to_the_lower_page() {
        assert_eq!(keep(lane(vec![0.1, 0.4, 0.4, f64::NAN, 0.2], vec![]), 3), vec![1, 2, 4]);
        assert_eq!(keep(lane(vec![1.0; 5], vec![]), 2), vec![0, 1]);
        // Pages past the scores count 0.
        let short = LanePlanInput {
            pages: 4,
            ..lane(vec![-1.0, 0.5], vec![])
        };
        assert_eq!(keep(short, 2), vec![1, 2]);
    }

    #[test]
    fn budgets_never_exceed_a_lane_and_cover_everything_when_large() {
        let lanes = [lane(vec![0.0; 2], vec![]), lane(vec![0.0; 10], vec![])];
        let keep = plan(&lanes, 10, &Allocator::Uniform);
        assert_eq!(keep, vec![vec![0, 1], (0..8).collect::<Vec<_>>()]);
        let keep = plan(&lanes, 100, &Allocator::Uniform);
        assert_eq!(keep, vec![vec![0, 1], (0..10).collect::<Vec<_>>()]);
        assert!(plan(&lanes, 0, &Allocator::Uniform).iter().all(Vec::is_empty));
        assert!(plan(&[], 10, &Allocator::Uniform).is_empty());
    }

    #[test]
    fn dropped_mass_is_the_share_left_out() {
        let mass = [0.5, 0.3, 0.2];
        assert!((dropped_mass(&mass, &[0, 2]) - 0.3).abs() < 1e-12);
        assert_eq!(dropped_mass(&mass, &[0, 1, 2]), 0.0);
        assert_eq!(dropped_mass(&mass, &[]), 1.0);
        assert_eq!(dropped_mass(&[0.0, 0.0], &[0]), 0.0);
    }

    #[test]
    fn dropped_mass_gives_the_output_error_of_renormalised_attention() {
        let (mass, values, kept) = ([0.5, 0.3, 0.2], [1.0, -2.0, 4.0], [0, 2]);
        let p = 1.0 - dropped_mass(&mass, &kept);
        let output = |pages: &[usize]| {
            let weight: f64 = pages.iter().map(|&i| mass[i]).sum();
            pages.iter().map(|&i| mass[i] * values[i]).sum::<f64>() / weight
        };
        let (full, kept_out, dropped) = (output(&[0, 1, 2]), output(&kept), output(&[1]));
        assert!((full - kept_out - (1.0 - p) * (dropped - kept_out)).abs() < 1e-12);
        assert!((full - 0.7).abs() < 1e-12);
    }
}
