//! ApplyPolicy and ReportAttention: a policy applied now (all or nothing,
//! through the same transition path as SetPageState), registered to run by
//! itself as the sequence grows, and the attention workers report.

use kvtier_core::policy::{PolicyAction, PolicySpec, RegisteredPolicy, Trigger};
use kvtier_core::{ColdTier, Reason, SequenceKey, wire};

use super::Store;
use crate::catalog::{HeadRange, Sequence};
use crate::policy::{PolicyOutcome, decide, ensure_attention};
use crate::{StoreError, StoreResult};

/// An ApplyPolicy request: a policy to apply now or to register.
#[derive(Debug, Clone, Copy)]
pub struct ApplyPolicy<'a> {
    /// The policy, its layers, budget and action.
    pub spec: &'a PolicySpec,
    /// Queries whose attention the store computes over the stored keys (and
    /// records), `[layer][n][num_query_heads][head_dim]` for the spec's
    /// layers in order (each layer has its own queries); may be empty.
    pub queries: &'a [f32],
    /// `Now` applies it; any other trigger registers it to run after appends
    /// (and then takes no queries).
    pub trigger: Trigger,
}

/// Weights one report gives per KV head, heads one after another.
#[derive(Debug, Clone, Copy)]
pub enum AttentionWeights<'a> {
    /// One weight per token, from the layer's first token on (at most the
    /// layer's length).
    Tokens(&'a [f32]),
    /// One weight per page, spread evenly over the page's tokens.
    Pages(&'a [f32]),
}

/// A ReportAttention request: one query's attention, as a worker computed
/// it, for the policies that score by observed attention (H2O and the like).
#[derive(Debug, Clone, Copy)]
pub struct ReportAttention<'a> {
    /// The layer the attention was computed in.
    pub layer: u32,
    /// The KV heads the weights cover, in order.
    pub heads: HeadRange,
    /// The weights: finite, non-negative, the same number for every head.
    pub weights: AttentionWeights<'a>,
    /// H2O's decay ρ in (0, 1]; `None` is 1.
    pub decay: Option<f64>,
}

impl Store {
    /// Applies a policy now (durable before this returns), or registers it
    /// (see [`Trigger`]).
    pub fn apply_policy(&self, key: &SequenceKey, req: ApplyPolicy<'_>) -> StoreResult<PolicyOutcome> {
        self.check_policy(req.spec)?;
        let outcome = self.catalog.write(key, |seq| {
            check_queries(seq, &req)?;
            match req.trigger {
                Trigger::Now => self.run_policy(seq, req.spec, req.queries, Reason::Policy),
                trigger => {
                    if trigger == Trigger::EveryTokens(0) {
                        return Err(StoreError::invalid(wire::EVERY_TOKENS, "must be at least 1"));
                    }
                    seq.auto_policy = Some(RegisteredPolicy::new(req.spec.clone(), trigger));
                    Ok(PolicyOutcome::default())
                }
            }
        })?;
        self.durable.commit()?;
        Ok(outcome)
    }

    /// Unregisters the sequence's policy, if any.
    pub fn unregister_policy(&self, key: &SequenceKey) -> StoreResult<()> {
        self.catalog.write(key, |seq| {
            seq.auto_policy = None;
            Ok(())
        })
    }

    fn check_policy(&self, spec: &PolicySpec) -> StoreResult<()> {
        if spec.budget_tokens == 0 {
            return Err(StoreError::invalid(wire::BUDGET_TOKENS, "must be at least 1"));
        }
        match spec.action {
            PolicyAction::Summarize { rows: 0 } => Err(StoreError::invalid(wire::SUMMARIZE_ROWS, "must be at least 1")),
            PolicyAction::Offload(ColdTier::Nvme) if self.durable.nvme().is_none() => Err(StoreError::precondition(
                wire::OFFLOAD_TIER,
                "the nvme tier is not configured",
            )),
            _ => Ok(()),
        }
    }

