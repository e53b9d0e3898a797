//! The store composes the engine's components and runs the operations of
//! the API over them, one file per kind of operation:
//!
//! | component | file | holds |
//! |---|---|---|
//! | sequence catalog | `catalog/` | sequences, lanes, the physical page table |
//! | pages | `page/` | physical pages; their placement, whose transitions are its only writers |
//! | host cache | `host/` | host tier, its LRU, migration to NVMe |
//! | device cache (hot set) | `device/` | device tier, its LRU, swap-in, workers |
//! | read path | `reader/` | bytes wherever they are, CRC, promotion |
//! | durability | `durability/` | manifest, NVMe copies, page ids, recovery |
//! | policies | `policy/` | candidates, budgets, attention |
//!
//! | operation | file |
//! |---|---|
//! | create, drop, describe sequences | `store/sequences.rs` |
//! | PutPages, AppendTokens | `store/write.rs` |
//! | FetchPages | `store/fetch.rs` |
//! | a move's export and import (drains) | `store/moves.rs` |
//! | SelectPages, Prefetch, leases | `store/select.rs` |
//! | SetPageState | `store/transition.rs` |
//! | ApplyPolicy, ReportAttention | `store/policy.rs` |
//! | SetAccessTrace, and each operation's trace record | `store/trace.rs` |
//! | where sketches live (memory, or NVMe as key rows) | `store/sketches.rs` |
//!
//! # Lock order
//!
//! Every lock is a `kvtier_sync` lock made with its rank, and
//! `kvtier_sync::Rank` is the one order, in one table: a thread takes a
//! lock only above every lock it holds, and nothing under a leaf (the
//! LRUs, the accounts, the leases, the workers' queue, the access trace).
//! Debug builds, and so every test, panic on a lock taken out of order.
//!
//! A page lock is never held across I/O (the in-place fill of an append
//! writes memory only). Calls that hold a sequence's lock across NVMe I/O:
//! writes (migrating to make room, persisting), selections and fetches
//! (reading NVMe-only pages, swap-in, spilled sketches), policies (reading
//! pages for the attention of given queries), evictions and summaries
//! (reading spilled pages' keys). They hold it because the lane must not
//! change under them: a write owns the lane's end, and a selection's pages
//! must be the ones its bounds ranked. A sequence's I/O therefore delays
//! only that sequence; the background migration, demotion and checkpoint
//! never take a sequence's write lock (a checkpoint takes each sequence's
//! read lock for one lane at a time), and the background sketch sweep
//! takes it only when it is free (`try_write`), leaving its change to the
//! sequence's next writer otherwise.

mod attend;
mod fetch;
mod moves;
mod policy;
mod select;
mod sequences;
mod sketches;
mod trace;
mod transition;
mod write;

use std::path::PathBuf;
use std::sync::Arc;

use kvtier_core::{SequenceKey, TenantId};
use kvtier_tiers::{ArenaTier, NvmeConfig, NvmeTier, Tier, TierKind};

pub use attend::{HeadAttention, attend_room};
pub use fetch::{FetchCursor, FetchPages, FetchedChunk, FetchedPage, PageList};
pub use moves::{ExportedPage, LaneAt, MovedContent, SequenceExport};
pub use policy::{ApplyPolicy, AttentionWeights, ReportAttention};
pub use select::{
    HeadSelection, Miss, SelectPages, SelectTiming, SelectedPage, Selection, data_bound, index_scan_bytes,
};
pub use sequences::Created;
pub use transition::{PageSelection, SetPageState, TransitionOutcome};
pub use write::{AppendOutcome, AppendTiming, AppendTokens, PutOutcome, PutPages};

use crate::access_trace::AccessTrace;
use crate::accounts::{Accounts, Limits};
use crate::catalog::Catalog;
use crate::device::{DevicePolicy, HotSet};
use crate::durability::{Durability, Durable, Image, Manifest};
use crate::host::{HostCache, HostPolicy};
use crate::lease::Leases;
use crate::page::StorePage;
use crate::reader::Reader;
use crate::stats::{Counters, Latency, StateCounts, StatsSnapshot, TierStats};
use crate::{StoreError, StoreResult};

