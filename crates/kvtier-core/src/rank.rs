//! How a lane's pages are ranked for a query group (docs/CONCEPTS.md §3.2):
//!
//! - `quest`: the sound upper bound `U(q, P)` from each page's min/max digest;
//! - `cuboid`: `q·c + |q|·ρ` from each page's box of mean and mean deviation
//!   (tighter, not a bound);
//! - `sketch`: every token's logit estimated from its int4 sketch, softmax
//!   over the lane, each page ranked by its estimated attention mass;
//! - `two-stage`: Quest's bound keeps `candidates ×` the budget, and only
//!   those pages are re-ranked by their sketches' estimated mass. (Stage one
//!   is the sound bound, not the cuboid: on real keys the cuboid's means
//!   dilute the single heavy tokens that carry most mass, and a cuboid
//!   stage one lost them — bench/results/selection.md.)
//!
//! The scores of a GQA group's query heads are combined per page as the
//! request's [`Aggregation`] says (for masses: max or mean of each head's
//! mass, or one selection per query head). Mass scores also allow a top-p
//! budget.
//!
//! A page's sketches may be spilled from the index (the store does so for
//! NVMe-cold pages): the modes that read them ask the query's
//! [`ColdSketches`] for those pages alone — two-stage for its candidates —
//! and rank exactly as if they had been resident.

use std::ops::Range;

use crate::fast_exp::exp_in_place;
use crate::score::score_column;
use crate::select::{Aggregation, Budget, Shard, TopP, select, select_among};
use crate::sketch_score::SketchQueries;
use crate::{DIGEST_CHUNK_PAGES, DigestColumn, PageIndex};

/// Which estimate ranks pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Quest's sound upper bound from each page's min/max digest.
    Quest,
    /// `q·c + |q|·ρ` from each page's box of mean and mean deviation; tighter
    /// than Quest but not a bound.
    Cuboid,
    /// Each page's estimated attention mass, from its tokens' int4 sketches.
    Sketch,
    /// Quest's bound picks `candidates ×` the budget; those are re-ranked by
    /// sketch mass.
    TwoStage,
}

impl Mode {
    /// All four modes, in declaration order.
    pub const ALL: [Mode; 4] = [Mode::Quest, Mode::Cuboid, Mode::Sketch, Mode::TwoStage];

    /// The mode's name: `quest`, `cuboid`, `sketch` or `two-stage`.
    pub const fn name(self) -> &'static str {
        match self {
            Mode::Quest => "quest",
            Mode::Cuboid => "cuboid",
            Mode::Sketch => "sketch",
            Mode::TwoStage => "two-stage",
        }
    }

    /// The mode named `name` (as [`Self::name`] spells it), or `None`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Whether pages are ranked by estimated attention mass (which a top-p
    /// budget needs).
    pub const fn estimates_mass(self) -> bool {
        matches!(self, Mode::Sketch | Mode::TwoStage)
    }

    /// How a GQA group's scores combine when a request names no
    /// aggregation. Bounds take the max: sound, a page any query head needs
    /// ranks by it. Masses take the mean: a page's share of the group's
    /// attention, which is what the group reads it for (the shared choice
    /// that holds the most pooled mass ranks by the sum; on real KV the mean
    /// closes more of the gap to the oracle at equal pages read than the
    /// max: bench/results/selection.md).
    pub const fn default_aggregation(self) -> Aggregation {
        match self {
            Mode::Quest | Mode::Cuboid => Aggregation::Max,
            Mode::Sketch | Mode::TwoStage => Aggregation::Mean,
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a selection ranks, beyond its budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ranking {
    /// Which estimate ranks pages.
    pub mode: Mode,
    /// Two-stage: stage one keeps this many times the budget (at least 1).
    pub candidates: u32,
    /// The attention's softmax scale, applied to estimated logits; `None`:
    /// `1/√head_dim`, as most models use.
    pub softmax_scale: Option<f32>,
    /// A top-p budget; applies only where [`Mode::estimates_mass`] (ignored
    /// otherwise). `None`: the plain page budget.
    pub top_p: Option<TopP>,
    /// Reuse the lane's last ranking while every query head's cosine
    /// similarity to the query that made it is at least this
    /// ([`crate::reuse`]); `None`: rank every time.
    pub reuse: Option<f32>,
}

/// The most stage-one candidates per budget page a request may ask for.
pub const MAX_CANDIDATES: u32 = 64;

/// The stage-one factor when a request names none.
pub const DEFAULT_CANDIDATES: u32 = 4;

/// The mode a request that names none gets (chosen by measurement:
/// bench/results/selection.md).
pub const DEFAULT_MODE: Mode = Mode::TwoStage;

impl Ranking {
    /// `mode` with the default factor and softmax scale, no top-p.
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            candidates: DEFAULT_CANDIDATES,
            softmax_scale: None,
            top_p: None,
            reuse: None,
        }
    }

    /// The softmax scale for heads of `head_dim`: the request's, or
    /// `1/√head_dim`.
    pub fn scale(&self, head_dim: usize) -> f32 {
        self.softmax_scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
    }
}

