//! Policies over a sequence's pages (DESIGN.md §5): what leaves for good
//! (evict → gone), is compressed (summarize → summary) or only demoted
//! (offload → cold). Scoring and budget allocation are the core's
//! (`kvtier_core::policy`); here they meet the pages: which pages are
//! candidates, the attention the store computes for given queries, the
//! statistics workers report, and the policies registered to run by
//! themselves as a sequence grows.

mod attention;

use std::collections::BTreeMap;
use std::ops::Range;

use kvtier_core::policy::{Allocator, LaneInput, LanePlanInput, PageScores, Scorer, dropped_mass, plan};
use kvtier_core::{Action, ColdTier, LogicalPage, PageState, Reason, SequenceKey};

use attention::{padded, sum_rows};

use crate::sequence::{HeadRange, Sequence};
use crate::sync::read;
use crate::transition::Target;
use crate::{Store, StoreError, StoreResult};

/// What happens to the pages a policy does not keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyAction {
    /// → gone.
    Evict,
    /// → summary of `rows` rows.
    Summarize { rows: u32 },
    /// hot → cold: nothing is lost.
    Offload(ColdTier),
}

impl PolicyAction {
    fn action(self) -> Action {
        match self {
            Self::Evict => Action::Evict,
            Self::Summarize { .. } => Action::Summarize,
            Self::Offload(tier) => Action::Offload(tier),
        }
    }

    /// Pages the budget is about: those holding original bytes (for offload,
    /// the hot ones). Summaries and gone pages are neither kept nor acted on.
    fn candidate(self, state: PageState) -> bool {
        match self {
            Self::Evict | Self::Summarize { .. } => matches!(state, PageState::Hot | PageState::Cold(_)),
            Self::Offload(_) => state == PageState::Hot,
        }
    }
}

/// When a policy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    Now,
    /// At each layer's first append (the end of prefill).
    AfterPrefill,
    /// Whenever a layer's length crosses a multiple of this many tokens.
    EveryTokens(u32),
}

/// A policy and its budget, as registered or applied.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    pub layer_start: u32,
    pub layer_count: u32,
    pub scorer: Scorer,
    pub allocator: Allocator,
    /// Tokens kept per (layer, KV head) on average, rounded up to pages.
    pub budget_tokens: u32,
    pub action: PolicyAction,
}

#[derive(Debug, Clone, Copy)]
pub struct ApplyPolicy<'a> {
    pub spec: &'a PolicySpec,
    /// Queries whose attention the store computes over the stored keys (and
    /// records), `[layer][n][num_query_heads][head_dim]` for the spec's
    /// layers in order (each layer has its own queries); may be empty.
    pub queries: &'a [f32],
    pub trigger: Trigger,
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PolicyOutcome {
    pub kept: u64,
    pub changed: u64,
    /// With queries: their mean attention mass on the pages acted on.
    pub dropped_mass: Option<f64>,
}

/// Weights one report gives per KV head, heads one after another.
#[derive(Debug, Clone, Copy)]
pub enum AttentionWeights<'a> {
    Tokens(&'a [f32]),
    Pages(&'a [f32]),
}

#[derive(Debug, Clone, Copy)]
pub struct ReportAttention<'a> {
    pub layer: u32,
    pub heads: HeadRange,
    pub weights: AttentionWeights<'a>,
    /// H2O's decay ρ in (0, 1]; `None` is 1.
    pub decay: Option<f64>,
}

/// A policy that runs by itself, and how far each layer had grown when it
/// last ran.
#[derive(Debug, Clone)]
pub(crate) struct AutoPolicy {
    spec: PolicySpec,
    trigger: Trigger,
    ran_at: BTreeMap<u32, u64>,
}

