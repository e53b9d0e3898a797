//! Counters and the snapshots reported by `GetStats`, `GetSequence` and
//! the metrics endpoint.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kvtier_core::{Layout, PageState, Reason, TenantId};

use crate::accounts::Usage;
use crate::histogram::Histogram;
use kvtier_tiers::{Tier, TierKind};

/// Why a prefetch was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrefetchKind {
    /// A client asked: the pages ranked next after a selection's, or those
    /// a speculative query would select.
    Asked,
    /// The loop policy's layer-ahead prefetch: what the next layer chose
    /// last time.
    LayerAhead,
}

impl PrefetchKind {
    pub(crate) const COUNT: usize = 2;

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// What became of prefetched pages, by kind.
#[derive(Debug, Default)]
pub(crate) struct PrefetchCounters {
    /// Pages a prefetch made hot while still wanted (not yet found cold by
    /// a selection: those are late).
    pub(crate) issued: AtomicU64,
    /// ... that a selection then chose while still hot.
    pub(crate) used: AtomicU64,
    /// Pages a selection chose while their prefetch was still queued or
    /// copying: the selection missed (or waited for a demand swap-in).
    pub(crate) late: AtomicU64,
    /// Pages a prefetch made hot that left the device, or were freed,
    /// before any selection chose them.
    pub(crate) wasted: AtomicU64,
}

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
    /// What became of prefetches, by [`PrefetchKind::index`].
    pub(crate) prefetch: [PrefetchCounters; PrefetchKind::COUNT],
    /// Pages selections chose that were hot, in the device policy's
    /// resident subset or its LRU-ordered stream region (every hot page
    /// under `lru`); and those that were not.
    pub(crate) device_hits_resident: AtomicU64,
    pub(crate) device_hits_stream: AtomicU64,
    pub(crate) device_misses: AtomicU64,
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
    /// The same for pages read from NVMe (the reads included).
    pub swap_in_from_nvme: Histogram,
    /// One batch of NVMe reads (CRC checks included) or writes.
    pub nvme_read: Histogram,
    /// One batch of NVMe writes (page copies, not the manifest).
    pub nvme_write: Histogram,
    /// Rewriting the manifest as a checkpoint.
    pub checkpoint: Histogram,
    /// Selections that asked for a swap-in (a decode step's layer), whole
    /// call in the store, by the slowest tier a chosen page came from:
    /// every page already hot, some from host memory, some from NVMe.
    pub selection_hot: Histogram,
    /// Some chosen page came from host memory, none from NVMe.
    pub selection_from_host: Histogram,
    /// Some chosen page came from NVMe.
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
    /// Pages in `state` (cold on host and cold on NVMe are counted apart).
    pub fn get(&self, state: PageState) -> u64 {
        self.0[state.index()]
    }

    pub(crate) fn add(&mut self, state: PageState) {
        self.0[state.index()] += 1;
    }

    /// Pages in every state together.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

/// How many page moves of one kind the store made since it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransitionCount {
    /// The state the pages left.
    pub from: PageState,
    /// The state they entered.
    pub to: PageState,
    /// Why they moved.
    pub reason: Reason,
    /// Pages moved (never 0 in a snapshot).
    pub count: u64,
}

/// One tier's size and use, as it reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierStats {
    /// Device, host or NVMe.
    pub kind: TierKind,
    /// The implementation's name (`host-arena`, `emulated`, ...).
    pub backend: &'static str,
    /// The tier stands in for absent hardware (a device tier in host memory).
    pub emulated: bool,
    /// The tier's size in bytes.
    pub capacity_bytes: u64,
    /// Bytes reserved by live slots, alignment padding included.
    pub used_bytes: u64,
    /// Live slots (page copies and summaries held in the tier).
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

/// Where the page index's sketches are: the whole store's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexMemory {
    /// Pages of every lane.
    pub pages: u64,
    /// Pages whose sketches are spilled.
    pub spilled_pages: u64,
    /// Bytes of sketch rows held in memory.
    pub sketch_bytes: u64,
}

