//! The four page states and the only transitions allowed between them
//! (docs/CONCEPTS.md §2). The state says where the *original* K/V bytes are.

use std::fmt;

/// Where a cold page's original bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ColdTier {
    /// Host (CPU) memory.
    Host,
    /// Local NVMe storage.
    Nvme,
}

/// The state of a page: where its original K/V bytes are, if anywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PageState {
    /// Original K/V in the device tier; usable at once.
    Hot,
    /// Original K/V one tier down; usable after a swap-in.
    Cold(ColdTier),
    /// Replaced by a summary; only approximately recoverable.
    Summary,
    /// Deleted; no copy anywhere.
    Gone,
}

/// What a caller (or a policy, or capacity pressure) asks of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// hot → cold(tier)
    Offload(ColdTier),
    /// cold → hot
    SwapIn,
    /// cold(a) → cold(b), a ≠ b
    Migrate(ColdTier),
    /// hot | cold → summary
    Summarize,
    /// hot | cold | summary → gone
    Evict,
}

/// Why a transition happened. Every transition carries one, and counters are
/// kept per (from, to, reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A client asked for it (`SetPageState`).
    Explicit,
    /// A tier was full and the store made room (never to `gone`).
    CapacityPressure,
    /// A selection needed the page now.
    Demand,
    /// A prediction promoted it ahead of need.
    Prefetch,
    /// An eviction or summarisation policy decided it.
    Policy,
    /// Stored bytes failed their checksum; never served.
    Integrity,
    /// Held only in memory when the server stopped.
    LostOnRestart,
}

/// A transition the state machine forbids. Refused; nothing changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IllegalTransition {
    /// The state the page was in (and still is).
    pub from: PageState,
    /// The action that was refused.
    pub action: Action,
}

impl Action {
    /// Every action, each cold tier apart.
    pub const ALL: [Action; 7] = [
        Action::Offload(ColdTier::Host),
        Action::Offload(ColdTier::Nvme),
        Action::SwapIn,
        Action::Migrate(ColdTier::Host),
        Action::Migrate(ColdTier::Nvme),
        Action::Summarize,
        Action::Evict,
    ];
}

impl PageState {
    /// Number of distinct states when cold is split by tier; see [`Self::index`].
    pub const COUNT: usize = 5;
    /// Every state, in [`Self::index`] order.
    pub const ALL: [PageState; Self::COUNT] = [
        PageState::Hot,
        PageState::Cold(ColdTier::Host),
        PageState::Cold(ColdTier::Nvme),
        PageState::Summary,
        PageState::Gone,
    ];

    /// Dense index in `0..COUNT`, for counter arrays.
    pub const fn index(self) -> usize {
        match self {
            PageState::Hot => 0,
            PageState::Cold(ColdTier::Host) => 1,
            PageState::Cold(ColdTier::Nvme) => 2,
            PageState::Summary => 3,
            PageState::Gone => 4,
        }
    }

    /// The state `action` leads to from `self`, or why it may not.
    pub fn apply(self, action: Action) -> Result<PageState, IllegalTransition> {
        use PageState::*;
        let next = match (self, action) {
            (Hot, Action::Offload(tier)) => Some(Cold(tier)),
            (Cold(_), Action::SwapIn) => Some(Hot),
            (Cold(from), Action::Migrate(to)) if from != to => Some(Cold(to)),
            (Hot | Cold(_), Action::Summarize) => Some(Summary),
            (Hot | Cold(_) | Summary, Action::Evict) => Some(Gone),
            _ => None,
        };
        next.ok_or(IllegalTransition { from: self, action })
    }

    /// True while the original bytes still exist somewhere.
    pub fn has_original(self) -> bool {
        matches!(self, PageState::Hot | PageState::Cold(_))
    }
}

impl Reason {
    /// Number of reasons; see [`Self::index`].
    pub const COUNT: usize = 7;
    /// Every reason, in [`Self::index`] order.
    pub const ALL: [Reason; Self::COUNT] = [
        Reason::Explicit,
        Reason::CapacityPressure,
        Reason::Demand,
        Reason::Prefetch,
        Reason::Policy,
        Reason::Integrity,
        Reason::LostOnRestart,
    ];

