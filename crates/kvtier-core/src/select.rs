//! Top-k page selection from per-page scores (docs/CONCEPTS.md §3, §6): sinks and
//! a recent window always in, the rest by highest score, ties to the lower
//! page index, result in position order. Partial selection, not a sort.

use std::cmp::Ordering;

/// How the scores of a GQA group's query heads make one score per page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aggregation {
    /// `max_h U(q_h, P)`: sound — a page any query head needs ranks by it.
    Max,
    /// Mean over the group: cheaper to satisfy, may miss a page one head needs.
    Mean,
    /// No aggregation: each query head selects its own pages.
    PerQueryHead,
}

/// Which pages a context-parallel rank owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// `world` nearly equal contiguous blocks; lower ranks take the remainder.
    Contiguous,
    /// Page `p` belongs to rank `p mod world`.
    Strided,
}

/// A context-parallel rank and what it selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This rank, in `0..world`.
    pub rank: u32,
    /// Number of context-parallel ranks; at least 1.
    pub world: u32,
    /// How pages are split among the ranks.
    pub ownership: Ownership,
    /// Whether the rank takes its share of the global selection or selects
    /// among its own pages.
    pub scope: Scope,
}

/// What a sharded selection ranks over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The caller's share of the global top-k: the union over ranks is the
    /// unsharded selection, exactly.
    Global,
    /// The top-k among the caller's pages only (sinks and window by global
    /// position, where the caller owns them).
    Local,
}

impl Shard {
    /// The pages `start..end` of `pages` owned by this rank when contiguous.
    fn block(&self, pages: usize) -> (usize, usize) {
        let (world, rank) = (self.world as usize, self.rank as usize);
        let (base, extra) = (pages / world, pages % world);
        let start = rank * base + rank.min(extra);
        (start, start + base + usize::from(rank < extra))
    }

    /// Whether this rank owns page `page` of a lane of `pages` pages.
    pub fn owns(&self, page: usize, pages: usize) -> bool {
        match self.ownership {
            Ownership::Contiguous => {
                let (start, end) = self.block(pages);
                (start..end).contains(&page)
            }
            Ownership::Strided => page % self.world as usize == self.rank as usize,
        }
    }
}

/// Budget, in pages, and the pages always included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Pages to choose in all, sinks and window included (these are chosen
    /// even beyond it).
    pub pages: usize,
    /// The first `sinks` pages, always chosen.
    pub sinks: usize,
    /// The last `window` pages (the most recent), always chosen.
    pub window: usize,
}

/// A top-p budget: after the forced pages, pages by score until the chosen
/// pages hold `p` of the total score of the pages that could be chosen (for
/// scores that are estimated attention masses, `p` of the estimated mass),
/// never fewer than `min_pages` nor more than the budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopP {
    /// Share of the total score to hold, in (0, 1].
    pub p: f32,
    /// Pages to choose at least (forced ones included), score share or not.
    pub min_pages: usize,
}

/// Orders (score, page) best first: higher score, then lower page.
fn rank(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Selects pages of a lane of `scores.len()` pages, in position order.
/// With a shard, `Global` selects over every page and keeps the caller's,
/// `Local` selects among the caller's pages only.
pub fn select(scores: &[f32], budget: Budget, shard: Option<Shard>) -> Vec<usize> {
    select_among(scores, None, budget, shard, None)
}

/// [`select`] among the pages of `pool` only (in position order, every
/// forced page among them), or among all pages (a selection re-ranking a
/// few candidates of a long lane looks at those alone), with a top-p
/// budget cutting the selection short where the chosen pages already hold
/// `p` of the score.
pub fn select_among(
    scores: &[f32],
    pool: Option<&[usize]>,
    budget: Budget,
    shard: Option<Shard>,
    top_p: Option<TopP>,
) -> Vec<usize> {
    let n = scores.len();
    let owned = |p: usize| shard.is_none_or(|s| s.owns(p, n));
    let local = shard.is_some_and(|s| s.scope == Scope::Local);
    let candidate = |p: usize| !local || owned(p);
    let pool = Pool { pages: pool, n };
    let mut chosen = top(scores, &pool, &candidate, budget);
    if let Some(top_p) = top_p {
        chosen = cut(scores, &pool, &candidate, budget, top_p, chosen);
    }
    if shard.is_some_and(|s| s.scope == Scope::Global) {
        chosen.retain(|&p| owned(p));
    }
    chosen
}

/// The pages a selection may choose from: listed, or all `n`.
struct Pool<'a> {
    pages: Option<&'a [usize]>,
    n: usize,
}

impl Pool<'_> {
    fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        let (listed, all) = match self.pages {
            Some(pages) => (Some(pages.iter().copied()), None),
            None => (None, Some(0..self.n)),
        };
        listed.into_iter().flatten().chain(all.into_iter().flatten())
    }

    fn len(&self) -> usize {
        self.pages.map_or(self.n, <[usize]>::len)
    }
}

