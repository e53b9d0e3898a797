//! [`Scorer::score`]: one lane's attention to page scores and protected
//! pages. Token scores become page scores by sum, so a page is as worth
//! keeping as its attention mass.

use super::pages::{newest, normalised, page_sums, pool};
use super::{LaneInput, PageScores, PolicyError, Scorer, TokenStats, Window};

impl Scorer {
    /// Scores one lane's pages. `budget_pages` is the lane's nominal budget,
    /// which `Window::Fraction` windows are sized against; an allocator may
    /// then give the lane more or fewer pages.
    pub fn score(&self, input: &LaneInput<'_>, budget_pages: usize) -> Result<PageScores, PolicyError> {
        let (tokens, page_size) = (input.tokens, input.page_size);
        if page_size == 0 {
            return Err(PolicyError::ZeroPageSize);
        }
        let pages = tokens.div_ceil(page_size);
        let recent = |window: Window| newest(pages, window.pages(tokens, page_size, budget_pages));
        Ok(match *self {
            Scorer::Streaming { sink_tokens } => PageScores {
                scores: (1..=pages).map(|p| p as f64).collect(),
                protected: (0..(sink_tokens as usize).min(tokens).div_ceil(page_size)).collect(),
            },
            Scorer::H2o { window, normalize } => {
                let stats = self.stats(input)?;
                let (accumulated, seen) = (stats.accumulated(), stats.seen());
                let score = |t: usize| match (normalize, seen[t]) {
                    (false, _) => accumulated[t],
                    (true, 0) => 0.0,
                    (true, n) => accumulated[t] / f64::from(n),
                };
                PageScores {
                    scores: normalised(page_sums(pages, page_size, stats.tokens(), score)),
                    protected: recent(window),
                }
            }
            Scorer::SnapKv {
                window_tokens,
                kernel,
                pooling,
            } => {
                if kernel % 2 == 0 {
                    return Err(PolicyError::EvenKernel { kernel });
                }
                let observed = self.observed(input)?;
                let prefix = tokens.saturating_sub(window_tokens as usize);
                let pooled = pool(&observed[..prefix], kernel as usize, pooling);
                PageScores {
                    scores: normalised(page_sums(pages, page_size, prefix, |t| pooled[t])),
                    protected: recent(Window::Tokens(window_tokens)),
                }
            }
            Scorer::Tova { window } => {
                let last = self.stats(input)?.last();
                PageScores {
                    scores: normalised(page_sums(pages, page_size, last.len(), |t| f64::from(last[t]))),
                    protected: recent(window),
                }
            }
            Scorer::Scissorhands { window } => {
                let counts = self.stats(input)?.persistence();
                PageScores {
                    scores: page_sums(pages, page_size, counts.len(), |t| f64::from(counts[t])),
                    protected: recent(window),
                }
            }
            Scorer::MaxMass => {
                let observed = self.observed(input)?;
                PageScores {
                    scores: normalised(page_sums(pages, page_size, tokens, |t| observed[t])),
                    protected: Vec::new(),
                }
            }
        })
    }

