//! Attention over a lane: what given queries attend to (computed here from
//! the stored keys), and the statistics that record it.

use kvtier_core::policy::{KeyRow, TokenStats, add_attention};

use crate::StoreResult;
use crate::catalog::Sequence;
use crate::cost;
use crate::reader::{PageContent, Reader};

/// Exact attention of each query over the lane's keys, as the query
/// head group's mean: one row per query over the lane's tokens. A summary
/// row stands for its `count` tokens (its logit gains ln count, and its
/// weight is spread over them); gone tokens get nothing.
pub(super) fn of_queries(
    seq: &Sequence,
    reader: &Reader<'_>,
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
    let contents = reader.owned_contents(layout, &requests, &mut Vec::new())?;
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

/// Makes room in the attention statistics of `lanes` for `tokens`
/// positions, charged first (statistics exist, for every lane, once
/// anything reports them); refused, with nothing changed, past a limit.
pub(crate) fn ensure_attention(seq: &mut Sequence, lanes: &[usize], tokens: usize) -> StoreResult<()> {
    let new = seq.attention.is_empty();
    let fresh = TokenStats::new();
    let mut bytes = if new {
        cost::attention(&fresh, seq.lanes.len() as u64, 0, true)
    } else {
        0
    };
    for &lane in lanes {
        let stats = seq.attention.get(lane).unwrap_or(&fresh);
        let more = tokens.saturating_sub(stats.tokens()) as u64;
        bytes += cost::attention(stats, 1, more, false);
    }
    seq.charge.grow(bytes)?;
    if new {
        seq.attention = vec![fresh; seq.lanes.len()];
    }
    Ok(())
}
