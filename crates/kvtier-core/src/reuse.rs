//! Reusing a lane's last ranking across decode steps (docs/CONCEPTS.md
//! §3.3). One step's query differs little from the last one's (FreeKV
//! reuses selections across steps on this ground): when every query head
//! of the group is within the request's cosine similarity of the query
//! that last ranked the lane, the lane's index is not scored again; its
//! last scores choose anew. The choice is remade, not copied, so sinks,
//! window, budget, shard and top-p hold as in a full ranking; a page opened
//! or grown since ranks above every page the last ranking scored (nothing
//! has scored what it holds now, and it is the newest). The anchor stays the
//! query that ranked: a slow drift re-ranks once it adds up to the
//! threshold.

use crate::rank::{HeadRank, LaneQuery, LaneRanking, Mode, Ranking, rank_lane};
use crate::select::{Aggregation, Budget, Scope, Shard, select_among};

/// A lane's last full ranking: what it was asked and what it found.
#[derive(Debug, Clone)]
pub struct LastRanking {
    /// The queries that ranked, `[group][head_dim]`.
    queries: Vec<f32>,
    /// What the ranking was for: a reuse must ask the same.
    ask: Ask,
    /// Tokens of the lane then.
    tokens: u64,
    heads: Vec<HeadRank>,
}

/// What a ranking's scores depend on besides the queries and the lane.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Ask {
    aggregation: Aggregation,
    budget: Budget,
    /// Only where it changes the scores: two-stage's candidates among a
    /// rank's own pages. Otherwise every context-parallel rank of a lane
    /// shares its ranking (each chooses its own share from it).
    shard: Option<Shard>,
    ranking: Ranking,
}

impl Ask {
    fn of(q: &LaneQuery<'_>) -> Self {
        Self {
            aggregation: q.aggregation,
            budget: q.budget,
            shard: local_candidates(q),
            ranking: q.ranking,
        }
    }
}

/// The shard, if it narrows two-stage's candidates to the rank's own pages.
fn local_candidates(q: &LaneQuery<'_>) -> Option<Shard> {
    q.shard
        .filter(|s| q.ranking.mode == Mode::TwoStage && s.scope == Scope::Local)
}

/// Ranks `q`'s lane, reusing `last` where the request allows
/// ([`Ranking::reuse`]) and the queries have not moved; a full ranking
/// with reuse replaces `last`. A request without reuse leaves `last` as it
/// is (a speculative prefetch, say, between two reusing selections).
/// Returns the ranking and whether it was reused.
pub fn rank_lane_reusing(q: &LaneQuery<'_>, last: &mut Option<LastRanking>) -> (LaneRanking, bool) {
    let Some(similarity) = q.ranking.reuse else {
        return (rank_lane(q), false);
    };
    if let Some(reused) = last.as_ref().and_then(|l| reuse(l, q, similarity)) {
        return (reused, true);
    }
    let ranked = rank_lane(q);
    *last = Some(LastRanking {
        queries: q.queries.to_vec(),
        ask: Ask::of(q),
        tokens: q.tokens,
        heads: ranked.heads.clone(),
    });
    (ranked, false)
}

/// The choice `last`'s scores make for `q`, if `q` asks what `last` was
/// asked, its lane has not shrunk (nor, for candidates among a rank's own
/// pages, whose block moves as the lane grows, grown), and each query head
/// is within `similarity` of `last`'s.
fn reuse(last: &LastRanking, q: &LaneQuery<'_>, similarity: f32) -> Option<LaneRanking> {
    let pages = q.index.digests().pages();
    let grown = q.tokens != last.tokens;
    if last.ask != Ask::of(q)
        || q.tokens < last.tokens
        || last.queries.len() != q.queries.len()
        || (grown && local_candidates(q).is_some())
    {
        return None;
    }
    let d = q.index.digests().head_dim();
    let close = last
        .queries
        .chunks_exact(d)
        .zip(q.queries.chunks_exact(d))
        .all(|(a, b)| similar(a, b, similarity));
    if !close {
        return None;
    }
    let top_p = q.ranking.top_p.filter(|_| q.ranking.mode.estimates_mass());
    let full = (last.tokens / q.index.page_size() as u64) as usize;
    let heads = last
        .heads
        .iter()
        .map(|head| {
            let mut scores = head.scores.clone();
            if grown {
                // Pages opened or grown since: above every scored page.
                let best = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                scores.truncate(full);
                scores.resize(pages, best.next_up());
            }
            let chosen = select_among(&scores, None, q.budget, q.shard, top_p);
            HeadRank {
                query_head: head.query_head,
                scores,
                chosen,
            }
        })
        .collect();
    Some(LaneRanking {
        heads,
        bytes_scanned: 0,
    })
}

/// Whether `a` and `b` are within cosine similarity `s` (with room for the
/// rounding of equal vectors, whose computed cosine may fall just short of 1).
fn similar(a: &[f32], b: &[f32], s: f32) -> bool {
    cosine(a, b) + 1e-9 >= f64::from(s)
}