impl Default for Ranking {
    fn default() -> Self {
        Self::new(DEFAULT_MODE)
    }
}

/// Where the sketch rows of pages spilled from a lane's index are read
/// again (the store: from the pages' key rows, on NVMe or wherever they
/// are). The ranking itself does no I/O; it asks once per stage.
pub trait ColdSketches: std::fmt::Debug + Sync {
    /// The sketch rows of each of `pages` (of the lane being ranked, in
    /// the order given; each page's valid rows), or `None` for a page whose
    /// keys cannot be had (lost): it is ranked as if its keys were zero.
    fn sketches(&self, pages: &[usize]) -> Vec<Option<Vec<u8>>>;
}

/// One lane's ranking problem.
#[derive(Debug, Clone, Copy)]
pub struct LaneQuery<'a> {
    /// The lane's resident index (digests, and the sketches not spilled).
    pub index: &'a PageIndex,
    /// Where the spilled sketches are read; `None` when none are.
    pub cold: Option<&'a dyn ColdSketches>,
    /// Tokens in the lane (the last page may be partial).
    pub tokens: u64,
    /// `[group][head_dim]`: the KV head's query heads.
    pub queries: &'a [f32],
    /// How the group's query heads are combined per page.
    pub aggregation: Aggregation,
    /// Pages to choose, and the sinks and window always chosen.
    pub budget: Budget,
    /// The context-parallel rank choosing, if the lane is sharded.
    pub shard: Option<Shard>,
    /// Which estimate ranks pages, and its parameters.
    pub ranking: Ranking,
}

/// The choice of one KV head, or of one of its query heads.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadRank {
    /// Without aggregation: which query head of the group.
    pub query_head: Option<u32>,
    /// One score per page of the lane: what it was ranked by (a bound or an
    /// estimated mass; −1 for pages two-stage never re-ranked).
    pub scores: Vec<f32>,
    /// In position order.
    pub chosen: Vec<usize>,
}

/// What [`rank_lane`] found for one lane.
#[derive(Debug, Clone, PartialEq)]
pub struct LaneRanking {
    /// One entry for the KV head, or one per query head with
    /// [`Aggregation::PerQueryHead`], in query-head order.
    pub heads: Vec<HeadRank>,
    /// Index bytes read: digests, and sketch rows.
    pub bytes_scanned: u64,
}

