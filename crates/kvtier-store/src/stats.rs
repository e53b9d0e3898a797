//! Counters and the snapshots reported by `GetStats`, `GetSequence` and
//! the metrics endpoint.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kvtier_core::{Layout, PageState, Reason, TenantId};

use crate::accounts::Usage;
use crate::histogram::Histogram;
use kvtier_tiers::{Tier, TierKind};

/// Event counters, updated without locks.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// `[from][to][reason]` with states indexed by `PageState::index`.
    transitions: [[[AtomicU64; Reason::COUNT]; PageState::COUNT]; PageState::COUNT],
    pub(crate) pages_written: AtomicU64,
    pub(crate) pages_shared: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) tokens_appended: AtomicU64,
    pub(crate) swapped_from_host: AtomicU64,
    pub(crate) swapped_from_nvme: AtomicU64,
    pub(crate) prefetch_issued: AtomicU64,
    pub(crate) prefetch_used: AtomicU64,
    pub(crate) prefetch_wasted: AtomicU64,
    /// NVMe copies that failed their CRC32C check or their read.
    pub(crate) integrity_failures: AtomicU64,
    /// Pages the host cache migrated to NVMe to make room.
    pub(crate) pages_migrated: AtomicU64,
    /// `[from][to]` by [`tier_index`]: bytes copied from one tier into another.
    bytes_moved: [[AtomicU64; 3]; 3],
    pub(crate) latency: Latency,
}

/// Where the store's time goes, for the metrics endpoint.
#[derive(Debug, Default)]
pub struct Latency {
    /// One swap-in batch's copy to the device, by the tier it came from.
    pub swap_in_from_host: Histogram,
    pub swap_in_from_nvme: Histogram,
    /// One batch of NVMe reads (CRC checks included) or writes.
    pub nvme_read: Histogram,
    pub nvme_write: Histogram,
    /// Rewriting the manifest as a checkpoint.
    pub checkpoint: Histogram,
    /// Selections that asked for a swap-in (a decode step's layer), whole
    /// call in the store, by the slowest tier a chosen page came from:
    /// every page already hot, some from host memory, some from NVMe.
    pub selection_hot: Histogram,
    pub selection_from_host: Histogram,
    pub selection_from_nvme: Histogram,
    /// ... and those answered at their deadline, before the swap-in finished.
    pub selection_past_deadline: Histogram,
}

fn tier_index(tier: TierKind) -> usize {
    match tier {
        TierKind::Device => 0,
        TierKind::Host => 1,
        TierKind::Nvme => 2,
    }
}

impl Counters {
    pub(crate) fn transition(&self, from: PageState, to: PageState, reason: Reason, pages: u64) {
        self.transitions[from.index()][to.index()][reason.index()].fetch_add(pages, Relaxed);
        tracing::debug!(%from, %to, reason = reason.name(), pages, "page transition");
    }

