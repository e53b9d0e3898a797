//! Per-lane attention statistics (docs/CONCEPTS.md §5), fed by the store's own
//! selection computations or by worker reports, read by the scorers.

use std::collections::VecDeque;

/// Scissorhands' history window. The paper leaves it a tuning parameter and
/// publishes no code; 8 bounds the importance ring to one byte per token per
/// lane, which matters because every (layer, KV head) of every sequence holds
/// one.
const DEFAULT_HISTORY: usize = 8;

/// What the recorded queries of one lane attended to.
///
/// Token vectors grow to the longest query recorded: a later query sees more
/// tokens, and a token a query could not see simply gets nothing from it.
#[derive(Debug, Clone)]
pub struct TokenStats {
    accumulated: Vec<f64>,
    seen: Vec<u32>,
    last: Vec<f32>,
    reports: u64,
    history: usize,
    /// One bitset per recent query, bit `t` set when token `t` got at least
    /// that query's mean weight: bits rather than counts keep the ring at
    /// `history * tokens / 8` bytes.
    important: VecDeque<Vec<u64>>,
}

impl Default for TokenStats {
    fn default() -> Self {
        Self::new()
    }
}

impl TokenStats {
    /// Empty statistics with the default history of 8 queries.
    pub fn new() -> Self {
        Self {
            accumulated: Vec::new(),
            seen: Vec::new(),
            last: Vec::new(),
            reports: 0,
            history: DEFAULT_HISTORY,
            important: VecDeque::new(),
        }
    }

    /// Records one query's attention over tokens `0..weights.len()` (a
    /// probability distribution, or any non-negative weights).
    ///
    /// `decay`: `Some(rho)` multiplies the accumulated scores by `rho` before
    /// adding (H2O with decay), so old attention fades.
    ///
    /// # Panics
    /// If `rho` is not in `(0, 1]`.
    pub fn record(&mut self, weights: &[f32], decay: Option<f64>) {
        if let Some(rho) = decay {
            assert!(rho > 0.0 && rho <= 1.0, "decay must be in (0, 1], got {rho}");
            self.accumulated.iter_mut().for_each(|a| *a *= rho);
        }
        if weights.len() > self.accumulated.len() {
            self.accumulated.resize(weights.len(), 0.0);
            self.seen.resize(weights.len(), 0);
        }
        let mut sum = 0.0;
        for (t, &w) in weights.iter().enumerate() {
            self.accumulated[t] += f64::from(w);
            self.seen[t] = self.seen[t].saturating_add(1);
            sum += f64::from(w);
        }
        self.last.clear();
        self.last.extend_from_slice(weights);
        self.reports += 1;
        self.remember(weights, sum);
    }

    /// Records attention already summed per page, from a worker that only has
    /// page-level weights: each page's weight is spread evenly over its tokens
    /// (the last page may be partial), then recorded as [`TokenStats::record`].
    /// An even spread keeps every page sum, which is what the scorers rank,
    /// exact; only token-level detail (persistence, pooling) sees flat pages.
    ///
    /// # Panics
    /// If `page_size` is 0, if `page_weights` does not hold one weight per
    /// page of `tokens`, or as [`TokenStats::record`].
    pub fn record_pages(&mut self, page_weights: &[f32], page_size: usize, tokens: usize, decay: Option<f64>) {
        assert!(page_size > 0, "page size must be positive");
        let pages = tokens.div_ceil(page_size);
        assert_eq!(page_weights.len(), pages, "one weight per page of {tokens} tokens");
        let weights: Vec<f32> = (0..tokens)
            .map(|t| {
                let page = t / page_size;
                let len = page_size.min(tokens - page * page_size);
                page_weights[page] / len as f32
            })
            .collect();
        self.record(&weights, decay);
    }

    /// The longest query length recorded (since the last truncation).
    pub fn tokens(&self) -> usize {
        self.accumulated.len()
    }

    /// How many queries were recorded.
    pub fn reports(&self) -> u64 {
        self.reports
    }

    /// H2O's accumulated attention per token.
    pub fn accumulated(&self) -> &[f64] {
        &self.accumulated
    }

    /// Per token, how many recorded queries could see it (`weights.len() > t`).
    pub fn seen(&self) -> &[u32] {
        &self.seen
    }

    /// The last recorded query's weights (TOVA).
    pub fn last(&self) -> &[f32] {
        &self.last
    }

    /// Scissorhands' persistence of importance: per token, in how many of the
    /// last `history` recorded queries its weight was at least that query's
    /// mean weight (`1/len` for a distribution).
    pub fn persistence(&self) -> Vec<u32> {
        let mut counts = vec![0u32; self.tokens()];
        for bits in &self.important {
            for (index, &word) in bits.iter().enumerate() {
                let mut word = word;
                while word != 0 {
                    counts[index * 64 + word.trailing_zeros() as usize] += 1;
                    word &= word - 1;
                }
            }
        }
        counts
    }

    /// Heap bytes each position adds: its accumulated weight, count and
    /// last weight, and one bit per remembered query.
    pub fn bytes_per_token(&self) -> usize {
        std::mem::size_of::<f64>() + std::mem::size_of::<u32>() + std::mem::size_of::<f32>() + self.history.div_ceil(8)
    }

    /// Sets how many recent queries [`TokenStats::persistence`] counts over,
    /// forgetting the oldest beyond it. 0 makes every count 0.
    pub fn set_history(&mut self, history: usize) {
        self.history = history;
        while self.important.len() > history {
            self.important.pop_front();
        }
    }