/// Ranks one lane's pages and chooses, per the query's mode.
pub fn rank_lane(q: &LaneQuery<'_>) -> LaneRanking {
    let index = q.index;
    let d = index.digests().head_dim();
    let group = q.queries.len() / d;
    let mode = q.ranking.mode;
    let n = index.digests().pages();
    // Every page's score for every query head of the group, `[page][group]`:
    // a bound (quest, two-stage's stage one), the cuboid's score, or the
    // estimated mass (sketch).
    let (lane_scores, mut bytes) = match mode {
        Mode::Quest | Mode::TwoStage => (score_all(index.digests(), q.queries), index.digests().byte_len() as u64),
        Mode::Cuboid => {
            // Each page's cuboid from its sketches, scored like a digest.
            let all: Vec<usize> = (0..n).collect();
            let sketches = Sketches::of(q, &all);
            let cuboids = index.cuboids(all.iter().enumerate().map(|(i, &p)| sketches.rows(i, p)));
            let mut scores = vec![0f32; n * group];
            score_column(index.digests().dtype(), d, &cuboids, q.queries, &mut scores);
            (scores, (q.tokens as usize * index.sketch_row_bytes()) as u64)
        }
        Mode::Sketch => {
            let all: Vec<usize> = (0..n).collect();
            page_masses(q, &all, q.queries)
        }
    };
    let selectors: Vec<(Option<u32>, Range<usize>)> = match q.aggregation {
        Aggregation::PerQueryHead => (0..group).map(|g| (Some(g as u32), g..g + 1)).collect(),
        Aggregation::Max | Aggregation::Mean => vec![(None, 0..group)],
    };
    let mut heads = Vec::with_capacity(selectors.len());
    for (query_head, members) in selectors {
        // Two-stage's stage one combines the bounds as the request combines
        // masses. With the mean, the max of bounds would keep more of the
        // pages one query head needs, but on real KV it filtered worse:
        // 0.920/0.959 of the gap at 1/32 and 1/16 (prose), 0.927/0.906
        // (code), against the mean's 0.927/0.969 and 0.947/0.958.
        let mut scores = combine(&lane_scores, group, members.clone(), q.aggregation);
        let mut pool = None;
        if mode == Mode::TwoStage {
            let (candidates, masses, read) = rerank(q, &scores, &q.queries[members.start * d..members.end * d]);
            bytes += read;
            scores = masses;
            pool = Some(candidates);
        }
        let top_p = q.ranking.top_p.filter(|_| mode.estimates_mass());
        let chosen = select_among(&scores, pool.as_deref(), q.budget, q.shard, top_p);
        heads.push(HeadRank {
            query_head,
            scores,
            chosen,
        });
    }
    LaneRanking {
        heads,
        bytes_scanned: bytes,
    }
}

/// Two-stage's second stage: the pages `bounds` ranks first (`candidates ×`
/// the budget, in position order), and every page's score: re-ranked by
/// estimated mass for `queries`, combined over those heads, or −1 for a
/// page not among them. And the sketch bytes read.
fn rerank(q: &LaneQuery<'_>, bounds: &[f32], queries: &[f32]) -> (Vec<usize>, Vec<f32>, u64) {
    let wide = Budget {
        pages: q.budget.pages.saturating_mul(q.ranking.candidates.max(1) as usize),
        ..q.budget
    };
    // Stage one keeps candidates over every page the final choice may take:
    // a global share is cut only at the end.
    let local = q.shard.filter(|s| s.scope == crate::select::Scope::Local);
    let candidates = select(bounds, wide, local);
    let (masses, read) = page_masses(q, &candidates, queries);
    let heads = queries.len() / q.index.digests().head_dim();
    let mut scores = vec![-1.0; bounds.len()];
    for (&p, m) in candidates.iter().zip(combine(&masses, heads, 0..heads, q.aggregation)) {
        scores[p] = m;
    }
    (candidates, scores, read)
}

/// Rows of page `p` of the query's lane (the last may be partial).
fn rows_in(q: &LaneQuery<'_>, p: usize) -> usize {
    let page_size = q.index.page_size() as u64;
    q.tokens.saturating_sub(p as u64 * page_size).min(page_size) as usize
}

/// `U` of every (page, query): `[page][group]`.
fn score_all(column: &DigestColumn, queries: &[f32]) -> Vec<f32> {
    let (d, group) = (column.head_dim(), queries.len() / column.head_dim());
    let mut scores = vec![0f32; column.pages() * group];
    for (entries, out) in column.chunks().zip(scores.chunks_mut(DIGEST_CHUNK_PAGES * group)) {
        score_column(column.dtype(), d, entries, queries, out);
    }
    scores
}

/// One score per page from the scores of query heads `members` of each
/// page's `group`: the max, the mean, or the one head's.
fn combine(scores: &[f32], group: usize, members: Range<usize>, aggregation: Aggregation) -> Vec<f32> {
    let scale = match aggregation {
        Aggregation::Mean => 1.0 / members.len() as f32,
        Aggregation::Max | Aggregation::PerQueryHead => 1.0,
    };
    scores
        .chunks_exact(group)
        .map(|page| fold(&page[members.clone()], aggregation, scale))
        .collect()
}

/// Scaling first keeps a mean of scores near the top of the f32 range
/// finite; the result is saturated so that no rounding makes one infinite.
fn fold(scores: &[f32], aggregation: Aggregation, scale: f32) -> f32 {
    let first = scores[0] * scale;
    let folded = scores[1..].iter().fold(first, |a, &b| match aggregation {
        Aggregation::Mean => a + b * scale,
        Aggregation::Max | Aggregation::PerQueryHead => a.max(b * scale),
    });
    folded.clamp(-f32::MAX, f32::MAX)
}

