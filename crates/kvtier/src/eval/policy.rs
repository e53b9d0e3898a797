//! `kvtier eval --policy`: eviction policies run through the store's own
//! `ApplyPolicy` over real KV, the way a worker would drive them, and
//! measured against dense attention at every decode position.
//!
//! One sequence holds every evaluated layer (so allocators split the budget
//! across layers and heads). Prefill writes tokens before the first decode
//! position; a worker's attention for every prefill query is reported
//! (policies that score by statistics read it), and the policy runs once.
//! Then each decode position appends its token, its queries attend over what
//! is left (that is what is measured), that attention is reported, and the
//! policy runs again, except SnapKV, which compresses the prompt only. The
//! action is `evict`: the point is what each policy loses.

use anyhow::Context;
use kvtier_core::policy::{Allocator, Scorer};
use kvtier_core::{DType, Layout, LayoutSpec, SequenceKey};
use kvtier_store::{
    AppendTokens, ApplyPolicy, AttentionWeights, FetchPages, HeadRange, PageContent, PageList, PolicyAction,
    PolicySpec, PutPages, ReportAttention, Store, StoreConfig, Trigger,
};
use serde::Serialize;

use super::data::LayerData;
use super::{Attention, Metrics};

/// Queries SnapKV's observation window and max-mass score by.
pub(crate) const OBSERVED_QUERIES: usize = 32;

/// What a policy run keeps at each decode position: per layer, per KV head,
/// a flag per token of `0..=t`.
pub(crate) type Kept = Vec<Vec<Vec<bool>>>;

/// A policy over layers of real KV in a store of its own.
pub(crate) struct PolicyRun<'a> {
    layers: &'a [LayerData],
    store: std::sync::Arc<Store>,
    key: SequenceKey,
    spec: PolicySpec,
    page_size: usize,
    held: usize,
    /// Queries seen so far, newest last (max-mass scores the last few).
    recent: Vec<usize>,
    pub(crate) dropped_mass: Vec<f64>,
}

impl<'a> PolicyRun<'a> {
    /// Writes tokens `0..prefill`, reports their attention, and applies the
    /// policy once.
    pub(crate) fn start(
        layers: &'a [LayerData],
        scorer: Scorer,
        allocator: Allocator,
        page_size: u32,
        budget_tokens: u32,
        prefill: usize,
    ) -> anyhow::Result<Self> {
        let first = &layers[0];
        let layout = Layout::new(LayoutSpec {
            num_layers: layers.len() as u32,
            num_kv_heads: first.kv_heads as u32,
            num_query_heads: first.heads as u32,
            head_dim: first.head_dim as u32,
            dtype: DType::F16,
            page_size,
            layer_groups: vec![],
        })?;
        let bytes: usize = layers.iter().map(|l| 2 * l.kv_heads * l.tokens * l.head_dim * 2).sum();
        let store = Store::new(StoreConfig {
            device_bytes: 0,
            host_bytes: 2 * bytes as u64 + (64 << 20),
            cache_writes_on_device: false,
            ..StoreConfig::default()
        })?;
        let key = SequenceKey::parse("eval", scorer.name())?;
        store.create_sequence(key.clone(), layout, vec![])?;
        let spec = PolicySpec {
            layer_start: 0,
            layer_count: layers.len() as u32,
            scorer,
            allocator,
            budget_tokens,
            action: PolicyAction::Evict,
        };
        let mut run = Self {
            layers,
            store,
            key,
            spec,
            page_size: page_size as usize,
            held: prefill,
            recent: Vec::new(),
            dropped_mass: Vec::new(),
        };
        for (i, l) in layers.iter().enumerate() {
            if prefill > 0 {
                let kv = l.kv_message(0..prefill);
                run.store.put_pages(
                    &run.key,
                    PutPages {
                        layer: i as u32,
                        heads: run.heads(),
                        first_page: 0,
                        num_tokens: prefill as u32,
                        kv: &kv,
                        persist: false,
                    },
                )?;
            }
        }
        if run.spec.scorer.needs_stats() {
            for t in 0..prefill {
                run.report(t, None)?;
            }
        }
        run.recent = (prefill.saturating_sub(OBSERVED_QUERIES)..prefill).collect();
        run.apply()?;
        Ok(run)
    }