impl Store {
    /// Applies a policy now (durable before this returns), or registers it
    /// (see [`Trigger`]).
    pub fn apply_policy(&self, key: &SequenceKey, req: ApplyPolicy<'_>) -> StoreResult<PolicyOutcome> {
        self.check_policy(req.spec)?;
        let outcome = self.with_sequence_mut(key, |seq| {
            seq.check_layers(req.spec.layer_start, req.spec.layer_count)?;
            let query_len = (seq.layout.num_query_heads() * seq.layout.head_dim()) as usize;
            let layers = req.spec.layer_count as usize;
            if !req.queries.len().is_multiple_of(query_len * layers) {
                return Err(StoreError::invalid(
                    "queries",
                    format!(
                        "holds {} floats, not the same whole number of queries of {query_len} \
                         (query heads × head_dim) for each of {layers} layers",
                        req.queries.len()
                    ),
                ));
            }
            if let Some(i) = req.queries.iter().position(|q| !q.is_finite()) {
                return Err(StoreError::invalid("queries", format!("value {i} is not finite")));
            }
            match req.trigger {
                Trigger::Now => self.run_policy(seq, req.spec, req.queries, Reason::Policy),
                trigger => {
                    if !req.queries.is_empty() {
                        return Err(StoreError::invalid(
                            "queries",
                            "only a policy applied now takes queries; a registered one scores by reported attention",
                        ));
                    }
                    if trigger == Trigger::EveryTokens(0) {
                        return Err(StoreError::invalid("every_tokens", "must be at least 1"));
                    }
                    seq.auto_policy = Some(AutoPolicy {
                        spec: req.spec.clone(),
                        trigger,
                        ran_at: BTreeMap::new(),
                    });
                    Ok(PolicyOutcome::default())
                }
            }
        })?;
        self.commit_change()?;
        Ok(outcome)
    }

    /// Unregisters the sequence's policy, if any.
    pub fn unregister_policy(&self, key: &SequenceKey) -> StoreResult<()> {
        self.with_sequence_mut(key, |seq| {
            seq.auto_policy = None;
            Ok(())
        })
    }

    fn check_policy(&self, spec: &PolicySpec) -> StoreResult<()> {
        if spec.budget_tokens == 0 {
            return Err(StoreError::invalid("budget_tokens", "must be at least 1"));
        }
        match spec.action {
            PolicyAction::Summarize { rows: 0 } => Err(StoreError::invalid("summarize.rows", "must be at least 1")),
            PolicyAction::Offload(ColdTier::Nvme) if self.nvme.is_none() => Err(StoreError::precondition(
                "offload.tier",
                "the nvme tier is not configured",
            )),
            _ => Ok(()),
        }
    }

    /// Runs the sequence's registered policy for `layer` if its trigger says
    /// so; called after every append. A failure is logged, never the
    /// append's.
    pub(crate) fn run_auto_policy(&self, seq: &mut Sequence, layer: u32) {
        let Some(auto) = &seq.auto_policy else { return };
        let spec = &auto.spec;
        if !(spec.layer_start..spec.layer_start + spec.layer_count).contains(&layer) {
            return;
        }
        let lane = seq.layout.lane(layer, 0);
        let tokens = seq.lanes[lane].tokens();
        let due = match (auto.trigger, auto.ran_at.get(&layer)) {
            (Trigger::AfterPrefill, ran) => ran.is_none(),
            (Trigger::EveryTokens(n), ran) => {
                let n = u64::from(n);
                ran.is_none_or(|&at| tokens / n > at / n) && tokens >= n
            }
            (Trigger::Now, _) => false,
        };
        if !due {
            return;
        }
        let spec = PolicySpec {
            layer_start: layer,
            layer_count: 1,
            ..spec.clone()
        };
        if let Some(auto) = &mut seq.auto_policy {
            auto.ran_at.insert(layer, tokens);
        }
        match self.run_policy(seq, &spec, &[], Reason::Policy) {
            Ok(outcome) => tracing::debug!(
                sequence = %seq.key,
                layer,
                policy = spec.scorer.name(),
                kept = outcome.kept,
                changed = outcome.changed,
                "registered policy ran"
            ),
            Err(e) => {
                tracing::warn!(sequence = %seq.key, layer, policy = spec.scorer.name(), error = %e, "registered policy failed")
            }
        }
    }

