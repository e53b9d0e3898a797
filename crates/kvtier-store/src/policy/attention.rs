//! Attention statistics: what workers report, and the attention the store
//! computes itself for queries given to a policy.

use kvtier_core::SequenceKey;
use kvtier_core::policy::{KeyRow, TokenStats, add_attention};

use super::{AttentionWeights, ReportAttention};
use crate::read::PageContent;
use crate::sequence::Sequence;
use crate::{Store, StoreError, StoreResult};

impl Store {
    /// Records one query's attention per KV head.
    pub fn report_attention(&self, key: &SequenceKey, req: ReportAttention<'_>) -> StoreResult<()> {
        if let Some(rho) = req.decay.filter(|r| !(*r > 0.0 && *r <= 1.0)) {
            return Err(StoreError::invalid("decay", format!("is {rho}; must be in (0, 1]")));
        }
        self.with_sequence_mut(key, |seq| {
            seq.check_layer("layer", req.layer)?;
            let heads = seq.check_heads(req.heads)?;
            let page_size = seq.layout.page_size() as usize;
            let (field, weights) = match req.weights {
                AttentionWeights::Tokens(w) => ("token_weights", w),
                AttentionWeights::Pages(w) => ("page_weights", w),
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
            seq.ensure_attention();
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

    /// Exact attention of each query over the lane's keys, as the query
    /// head group's mean: one row per query over the lane's tokens. A summary
    /// row stands for its `count` tokens (its logit gains ln count, and its
    /// weight is spread over them); gone tokens get nothing.
    pub(super) fn query_attention(
        &self,
        seq: &Sequence,
        head: u32,
        lane: usize,
        queries: &[f32],
    ) -> StoreResult<Vec<Vec<f32>>> {
        let layout = &seq.layout;
        let d = layout.head_dim() as usize;
        let dtype = layout.dtype();
        let l = &seq.lanes[lane];
        let tokens = l.tokens() as usize;
        let page_size = layout.page_size() as usize;
        let requests: Vec<_> = (0..l.num_pages()).map(|p| (l, p)).collect();
        let contents = self.read_pages(layout, &requests, &mut Vec::new())?;
        // Key rows with the tokens each stands for.
        let mut rows: Vec<(usize, usize, Vec<f32>)> = Vec::new();
        for (p, (_, content)) in contents.iter().enumerate() {
            let first = p * page_size;
            match content {
                PageContent::Original(bytes) => {
                    for r in 0..l.rows_in(p) as usize {
                        rows.push((first + r, 1, (0..d).map(|i| dtype.get_f32(bytes, r * d + i)).collect()));
                    }
                }
                PageContent::Summary { counts, kv } => {
                    let mut at = first;
                    for (r, &c) in counts.iter().enumerate() {
                        rows.push((at, c as usize, (0..d).map(|i| dtype.get_f32(kv, r * d + i)).collect()));
                        at += c as usize;
                    }
                }
                PageContent::Gone(_) => {}
            }
        }
        let keys: Vec<KeyRow<'_>> = rows
            .iter()
            .map(|(first_token, count, key)| KeyRow {
                first_token: *first_token,
                count: *count,
                key,
            })
            .collect();
        let group = (layout.num_query_heads() / layout.num_kv_heads()) as usize;
        let scale = 1.0 / (d as f64).sqrt();
        let query_len = layout.num_query_heads() as usize * d;
        Ok(queries
            .chunks_exact(query_len)
            .map(|query| {
                let mut row = vec![0f32; tokens];
                for g in 0..group {
                    let qh = head as usize * group + g;
                    add_attention(&query[qh * d..(qh + 1) * d], &keys, scale, 1.0 / group as f64, &mut row);
                }
                row
            })
            .collect())
    }
}

pub(super) fn padded(values: &[f64], tokens: usize) -> Vec<f64> {
    let mut out = values.to_vec();
    out.resize(tokens, 0.0);
    out
}

pub(super) fn sum_rows(rows: &[Vec<f32>], tokens: usize) -> Vec<f64> {
    let mut out = vec![0f64; tokens];
    for row in rows {
        out.iter_mut().zip(row).for_each(|(o, w)| *o += f64::from(*w));
    }
    out
}

impl Sequence {
    /// Attention statistics exist once anything reports them.
    pub(crate) fn ensure_attention(&mut self) {
        if self.attention.is_empty() {
            self.attention = vec![TokenStats::new(); self.lanes.len()];
        }
    }
}
