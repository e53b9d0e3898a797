//! Policies over a sequence's pages (docs/CONCEPTS.md §5): which pages leave for
//! good (evict → gone), are compressed (summarize → summary) or are only
//! demoted (offload → cold). Scoring and budget allocation are the core's
//! (`kvtier_core::policy`); here they meet the pages: which pages are
//! candidates, the attention the store computes for given queries, and the
//! statistics workers report. The store applies the decision
//! (`store/policy.rs`).

mod attention;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use kvtier_core::policy::{LaneInput, LanePlanInput, PageScores, PolicyAction, PolicySpec, dropped_mass, plan};
use kvtier_core::{LogicalPage, PageState, wire};

pub(crate) use attention::ensure_attention;

use crate::catalog::{Sequence, Target};
use crate::page::state_of;
use crate::reader::Reader;
use crate::{StoreError, StoreResult};

/// What a policy applied now did, summed over its lanes (all zero for a
/// policy only registered).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PolicyOutcome {
    /// Candidate pages left as they were: within the budget, or leased when
    /// the action is an offload.
    pub kept: u64,
    /// Pages the action was applied to (evicted, summarised or offloaded).
    pub changed: u64,
    /// With queries: their mean attention mass on the pages acted on.
    pub dropped_mass: Option<f64>,
}

/// What a policy decided for a sequence: the pages to act on, and counts.
#[derive(Debug)]
pub(crate) struct Decision {
    pub(crate) targets: Vec<Target>,
    pub(crate) outcome: PolicyOutcome,
}

/// One lane, scored (its plan input goes to the allocator).
struct Scored {
    /// The lane's candidate pages, in order (the plan indexes them).
    candidates: Vec<usize>,
    states: Vec<PageState>,
    /// With queries: their attention mass per page.
    mass: Option<Vec<f64>>,
}

/// Scores every lane of the spec's layers, plans the budget over them, and
/// names the candidates not kept. Given queries, their attention over the
/// stored keys is computed (and recorded) and stands for what was observed.
pub(crate) fn decide(
    seq: &mut Sequence,
    reader: &Reader<'_>,
    spec: &PolicySpec,
    queries: &[f32],
) -> StoreResult<Decision> {
    let layers = seq.check_layers(spec.layer_start, spec.layer_count)?;
    let budget_pages = (spec.budget_tokens as usize).div_ceil(seq.layout.page_size() as usize);
    let lanes = policy_lanes(seq, layers.clone());
    let mut scored = Vec::with_capacity(lanes.len());
    for &(layer, head, lane) in &lanes {
        let queries = if queries.is_empty() {
            &[][..]
        } else {
            let per_layer = queries.len() / layers.len();
            let at = (layer - layers.start) as usize * per_layer;
            &queries[at..at + per_layer]
        };
        let at = (layer, layer - layers.start, head, lane);
        scored.push(score_lane(seq, reader, spec, at, queries, budget_pages)?);
    }
    let (plans, scored): (Vec<LanePlanInput>, Vec<Scored>) = scored.into_iter().unzip();
    let kept = plan(&plans, budget_pages * lanes.len(), &spec.allocator);
    let mut decision = Decision {
        targets: Vec::new(),
        outcome: PolicyOutcome::default(),
    };
    let mut dropped = Vec::new();
    for ((&(layer, head, lane), lane_scored), kept) in lanes.iter().zip(&scored).zip(kept) {
        let keep: BTreeSet<usize> = kept.iter().map(|&c| lane_scored.candidates[c]).collect();
        let mut acted = Vec::new();
        for &page in &lane_scored.candidates {
            if keep.contains(&page) || pinned_for(seq, spec.action, lane, page) {
                decision.outcome.kept += 1;
                continue;
            }
            acted.push(page);
            decision.targets.push(Target {
                layer,
                head,
                lane,
                page,
                from: lane_scored.states[page],
            });
        }
        if let Some(mass) = &lane_scored.mass {
            // `acted` is in page order, as the candidates are.
            let untouched: Vec<usize> = (0..mass.len()).filter(|p| acted.binary_search(p).is_err()).collect();
            dropped.push(dropped_mass(mass, &untouched));
        }
    }
    decision.outcome.changed = decision.targets.len() as u64;
    if !dropped.is_empty() {
        decision.outcome.dropped_mass = Some(dropped.iter().sum::<f64>() / dropped.len() as f64);
    }
    Ok(decision)
}

