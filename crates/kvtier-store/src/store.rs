//! The store: sequences, the shared page table and the tiers.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use kvtier_core::{Layout, LogicalPage, PageState, PhysicalPages, Reason, SequenceKey};
use kvtier_tiers::{ArenaTier, NvmeConfig, NvmeTier, Tier, TierKind};

use crate::device::DeviceLru;
use crate::durability::{Durability, Image, Manifest, PageIds, Record};
use crate::lease::Leases;
use crate::movement::HostLru;
use crate::page::{PageRef, PhysPage, ShareKey, StorePage};
use crate::sequence::Sequence;
use crate::stats::{Counters, SequenceInfo, StateCounts, StatsSnapshot, TierBytes, TierStats};
use crate::swapin::Workers;
use crate::sync::{lock, read, write};
use crate::{StoreError, StoreResult};

/// Sizes and placement choices.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    /// Device tier capacity. Emulated in host memory when no GPU is present.
    pub device_bytes: u64,
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
    /// Above this share of host capacity, least recently used host pages
    /// migrate to NVMe in the background ...
    pub host_high_watermark: f64,
    /// ... until host use is down to this share.
    pub host_low_watermark: f64,
    /// Reading an NVMe-only page gives it a host copy again.
    pub promote_on_read: bool,
    /// What a persisting write waits for.
    pub durability: Durability,
    /// The manifest; default: the NVMe file's path with extension
    /// `.manifest`. Needed to recover pages after a restart.
    pub manifest_path: Option<PathBuf>,
    /// Rewrite the manifest as a checkpoint once it is past this size (and
    /// has doubled since the last checkpoint).
    pub checkpoint_bytes: u64,
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
            durability: Durability::Relaxed,
            manifest_path: None,
            checkpoint_bytes: 64 << 20,
        }
    }
}