/// Sizes and placement choices.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    /// Device tier capacity. Emulated in host memory when no GPU is present.
    pub device_bytes: u64,
    /// Host tier capacity in bytes: cold pages (and, inclusive, hot pages'
    /// host copies) and summaries.
    pub host_bytes: u64,
    /// New pages also get a device copy (demoting LRU hot pages for room);
    /// off, they start cold and become hot only on demand.
    pub cache_writes_on_device: bool,
    /// Whether a hot page keeps its host copy (inclusive: demotion is free)
    /// or gives it up (exclusive: host memory holds only cold pages, and
    /// demotion copies the page back down).
    pub device_cache: DeviceCache,
    /// The NVMe tier; `None` keeps everything in memory.
    pub nvme: Option<NvmeConfig>,
    /// Past this share of host capacity a round opens: the calls that
    /// follow choose least recently used host pages (in the host policy's
    /// order), which migrate to NVMe in the background ...
    pub host_high_watermark: f64,
    /// ... until host use is down to this share.
    pub host_low_watermark: f64,
    /// Reading an NVMe-only page gives it a host copy again.
    pub promote_on_read: bool,
    /// The index's sketches of NVMe-cold pages leave host memory (read
    /// back from the pages for two-stage's candidates): less memory, more
    /// NVMe reads per ranking. Off (the default: two-stage's steps cost
    /// about twice as much with it, bench/results/selection.md): every
    /// sketch stays in memory.
    pub spill_sketches: bool,
    /// What a persisting write waits for.
    pub durability: Durability,
    /// The manifest; default: the NVMe file's path with extension
    /// `.manifest`. Needed to recover pages after a restart.
    pub manifest_path: Option<PathBuf>,
    /// Rewrite the manifest as a checkpoint once it is past this size (and
    /// has doubled since the last checkpoint).
    pub checkpoint_bytes: u64,
    /// The metadata budget and per-tenant quotas.
    pub limits: Limits,
    /// Which hot page the device demotes when it needs room.
    pub device_policy: DevicePolicy,
    /// Which host pages migrate to NVMe first when host memory needs room.
    pub host_policy: HostPolicy,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            device_bytes: 256 << 20,
            host_bytes: 1 << 30,
            cache_writes_on_device: true,
            device_cache: DeviceCache::Inclusive,
            nvme: None,
            host_high_watermark: 0.9,
            host_low_watermark: 0.8,
            promote_on_read: true,
            spill_sketches: false,
            durability: Durability::Relaxed,
            manifest_path: None,
            checkpoint_bytes: 64 << 20,
            limits: Limits::default(),
            device_policy: DevicePolicy::default(),
            host_policy: HostPolicy::default(),
        }
    }
}

/// How the device tier caches host memory (see [`StoreConfig::device_cache`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceCache {
    /// A hot page keeps its host copy: demotion frees the device slot only.
    Inclusive,
    /// A hot page gives its host copy up: host memory holds only cold pages,
    /// and demotion copies the page back down.
    Exclusive,
}

/// The tiered KV-cache store: sequences and their pages over the device,
/// host and NVMe tiers, and every operation of the API on them.
#[derive(Debug)]
pub struct Store {
    config: StoreConfig,
    catalog: Catalog,
    host: HostCache,
    device: HotSet,
    durable: Durable,
    leases: Leases,
    /// The metadata budget, tenants' quotas and what each tenant holds.
    accounts: Arc<Accounts>,
    counters: Arc<Counters>,
    /// Page accesses, recorded when asked (off by default).
    trace: AccessTrace,
    /// Background ticks so far, to sweep sketches every so many.
    sketch_sweep_ticks: std::sync::atomic::AtomicU32,
    /// A sketch sweep is running: one at a time.
    sketch_sweeping: std::sync::atomic::AtomicBool,
}