/// Each of `pages`' estimated attention mass for each query head of
/// `queries` (softmax over the tokens of `pages`, from their sketches):
/// `[page][head]`; and the sketch bytes read.
fn page_masses(q: &LaneQuery<'_>, pages: &[usize], queries: &[f32]) -> (Vec<f32>, u64) {
    let index = q.index;
    let d = index.digests().head_dim();
    let heads = queries.len() / d;
    let row = index.sketch_row_bytes();
    let scale = q.ranking.scale(d);
    // Each page's sketch rows scored where they lie, the queries prepared once.
    let prepared = SketchQueries::new(d, queries);
    let sketches = Sketches::of(q, pages);
    let rows: Vec<usize> = pages.iter().map(|&p| rows_in(q, p)).collect();
    let total: usize = rows.iter().sum();
    let mut logits = vec![0f32; total * heads];
    let mut at = 0;
    for (i, (&p, &r)) in pages.iter().zip(&rows).enumerate() {
        prepared.logits(sketches.rows(i, p), &mut logits[at * heads..(at + r) * heads]);
        at += r;
    }
    // `[token][head]` runs of `width` values (whole vectors, whole tokens):
    // loops over them compile to vector code; lane `k` is head `k % heads`.
    let width = heads * 8 / gcd(heads, 8);
    let mut lanes = vec![f32::NEG_INFINITY; width];
    for run in logits.chunks(width) {
        lanes.iter_mut().zip(run).for_each(|(m, &l)| *m = m.max(l));
    }
    let mut top = vec![f32::NEG_INFINITY; heads];
    for token in lanes.chunks_exact(heads) {
        top.iter_mut().zip(token).for_each(|(t, &m)| *t = t.max(m));
    }
    // Each token's weight exp((l − top) · scale), in vector passes.
    let shift = top.repeat(width / heads);
    for run in logits.chunks_mut(width) {
        run.iter_mut().zip(&shift).for_each(|(l, &t)| *l = (*l - t) * scale);
    }
    exp_in_place(&mut logits);
    // Per page and head the sum of the weights; per head the total.
    let mut masses = vec![0f32; pages.len() * heads];
    let mut totals = vec![0f64; heads];
    let mut at = 0;
    for (page, &r) in masses.chunks_exact_mut(heads).zip(&rows) {
        lanes.fill(0.0);
        for run in logits[at * heads..(at + r) * heads].chunks(width) {
            lanes.iter_mut().zip(run).for_each(|(w, &e)| *w += e);
        }
        at += r;
        for token in lanes.chunks_exact(heads) {
            page.iter_mut().zip(token).for_each(|(m, &w)| *m += w);
        }
        totals
            .iter_mut()
            .zip(page.iter())
            .for_each(|(z, &w)| *z += f64::from(w));
    }
    let norms: Vec<f32> = totals
        .iter()
        .map(|&z| if z > 0.0 { (1.0 / z) as f32 } else { 0.0 })
        .collect();
    for page in masses.chunks_exact_mut(heads) {
        page.iter_mut().zip(&norms).for_each(|(m, n)| *m *= n);
    }
    (masses, (total * row) as u64)
}

/// The sketch rows of a list of pages: the index's, and for those spilled
/// from it what [`ColdSketches`] read, fetched in one call.
struct Sketches<'a> {
    q: LaneQuery<'a>,
    /// Per spilled page (by its place in the list) its rows; zeroed rows
    /// where they could not be read.
    cold: Vec<(usize, Vec<u8>)>,
}

impl<'a> Sketches<'a> {
    fn of(q: &LaneQuery<'a>, pages: &[usize]) -> Self {
        let index = q.index;
        let mut cold = Vec::new();
        if index.spilled_pages() > 0 {
            let (at, spilled): (Vec<usize>, Vec<usize>) = pages
                .iter()
                .enumerate()
                .filter(|(_, p)| index.sketch(**p).is_none())
                .map(|(i, &p)| (i, p))
                .unzip();
            if !spilled.is_empty() {
                let read = match q.cold {
                    Some(source) => source.sketches(&spilled),
                    None => vec![None; spilled.len()],
                };
                assert_eq!(read.len(), spilled.len(), "one answer per spilled page");
                let row = index.sketch_row_bytes();
                cold = at
                    .into_iter()
                    .zip(&spilled)
                    .zip(read)
                    .map(|((i, &p), rows)| {
                        let want = rows_in(q, p) * row;
                        (i, rows.filter(|r| r.len() == want).unwrap_or_else(|| vec![0; want]))
                    })
                    .collect();
            }
        }
        Self { q: *q, cold }
    }