    fn heads(&self) -> HeadRange {
        HeadRange {
            start: 0,
            count: self.layers[0].kv_heads as u32,
        }
    }

    /// Reports each layer's attention of the query at `t` over `kept` (all
    /// of `0..=t` when `None`), as a worker that computed it would.
    fn report(&self, t: usize, kept: Option<&Kept>) -> anyhow::Result<()> {
        for (i, l) in self.layers.iter().enumerate() {
            let weights = l.group_attention(t, kept.map(|k| &k[i][..]));
            self.store.report_attention(
                &self.key,
                ReportAttention {
                    layer: i as u32,
                    heads: self.heads(),
                    weights: AttentionWeights::Tokens(&weights),
                    decay: None,
                },
            )?;
        }
        Ok(())
    }

    /// Applies the policy, with each layer's recent queries for the scorers
    /// that observe them.
    fn apply(&mut self) -> anyhow::Result<()> {
        if self.held == 0 {
            return Ok(());
        }
        let queries: Vec<f32> = if self.spec.scorer.needs_observed() {
            let window = match self.spec.scorer {
                Scorer::SnapKv { window_tokens, .. } => window_tokens as usize,
                _ => OBSERVED_QUERIES,
            };
            let from = self.recent.len().saturating_sub(window);
            self.layers
                .iter()
                .flat_map(|l| self.recent[from..].iter().flat_map(|&t| l.queries_at(t)))
                .collect()
        } else {
            Vec::new()
        };
        let outcome = self
            .store
            .apply_policy(
                &self.key,
                ApplyPolicy {
                    spec: &self.spec,
                    queries: &queries,
                    trigger: Trigger::Now,
                },
            )
            .context("applying the policy")?;
        self.dropped_mass.extend(outcome.dropped_mass);
        Ok(())
    }

    /// Appends token `t`, returns what the store holds for its queries, then
    /// reports their attention and applies the policy again.
    pub(crate) fn step(&mut self, t: usize) -> anyhow::Result<Kept> {
        for (i, l) in self.layers.iter().enumerate() {
            let kv = l.kv_message(self.held..t + 1);
            self.store.append_tokens(
                &self.key,
                AppendTokens {
                    layer: i as u32,
                    heads: self.heads(),
                    num_tokens: (t + 1 - self.held) as u32,
                    kv: &kv,
                    expected_position: Some(self.held as u64),
                    persist: false,
                },
            )?;
        }
        self.held = t + 1;
        let kept = self.kept(t)?;
        self.recent.push(t);
        if self.spec.scorer.needs_stats() {
            self.report(t, Some(&kept))?;
        }
        if !matches!(self.spec.scorer, Scorer::SnapKv { .. }) {
            self.apply()?;
        }
        Ok(kept)
    }

    /// Which tokens of `0..=t` each lane still holds.
    fn kept(&self, t: usize) -> anyhow::Result<Kept> {
        let mut out = Vec::with_capacity(self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            let pages = self.store.fetch_pages(
                &self.key,
                FetchPages {
                    layer: i as u32,
                    heads: self.heads(),
                    pages: PageList::All,
                    with_digests: false,
                },
            )?;
            let mut lanes = vec![vec![false; t + 1]; l.kv_heads];
            for p in pages {
                if matches!(p.content, PageContent::Original(_)) {
                    let start = p.page as usize * self.page_size;
                    lanes[p.kv_head as usize][start..(start + self.page_size).min(t + 1)].fill(true);
                }
            }
            out.push(lanes);
        }
        Ok(out)
    }
}