    /// Counts a transition of one page, if its state changed.
    pub(crate) fn counted(&self, from: PageState, to: PageState, reason: Reason) {
        if from != to {
            self.transition(from, to, reason, 1);
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// `bytes` copied from tier `from` into tier `to`.
    pub(crate) fn moved(&self, from: TierKind, to: TierKind, bytes: u64) {
        self.bytes_moved[tier_index(from)][tier_index(to)].fetch_add(bytes, Relaxed);
    }

    pub(crate) fn transitions(&self) -> Vec<TransitionCount> {
        let mut out = Vec::new();
        for from in PageState::ALL {
            for to in PageState::ALL {
                for reason in Reason::ALL {
                    let count = self.transitions[from.index()][to.index()][reason.index()].load(Relaxed);
                    if count > 0 {
                        out.push(TransitionCount {
                            from,
                            to,
                            reason,
                            count,
                        });
                    }
                }
            }
        }
        out
    }
}

/// Pages per state, cold split by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateCounts(pub [u64; PageState::COUNT]);

impl StateCounts {
    pub fn get(&self, state: PageState) -> u64 {
        self.0[state.index()]
    }

    pub(crate) fn add(&mut self, state: PageState) {
        self.0[state.index()] += 1;
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransitionCount {
    pub from: PageState,
    pub to: PageState,
    pub reason: Reason,
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierStats {
    pub kind: TierKind,
    pub backend: &'static str,
    pub emulated: bool,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub slots: u64,
}

impl TierStats {
    pub(crate) fn of(tier: &dyn Tier) -> Self {
        Self {
            kind: tier.kind(),
            backend: tier.backend(),
            emulated: tier.emulated(),
            capacity_bytes: tier.capacity_bytes(),
            used_bytes: tier.used_bytes(),
            slots: tier.slots(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Whose view this is: one tenant's, or (`None`) the whole server's.
    pub tenant: Option<TenantId>,
    /// Metadata charged, and the limit it is charged against (the server's
    /// budget, or the tenant's quota; `None`: no limit).
    pub metadata_bytes: u64,
    pub metadata_limit_bytes: Option<u64>,
    /// In a tenant's view: what it holds and may hold.
    pub usage: Option<Usage>,
    pub tiers: Vec<TierStats>,
    /// Logical pages of all live sequences by state.
    pub pages: StateCounts,
    pub sequences: u64,
    /// Distinct physical pages (shared pages count once).
    pub physical_pages: u64,
    pub transitions: Vec<TransitionCount>,
    pub pages_written: u64,
    /// Page writes that found the page already stored under its prefix hash.
    pub pages_shared: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub tokens_appended: u64,
    /// Selected pages made hot, by where they came from.
    pub swapped_from_host: u64,
    pub swapped_from_nvme: u64,
    /// Pages a prefetch made hot; of those, used by a later selection while
    /// still hot, and demoted or freed first.
    pub prefetch_issued: u64,
    pub prefetch_used: u64,
    pub prefetch_wasted: u64,
    pub leases: u64,
    pub integrity_failures: u64,
    pub pages_migrated: u64,
    /// Bytes copied between tiers, as (from, to, bytes), pairs with none
    /// left out.
    pub bytes_moved: Vec<(TierKind, TierKind, u64)>,
}

impl StatsSnapshot {
    pub(crate) fn counters(&mut self, c: &Counters) {
        self.transitions = c.transitions();
        self.pages_written = c.pages_written.load(Relaxed);
        self.pages_shared = c.pages_shared.load(Relaxed);
        self.bytes_written = c.bytes_written.load(Relaxed);
        self.bytes_read = c.bytes_read.load(Relaxed);
        self.tokens_appended = c.tokens_appended.load(Relaxed);
        self.swapped_from_host = c.swapped_from_host.load(Relaxed);
        self.swapped_from_nvme = c.swapped_from_nvme.load(Relaxed);
        self.prefetch_issued = c.prefetch_issued.load(Relaxed);
        self.prefetch_used = c.prefetch_used.load(Relaxed);
        self.prefetch_wasted = c.prefetch_wasted.load(Relaxed);
        self.integrity_failures = c.integrity_failures.load(Relaxed);
        self.pages_migrated = c.pages_migrated.load(Relaxed);
        self.bytes_moved = TierKind::ALL
            .iter()
            .flat_map(|&from| TierKind::ALL.iter().map(move |&to| (from, to)))
            .map(|(from, to)| (from, to, c.bytes_moved[tier_index(from)][tier_index(to)].load(Relaxed)))
            .filter(|&(_, _, bytes)| bytes > 0)
            .collect();
    }
}

/// Bytes one sequence holds per tier, each copy counted (a hot page also has
/// a backing copy). A page shared with other sequences is counted in full
/// here (this is the sequence's view), and once in the tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierBytes {
    pub device: u64,
    pub host: u64,
    pub nvme: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceInfo {
    pub layout: Layout,
    /// Positions present in every lane.
    pub tokens: u64,
    /// Positions present in the longest lane (lanes differ while writers of
    /// different layers or head ranges are mid-step).
    pub max_tokens: u64,
    pub pages: StateCounts,
    pub bytes: TierBytes,
    /// Pages whose physical page other sequences also use.
    pub shared_pages: u64,
    pub digest_bytes: u64,
    pub prefix_hashes: u64,
    /// Gone pages by the reason they went (lost on restart, integrity, ...).
    pub gone_by_reason: Vec<(Reason, u64)>,
}
