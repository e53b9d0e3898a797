//! Page scorers (docs/CONCEPTS.md §5): each turns one lane's attention into page
//! scores and the pages it protects. Token scores become page scores by sum,
//! so a page is as worth keeping as its attention mass, and a window or sink
//! that reaches into a page keeps the whole page.

/// How a recent window is sized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Window {
    /// The lane's last `n` tokens, as the pages holding them.
    Tokens(u32),
    /// This fraction (clamped to `0..=1`) of the lane's budget, in pages,
    /// rounded up: a split of the budget (H2O's heavy/recent halves) that
    /// holds at any budget.
    Fraction(f32),
}

impl Window {
    /// How many of the newest pages the window covers, at most `pages`.
    pub(super) fn pages(self, tokens: usize, page_size: usize, budget_pages: usize) -> usize {
        let pages = tokens.div_ceil(page_size);
        let covered = match self {
            Window::Tokens(0) => 0,
            Window::Tokens(n) => pages - tokens.saturating_sub(n as usize) / page_size,
            Window::Fraction(f) => (f64::from(f.clamp(0.0, 1.0)) * budget_pages as f64).ceil() as usize,
        };
        covered.min(pages)
    }
}

/// SnapKV's smoothing of the observed attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// A token scores as its loudest neighbour.
    Max,
    /// A token scores as its neighbourhood's mean.
    Avg,
}

/// An eviction scorer with its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scorer {
    /// StreamingLLM (Xiao et al. 2023): the first `sink_tokens` (attention
    /// sinks; 4 in the paper) and the most recent tokens filling the rest of
    /// the budget. At page granularity the sinks are the pages holding them
    /// (protected) and recency is the score (page index + 1, not normalised),
    /// so any budget keeps the sink pages plus the newest pages.
    Streaming {
        /// Leading tokens kept as attention sinks.
        sink_tokens: u32,
    },
    /// H2O (Zhang et al. 2023): heavy hitters by accumulated attention (decay
    /// is [`super::TokenStats::record`]'s) plus a recent window, half the budget each
    /// in the paper (`Window::Fraction(0.5)`). `normalize` divides a token's
    /// score by the queries that could see it, which removes the bias toward
    /// early tokens (off in the paper). A heavy-hitter token keeps its page.
    H2o {
        /// The recent window, protected.
        window: Window,
        /// Divide each token's accumulated attention by the queries that saw it.
        normalize: bool,
    },
    /// SnapKV (Li et al. 2024), one-shot at the end of prefill: `observed` is
    /// the attention of the last `window_tokens` queries summed per token;
    /// the prefix before that window is scored after 1-D pooling of `kernel`
    /// (odd) tokens, and the window itself is protected. Defaults: window 32,
    /// kernel 7, max pooling, the LongBench configuration of SnapKV, PyramidKV
    /// and Ada-KV (`w32_k7_maxpool`); the reference code's fallbacks are
    /// kernel 5 with average pooling.
    SnapKv {
        /// The observation window: `observed` comes from the last
        /// `window_tokens` queries, whose own tokens are protected.
        window_tokens: u32,
        /// Pooling width in tokens; must be odd.
        kernel: u32,
        /// How the pooling combines a token's neighbourhood.
        pooling: Pooling,
    },
    /// TOVA (Oren et al. 2024): the last query's attention alone, so no recent
    /// window in the reference (`Window::Tokens(0)`).
    Tova {
        /// The recent window, protected.
        window: Window,
    },
    /// Scissorhands (Liu et al. 2023): how often each token was important
    /// (at least its query's mean weight) over the history window, see
    /// [`super::TokenStats::persistence`], plus a recent window. Counts are summed
    /// per page and not normalised.
    Scissorhands {
        /// The recent window, protected.
        window: Window,
    },
    /// max-mass: the pages with the largest attention mass for the given
    /// queries (`observed`), nothing protected; pair it with
    /// [`super::dropped_mass`] to report what the kept set misses.
    MaxMass,
}

impl Scorer {
    /// The scorer called `name`, with its reference defaults.
    pub fn defaults(name: &str) -> Option<Self> {
        Some(match name {
            "streaming" => Scorer::Streaming { sink_tokens: 4 },
            "h2o" => Scorer::H2o {
                window: Window::Fraction(0.5),
                normalize: false,
            },
            "snapkv" => Scorer::SnapKv {
                window_tokens: 32,
                kernel: 7,
                pooling: Pooling::Max,
            },
            "tova" => Scorer::Tova {
                window: Window::Tokens(0),
            },
            // The paper fixes no recent window; SnapKV's 32 tokens, so that a
            // short budget is not all recency.
            "scissorhands" => Scorer::Scissorhands {
                window: Window::Tokens(32),
            },
            "max-mass" => Scorer::MaxMass,
            _ => return None,
        })
    }

    /// The name [`Scorer::defaults`] knows this scorer by.
    pub fn name(&self) -> &'static str {
        match self {
            Scorer::Streaming { .. } => "streaming",
            Scorer::H2o { .. } => "h2o",
            Scorer::SnapKv { .. } => "snapkv",
            Scorer::Tova { .. } => "tova",
            Scorer::Scissorhands { .. } => "scissorhands",
            Scorer::MaxMass => "max-mass",
        }
    }

    /// Whether [`Scorer::score`] reads [`super::LaneInput::stats`].
    pub fn needs_stats(&self) -> bool {
        matches!(
            self,
            Scorer::H2o { .. } | Scorer::Tova { .. } | Scorer::Scissorhands { .. }
        )
    }

    /// Whether [`Scorer::score`] reads [`super::LaneInput::observed`].
    pub fn needs_observed(&self) -> bool {
        matches!(self, Scorer::SnapKv { .. } | Scorer::MaxMass)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_round_trip_their_names() {
        for name in ["streaming", "h2o", "snapkv", "tova", "scissorhands", "max-mass"] {
            let scorer = Scorer::defaults(name).unwrap();
            assert_eq!(scorer.name(), name);
            assert!(!(scorer.needs_stats() && scorer.needs_observed()), "{name}");
        }
        assert_eq!(Scorer::defaults("lru"), None);
        assert!(Scorer::defaults("tova").unwrap().needs_stats());
        assert!(Scorer::defaults("snapkv").unwrap().needs_observed());
        assert!(!Scorer::defaults("streaming").unwrap().needs_stats());
    }

    #[test]
    fn windows_cover_whole_pages() {
        // 10 tokens in pages of 2.
        assert_eq!(Window::Tokens(0).pages(10, 2, 4), 0);
        assert_eq!(Window::Tokens(3).pages(10, 2, 4), 2);
        assert_eq!(Window::Tokens(4).pages(10, 2, 4), 2);
        assert_eq!(Window::Tokens(99).pages(10, 2, 4), 5);
        // 9 tokens: the last page holds one.
        assert_eq!(Window::Tokens(2).pages(9, 2, 4), 2);
        assert_eq!(Window::Fraction(0.5).pages(10, 2, 3), 2);
        assert_eq!(Window::Fraction(7.0).pages(10, 2, 3), 3);
        assert_eq!(Window::Fraction(1.0).pages(10, 2, 9), 5);
        assert_eq!(Window::Fraction(f32::NAN).pages(10, 2, 9), 0);
    }
}