/// The statistics `GetStats` reports: the whole server's, or one tenant's
/// (its sequences, pages and usage only: tiers and counters are left empty).
/// Counters count since the store was opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Whose view this is: one tenant's, or (`None`) the whole server's.
    pub tenant: Option<TenantId>,
    /// Metadata charged, and the limit it is charged against (the server's
    /// budget, or the tenant's quota; `None`: no limit).
    pub metadata_bytes: u64,
    /// The limit `metadata_bytes` is charged against, in bytes.
    pub metadata_limit_bytes: Option<u64>,
    /// In a tenant's view: what it holds and may hold.
    pub usage: Option<Usage>,
    /// The configured tiers: device, host memory, and NVMe if there is one.
    pub tiers: Vec<TierStats>,
    /// Logical pages of all live sequences by state.
    pub pages: StateCounts,
    /// Live sequences (not dropped).
    pub sequences: u64,
    /// Distinct physical pages (shared pages count once).
    pub physical_pages: u64,
    /// Page moves by (from, to, reason); kinds never made are left out.
    pub transitions: Vec<TransitionCount>,
    /// New physical pages stored by puts and appends (shared ones not counted).
    pub pages_written: u64,
    /// Page writes that found the page already stored under its prefix hash.
    pub pages_shared: u64,
    /// K and V bytes received by puts and appends.
    pub bytes_written: u64,
    /// Page bytes selections and fetches copied into their callers' buffers.
    pub bytes_read: u64,
    /// Tokens appended, counted once per lane written (tokens × KV heads).
    pub tokens_appended: u64,
    /// Selected pages made hot, by where they came from.
    pub swapped_from_host: u64,
    /// Selected pages made hot from NVMe.
    pub swapped_from_nvme: u64,
    /// What became of the prefetches clients asked for (pages ranked
    /// next, speculative queries).
    pub prefetch: PrefetchCounts,
    /// What became of the loop device policy's layer-ahead prefetches.
    pub layer_ahead: PrefetchCounts,
    /// Pages selections chose (those that swap in or read data) that were
    /// hot, by the device policy's region, and those that were not.
    pub device_hits: DeviceHits,
    /// Leases held now: selections' pages pinned until released or expired.
    pub leases: u64,
    /// Where the page index's sketches are: in memory, or spilled to NVMe.
    pub index: IndexMemory,
    /// NVMe copies that failed their CRC32C check or their read.
    pub integrity_failures: u64,
    /// Pages the host cache migrated to NVMe to make room.
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
        self.prefetch = PrefetchCounts::of(&c.prefetch[PrefetchKind::Asked.index()]);
        self.layer_ahead = PrefetchCounts::of(&c.prefetch[PrefetchKind::LayerAhead.index()]);
        self.device_hits = DeviceHits {
            resident: c.device_hits_resident.load(Relaxed),
            stream: c.device_hits_stream.load(Relaxed),
            misses: c.device_misses.load(Relaxed),
        };
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

/// What became of the pages prefetches brought up, since the store opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchCounts {
    /// Pages a prefetch made hot while still wanted (not already counted
    /// late).
    pub issued: u64,
    /// ... that a later selection chose while still hot.
    pub used: u64,
    /// Pages a selection chose while their prefetch was still queued or
    /// copying (the selection found them cold).
    pub late: u64,
    /// Pages a prefetch made hot that were demoted or freed before any
    /// selection chose them.
    pub wasted: u64,
}

impl PrefetchCounts {
    fn of(c: &PrefetchCounters) -> Self {
        Self {
            issued: c.issued.load(Relaxed),
            used: c.used.load(Relaxed),
            late: c.late.load(Relaxed),
            wasted: c.wasted.load(Relaxed),
        }
    }
}

/// Chosen pages the device held, by the device policy's region, and those
/// it did not.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceHits {
    /// Hot in the loop policy's resident subset.
    pub resident: u64,
    /// Hot in the LRU-ordered region: the loop policy's stream region, or
    /// the whole device under `lru`.
    pub stream: u64,
    /// Not hot when chosen.
    pub misses: u64,
}

/// Bytes one sequence holds per tier, each copy counted (a hot page also has
/// a backing copy). A page shared with other sequences is counted in full
/// here (this is the sequence's view), and once in the tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierBytes {
    /// Bytes of hot copies in the device tier.
    pub device: u64,
    /// Bytes in host memory: page copies and summaries.
    pub host: u64,
    /// Bytes of page copies on NVMe.
    pub nvme: u64,
}

/// What `GetSequence` reports about one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceInfo {
    /// The KV cache shape it was created with.
    pub layout: Layout,
    /// Positions present in every lane.
    pub tokens: u64,
    /// Positions present in the longest lane (lanes differ while writers of
    /// different layers or head ranges are mid-step).
    pub max_tokens: u64,
    /// Logical pages of every lane by state.
    pub pages: StateCounts,
    /// Bytes it holds per tier.
    pub bytes: TierBytes,
    /// Pages whose physical page other sequences also use.
    pub shared_pages: u64,
    /// Bytes of its pages' digests (min and max keys), resident in host memory.
    pub digest_bytes: u64,
    /// Entries in its prefix hash chain (one per full page, as created).
    pub prefix_hashes: u64,
    /// Gone pages by the reason they went (lost on restart, integrity, ...).
    pub gone_by_reason: Vec<(Reason, u64)>,
}