/// Scores lane `lane` (layer `layer`, the `nth` of the spec's, KV head
/// `head`).
fn score_lane(
    seq: &mut Sequence,
    reader: &Reader<'_>,
    spec: &PolicySpec,
    (layer, nth, head, lane): (u32, u32, u32, usize),
    queries: &[f32],
    budget_pages: usize,
) -> StoreResult<(LanePlanInput, Scored)> {
    let page_size = seq.layout.page_size() as usize;
    let states: Vec<PageState> = seq.lanes[lane].pages().map(state_of).collect();
    let tokens = seq.lanes[lane].tokens() as usize;
    // Attention of the given queries, computed here (and recorded);
    // without queries, what workers reported stands for it.
    let observed = if queries.is_empty() {
        seq.attention
            .get(lane)
            .map(|s| attention::padded(s.accumulated(), tokens))
    } else {
        let rows = attention::of_queries(seq, reader, head, lane, queries)?;
        ensure_attention(seq, &[lane], tokens)?;
        for row in &rows {
            seq.attention[lane].record(row, None);
        }
        Some(attention::sum_rows(&rows, tokens))
    };
    let input = LaneInput {
        tokens,
        page_size,
        stats: seq.attention.get(lane),
        observed: observed.as_deref(),
    };
    let scored = spec
        .scorer
        .score(&input, budget_pages)
        .map_err(|e| StoreError::precondition(wire::POLICY_SPEC, format!("layer {layer} KV head {head}: {e}")))?;
    // Appends write into a partial last page: it is never a candidate.
    let l = &seq.lanes[lane];
    let partial_last = l
        .num_pages()
        .checked_sub(1)
        .filter(|&p| (l.rows_in(p) as usize) < page_size);
    let candidates: Vec<usize> = (0..l.num_pages())
        .filter(|&p| spec.action.candidate(states[p]) && Some(p) != partial_last)
        .collect();
    let index: BTreeMap<usize, usize> = candidates.iter().enumerate().map(|(i, &p)| (p, i)).collect();
    let protected = scored.protected.iter().filter_map(|p| index.get(p).copied()).collect();
    let mass = observed
        .filter(|_| !queries.is_empty())
        .map(|o| o.chunks(page_size).map(|c| c.iter().sum::<f64>()).collect());
    let plan = LanePlanInput {
        layer: nth as usize,
        head: head as usize,
        pages: candidates.len(),
        scores: PageScores {
            scores: candidates.iter().map(|&p| scored.scores[p]).collect(),
            protected,
        },
    };
    Ok((
        plan,
        Scored {
            candidates,
            states,
            mass,
        },
    ))
}

/// Leased pages may not move: an offload policy keeps them.
fn pinned_for(seq: &Sequence, action: PolicyAction, lane: usize, page: usize) -> bool {
    matches!(action, PolicyAction::Offload(_))
        && matches!(seq.lanes[lane].page(page), Some(LogicalPage::Physical(r)) if r.page.pinned())
}

/// The distinct lanes of `layers` × every KV head (layers of a shared-KV
/// group name one lane), with the first (layer, head) naming each.
fn policy_lanes(seq: &Sequence, layers: Range<u32>) -> Vec<(u32, u32, usize)> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for layer in layers {
        for (head, lane) in seq.lanes_of(layer, 0..seq.layout.num_kv_heads()) {
            if seen.insert(lane) {
                out.push((layer, head, lane));
            }
        }
    }
    out
}
