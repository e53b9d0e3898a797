//! What a scorer reads for one lane and what it returns, and the
//! token-to-page arithmetic the scorers share.

use super::{Pooling, TokenStats};

/// What one lane's scoring needs.
#[derive(Debug, Clone, Copy)]
pub struct LaneInput<'a> {
    /// Token positions `0..tokens`.
    pub tokens: usize,
    /// Tokens per page; the last page may be partial.
    pub page_size: usize,
    /// The lane's recorded attention (H2O, TOVA, Scissorhands). It may cover
    /// fewer tokens than the lane (tokens appended since the last report
    /// score 0), never more.
    pub stats: Option<&'a TokenStats>,
    /// Attention summed over the explicitly given queries (SnapKV's
    /// observation window, max-mass's queries), one value per token; `None`
    /// when not given.
    pub observed: Option<&'a [f64]>,
}

/// One lane's scored pages.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PageScores {
    /// Per page, higher = more worth keeping: the sum of the page's token
    /// scores, i.e. its attention mass, so one heavy-hitter token keeps its
    /// whole page. Attention-derived scores (H2O, SnapKV, TOVA, max-mass) are
    /// normalised to sum to 1 over the lane so that Ada-KV can compare heads
    /// whose raw totals differ (a head's query count, decay, pooling);
    /// Scissorhands' counts and StreamingLLM's recency ranks are not masses
    /// and already share one scale across heads, so they stay raw.
    pub scores: Vec<f64>,
    /// Pages to keep first, if the budget allows (sinks, the recent or
    /// observation window), most important first.
    pub protected: Vec<usize>,
}

/// Sums `score(t)` over tokens `0..scored` into `pages` pages.
pub(super) fn page_sums(pages: usize, page_size: usize, scored: usize, score: impl Fn(usize) -> f64) -> Vec<f64> {
    let mut sums = vec![0.0; pages];
    for t in 0..scored {
        sums[t / page_size] += score(t);
    }
    sums
}

/// Scales `scores` to sum to 1; all-zero scores stay zero.
pub(super) fn normalised(mut scores: Vec<f64>) -> Vec<f64> {
    let sum: f64 = scores.iter().sum();
    if sum > 0.0 && sum.is_finite() {
        scores.iter_mut().for_each(|s| *s /= sum);
    }
    scores
}

/// The `n` most recent of `pages` pages, newest first: when the budget cannot
/// hold the whole window, the newest pages are the ones it keeps.
pub(super) fn newest(pages: usize, n: usize) -> Vec<usize> {
    (pages - n.min(pages)..pages).rev().collect()
}

/// 1-D pooling of `kernel` (odd) values centred on each position, output the
/// size of the input. Windows are clamped at the edges rather than padded, so
/// an average near an edge is over real values only (PyTorch's `avg_pool1d`
/// counts zero padding instead, which would penalise the first and last
/// tokens for their position).
pub(super) fn pool(values: &[f64], kernel: usize, pooling: Pooling) -> Vec<f64> {
    let half = kernel / 2;
    (0..values.len())
        .map(|i| {
            let window = &values[i.saturating_sub(half)..(i + half + 1).min(values.len())];
            match pooling {
                Pooling::Max => window.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                Pooling::Avg => window.iter().sum::<f64>() / window.len() as f64,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_sums_cover_the_partial_last_page() {
        let sums = page_sums(3, 4, 10, |t| t as f64);
        assert_eq!(sums, vec![6.0, 22.0, 17.0]);
        // Tokens past `scored` (not yet reported) add nothing.
        assert_eq!(page_sums(3, 4, 5, |_| 1.0), vec![4.0, 1.0, 0.0]);
    }

    #[test]
    fn normalised_sums_to_one_unless_all_zero() {
        assert_eq!(normalised(vec![1.0, 3.0]), vec![0.25, 0.75]);
        assert_eq!(normalised(vec![0.0, 0.0]), vec![0.0, 0.0]);
    }

    #[test]
    fn newest_pages_come_first() {
        assert_eq!(newest(5, 2), vec![4, 3]);
        assert_eq!(newest(2, 7), vec![1, 0]);
        assert!(newest(5, 0).is_empty());
    }

    #[test]
    fn pooling_clamps_at_the_edges() {
        let values = [0.0, 3.0, 0.0, 0.0, 6.0, 0.0];
        assert_eq!(pool(&values, 3, Pooling::Max), vec![3.0, 3.0, 3.0, 6.0, 6.0, 6.0]);
        assert_eq!(pool(&values, 3, Pooling::Avg), vec![1.5, 1.0, 1.0, 2.0, 2.0, 3.0]);
        assert_eq!(pool(&values, 1, Pooling::Avg), values.to_vec());
        assert_eq!(pool(&values, 5, Pooling::Avg), vec![1.0, 0.75, 1.8, 1.8, 1.5, 2.0]);
    }
}