    fn stats<'a>(&self, input: &LaneInput<'a>) -> Result<&'a TokenStats, PolicyError> {
        let scorer = self.name();
        let stats = input.stats.ok_or(PolicyError::MissingStats { scorer })?;
        if stats.tokens() > input.tokens {
            return Err(PolicyError::StatsTooLong {
                scorer,
                stats: stats.tokens(),
                tokens: input.tokens,
            });
        }
        Ok(stats)
    }

    fn observed<'a>(&self, input: &LaneInput<'a>) -> Result<&'a [f64], PolicyError> {
        let scorer = self.name();
        let observed = input.observed.ok_or(PolicyError::MissingObserved { scorer })?;
        if observed.len() != input.tokens {
            return Err(PolicyError::ObservedLength {
                scorer,
                observed: observed.len(),
                tokens: input.tokens,
            });
        }
        Ok(observed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Pooling;

    /// Ten tokens in pages of two: five pages.
    fn lane<'a>(stats: Option<&'a TokenStats>, observed: Option<&'a [f64]>) -> LaneInput<'a> {
        LaneInput {
            tokens: 10,
            page_size: 2,
            stats,
            observed,
        }
    }

    fn assert_close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-9, "{got:?} vs {want:?}");
        }
    }

    /// Accumulated [0.875, 0.375, 0.5, 0.25], seen [2, 2, 1, 1], persistence
    /// [1, 0, 1, 1], last [0.125, 0.125, 0.5, 0.25].
    fn two_queries() -> TokenStats {
        let mut stats = TokenStats::new();
        stats.record(&[0.75, 0.25], None);
        stats.record(&[0.125, 0.125, 0.5, 0.25], None);
        stats
    }

    #[test]
    fn streaming_protects_sinks_and_ranks_by_recency() {
        let scored = Scorer::Streaming { sink_tokens: 3 }
            .score(&lane(None, None), 4)
            .unwrap();
        assert_eq!(scored.scores, vec![1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(scored.protected, vec![0, 1]);
        let empty = LaneInput {
            tokens: 0,
            ..lane(None, None)
        };
        assert_eq!(
            Scorer::Streaming { sink_tokens: 4 }.score(&empty, 4).unwrap(),
            PageScores::default()
        );
    }

    #[test]
    fn h2o_sums_accumulated_attention_per_page() {
        let stats = two_queries();
        let h2o = |window, normalize| Scorer::H2o { window, normalize };
        let scored = h2o(Window::Fraction(0.5), false)
            .score(&lane(Some(&stats), None), 4)
            .unwrap();
        assert_close(&scored.scores, &[0.625, 0.375, 0.0, 0.0, 0.0]);
        assert_eq!(scored.protected, vec![4, 3]);
        // Divided by `seen`: [0.4375, 0.1875, 0.5, 0.25], so page 1 now leads.
        let scored = h2o(Window::Tokens(3), true)
            .score(&lane(Some(&stats), None), 4)
            .unwrap();
        assert_close(&scored.scores, &[0.625 / 1.375, 0.75 / 1.375, 0.0, 0.0, 0.0]);
        assert_eq!(scored.protected, vec![4, 3]);
    }

    #[test]
    fn snapkv_pools_the_prefix_and_protects_the_observation_window() {
        // The last 4 tokens are the observation window: their values do not score.
        let observed = [0.0, 0.4, 0.0, 0.0, 0.0, 0.1, 9.0, 9.0, 9.0, 9.0];
        let snapkv = |pooling| Scorer::SnapKv {
            window_tokens: 4,
            kernel: 3,
            pooling,
        };
        let scored = snapkv(Pooling::Max).score(&lane(None, Some(&observed)), 4).unwrap();
        // Pooled prefix [0.4, 0.4, 0.4, 0, 0.1, 0.1].
        assert_close(&scored.scores, &[0.8 / 1.4, 0.4 / 1.4, 0.2 / 1.4, 0.0, 0.0]);
        assert_eq!(scored.protected, vec![4, 3]);
        // Pooled prefix [0.2, 0.4/3, 0.4/3, 0, 0.1/3, 0.05]: clamped at the window.
        let scored = snapkv(Pooling::Avg).score(&lane(None, Some(&observed)), 4).unwrap();
        let pages = [0.2 + 0.4 / 3.0, 0.4 / 3.0, 0.1 / 3.0 + 0.05];
        let sum: f64 = pages.iter().sum();
        assert_close(
            &scored.scores,
            &[pages[0] / sum, pages[1] / sum, pages[2] / sum, 0.0, 0.0],
        );
    }

    #[test]
    fn tova_scores_the_last_query() {
        let stats = two_queries();
        let scored = Scorer::defaults("tova")
            .unwrap()
            .score(&lane(Some(&stats), None), 4)
            .unwrap();
        assert_close(&scored.scores, &[0.25, 0.75, 0.0, 0.0, 0.0]);
        assert!(scored.protected.is_empty());
    }

    #[test]
    fn scissorhands_sums_raw_persistence_counts() {
        let stats = two_queries();
        let scorer = Scorer::Scissorhands {
            window: Window::Tokens(2),
        };
        let scored = scorer.score(&lane(Some(&stats), None), 4).unwrap();
        assert_eq!(scored.scores, vec![1.0, 2.0, 0.0, 0.0, 0.0]);
        assert_eq!(scored.protected, vec![4]);
    }

    #[test]
    fn max_mass_normalises_the_observed_mass() {
        let observed = [0.5, 0.5, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 1.0, 0.0];
        let scored = Scorer::MaxMass.score(&lane(None, Some(&observed)), 4).unwrap();
        assert_close(&scored.scores, &[0.25, 0.25, 0.0, 0.25, 0.25]);
        assert!(scored.protected.is_empty());
    }

    #[test]
    fn missing_or_mismatched_inputs_are_named() {
        let stats = two_queries();
        let observed = [0.1; 9];
        let h2o = Scorer::defaults("h2o").unwrap();
        let snapkv = Scorer::defaults("snapkv").unwrap();
        let err = h2o.score(&lane(None, Some(&observed)), 4).unwrap_err();
        assert_eq!(err, PolicyError::MissingStats { scorer: "h2o" });
        let err = snapkv.score(&lane(Some(&stats), None), 4).unwrap_err();
        assert_eq!(err, PolicyError::MissingObserved { scorer: "snapkv" });
        assert!(err.to_string().contains("observed"), "{err}");
        let err = Scorer::MaxMass.score(&lane(None, Some(&observed)), 4).unwrap_err();
        assert_eq!(
            err,
            PolicyError::ObservedLength {
                scorer: "max-mass",
                observed: 9,
                tokens: 10
            }
        );
        let short = LaneInput {
            tokens: 3,
            ..lane(Some(&stats), None)
        };
        assert!(matches!(
            h2o.score(&short, 4),
            Err(PolicyError::StatsTooLong { stats: 4, .. })
        ));
        let even = Scorer::SnapKv {
            window_tokens: 2,
            kernel: 4,
            pooling: Pooling::Max,
        };
        let observed = [0.1; 10];
        assert_eq!(
            even.score(&lane(None, Some(&observed)), 4),
            Err(PolicyError::EvenKernel { kernel: 4 })
        );
        let zero = LaneInput {
            page_size: 0,
            ..lane(None, None)
        };
        assert_eq!(Scorer::MaxMass.score(&zero, 4), Err(PolicyError::ZeroPageSize));
    }
}