    /// The valid rows of page `p`, the `i`-th of the list.
    fn rows(&self, i: usize, p: usize) -> &[u8] {
        match self.q.index.sketch(p) {
            Some(all) => &all[..rows_in(&self.q, p) * self.q.index.sketch_row_bytes()],
            None => {
                let at = self
                    .cold
                    .binary_search_by_key(&i, |(j, _)| *j)
                    .expect("fetched with the list");
                &self.cold[at].1
            }
        }
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::DType;
    use crate::sketch::{code, row_bytes, scale_zero};
    use proptest::prelude::*;

    /// A lane of `tokens` keys (f16) in pages of `page_size`.
    pub(crate) fn lane(d: usize, page_size: u32, keys: &[f32]) -> (PageIndex, u64) {
        let dtype = DType::F16;
        let bytes = dtype.encode(keys);
        let mut index = PageIndex::new(dtype, d, page_size);
        for page in bytes.chunks(page_size as usize * d * 2) {
            index.open_page(page);
        }
        (index, (keys.len() / d) as u64)
    }

    /// Each page's estimated mass, the slow way: every sketch row decoded,
    /// its logit `zero · Σq + scale · Σ_r q̂_r · code_r` with the query
    /// rounded to int8 steps (`q̂ = step · round(q / step)`, `step =
    /// max|q| / 127`: the estimator sketch_score.rs documents), softmax in
    /// f64 over the tokens of `pages`.
    fn reference_masses(index: &PageIndex, tokens: u64, pages: &[usize], q: &[f32], scale: f32) -> Vec<f64> {
        let d = q.len();
        let ps = index.page_size() as u64;
        // The step and the rounding in f32, as the scorer does them: a
        // quotient near a half rounds the same way.
        let step = q.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        let rounded: Vec<f64> = q
            .iter()
            .map(|&v| {
                if step > 0.0 {
                    f64::from((v / step).round()) * f64::from(step)
                } else {
                    0.0
                }
            })
            .collect();
        let sum: f64 = q.iter().map(|&v| f64::from(v)).sum();
        let logits: Vec<Vec<f64>> = pages
            .iter()
            .map(|&p| {
                let rows = tokens.saturating_sub(p as u64 * ps).min(ps) as usize;
                (0..rows)
                    .map(|t| {
                        let n = row_bytes(d);
                        let row = &index.sketch(p).expect("resident")[t * n..(t + 1) * n];
                        let (step_k, zero) = scale_zero(d, row);
                        let dot: f64 = (0..d).map(|r| f64::from(code(row, r)) * rounded[r]).sum();
                        (f64::from(zero) * sum + f64::from(step_k) * dot) * f64::from(scale)
                    })
                    .collect()
            })
            .collect();
        let top = logits.iter().flatten().copied().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = logits.iter().flatten().map(|l| (l - top).exp()).sum();
        logits
            .iter()
            .map(|page| page.iter().map(|l| (l - top).exp()).sum::<f64>() / total)
            .collect()
    }

    /// Sketches read again from the lane's keys, recording which pages
    /// were asked for.
    #[derive(Debug)]
    struct FromKeys {
        keys: Vec<u8>,
        d: usize,
        page_size: usize,
        asked: std::sync::Mutex<Vec<usize>>,
    }

    impl ColdSketches for FromKeys {
        fn sketches(&self, pages: &[usize]) -> Vec<Option<Vec<u8>>> {
            self.asked.lock().unwrap().extend_from_slice(pages);
            let row = self.d * 2;
            pages
                .iter()
                .map(|&p| {
                    let start = (p * self.page_size * row).min(self.keys.len());
                    let end = ((p + 1) * self.page_size * row).min(self.keys.len());
                    Some(crate::sketch::encode(DType::F16, self.d, &self.keys[start..end]))
                })
                .collect()
        }
    }

    proptest! {
        /// With some pages' sketches spilled and read back through
        /// `ColdSketches`, every mode ranks exactly as with all resident;
        /// quest asks for none, two-stage only for its spilled candidates.
        #[test]
        fn spilled_sketches_rank_as_resident_ones(
            d in prop_oneof![Just(8usize), Just(16usize)],
            page_size in 1u32..6,
            tokens in 1usize..80,
            group in 1usize..3,
            budget in 1usize..6,
            spill in proptest::collection::vec(any::<bool>(), 80),
            values in proptest::collection::vec(-3.0f32..3.0, 1400),
        ) {
            let (index, tokens) = lane(d, page_size, &values[..tokens * d]);
            let mut spilled = index.clone();
            let n = index.digests().pages();
            for p in (0..n).filter(|&p| spill[p]) {
                spilled.spill_sketch(p);
            }
            let cold = FromKeys {
                keys: DType::F16.encode(&values[..tokens as usize * d]),
                d,
                page_size: page_size as usize,
                asked: std::sync::Mutex::new(Vec::new()),
            };
            let queries = &values[values.len() - group * d..];
            let budget = Budget { pages: budget, sinks: 1, window: 1 };
            for mode in Mode::ALL {
                for aggregation in [Aggregation::Max, Aggregation::Mean, Aggregation::PerQueryHead] {
                    let query = LaneQuery { index: &index, cold: None, tokens, queries, aggregation, budget, shard: None, ranking: Ranking::new(mode) };
                    let want = rank_lane(&query);
                    cold.asked.lock().unwrap().clear();
                    let got = rank_lane(&LaneQuery { index: &spilled, cold: Some(&cold), ..query });
                    prop_assert_eq!(&got, &want, "{} {:?}", mode, aggregation);
                    let asked = std::mem::take(&mut *cold.asked.lock().unwrap());
                    prop_assert!(asked.iter().all(|&p| spill[p]), "{}: asked for a resident page", mode);
                    if mode == Mode::Quest {
                        prop_assert!(asked.is_empty());
                    }
                    if mode == Mode::TwoStage {
                        let re_ranked: Vec<usize> = want.heads.iter().flat_map(|h| (0..n).filter(|&p| h.scores[p] != -1.0)).collect();
                        prop_assert!(asked.iter().all(|p| re_ranked.contains(p)), "two-stage read a page it did not re-rank");
                    }
                }
            }
        }
    }

    proptest! {
        /// Sketch and two-stage scores are the reference masses (per query
        /// head, then the group's max or mean, or each head's own), and the
        /// choice is the top of them.
        #[test]
        fn mass_modes_equal_a_decoded_softmax(
            d in prop_oneof![Just(8usize), Just(16usize), Just(20usize)],
            page_size in 1u32..6,
            tokens in 1usize..60,
            group in 1usize..4,
            budget in 1usize..8,
            candidates in 1u32..4,
            aggregation in 0usize..3,
            values in proptest::collection::vec(-3.0f32..3.0, 1400),
        ) {
            let (index, tokens) = lane(d, page_size, &values[..tokens * d]);
            let queries = &values[values.len() - group * d..];
            let budget = Budget { pages: budget, sinks: 0, window: 0 };
            let aggregation = [Aggregation::Max, Aggregation::Mean, Aggregation::PerQueryHead][aggregation];
            let n = index.digests().pages();
            let scale = 1.0 / (d as f32).sqrt();
            for mode in [Mode::Sketch, Mode::TwoStage] {
                let ranking = Ranking { candidates, ..Ranking::new(mode) };
                let query = LaneQuery { index: &index, cold: None, tokens, queries, aggregation, budget, shard: None, ranking };
                let got = rank_lane(&query);
                let selectors: Vec<std::ops::Range<usize>> = match aggregation {
                    Aggregation::PerQueryHead => (0..group).map(|g| g..g + 1).collect(),
                    _ => std::iter::once(0..group).collect(),
                };
                prop_assert_eq!(got.heads.len(), selectors.len());
                for (head, members) in got.heads.iter().zip(selectors) {
                    let pool: Vec<usize> = match mode {
                        Mode::Sketch => (0..n).collect(),
                        _ => {
                            let bounds = score_all(index.digests(), queries);
                            let first = combine(&bounds, group, members.clone(), aggregation);
                            select(&first, Budget { pages: budget.pages * candidates as usize, ..budget }, None)
                        }
                    };
                    // Each member head's masses over the pool, then the group's max or mean.
                    let per_head: Vec<Vec<f64>> = members
                        .clone()
                        .map(|g| reference_masses(&index, tokens, &pool, &queries[g * d..(g + 1) * d], scale))
                        .collect();
                    let mut want = vec![-1f64; n];
                    for (i, &p) in pool.iter().enumerate() {
                        let masses = per_head.iter().map(|m| m[i]);
                        want[p] = match aggregation {
                            Aggregation::Mean => masses.sum::<f64>() / members.len() as f64,
                            _ => masses.fold(0.0, f64::max),
                        };
                    }
                    for (p, (&got, &want)) in head.scores.iter().zip(&want).enumerate() {
                        prop_assert!((f64::from(got) - want).abs() < 1e-4, "{mode} {aggregation:?} page {p}: {got} vs {want}");
                    }
                    prop_assert_eq!(head.chosen.len(), budget.pages.min(n));
                    prop_assert!(head.chosen.iter().all(|p| pool.contains(p)));
                    let worst = head.chosen.iter().map(|&p| want[p]).fold(f64::INFINITY, f64::min);
                    for p in (0..n).filter(|p| !head.chosen.contains(p)) {
                        prop_assert!(want[p] <= worst + 1e-4, "{mode}: page {p} ({}) left out, {worst} chosen", want[p]);
                    }
                }
            }
        }

        /// Quest and cuboid rank by their columns' scores (the group's max).
        #[test]
        fn digest_modes_rank_by_their_column(
            tokens in 1usize..60,
            budget in 1usize..8,
            values in proptest::collection::vec(-3.0f32..3.0, 600),
        ) {
            let d = 8;
            let (index, tokens) = lane(d, 4, &values[..tokens * d]);
            let queries = &values[values.len() - 2 * d..];
            let budget = Budget { pages: budget, sinks: 1, window: 1 };
            let mut cuboids = DigestColumn::new(DType::F16, d);
            for p in 0..index.digests().pages() {
                let rows = (tokens as usize - 4 * p).min(4);
                let mut entry = vec![0u8; index.digests().entry_bytes()];
                crate::sketch::cuboid_entry(DType::F16, d, &index.sketch(p).expect("resident")[..rows * row_bytes(d)], &mut entry);
                cuboids.push_entry(&entry);
            }
            for (mode, column) in [(Mode::Quest, index.digests()), (Mode::Cuboid, &cuboids)] {
                let query = LaneQuery { index: &index, cold: None, tokens, queries, aggregation: Aggregation::Max, budget, shard: None, ranking: Ranking::new(mode) };
                let got = rank_lane(&query);
                let bounds = combine(&score_all(column, queries), 2, 0..2, Aggregation::Max);
                prop_assert_eq!(&got.heads[0].scores, &bounds);
                prop_assert_eq!(&got.heads[0].chosen, &select(&bounds, budget, None));
            }
        }
    }

    #[test]
    fn the_sketch_finds_the_page_a_loose_bound_hides() {
        // Page 1 holds the one key aligned with the query; every other page
        // spans a wide box in two channels (Quest's bound is high for all)
        // but no key in them scores well.
        let d = 8;
        let mut keys = Vec::new();
        for page in 0..8 {
            for t in 0..4 {
                let mut k = [0f32; 8];
                if page == 1 && t == 2 {
                    k[0] = 3.0;
                    k[1] = 3.0;
                } else {
                    k[t % 2] = if t < 2 { 4.0 } else { -4.0 };
                }
                keys.extend(k);
            }
        }
        let (index, tokens) = lane(d, 4, &keys);
        let mut q = [0f32; 8];
        q[0] = 2.0;
        q[1] = 2.0;
        let budget = Budget {
            pages: 1,
            sinks: 0,
            window: 0,
        };
        let chosen = |mode| {
            let query = LaneQuery {
                index: &index,
                cold: None,
                tokens,
                queries: &q,
                aggregation: Aggregation::Max,
                budget,
                shard: None,
                ranking: Ranking::new(mode),
            };
            rank_lane(&query).heads[0].chosen.clone()
        };
        assert_eq!(chosen(Mode::Sketch), [1]);
        assert_eq!(chosen(Mode::TwoStage), [1]);
        // Quest's bound ties every page (max 4 in both channels): it takes page 0.
        assert_eq!(chosen(Mode::Quest), [0]);
    }
}