    /// Dense index in `0..COUNT`, for counter arrays.
    pub const fn index(self) -> usize {
        match self {
            Reason::Explicit => 0,
            Reason::CapacityPressure => 1,
            Reason::Demand => 2,
            Reason::Prefetch => 3,
            Reason::Policy => 4,
            Reason::Integrity => 5,
            Reason::LostOnRestart => 6,
        }
    }

    /// Short snake_case name, as used in counter labels (`capacity`, `lost_on_restart`).
    pub const fn name(self) -> &'static str {
        match self {
            Reason::Explicit => "explicit",
            Reason::CapacityPressure => "capacity",
            Reason::Demand => "demand",
            Reason::Prefetch => "prefetch",
            Reason::Policy => "policy",
            Reason::Integrity => "integrity",
            Reason::LostOnRestart => "lost_on_restart",
        }
    }
}

impl ColdTier {
    /// Lower-case name (`host`, `nvme`), as printed in states and actions.
    pub const fn name(self) -> &'static str {
        match self {
            ColdTier::Host => "host",
            ColdTier::Nvme => "nvme",
        }
    }
}

impl fmt::Display for PageState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageState::Hot => f.write_str("hot"),
            PageState::Cold(tier) => write!(f, "cold({})", tier.name()),
            PageState::Summary => f.write_str("summary"),
            PageState::Gone => f.write_str("gone"),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Offload(tier) => write!(f, "offload to {}", tier.name()),
            Action::SwapIn => f.write_str("swap-in"),
            Action::Migrate(tier) => write!(f, "migrate to {}", tier.name()),
            Action::Summarize => f.write_str("summarize"),
            Action::Evict => f.write_str("evict"),
        }
    }
}

impl fmt::Display for IllegalTransition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let needs = match self.action {
            Action::Offload(_) => "a hot page",
            Action::SwapIn => "a cold page",
            Action::Migrate(_) => "a cold page in the other cold tier",
            Action::Summarize => "a hot or cold page",
            Action::Evict => "a page that is not already gone",
        };
        write!(f, "cannot {} a {} page; it needs {needs}", self.action, self.from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// docs/CONCEPTS.md §2 written out as the list of allowed (from, to) edges,
    /// independently of `apply`.
    fn allowed(from: PageState, to: PageState) -> bool {
        use ColdTier::*;
        use PageState::*;
        const EDGES: &[(PageState, PageState)] = &[
            (Hot, Cold(Host)),
            (Hot, Cold(Nvme)),
            (Cold(Host), Hot),
            (Cold(Nvme), Hot),
            (Cold(Host), Cold(Nvme)),
            (Cold(Nvme), Cold(Host)),
            (Hot, Summary),
            (Cold(Host), Summary),
            (Cold(Nvme), Summary),
            (Hot, Gone),
            (Cold(Host), Gone),
            (Cold(Nvme), Gone),
            (Summary, Gone),
        ];
        EDGES.contains(&(from, to))
    }

    #[test]
    fn every_allowed_edge_is_reachable_by_exactly_one_action() {
        for from in PageState::ALL {
            for to in PageState::ALL {
                let ways = Action::ALL.iter().filter(|a| from.apply(**a) == Ok(to)).count();
                assert_eq!(ways, usize::from(allowed(from, to)), "{from} -> {to}");
            }
        }
    }

    #[test]
    fn messages_say_what_was_needed() {
        let e = PageState::Gone.apply(Action::SwapIn).unwrap_err();
        assert_eq!(e.to_string(), "cannot swap-in a gone page; it needs a cold page");
    }

    proptest! {
        /// Any run of actions: each step either follows an allowed edge or is
        /// refused and leaves the state as it was; nothing leaves gone, nothing
        /// returns from summary to hot or cold.
        #[test]
        fn runs_of_actions_follow_the_machine(
            start in 0..PageState::COUNT,
            actions in proptest::collection::vec(0..Action::ALL.len(), 0..64),
        ) {
            let mut state = PageState::ALL[start];
            for a in actions {
                let before = state;
                match before.apply(Action::ALL[a]) {
                    Ok(next) => {
                        prop_assert!(allowed(before, next));
                        prop_assert!(before != PageState::Gone);
                        prop_assert!(!(before == PageState::Summary && next.has_original()));
                        state = next;
                    }
                    Err(e) => {
                        prop_assert_eq!(e.from, before);
                        prop_assert_eq!(state, before);
                    }
                }
            }
        }
    }
}