    /// Forgets tokens from `tokens` on, after the lane was truncated, so that
    /// a later, shorter sequence does not inherit their scores. Appends never
    /// need it.
    pub fn truncate(&mut self, tokens: usize) {
        self.accumulated.truncate(tokens);
        self.seen.truncate(tokens);
        self.last.truncate(tokens);
        let words = tokens.div_ceil(64);
        for bits in &mut self.important {
            // A shorter bitset has no bits at or past `tokens` to clear.
            if bits.len() >= words {
                bits.truncate(words);
                if !tokens.is_multiple_of(64) {
                    bits[words - 1] &= (1u64 << (tokens % 64)) - 1;
                }
            }
        }
    }

    fn remember(&mut self, weights: &[f32], sum: f64) {
        if self.history == 0 {
            return;
        }
        let mean = sum / weights.len() as f64;
        let mut bits = vec![0u64; weights.len().div_ceil(64)];
        for (t, &w) in weights.iter().enumerate() {
            if f64::from(w) >= mean {
                bits[t / 64] |= 1 << (t % 64);
            }
        }
        if self.important.len() == self.history {
            self.important.pop_front();
        }
        self.important.push_back(bits);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_accumulates_counts_and_keeps_the_last_query() {
        let mut stats = TokenStats::new();
        stats.record(&[0.5, 0.5], None);
        stats.record(&[0.25, 0.25, 0.5], None);
        assert_eq!(stats.tokens(), 3);
        assert_eq!(stats.reports(), 2);
        assert_eq!(stats.accumulated(), &[0.75, 0.75, 0.5]);
        assert_eq!(stats.seen(), &[2, 2, 1]);
        assert_eq!(stats.last(), &[0.25, 0.25, 0.5]);
    }

    #[test]
    fn decay_multiplies_before_adding() {
        let mut stats = TokenStats::new();
        stats.record(&[1.0, 0.0], None);
        stats.record(&[0.5, 0.5], Some(0.5));
        stats.record(&[0.0, 0.0, 1.0], Some(0.5));
        assert_eq!(stats.accumulated(), &[0.5, 0.25, 1.0]);
        assert_eq!(stats.seen(), &[3, 3, 1]);
    }

    #[test]
    #[should_panic(expected = "decay")]
    fn decay_outside_the_unit_interval_is_refused() {
        TokenStats::new().record(&[1.0], Some(1.5));
    }

    #[test]
    fn persistence_counts_queries_at_or_above_their_mean() {
        let mut stats = TokenStats::new();
        // Means 1/4, 1/4, 1/5.
        stats.record(&[0.375, 0.125, 0.25, 0.25], None);
        stats.record(&[0.125, 0.125, 0.125, 0.625], None);
        stats.record(&[0.25, 0.0, 0.0, 0.5, 0.25], None);
        assert_eq!(stats.persistence(), vec![2, 0, 1, 3, 1]);
    }

    #[test]
    fn history_ring_forgets_the_oldest_queries() {
        let mut stats = TokenStats::new();
        stats.set_history(2);
        stats.record(&[1.0, 0.0, 0.0], None);
        stats.record(&[0.0, 1.0, 0.0], None);
        stats.record(&[0.0, 0.0, 1.0], None);
        assert_eq!(stats.persistence(), vec![0, 1, 1]);
        stats.set_history(1);
        assert_eq!(stats.persistence(), vec![0, 0, 1]);
        stats.set_history(0);
        stats.record(&[1.0, 0.0, 0.0], None);
        assert_eq!(stats.persistence(), vec![0, 0, 0]);
    }

    #[test]
    fn persistence_spans_several_words() {
        let mut stats = TokenStats::new();
        let mut weights = vec![0.0f32; 130];
        weights[0] = 0.5;
        weights[129] = 0.5;
        stats.record(&weights, None);
        let counts = stats.persistence();
        assert_eq!(counts.len(), 130);
        assert_eq!((counts[0], counts[64], counts[129]), (1, 0, 1));
        assert_eq!(counts.iter().sum::<u32>(), 2);
    }

    #[test]
    fn record_pages_spreads_each_page_evenly() {
        let mut stats = TokenStats::new();
        // Pages of 4 tokens, the last holding 2.
        stats.record_pages(&[0.5, 0.25, 0.25], 4, 10, None);
        assert_eq!(
            stats.last(),
            &[0.125, 0.125, 0.125, 0.125, 0.0625, 0.0625, 0.0625, 0.0625, 0.125, 0.125]
        );
        assert_eq!(stats.seen(), &[1; 10]);
    }

    #[test]
    fn truncate_forgets_later_tokens_everywhere() {
        let mut stats = TokenStats::new();
        let mut weights = vec![0.0f32; 70];
        weights[3] = 0.5;
        weights[66] = 0.5;
        stats.record(&weights, None);
        stats.record(&[0.0, 0.0, 0.0, 1.0], None);
        stats.truncate(66);
        assert_eq!(stats.tokens(), 66);
        assert_eq!((stats.seen().len(), stats.last().len()), (66, 4));
        // Growing again must not resurrect token 66's old importance.
        let mut again = vec![0.0f32; 70];
        again[3] = 1.0;
        stats.record(&again, None);
        let counts = stats.persistence();
        assert_eq!((counts[3], counts[66]), (3, 0));
        assert_eq!(stats.accumulated()[66], 0.0);
    }
}