/// `a·b / (|a| |b|)`, in f64; 0 when either is zero.
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa > 0.0 && bb > 0.0 {
        ab / (aa.sqrt() * bb.sqrt())
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lane(d: usize, page_size: u32, keys: &[f32]) -> crate::PageIndex {
        crate::rank::tests::lane(d, page_size, keys).0
    }

    /// The model's anchor: the last full ranking's queries, budget, lane
    /// pages and tokens, and scores.
    struct Anchor {
        queries: Vec<f32>,
        budget: usize,
        pages: usize,
        tokens: usize,
        scores: Vec<f32>,
    }

    proptest! {
        /// Against the model: a reuse happens exactly when the request
        /// asks the same with every query head within the threshold of the
        /// anchor (the query of the last full ranking that asked for reuse)
        /// on a lane no shorter; it chooses what selecting over the
        /// anchor's scores chooses, pages opened or grown since above them
        /// all; otherwise the ranking is the full one, and becomes the
        /// anchor if it asked for reuse (a request without reuse changes
        /// nothing kept).
        #[test]
        fn reuse_follows_its_model(
            d in prop_oneof![Just(4usize), Just(8usize)],
            steps in proptest::collection::vec((0usize..4, 0u32..4, -1.0f32..1.0, 0usize..3, 0u8..5), 1..12),
            mode in prop_oneof![Just(Mode::Quest), Just(Mode::TwoStage)],
            threshold in 0.5f32..1.0,
            values in proptest::collection::vec(-3.0f32..3.0, 800),
        ) {
            let group = 2;
            let page_size = 4;
            let mut tokens = 24usize;
            let mut queries = values[values.len() - group * d..].to_vec();
            let mut last = None;
            let mut anchor: Option<Anchor> = None;
            for (grow, budget, nudge, which, plain) in steps {
                tokens = (tokens + grow * 3).min(values.len() / d - 1);
                let index = lane(d, page_size, &values[..tokens * d]);
                queries[which % (group * d)] += nudge;
                let budget = Budget { pages: 2 + budget as usize, sinks: 1, window: 1 };
                let reuse = (plain > 0).then_some(threshold);
                let ranking = Ranking { reuse, ..Ranking::new(mode) };
                let q = LaneQuery { index: &index, cold: None, tokens: tokens as u64, queries: &queries, aggregation: mode.default_aggregation(), budget, shard: None, ranking };
                let (got, reused) = rank_lane_reusing(&q, &mut last);
                let pages = index.digests().pages();
                let expect = anchor.as_ref().filter(|a| {
                    reuse.is_some() && a.budget == budget.pages && a.tokens <= tokens
                        && a.queries.chunks_exact(d).zip(queries.chunks_exact(d)).all(|(a, b)| cosine(a, b) + 1e-9 >= f64::from(threshold))
                });
                match expect {
                    Some(a) => {
                        prop_assert!(reused);
                        let mut scores = a.scores.clone();
                        if a.tokens != tokens {
                            let best = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                            scores.truncate((a.tokens / page_size as usize).min(a.pages));
                            scores.resize(pages, best.next_up());
                        }
                        prop_assert_eq!(&got.heads[0].chosen, &crate::select::select(&scores, budget, None));
                        prop_assert_eq!(got.bytes_scanned, 0);
                    }
                    None => {
                        prop_assert!(!reused);
                        prop_assert_eq!(&got, &rank_lane(&q));
                        if reuse.is_some() {
                            anchor = Some(Anchor {
                                queries: queries.clone(),
                                budget: budget.pages,
                                pages,
                                tokens,
                                scores: got.heads[0].scores.clone(),
                            });
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_request_without_reuse_leaves_the_kept_ranking_and_equal_queries_reuse() {
        let index = lane(4, 4, &[1.0; 64]);
        let queries = [0.1f32, 0.7, 0.3, 0.9, 1.0, 1.0, 1.0, 1.0];
        let q = LaneQuery {
            index: &index,
            cold: None,
            tokens: 16,
            queries: &queries,
            aggregation: Aggregation::Max,
            budget: Budget {
                pages: 2,
                sinks: 0,
                window: 0,
            },
            shard: None,
            ranking: Ranking {
                reuse: Some(1.0),
                ..Ranking::new(Mode::Quest)
            },
        };
        let mut last = None;
        assert!(!rank_lane_reusing(&q, &mut last).1);
        assert!(rank_lane_reusing(&q, &mut last).1, "the same queries reuse at 1.0");
        let plain = LaneQuery {
            ranking: Ranking::new(Mode::Quest),
            ..q
        };
        assert!(!rank_lane_reusing(&plain, &mut last).1);
        assert!(rank_lane_reusing(&q, &mut last).1, "a request without reuse left it");
    }
}