    /// Runs the sequence's registered policy for `layer` if its trigger says
    /// so; called after every append. A failure is logged, never the
    /// append's.
    pub(super) fn run_auto_policy(&self, seq: &mut Sequence, layer: u32) {
        let tokens = seq.lanes[seq.layout.lane(layer, 0)].tokens();
        let Some(auto) = seq.auto_policy.as_mut() else { return };
        if !auto.due(layer, tokens) {
            return;
        }
        let spec = PolicySpec {
            layer_start: layer,
            layer_count: 1,
            ..auto.spec.clone()
        };
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

    /// Decides what the policy keeps, and applies its action to the rest.
    fn run_policy(
        &self,
        seq: &mut Sequence,
        spec: &PolicySpec,
        queries: &[f32],
        reason: Reason,
    ) -> StoreResult<PolicyOutcome> {
        let decision = decide(seq, &self.reader(), spec, queries)?;
        if !decision.targets.is_empty() {
            let rows = match spec.action {
                PolicyAction::Summarize { rows } => rows,
                _ => 1,
            };
            self.apply_targets(seq, &decision.targets, spec.action.action(), rows, reason)?;
        }
        Ok(decision.outcome)
    }

    /// Records one query's attention per KV head.
    pub fn report_attention(&self, key: &SequenceKey, req: ReportAttention<'_>) -> StoreResult<()> {
        if let Some(rho) = req.decay.filter(|r| !(*r > 0.0 && *r <= 1.0)) {
            return Err(StoreError::invalid(wire::DECAY, format!("is {rho}; must be in (0, 1]")));
        }
        self.catalog.write(key, |seq| {
            seq.check_layer(req.layer)?;
            let heads = seq.check_heads(req.heads)?;
            let page_size = seq.layout.page_size() as usize;
            let (field, weights) = match req.weights {
                AttentionWeights::Tokens(w) => (wire::TOKEN_WEIGHTS, w),
                AttentionWeights::Pages(w) => (wire::PAGE_WEIGHTS, w),
            };
            if weights.is_empty() || !weights.len().is_multiple_of(heads.len()) {
                return Err(StoreError::invalid(
                    field,
                    format!(
                        "holds {} weights, not one non-empty row per KV head ({})",
                        weights.len(),
                        heads.len()
                    ),
                ));
            }
            if let Some(i) = weights.iter().position(|w| !(w.is_finite() && *w >= 0.0)) {
                return Err(StoreError::invalid(
                    field,
                    format!("weight {i} is {}; weights are finite and non-negative", weights[i]),
                ));
            }
            let n = weights.len() / heads.len();
            let lanes: Vec<usize> = seq.lanes_of(req.layer, heads).map(|(_, l)| l).collect();
            let tokens = seq.lanes[lanes[0]].tokens() as usize;
            let (limit, what) = match req.weights {
                AttentionWeights::Tokens(_) => (tokens, "tokens"),
                AttentionWeights::Pages(_) => (tokens.div_ceil(page_size), "pages"),
            };
            if n > limit {
                return Err(StoreError::invalid(
                    field,
                    format!("rows of {n} weights, but layer {} holds {limit} {what}", req.layer),
                ));
            }
            let recorded = match req.weights {
                AttentionWeights::Tokens(_) => n,
                AttentionWeights::Pages(_) => (n * page_size).min(tokens),
            };
            ensure_attention(seq, &lanes, recorded)?;
            for (row, lane) in weights.chunks_exact(n).zip(lanes) {
                let stats = &mut seq.attention[lane];
                match req.weights {
                    AttentionWeights::Tokens(_) => stats.record(row, req.decay),
                    AttentionWeights::Pages(_) => {
                        stats.record_pages(row, page_size, (n * page_size).min(tokens), req.decay)
                    }
                }
            }
            Ok(())
        })
    }
}

/// Queries must be whole, finite, the same number per layer, and only for a
/// policy applied now.
fn check_queries(seq: &Sequence, req: &ApplyPolicy<'_>) -> StoreResult<()> {
    seq.check_layers(req.spec.layer_start, req.spec.layer_count)?;
    let query_len = (seq.layout.num_query_heads() * seq.layout.head_dim()) as usize;
    let layers = req.spec.layer_count as usize;
    if !req.queries.len().is_multiple_of(query_len * layers) {
        return Err(StoreError::invalid(
            wire::QUERIES,
            format!(
                "holds {} floats, not the same whole number of queries of {query_len} \
                 (query heads × head_dim) for each of {layers} layers",
                req.queries.len()
            ),
        ));
    }
    if let Some(i) = req.queries.iter().position(|q| !q.is_finite()) {
        return Err(StoreError::invalid(wire::QUERIES, format!("value {i} is not finite")));
    }
    if req.trigger != Trigger::Now && !req.queries.is_empty() {
        return Err(StoreError::invalid(
            wire::QUERIES,
            "only a policy applied now takes queries; a registered one scores by reported attention",
        ));
    }
    Ok(())
}