/// The selection among the pages of `pool` for which `candidate` holds.
fn top(scores: &[f32], pool: &Pool<'_>, candidate: &impl Fn(usize) -> bool, budget: Budget) -> Vec<usize> {
    let n = scores.len();
    let forced = |p: usize| p < budget.sinks || p + budget.window >= n;
    // The budget comes from the request: a client may ask for billions.
    let mut chosen = Vec::with_capacity(budget.pages.min(n));
    let mut rest: Vec<(f32, u32)> = Vec::with_capacity(pool.len());
    for p in pool.iter().filter(|&p| candidate(p)) {
        if forced(p) {
            chosen.push(p);
        } else {
            rest.push((scores[p], p as u32));
        }
    }
    let room = budget.pages.saturating_sub(chosen.len());
    if room < rest.len() {
        if room > 0 {
            rest.select_nth_unstable_by(room - 1, rank);
        }
        rest.truncate(room);
    }
    chosen.extend(rest.iter().map(|&(_, p)| p as usize));
    chosen.sort_unstable();
    chosen
}

/// The forced pages of `chosen`, then its others best first until the
/// share of the candidates' total score reaches `p` (at least `min_pages`).
fn cut(
    scores: &[f32],
    pool: &Pool<'_>,
    candidate: &impl Fn(usize) -> bool,
    budget: Budget,
    top_p: TopP,
    chosen: Vec<usize>,
) -> Vec<usize> {
    let n = scores.len();
    let forced = |p: usize| p < budget.sinks || p + budget.window >= n;
    let total: f64 = pool
        .iter()
        .filter(|&p| candidate(p))
        .map(|p| f64::from(scores[p].max(0.0)))
        .sum();
    let (mut kept, mut others): (Vec<usize>, Vec<usize>) = chosen.into_iter().partition(|&p| forced(p));
    others.sort_unstable_by(|&a, &b| rank(&(scores[a], a as u32), &(scores[b], b as u32)));
    let mut held: f64 = kept.iter().map(|&p| f64::from(scores[p].max(0.0))).sum();
    let goal = f64::from(top_p.p) * total;
    for p in others {
        if held >= goal && kept.len() >= top_p.min_pages {
            break;
        }
        held += f64::from(scores[p].max(0.0));
        kept.push(p);
    }
    kept.sort_unstable();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The rule written the slow, obvious way: sort everything.
    fn reference(scores: &[f32], budget: Budget) -> Vec<usize> {
        let n = scores.len();
        if n <= budget.pages {
            return (0..n).collect();
        }
        let forced: Vec<usize> = (0..n).filter(|&p| p < budget.sinks || p + budget.window >= n).collect();
        let mut others: Vec<usize> = (0..n).filter(|p| !forced.contains(p)).collect();
        others.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b)));
        let mut out = forced.clone();
        out.extend(others.into_iter().take(budget.pages.saturating_sub(forced.len())));
        out.sort();
        out
    }

    /// A valid budget: sinks and window fit in it.
    fn budget_for(k: usize, s: usize, w: usize) -> Budget {
        Budget {
            pages: k.max(s + w),
            sinks: s,
            window: w,
        }
    }

    proptest! {
        #[test]
        fn selection_equals_a_brute_force_reference(
            // Few distinct values, so ties are common.
            scores in proptest::collection::vec((0i8..6).prop_map(f32::from), 0..60),
            k in 0usize..20, s in 0usize..4, w in 0usize..4,
        ) {
            let b = budget_for(k, s, w);
            let got = select(&scores, b, None);
            prop_assert_eq!(&got, &reference(&scores, b));
            prop_assert!(got.len() == b.pages.min(scores.len()));
        }

        #[test]
        fn global_shares_union_to_the_unsharded_selection(
            scores in proptest::collection::vec((0i8..8).prop_map(f32::from), 0..80),
            k in 0usize..24, s in 0usize..3, w in 0usize..3,
            world in 1u32..=8, strided in any::<bool>(),
        ) {
            let b = budget_for(k, s, w);
            let ownership = if strided { Ownership::Strided } else { Ownership::Contiguous };
            let whole = select(&scores, b, None);
            let mut union = Vec::new();
            for rank in 0..world {
                let shard = Shard { rank, world, ownership, scope: Scope::Global };
                let share = select(&scores, b, Some(shard));
                prop_assert!(share.iter().all(|&p| shard.owns(p, scores.len())));
                union.extend(share);
            }
            union.sort();
            prop_assert_eq!(union, whole);
        }

        #[test]
        fn every_page_has_exactly_one_owner(pages in 0usize..100, world in 1u32..=8, strided in any::<bool>()) {
            let ownership = if strided { Ownership::Strided } else { Ownership::Contiguous };
            for p in 0..pages {
                let owners = (0..world)
                    .filter(|&rank| Shard { rank, world, ownership, scope: Scope::Local }.owns(p, pages))
                    .count();
                prop_assert_eq!(owners, 1);
            }
        }

        #[test]
        fn local_scope_selects_within_the_share(
            scores in proptest::collection::vec((0i8..8).prop_map(f32::from), 0..80),
            k in 0usize..24, world in 1u32..=8, rank_seed in any::<u32>(), strided in any::<bool>(),
        ) {
            let b = budget_for(k, 1, 1);
            let ownership = if strided { Ownership::Strided } else { Ownership::Contiguous };
            let shard = Shard { rank: rank_seed % world, world, ownership, scope: Scope::Local };
            let mine: Vec<usize> = (0..scores.len()).filter(|&p| shard.owns(p, scores.len())).collect();
            let got = select(&scores, b, Some(shard));
            prop_assert_eq!(got.len(), b.pages.min(mine.len()));
            prop_assert!(got.iter().all(|p| mine.contains(p)));
            // Nothing unchosen in the share beats a chosen non-forced page.
            let n = scores.len();
            let forced = |p: usize| p < b.sinks || p + b.window >= n;
            if let Some(worst) = got.iter().filter(|&&p| !forced(p)).map(|&p| (scores[p], p as u32)).max_by(rank) {
                for &p in mine.iter().filter(|p| !got.contains(p) && !forced(**p)) {
                    prop_assert!(rank(&(scores[p], p as u32), &worst) == Ordering::Greater);
                }
            }
        }
    }

    proptest! {
        /// A top-p selection is the full selection's forced pages and its
        /// best others, the fewest that reach `p` of the total (at least
        /// `min_pages`).
        #[test]
        fn top_p_keeps_the_fewest_best_pages_that_reach_p(
            scores in proptest::collection::vec((0u8..20).prop_map(|v| f32::from(v) / 20.0), 0..60),
            k in 0usize..30, s in 0usize..3, w in 0usize..3,
            p in 0.0f32..1.0, min_pages in 0usize..10,
        ) {
            let b = budget_for(k, s, w);
            let full = select(&scores, b, None);
            let cut = select_among(&scores, None, b, None, Some(TopP { p, min_pages }));
            let n = scores.len();
            let forced = |q: usize| q < b.sinks || q + b.window >= n;
            prop_assert!(cut.iter().all(|q| full.contains(q)));
            prop_assert!(full.iter().filter(|&&q| forced(q)).all(|q| cut.contains(q)));
            let total: f32 = scores.iter().sum();
            let held = |set: &[usize]| set.iter().map(|&q| scores[q]).sum::<f32>();
            let mut others: Vec<usize> = cut.iter().copied().filter(|&q| !forced(q)).collect();
            if !others.is_empty() {
                // Dropping the weakest other page would miss the goal or the minimum.
                others.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(b.cmp(&a)));
                let weakest = others[0];
                let without: Vec<usize> = cut.iter().copied().filter(|&q| q != weakest).collect();
                prop_assert!(held(&without) < p * total + 1e-4 || without.len() < min_pages);
                // Nothing left out of the full selection beats it.
                for q in full.iter().filter(|q| !cut.contains(q)) {
                    prop_assert!(scores[*q] <= scores[weakest]);
                }
            }
            if cut.len() < full.len() {
                prop_assert!(held(&cut) >= p * total - 1e-4 && cut.len() >= min_pages);
            }
        }
    }

    #[test]
    fn sinks_and_window_count_against_the_budget() {
        let scores = [0.0, 9.0, 8.0, 7.0, 0.0, 0.0];
        let b = Budget {
            pages: 4,
            sinks: 1,
            window: 2,
        };
        assert_eq!(select(&scores, b, None), [0, 1, 4, 5]);
        // Ties go to the lower page.
        let flat = [1.0; 6];
        assert_eq!(
            select(
                &flat,
                Budget {
                    pages: 3,
                    sinks: 0,
                    window: 0
                },
                None
            ),
            [0, 1, 2]
        );
        // Few pages: everything.
        assert_eq!(select(&[1.0, 2.0], b, None), [0, 1]);
    }

    #[test]
    fn contiguous_blocks_spread_the_remainder_over_low_ranks() {
        let blocks: Vec<(usize, usize)> = (0..3)
            .map(|rank| {
                Shard {
                    rank,
                    world: 3,
                    ownership: Ownership::Contiguous,
                    scope: Scope::Global,
                }
                .block(10)
            })
            .collect();
        assert_eq!(blocks, [(0, 4), (4, 7), (7, 10)]);
    }
}