/// A locked manifest, its path and what it says to recover.
type Recovering = (PathBuf, Manifest, Image);

impl Store {
    /// A store over host memory, with the device tier emulated in host
    /// memory and, if configured, an NVMe tier.
    pub fn new(config: StoreConfig) -> StoreResult<Arc<Self>> {
        Self::new_with(config, None, None)
    }

    /// Like [`Self::new`], with the given device and host tiers where they
    /// are `Some` (a GPU's), and tiers sized by the config where not.
    pub fn new_with(
        config: StoreConfig,
        device: Option<Arc<dyn Tier>>,
        host: Option<Arc<dyn Tier>>,
    ) -> StoreResult<Arc<Self>> {
        let device = match device {
            Some(d) => d,
            None => {
                // Debug: whoever chose no GPU tier (`kvtier serve`) says why.
                tracing::debug!(
                    device_bytes = config.device_bytes,
                    "the device tier is emulated in host memory"
                );
                Arc::new(ArenaTier::emulated_device(config.device_bytes)?)
            }
        };
        let host = match host {
            Some(h) => h,
            None => Arc::new(ArenaTier::host(config.host_bytes)?),
        };
        // The manifest's lock first: a second server over the same data
        // directory is refused by the lock that names its holder, before it
        // touches anything.
        let recovering = match &config.nvme {
            Some(c) => Some(open_manifest(
                config.manifest_path.clone().unwrap_or_else(|| default_manifest(c)),
                &config,
            )?),
            None => None,
        };
        let nvme = match &config.nvme {
            Some(c) => {
                let tier = NvmeTier::open(c.clone())?;
                tracing::info!(path = %c.path.display(), capacity = c.capacity, engine = tier.backend(), "nvme tier ready");
                Some(Arc::new(tier) as Arc<dyn Tier>)
            }
            None => None,
        };
        Self::build(device, host, nvme, recovering, config)
    }

    /// A store over the given tiers (their capacities override the config's).
    /// With an NVMe tier and a manifest, pages recorded there are recovered
    /// first; background threads migrate the pages host memory's rounds
    /// chose and keep the manifest flushed for as long as the store lives.
    pub fn with_tiers(
        device: Arc<dyn Tier>,
        host: Arc<dyn Tier>,
        nvme: Option<Arc<dyn Tier>>,
        config: StoreConfig,
    ) -> StoreResult<Arc<Self>> {
        let path = match (&nvme, &config.manifest_path, &config.nvme) {
            (Some(_), Some(path), _) => Some(path.clone()),
            (Some(_), None, Some(c)) => Some(default_manifest(c)),
            _ => None,
        };
        let recovering = match path {
            Some(path) => Some(open_manifest(path, &config)?),
            None => None,
        };
        Self::build(device, host, nvme, recovering, config)
    }

