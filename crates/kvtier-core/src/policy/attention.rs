//! Exact softmax attention of one query over a lane's keys, where a key may
//! be a summary row standing for several tokens: its logit gains `ln count`
//! (as if `count` identical keys were there) and its weight is spread evenly
//! over the tokens it stands for. A page of identical keys summarised to one
//! row therefore gets exactly the attention the page had.

/// A key row and the consecutive tokens it stands for.
#[derive(Debug, Clone, Copy)]
pub struct KeyRow<'a> {
    /// Position of the first token the row stands for.
    pub first_token: usize,
    /// Consecutive tokens it stands for: 1 for an original key, a summary
    /// row's count otherwise.
    pub count: usize,
    /// The key, `head_dim` values.
    pub key: &'a [f32],
}

/// Attention weights per token over `0..tokens` (zero where no key stands),
/// added into `out` times `share` (so query heads of a group can be averaged
/// into one row).
pub fn add_attention(query: &[f32], keys: &[KeyRow<'_>], scale: f64, share: f64, out: &mut [f32]) {
    let logits: Vec<f64> = keys
        .iter()
        .map(|k| {
            let dot: f64 = k
                .key
                .iter()
                .zip(query)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            dot * scale + (k.count as f64).ln()
        })
        .collect();
    let top = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = logits.iter().map(|x| (x - top).exp()).collect();
    let total: f64 = weights.iter().sum();
    for (k, w) in keys.iter().zip(weights) {
        let per_token = (share * w / total / k.count as f64) as f32;
        out[k.first_token..k.first_token + k.count]
            .iter_mut()
            .for_each(|x| *x += per_token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(first_token: usize, count: usize, key: &[f32]) -> KeyRow<'_> {
        KeyRow {
            first_token,
            count,
            key,
        }
    }

    #[test]
    fn a_summary_of_identical_keys_gets_the_pages_attention_exactly() {
        let q = [0.3f32, -1.2, 2.0];
        let (a, b) = ([1.0f32, 0.5, -0.25], [0.75f32, -2.0, 1.5]);
        // Tokens 0..3 all key `a`, tokens 3..5 key `b`.
        let original: Vec<KeyRow> = (0..3)
            .map(|t| row(t, 1, &a))
            .chain((3..5).map(|t| row(t, 1, &b)))
            .collect();
        let summarised = [row(0, 3, &a), row(3, 1, &b), row(4, 1, &b)];
        let (mut x, mut y) = (vec![0f32; 5], vec![0f32; 5]);
        add_attention(&q, &original, 0.5, 1.0, &mut x);
        add_attention(&q, &summarised, 0.5, 1.0, &mut y);
        for (u, v) in x.iter().zip(&y) {
            assert!((u - v).abs() < 1e-7, "{x:?} vs {y:?}");
        }
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn gone_tokens_get_nothing_and_shares_add() {
        let q = [1.0f32];
        let keys = [row(0, 1, &[1.0]), row(2, 1, &[1.0])];
        let mut out = vec![0f32; 3];
        add_attention(&q, &keys, 1.0, 0.5, &mut out);
        add_attention(&q, &keys, 1.0, 0.5, &mut out);
        assert_eq!(out, [0.5, 0.0, 0.5]);
    }
}