    /// Scores every lane of the spec's layers, plans the budget, and applies
    /// the action to the candidates not kept.
    fn run_policy(
        &self,
        seq: &mut Sequence,
        spec: &PolicySpec,
        queries: &[f32],
        reason: Reason,
    ) -> StoreResult<PolicyOutcome> {
        let layers = seq.check_layers(spec.layer_start, spec.layer_count)?;
        let page_size = seq.layout.page_size() as usize;
        let budget_pages = (spec.budget_tokens as usize).div_ceil(page_size);
        let lanes = policy_lanes(seq, layers.clone());
        let mut inputs = Vec::with_capacity(lanes.len());
        let mut candidates = Vec::with_capacity(lanes.len());
        let mut masses = Vec::new();
        for (i, &(layer, head, lane)) in lanes.iter().enumerate() {
            let states = self.page_states(seq, lane);
            let tokens = seq.lanes[lane].tokens() as usize;
            // Attention of the given queries, computed here (and recorded);
            // without queries, what workers reported stands for it.
            let observed = if queries.is_empty() {
                seq.attention.get(lane).map(|s| padded(s.accumulated(), tokens))
            } else {
                let per_layer = queries.len() / layers.len();
                let at = (layer - layers.start) as usize * per_layer;
                let attention = self.query_attention(seq, head, lane, &queries[at..at + per_layer])?;
                seq.ensure_attention();
                for row in &attention {
                    seq.attention[lane].record(row, None);
                }
                Some(sum_rows(&attention, tokens))
            };
            let l = &seq.lanes[lane];
            let input = LaneInput {
                tokens,
                page_size,
                stats: seq.attention.get(lane),
                observed: observed.as_deref(),
            };
            let scored = spec
                .scorer
                .score(&input, budget_pages)
                .map_err(|e| StoreError::precondition("policy", format!("layer {layer} KV head {head}: {e}")))?;
            // Appends write into a partial last page: it is never a candidate.
            let partial_last = l
                .num_pages()
                .checked_sub(1)
                .filter(|&p| (l.rows_in(p) as usize) < page_size);
            let lane_candidates: Vec<usize> = (0..l.num_pages())
                .filter(|&p| spec.action.candidate(states[p]) && Some(p) != partial_last)
                .collect();
            let index: BTreeMap<usize, usize> = lane_candidates.iter().enumerate().map(|(i, &p)| (p, i)).collect();
            let protected = scored.protected.iter().filter_map(|p| index.get(p).copied()).collect();
            if let Some(o) = observed.as_ref().filter(|_| !queries.is_empty()) {
                masses.push((
                    i,
                    o.chunks(page_size).map(|c| c.iter().sum::<f64>()).collect::<Vec<_>>(),
                ));
            }
            inputs.push(LanePlanInput {
                layer: (layer - layers.start) as usize,
                head: head as usize,
                pages: lane_candidates.len(),
                scores: PageScores {
                    scores: lane_candidates.iter().map(|&p| scored.scores[p]).collect(),
                    protected,
                },
            });
            candidates.push((lane_candidates, states));
        }
        let kept = plan(&inputs, budget_pages * lanes.len(), &spec.allocator);
        let mut targets = Vec::new();
        let mut outcome = PolicyOutcome::default();
        let mut dropped = Vec::new();
        for (i, (&(layer, head, lane), (lane_candidates, states))) in lanes.iter().zip(&candidates).enumerate() {
            let keep: std::collections::BTreeSet<usize> = kept[i].iter().map(|&c| lane_candidates[c]).collect();
            let mut acted = Vec::new();
            for &page in lane_candidates {
                if keep.contains(&page) || self.pinned_for(seq, spec.action, lane, page) {
                    outcome.kept += 1;
                    continue;
                }
                acted.push(page);
                targets.push(Target {
                    layer,
                    head,
                    lane,
                    page,
                    from: states[page],
                });
            }
            if let Some((_, mass)) = masses.iter().find(|(j, _)| *j == i) {
                let untouched: Vec<usize> = (0..mass.len()).filter(|p| !acted.contains(p)).collect();
                dropped.push(dropped_mass(mass, &untouched));
            }
        }
        outcome.changed = targets.len() as u64;
        if !dropped.is_empty() {
            outcome.dropped_mass = Some(dropped.iter().sum::<f64>() / dropped.len() as f64);
        }
        if !targets.is_empty() {
            let rows = match spec.action {
                PolicyAction::Summarize { rows } => rows,
                _ => 1,
            };
            self.apply_targets(seq, &targets, spec.action.action(), rows, reason)?;
        }
        Ok(outcome)
    }

    /// Leased pages may not move: an offload policy keeps them.
    fn pinned_for(&self, seq: &Sequence, action: PolicyAction, lane: usize, page: usize) -> bool {
        matches!(action, PolicyAction::Offload(_))
            && matches!(seq.lanes[lane].page(page), Some(LogicalPage::Physical(r)) if r.page.pinned())
    }

    fn page_states(&self, seq: &Sequence, lane: usize) -> Vec<PageState> {
        seq.lanes[lane]
            .pages()
            .map(|p| match p {
                LogicalPage::Physical(r) => read(&r.page.place).state(),
                LogicalPage::Summary(_) => PageState::Summary,
                LogicalPage::Gone(_) => PageState::Gone,
            })
            .collect()
    }
}

/// The distinct lanes of `layers` × every KV head (layers of a shared-KV
/// group name one lane), with the first (layer, head) naming each.
fn policy_lanes(seq: &Sequence, layers: Range<u32>) -> Vec<(u32, u32, usize)> {
    let mut seen = std::collections::BTreeSet::new();
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