    fn build(
        device: Arc<dyn Tier>,
        host: Arc<dyn Tier>,
        nvme: Option<Arc<dyn Tier>>,
        recovering: Option<Recovering>,
        config: StoreConfig,
    ) -> StoreResult<Arc<Self>> {
        let kinds_right = device.kind() == TierKind::Device
            && host.kind() == TierKind::Host
            && nvme.as_ref().is_none_or(|t| t.kind() == TierKind::Nvme);
        if !kinds_right {
            return Err(StoreError::Internal("tiers given in the wrong roles".into()));
        }
        let counters = Arc::new(Counters::default());
        let (manifest, image) = match recovering {
            Some((path, manifest, image)) => (Some(manifest), Some((path, image))),
            None => (None, None),
        };
        let next_page_id = image.as_ref().map_or(0, |(_, i)| i.next_page_id);
        let durable = Durable::new(manifest, next_page_id, [&device, &host], nvme, Arc::clone(&counters));
        let exclusive = config.device_cache == DeviceCache::Exclusive;
        // Without NVMe there is nowhere to migrate to: no round ever falls
        // due (memory may fill to its capacity).
        let (high, low) = match durable.nvme() {
            Some(_) => (config.host_high_watermark, config.host_low_watermark),
            None => (1.0, 1.0),
        };
        let store = Arc::new(Self {
            host: HostCache::new(host, config.host_policy, high, low),
            device: HotSet::new(device, exclusive, config.device_policy, Arc::clone(&counters)),
            catalog: Catalog::default(),
            durable,
            leases: Leases::default(),
            sketch_sweep_ticks: std::sync::atomic::AtomicU32::new(0),
            sketch_sweeping: std::sync::atomic::AtomicBool::new(false),
            accounts: Accounts::new(config.limits.clone()),
            counters,
            config,
            trace: AccessTrace::default(),
        });
        if let Some((path, image)) = image {
            let recovered = store.durable.recover(image, &store.catalog, &store.accounts);
            tracing::info!(
                manifest = %path.display(),
                sequences = recovered.sequences,
                pages = recovered.pages,
                summaries = recovered.summaries,
                lost_on_restart = recovered.lost_on_restart,
                "recovered from the manifest"
            );
            store.durable.checkpoint(&store.catalog);
        }
        if let Err(e) = spawn_loop("kvtier-background", &store, Self::background_tick) {
            tracing::error!(error = %e, "cannot start the background thread; leases expire only when looked at");
        }
        // Host memory's rounds: woken as their pages are chosen.
        match spawn_loop("kvtier-host-rounds", &store, |store| {
            store.host.rebalance(&store.durable)
        }) {
            Ok(thread) => store.host.run_rounds_on(thread),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the host rounds thread; migration happens only under pressure")
            }
        }
        // Its own thread: a checkpoint of a large manifest takes seconds, and
        // host memory must keep draining meanwhile (or appends migrate pages
        // themselves).
        if store.durable.can_persist()
            && let Err(e) = spawn_loop("kvtier-checkpoint", &store, Self::checkpoint_if_due)
        {
            tracing::error!(error = %e, "cannot start the checkpoint thread; the manifest keeps growing");
        }
        Ok(store)
    }

    /// One round of background work: expired leases, sketches and a
    /// manifest flush.
    fn background_tick(&self) {
        let expired = self.leases.expire(std::time::Instant::now());
        if expired > 0 {
            tracing::debug!(expired, "leases expired");
        }
        self.sweep_sketches_if_due();
        self.durable.flush_if_idle();
    }

    /// A checkpoint once the manifest has grown large.
    fn checkpoint_if_due(&self) {
        if self.durable.wants_checkpoint() {
            self.durable.checkpoint(&self.catalog);
        }
    }

    /// The read path over this store's tiers.
    fn reader(&self) -> Reader<'_> {
        Reader {
            host: &self.host,
            device: &**self.device.tier(),
            durable: &self.durable,
            counters: &self.counters,
            promote: self.config.promote_on_read,
            touch: true,
        }
    }

    /// Releases logical pages: summaries free their slot, physical pages lose
    /// a reference and are freed with the last one (their slots return to
    /// the tiers as the last `Arc`s drop, or when a reader still copying
    /// from one finishes).
    fn release(&self, logical: impl IntoIterator<Item = StorePage>) {
        let freed = self.catalog.release(logical);
        self.durable.journal_freed(&freed);
        for page in &freed {
            self.device.note_wasted(page);
        }
        self.device.forget(freed.iter().map(|p| p.id));
        self.host.forget(freed.iter().map(|p| p.id));
    }

    /// Rewrites the manifest compactly now, as the store does by itself
    /// once it passes `checkpoint_bytes` (nothing without an NVMe tier).
    pub fn checkpoint(&self) {
        self.durable.checkpoint(&self.catalog);
    }

    /// Waits until background swap-ins and prefetches, and host memory's
    /// background round due, have finished (for benchmarks and tests that
    /// measure their effect).
    pub fn wait_idle(&self) {
        self.device.workers().wait_idle();
        self.host.rebalance(&self.durable);
    }

    /// Where the store's time goes (histograms for the metrics endpoint).
    pub fn latency(&self) -> &Latency {
        &self.counters.latency
    }

    /// The whole server's statistics: tiers, pages by state, metadata
    /// against its budget, and every counter.
    pub fn stats(&self) -> StatsSnapshot {
        let (sequences, pages) = self.count_pages(|_| true);
        let tiers = [Some(self.device.tier()), Some(self.host.tier()), self.durable.nvme()];
        let mut snapshot = StatsSnapshot {
            tiers: tiers.into_iter().flatten().map(|t| TierStats::of(&**t)).collect(),
            pages,
            sequences,
            physical_pages: self.catalog.physical_pages(),
            metadata_bytes: self.accounts.metadata_bytes(),
            metadata_limit_bytes: Some(self.accounts.metadata_budget()),
            ..StatsSnapshot::default()
        };
        snapshot.counters(&self.counters);
        snapshot.leases = self.leases.active() as u64;
        snapshot.index = self.index_memory();
        snapshot
    }

    /// One tenant's view: its sequences and their pages, nothing about the
    /// tiers, the server's counters or other tenants.
    pub fn tenant_stats(&self, tenant: &TenantId) -> StatsSnapshot {
        let (sequences, pages) = self.count_pages(|key| key.tenant == *tenant);
        let usage = self.accounts.usage(tenant);
        StatsSnapshot {
            tenant: Some(tenant.clone()),
            pages,
            sequences,
            metadata_bytes: usage.metadata_bytes,
            metadata_limit_bytes: usage.quota.metadata_bytes,
            usage: Some(usage),
            ..StatsSnapshot::default()
        }
    }

    /// The live sequences whose key passes `select`, and their pages by state.
    fn count_pages(&self, select: impl Fn(&SequenceKey) -> bool) -> (u64, StateCounts) {
        let mut pages = StateCounts::default();
        let mut sequences = 0;
        for cell in self.catalog.cells() {
            let seq = cell.read();
            if seq.dropped || !select(&seq.key) {
                continue;
            }
            sequences += 1;
            for page in seq.lanes.iter().flat_map(|l| l.pages()) {
                pages.add(crate::page::state_of(page));
            }
        }
        (sequences, pages)
    }

    /// The configuration the store was opened with.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }
}