#[derive(Debug)]
pub struct Store {
    pub(crate) device: Arc<dyn Tier>,
    pub(crate) host: Arc<dyn Tier>,
    pub(crate) nvme: Option<Arc<dyn Tier>>,
    /// With an NVMe tier: what survives a restart (`durability/`).
    pub(crate) manifest: Option<Manifest>,
    pub(crate) config: StoreConfig,
    sequences: RwLock<HashMap<SequenceKey, Arc<RwLock<Sequence>>>>,
    /// Lock order: a sequence, then `pages`, then a page's placement, then
    /// `device_lru`. Nothing takes them the other way round.
    pub(crate) pages: Mutex<PhysicalPages<Arc<PhysPage>, ShareKey>>,
    pub(crate) device_lru: Mutex<DeviceLru>,
    pub(crate) host_lru: Mutex<HostLru>,
    /// Held while pages migrate to NVMe.
    pub(crate) migrating: Mutex<()>,
    pub(crate) workers: Arc<Workers>,
    pub(crate) leases: Leases,
    pub(crate) ids: PageIds,
    pub(crate) counters: Counters,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceCache {
    Inclusive,
    Exclusive,
}

/// A new sequence and how many leading pages it shares with earlier ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    pub attached_pages: u64,
    pub info: SequenceInfo,
}

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
                tracing::info!(
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
            Some(c) => open_manifest(
                config.manifest_path.clone().unwrap_or_else(|| default_manifest(c)),
                &config,
            )?,
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
    /// first, and a background thread keeps host memory between the
    /// watermarks and the manifest flushed for as long as the store lives.
    pub fn with_tiers(
        device: Arc<dyn Tier>,
        host: Arc<dyn Tier>,
        nvme: Option<Arc<dyn Tier>>,
        config: StoreConfig,
    ) -> StoreResult<Arc<Self>> {
        assert_eq!(device.kind(), TierKind::Device, "device tier kind");
        assert_eq!(host.kind(), TierKind::Host, "host tier kind");
        assert!(
            nvme.as_ref().is_none_or(|t| t.kind() == TierKind::Nvme),
            "nvme tier kind"
        );
        let path = match (&nvme, &config.manifest_path, &config.nvme) {
            (Some(_), Some(path), _) => Some(path.clone()),
            (Some(_), None, Some(c)) => Some(default_manifest(c)),
            _ => None,
        };
        let recovering = match path {
            Some(path) => open_manifest(path, &config)?,
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
        let (path, manifest, image) = match recovering {
            Some((path, manifest, image)) => (Some(path), Some(manifest), Some(image)),
            None => (None, None, None),
        };
        let store = Arc::new(Self {
            device,
            host,
            nvme,
            manifest,
            config,
            sequences: RwLock::default(),
            pages: Mutex::default(),
            device_lru: Mutex::new(DeviceLru::unbounded()),
            host_lru: Mutex::new(HostLru::unbounded()),
            migrating: Mutex::new(()),
            workers: Workers::start(2),
            leases: Leases::default(),
            ids: PageIds::starting_at(image.as_ref().map_or(0, |i| i.next_page_id)),
            counters: Counters::default(),
        });
        if let (Some(path), Some(image)) = (&path, image) {
            let recovered = store.recover(image);
            tracing::info!(
                manifest = %path.display(),
                sequences = recovered.sequences,
                pages = recovered.pages,
                summaries = recovered.summaries,
                lost_on_restart = recovered.lost_on_restart,
                "recovered from the manifest"
            );
            store.checkpoint();
        }
        if let Err(e) = spawn_loop("kvtier-background", &store, Self::background_tick) {
            tracing::error!(error = %e, "cannot start the background thread; migration happens only under pressure");
        }
        // Its own thread: a checkpoint of a large manifest takes seconds, and
        // host memory must keep draining meanwhile (or appends migrate pages
        // themselves).
        if store.manifest.is_some()
            && let Err(e) = spawn_loop("kvtier-checkpoint", &store, Self::checkpoint_if_due)
        {
            tracing::error!(error = %e, "cannot start the checkpoint thread; the manifest keeps growing");
        }
        Ok(store)
    }

    /// One round of background work: expired leases, host watermarks and a
    /// manifest flush.
    fn background_tick(&self) {
        let expired = self.leases.expire(std::time::Instant::now());
        if expired > 0 {
            tracing::debug!(expired, "leases expired");
        }
        self.rebalance_host();
        if let Some(manifest) = &self.manifest
            && let Err(e) = manifest.flush_if_idle()
        {
            tracing::error!(error = %e, "manifest flush failed");
        }
    }

    /// A checkpoint once the manifest has grown large.
    fn checkpoint_if_due(&self) {
        if self.manifest.as_ref().is_some_and(Manifest::wants_checkpoint) {
            self.checkpoint();
        }
    }

    pub(crate) fn sequence_cells(&self) -> Vec<Arc<RwLock<Sequence>>> {
        read(&self.sequences).values().cloned().collect()
    }

    pub(crate) fn insert_recovered(&self, seq: Sequence) {
        write(&self.sequences).insert(seq.key.clone(), Arc::new(RwLock::new(seq)));
    }

    /// The cell of sequence `key`.
    pub(crate) fn sequence(&self, key: &SequenceKey) -> StoreResult<Arc<RwLock<Sequence>>> {
        read(&self.sequences).get(key).cloned().ok_or_else(|| not_found(key))
    }

    /// Runs `f` on the sequence with its lock held for reading.
    pub(crate) fn with_sequence<T>(
        &self,
        key: &SequenceKey,
        f: impl FnOnce(&Sequence) -> StoreResult<T>,
    ) -> StoreResult<T> {
        let cell = self.sequence(key)?;
        let seq = read(&cell);
        if seq.dropped {
            return Err(not_found(key));
        }
        f(&seq)
    }

    /// Runs `f` on the sequence with its lock held for writing.
    pub(crate) fn with_sequence_mut<T>(
        &self,
        key: &SequenceKey,
        f: impl FnOnce(&mut Sequence) -> StoreResult<T>,
    ) -> StoreResult<T> {
        let cell = self.sequence(key)?;
        let mut seq = write(&cell);
        if seq.dropped {
            return Err(not_found(key));
        }
        f(&mut seq)
    }

    /// Creates a sequence. With a prefix hash chain (one hash per full page),
    /// the longest run of leading pages already stored for every lane under
    /// the same tenant, layout and hashes is attached at once: those pages are
    /// shared, not copied, and need not be sent again.
    pub fn create_sequence(
        &self,
        key: SequenceKey,
        layout: Layout,
        prefix_hashes: Vec<Vec<u8>>,
    ) -> StoreResult<Created> {
        let hashes = check_hashes(prefix_hashes)?;
        if read(&self.sequences).contains_key(&key) {
            return Err(already_exists(&key));
        }
        let mut seq = Sequence::new(key.clone(), Arc::new(layout), hashes);
        let attached_pages = self.attach_prefix(&mut seq);
        let mut sequences = write(&self.sequences);
        if sequences.contains_key(&key) {
            drop(sequences);
            self.release_sequence_pages(&mut seq);
            return Err(already_exists(&key));
        }
        let info = self.info_of(&seq);
        let mut records = vec![Record::Sequence {
            key: key.clone(),
            layout: (*seq.layout).clone(),
            hashes: seq.hashes.iter().map(|h| h.to_vec()).collect(),
        }];
        for (lane_index, lane) in seq.lanes.iter().enumerate() {
            for page in 0..attached_pages as usize {
                if let Some(LogicalPage::Physical(r)) = lane.page(page) {
                    records.push(Self::map_record(&seq, lane_index, page, r.page.id));
                }
            }
        }
        self.journal(records);
        sequences.insert(key.clone(), Arc::new(RwLock::new(seq)));
        tracing::info!(sequence = %key, attached_pages, "sequence created");
        Ok(Created { attached_pages, info })
    }

    fn attach_prefix(&self, seq: &mut Sequence) -> u64 {
        let mut pages = lock(&self.pages);
        let mut attached = 0;
        for (p, hash) in seq.hashes.iter().enumerate() {
            let found: Option<Vec<_>> = (0..seq.lanes.len())
                .map(|lane| pages.find(&share_key(seq, hash, lane)))
                .collect();
            let Some(ids) = found else { break };
            for (lane, id) in ids.into_iter().enumerate() {
                let page = Arc::clone(pages.get(id).expect("registered pages are live"));
                pages.acquire(id).expect("registered pages are live");
                let digest = page.digest.as_deref().expect("shared pages keep their digest");
                seq.lanes[lane].push_full_page(
                    LogicalPage::Physical(PageRef {
                        id,
                        page: Arc::clone(&page),
                    }),
                    digest,
                );
            }
            attached = p as u64 + 1;
        }
        attached
    }

    /// Drops a sequence; physical pages no other sequence uses are freed.
    /// Durable before it returns: a crash cannot bring the sequence back.
    pub fn drop_sequence(&self, key: &SequenceKey) -> StoreResult<()> {
        let cell = self.sequence(key)?;
        let mut seq = write(&cell);
        if seq.dropped {
            return Err(not_found(key));
        }
        // Under the sequence's lock, and before it leaves the map: every
        // record of this sequence comes before its `Drop`, and a sequence
        // created again under the key journals its start after it.
        seq.dropped = true;
        self.journal(vec![Record::Drop { key: key.clone() }]);
        write(&self.sequences).remove(key);
        self.release_sequence_pages(&mut seq);
        drop(seq);
        tracing::info!(sequence = %key, "sequence dropped");
        self.commit_change()
    }

    fn release_sequence_pages(&self, seq: &mut Sequence) {
        let pages: Vec<StorePage> = seq.lanes.iter_mut().flat_map(|l| l.take_pages()).collect();
        self.release(pages);
    }

    /// Releases logical pages: summaries free their slot, physical pages lose
    /// a reference and are freed with the last one.
    pub(crate) fn release(&self, logical: impl IntoIterator<Item = StorePage>) {
        let mut freed = Vec::new();
        {
            let mut pages = lock(&self.pages);
            for page in logical {
                if let LogicalPage::Physical(r) = page {
                    match pages.release(r.id) {
                        Ok(Some(page)) => freed.push(page),
                        Ok(None) => {}
                        Err(e) => tracing::error!(error = %e, "page table out of step; page leaked"),
                    }
                }
            }
        }
        self.journal_freed(&freed);
        for page in &freed {
            self.note_wasted(page);
        }
        self.forget_device(freed.iter().map(|p| p.id));
        let mut host_lru = lock(&self.host_lru);
        for page in &freed {
            host_lru.pop(&page.id);
        }
        // Slots return to their tiers as the last `Arc`s drop here (or when a
        // reader still copying from one finishes).
    }

    pub fn sequence_info(&self, key: &SequenceKey) -> StoreResult<SequenceInfo> {
        self.with_sequence(key, |seq| Ok(self.info_of(seq)))
    }

    fn info_of(&self, seq: &Sequence) -> SequenceInfo {
        let layout = &seq.layout;
        let page_bytes = layout.page_bytes() as u64;
        let mut states = StateCounts::default();
        let mut bytes = TierBytes::default();
        let mut shared_ids = Vec::new();
        let mut gone: HashMap<Reason, u64> = HashMap::new();
        for lane in &seq.lanes {
            for page in lane.pages() {
                match page {
                    LogicalPage::Physical(r) => {
                        let place = read(&r.page.place);
                        states.add(place.state());
                        if let Some(reason) = place.lost {
                            *gone.entry(reason).or_default() += 1;
                        }
                        bytes.device += page_bytes * u64::from(place.device.is_some());
                        bytes.host += page_bytes * u64::from(place.host.is_some());
                        bytes.nvme += page_bytes * u64::from(place.nvme.is_some());
                        shared_ids.push(r.id);
                    }
                    LogicalPage::Summary(s) => {
                        states.add(PageState::Summary);
                        bytes.host += s.slot.len();
                    }
                    LogicalPage::Gone(reason) => {
                        states.add(PageState::Gone);
                        *gone.entry(*reason).or_default() += 1;
                    }
                }
            }
        }
        let shared_pages = {
            let pages = lock(&self.pages);
            shared_ids
                .iter()
                .filter(|id| pages.refs(**id).is_some_and(|r| r > 1))
                .count() as u64
        };
        let tokens = seq.lanes.iter().map(|l| l.tokens());
        SequenceInfo {
            layout: (**layout).clone(),
            tokens: tokens.clone().min().unwrap_or(0),
            max_tokens: tokens.max().unwrap_or(0),
            pages: states,
            bytes,
            shared_pages,
            digest_bytes: seq.lanes.iter().map(|l| l.digests().byte_len() as u64).sum(),
            prefix_hashes: seq.hashes.len() as u64,
            gone_by_reason: Reason::ALL
                .iter()
                .filter_map(|r| gone.get(r).map(|n| (*r, *n)))
                .collect(),
        }
    }

    pub fn stats(&self) -> StatsSnapshot {
        let cells: Vec<_> = read(&self.sequences).values().cloned().collect();
        let mut pages = StateCounts::default();
        for cell in &cells {
            let seq = read(cell);
            for page in seq.lanes.iter().flat_map(|l| l.pages()) {
                pages.add(match page {
                    LogicalPage::Physical(r) => read(&r.page.place).state(),
                    LogicalPage::Summary(_) => PageState::Summary,
                    LogicalPage::Gone(_) => PageState::Gone,
                });
            }
        }
        let mut snapshot = StatsSnapshot {
            tiers: [Some(&self.device), Some(&self.host), self.nvme.as_ref()]
                .into_iter()
                .flatten()
                .map(|t| TierStats::of(&**t))
                .collect(),
            pages,
            sequences: cells.len() as u64,
            physical_pages: lock(&self.pages).len() as u64,
            transitions: Vec::new(),
            pages_written: 0,
            pages_shared: 0,
            bytes_written: 0,
            bytes_read: 0,
            tokens_appended: 0,
            swapped_from_host: 0,
            swapped_from_nvme: 0,
            prefetch_issued: 0,
            prefetch_used: 0,
            prefetch_wasted: 0,
            leases: 0,
        };
        snapshot.counters(&self.counters);
        snapshot.leases = self.leases.active() as u64;
        snapshot
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }
}

/// A locked manifest, its path and what it says to recover.
type Recovering = (PathBuf, Manifest, Image);

fn default_manifest(nvme: &NvmeConfig) -> PathBuf {
    nvme.path.with_extension("manifest")
}

fn open_manifest(path: PathBuf, config: &StoreConfig) -> StoreResult<Option<Recovering>> {
    let (manifest, image) =
        Manifest::open(&path, config.durability, config.checkpoint_bytes).map_err(StoreError::Manifest)?;
    Ok(Some((path, manifest, image)))
}

/// Runs `tick` every 20 ms on a thread of its own for as long as the store
/// lives (the thread holds it only during a tick).
fn spawn_loop(name: &str, store: &Arc<Store>, tick: fn(&Store)) -> std::io::Result<()> {
    let weak = Arc::downgrade(store);
    std::thread::Builder::new().name(name.into()).spawn(move || {
        while let Some(store) = weak.upgrade() {
            tick(&store);
            drop(store);
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    })?;
    Ok(())
}

impl Drop for Store {
    fn drop(&mut self) {
        self.workers.close();
        if let Some(manifest) = &self.manifest
            && let Err(e) = manifest.commit()
        {
            tracing::error!(error = %e, "manifest flush at shutdown failed");
        }
    }
}

pub(crate) fn share_key(seq: &Sequence, hash: &Arc<[u8]>, lane: usize) -> ShareKey {
    ShareKey {
        tenant: seq.key.tenant.clone(),
        layout: Arc::clone(&seq.layout),
        hash: Arc::clone(hash),
        lane: lane as u32,
    }
}

const MAX_HASH_BYTES: usize = 64;

fn check_hashes(hashes: Vec<Vec<u8>>) -> StoreResult<Vec<Arc<[u8]>>> {
    let mut seen = HashSet::with_capacity(hashes.len());
    hashes
        .into_iter()
        .enumerate()
        .map(|(i, h)| {
            let field = format!("prefix_hashes[{i}]");
            if h.is_empty() || h.len() > MAX_HASH_BYTES {
                return Err(StoreError::invalid(
                    field,
                    format!("is {} bytes long, must be 1..={MAX_HASH_BYTES}", h.len()),
                ));
            }
            let h: Arc<[u8]> = h.into();
            if !seen.insert(Arc::clone(&h)) {
                return Err(StoreError::invalid(
                    field,
                    "repeats an earlier hash; a hash chain names each prefix once",
                ));
            }
            Ok(h)
        })
        .collect()
}

pub(crate) fn not_found(key: &SequenceKey) -> StoreError {
    StoreError::NotFound {
        what: format!("sequence {key}"),
    }
}

fn already_exists(key: &SequenceKey) -> StoreError {
    StoreError::AlreadyExists {
        what: format!("sequence {key}"),
    }
}
