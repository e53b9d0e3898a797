//! Eviction policies at page granularity (docs/CONCEPTS.md §5): which pages of each
//! lane to keep within a budget. The caller applies its action (evict,
//! summarize, offload) to the rest.
//!
//! [`TokenStats`] gathers a lane's attention, a [`Scorer`] turns it into
//! [`PageScores`], and [`plan`] splits a budget over lanes with an
//! [`Allocator`] and picks each lane's pages.

mod alloc;
mod attention;
mod pages;
mod plan;
mod scorer;
mod scoring;
mod spec;
mod stats;

pub use alloc::Allocator;
pub use attention::{KeyRow, add_attention};
pub use pages::{LaneInput, PageScores};
pub use plan::{LanePlanInput, dropped_mass, plan};
pub use scorer::{Pooling, Scorer, Window};
pub use spec::{PolicyAction, PolicySpec, RegisteredPolicy, Trigger};
pub use stats::TokenStats;

/// Why a lane could not be scored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The scorer reads [`TokenStats`] and the lane had none.
    #[error("{scorer} needs the lane's attention statistics, and none were given")]
    MissingStats {
        /// The scorer's name ([`Scorer::name`]).
        scorer: &'static str,
    },
    /// The scorer reads [`LaneInput::observed`] and it was not given.
    #[error("{scorer} needs the observed queries' attention per token, and none was given")]
    MissingObserved {
        /// The scorer's name ([`Scorer::name`]).
        scorer: &'static str,
    },
    /// The statistics outlive a truncation of the lane.
    #[error(
        "{scorer}: attention statistics cover {stats} tokens but the lane has {tokens} (truncate them with the lane)"
    )]
    StatsTooLong {
        /// The scorer's name ([`Scorer::name`]).
        scorer: &'static str,
        /// Tokens the statistics cover ([`TokenStats::tokens`]).
        stats: usize,
        /// Tokens in the lane.
        tokens: usize,
    },
    /// The observed attention is not one value per token of the lane.
    #[error("{scorer}: observed attention covers {observed} tokens but the lane has {tokens}")]
    ObservedLength {
        /// The scorer's name ([`Scorer::name`]).
        scorer: &'static str,
        /// Values given in [`LaneInput::observed`].
        observed: usize,
        /// Tokens in the lane.
        tokens: usize,
    },
    /// SnapKV's pooling needs a centre token.
    #[error("the pooling kernel must be odd, got {kernel}")]
    EvenKernel {
        /// The kernel width asked for, in tokens.
        kernel: u32,
    },
    /// A lane of zero-token pages.
    #[error("the page size must be positive")]
    ZeroPageSize,
}