/// One method's quality at one budget, averaged over layers, query heads
/// and decode positions; the measures docs/CONCEPTS.md §2 keeps apart.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct PolicyRow {
    pub(crate) method: String,
    pub(crate) allocator: Option<String>,
    pub(crate) budget_tokens: Option<u32>,
    /// Dense attention mass on what the query could use.
    pub(crate) mass: f64,
    /// Share of the dense top-k tokens (k = the budget) available.
    pub(crate) recall: f64,
    /// ‖o − o_dense‖ / ‖o_dense‖.
    pub(crate) rel_err: f64,
    /// Original bytes / bytes kept (1 when nothing is removed for good).
    pub(crate) capacity_compression: f64,
    /// Bytes read per step / bytes resident.
    pub(crate) read_sparsity: f64,
    /// Tokens held per (layer, KV head), mean over positions.
    pub(crate) kept_tokens: f64,
    /// max-mass: the mean dropped mass its runs reported.
    pub(crate) dropped_mass: Option<f64>,
    /// Largest residual of `o_full − o_kept = (1 − p)(o_dropped − o_kept)`.
    pub(crate) identity_residual: f64,
    /// The same per layer: where a policy wins or loses.
    pub(crate) per_layer: Vec<LayerQuality>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct LayerQuality {
    pub(crate) layer: u32,
    pub(crate) mass: f64,
    pub(crate) rel_err: f64,
    pub(crate) kept_tokens: f64,
}

/// Runs one policy over the decode positions and averages its measures.
pub(crate) fn evaluate_policy(
    layers: &[LayerData],
    scorer: Scorer,
    allocator: Allocator,
    page_size: u32,
    budget_tokens: u32,
    positions: &[usize],
) -> anyhow::Result<PolicyRow> {
    let name = scorer.name();
    let mut run = PolicyRun::start(layers, scorer, allocator, page_size, budget_tokens, positions[0])?;
    let mut sum = Metrics::default();
    let (mut samples, mut kept_tokens, mut original_tokens, mut lanes) = (0usize, 0f64, 0f64, 0usize);
    // Per layer: metrics, samples, kept tokens, lanes.
    let mut by_layer = vec![(Metrics::default(), 0usize, 0f64, 0usize); layers.len()];
    for &t in positions {
        let kept = run.step(t)?;
        for (l, data) in layers.iter().enumerate() {
            for (kv, mask) in kept[l].iter().enumerate() {
                let held = mask.iter().filter(|m| **m).count();
                kept_tokens += held as f64;
                original_tokens += (t + 1) as f64;
                lanes += 1;
                by_layer[l].2 += held as f64;
                by_layer[l].3 += 1;
                for g in 0..data.group() {
                    let m = Attention {
                        q: data.query(kv * data.group() + g, t),
                        keys: data.keys(kv, t + 1),
                        values: data.values(kv, t + 1),
                        d: data.head_dim,
                        scale: data.scale,
                    }
                    .metrics(mask, page_size as usize, Some(budget_tokens), (0, 0));
                    sum.add(&m);
                    samples += 1;
                    by_layer[l].0.add(&m);
                    by_layer[l].1 += 1;
                }
            }
        }
    }
    let n = samples.max(1) as f64;
    Ok(PolicyRow {
        method: name.to_owned(),
        allocator: Some(allocator.name().to_owned()),
        budget_tokens: Some(budget_tokens),
        mass: sum.mass / n,
        recall: sum.recall / n,
        rel_err: sum.rel_err / n,
        // Bytes, not a mean of per-lane ratios: a lane an allocator starves
        // would otherwise dominate.
        capacity_compression: original_tokens / kept_tokens.max(1.0),
        read_sparsity: 1.0,
        kept_tokens: kept_tokens / lanes.max(1) as f64,
        dropped_mass: (!run.dropped_mass.is_empty())
            .then(|| run.dropped_mass.iter().sum::<f64>() / run.dropped_mass.len() as f64),
        identity_residual: sum.identity_residual,
        per_layer: layers
            .iter()
            .zip(by_layer)
            .map(|(data, (m, n, kept, lanes))| LayerQuality {
                layer: data.layer,
                mass: m.mass / n.max(1) as f64,
                rel_err: m.rel_err / n.max(1) as f64,
                kept_tokens: kept / lanes.max(1) as f64,
            })
            .collect(),
    })
}