/// A span in whole microseconds, as timings report them.
fn micros(d: std::time::Duration) -> u64 {
    d.as_micros() as u64
}

fn default_manifest(nvme: &NvmeConfig) -> PathBuf {
    nvme.path.with_extension("manifest")
}

fn open_manifest(path: PathBuf, config: &StoreConfig) -> StoreResult<Recovering> {
    let (manifest, image) =
        Manifest::open(&path, config.durability, config.checkpoint_bytes).map_err(StoreError::Manifest)?;
    Ok((path, manifest, image))
}

/// The pause between two rounds of a background loop (leases, sketches,
/// checkpoints; host memory's rounds thread is also woken when it has
/// pages to move).
const BACKGROUND_TICK: std::time::Duration = std::time::Duration::from_millis(20);

/// Runs `tick` every [`BACKGROUND_TICK`] on a thread of its own for as
/// long as the store lives (the thread holds it only during a tick).
fn spawn_loop(name: &str, store: &Arc<Store>, tick: fn(&Store)) -> std::io::Result<std::thread::Thread> {
    let weak = Arc::downgrade(store);
    let handle = std::thread::Builder::new().name(name.into()).spawn(move || {
        while let Some(store) = weak.upgrade() {
            tick(&store);
            drop(store);
            // The host rounds thread is unparked early when it has work.
            std::thread::park_timeout(BACKGROUND_TICK);
        }
    })?;
    Ok(handle.thread().clone())
}

impl Drop for Store {
    fn drop(&mut self) {
        self.device.workers().close();
        if let Err(e) = self.durable.commit() {
            tracing::error!(error = %e, "manifest flush at shutdown failed");
        }
    }
}
