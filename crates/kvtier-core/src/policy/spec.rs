//! What a client asks of a policy: which layers, which scorer and budget
//! allocator, how many tokens to keep, what happens to the rest, and when
//! it runs.

use std::collections::BTreeMap;

use super::{Allocator, Scorer};
use crate::{Action, ColdTier, PageState};

/// What happens to the pages a policy does not keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyAction {
    /// → gone.
    Evict,
    /// → summary of `rows` rows.
    Summarize {
        /// Summary rows per page (clamped to `1..=` the page's valid rows).
        rows: u32,
    },
    /// hot → cold: nothing is lost.
    Offload(ColdTier),
}

impl PolicyAction {
    /// The state machine's action.
    pub fn action(self) -> Action {
        match self {
            Self::Evict => Action::Evict,
            Self::Summarize { .. } => Action::Summarize,
            Self::Offload(tier) => Action::Offload(tier),
        }
    }

    /// Pages the budget is about: those holding original bytes (for offload,
    /// the hot ones). Summaries and gone pages are neither kept nor acted on.
    pub fn candidate(self, state: PageState) -> bool {
        match self {
            Self::Evict | Self::Summarize { .. } => matches!(state, PageState::Hot | PageState::Cold(_)),
            Self::Offload(_) => state == PageState::Hot,
        }
    }
}

/// When a policy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Once, when applied; never registered.
    Now,
    /// At each layer's first append (the end of prefill).
    AfterPrefill,
    /// Whenever a layer's length crosses a multiple of this many tokens.
    EveryTokens(u32),
}

/// A policy and its budget, as registered or applied.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    /// First model layer the policy covers, 0-based.
    pub layer_start: u32,
    /// Model layers it covers from `layer_start`.
    pub layer_count: u32,
    /// How each lane's pages are scored.
    pub scorer: Scorer,
    /// How the total budget is split over the lanes.
    pub allocator: Allocator,
    /// Tokens kept per (layer, KV head) on average, rounded up to pages.
    pub budget_tokens: u32,
    /// What happens to the pages not kept.
    pub action: PolicyAction,
}

/// A policy that runs by itself as a sequence grows, and how far each
/// layer had grown when it last ran.
#[derive(Debug, Clone, PartialEq)]
pub struct RegisteredPolicy {
    /// The policy and its budget.
    pub spec: PolicySpec,
    /// When it runs.
    pub trigger: Trigger,
    ran_at: BTreeMap<u32, u64>,
}

impl RegisteredPolicy {
    /// A registered policy that has not yet run on any layer.
    pub fn new(spec: PolicySpec, trigger: Trigger) -> Self {
        Self {
            spec,
            trigger,
            ran_at: BTreeMap::new(),
        }
    }

    /// Whether an append that left `layer` at `tokens` tokens runs the
    /// policy for that layer now; if so, the run is recorded.
    pub fn due(&mut self, layer: u32, tokens: u64) -> bool {
        let spec = &self.spec;
        if !(spec.layer_start..spec.layer_start + spec.layer_count).contains(&layer) {
            return false;
        }
        let due = match (self.trigger, self.ran_at.get(&layer)) {
            (Trigger::AfterPrefill, ran) => ran.is_none(),
            (Trigger::EveryTokens(n), ran) => {
                let n = u64::from(n.max(1));
                ran.is_none_or(|&at| tokens / n > at / n) && tokens >= n
            }
            (Trigger::Now, _) => false,
        };
        if due {
            self.ran_at.insert(layer, tokens);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registered(trigger: Trigger) -> RegisteredPolicy {
        RegisteredPolicy::new(
            PolicySpec {
                layer_start: 1,
                layer_count: 2,
                scorer: Scorer::Streaming { sink_tokens: 4 },
                allocator: Allocator::Uniform,
                budget_tokens: 8,
                action: PolicyAction::Evict,
            },
            trigger,
        )
    }

    #[test]
    fn after_prefill_runs_once_per_layer_of_its_range() {
        let mut p = registered(Trigger::AfterPrefill);
        assert!(!p.due(0, 100), "layer outside the range");
        assert!(p.due(1, 100));
        assert!(!p.due(1, 101));
        assert!(p.due(2, 100));
    }

    #[test]
    fn every_tokens_runs_when_a_multiple_is_crossed() {
        let mut p = registered(Trigger::EveryTokens(16));
        assert!(!p.due(1, 15));
        assert!(p.due(1, 16));
        assert!(!p.due(1, 31));
        assert!(p.due(1, 33));
    }
}
