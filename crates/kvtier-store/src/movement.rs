//! Moving page bytes between the host and NVMe tiers: reading originals
//! wherever they are (NVMe reads batched and CRC-checked), migrating least
//! recently used host pages to NVMe under pressure, and promoting NVMe pages
//! back to host memory.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use kvtier_core::{ColdTier, Layout, PageState, Reason};
use kvtier_tiers::{AlignedBuf, Slot, Tier, TierError};

use crate::durability::{Record, page_crc};
use crate::page::{NvmeCopy, PhysPage, read_rows, rows_of};
use crate::sync::{lock, read, write};
use crate::{Store, StoreError, StoreResult};

/// Pages migrated per batch when making room in host memory.
const MIGRATION_BATCH: usize = 64;

/// Time a foreground call spent making host room: waiting for a migration
/// already running, and migrating itself.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct MigrationTime {
    pub(crate) waited: Duration,
    pub(crate) moving: Duration,
}

pub(crate) type HostLru = lru::LruCache<u64, Weak<PhysPage>>;

/// What happens to a page's host copy once its NVMe copy is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Keep it (persisting: the page stays fast and becomes durable).
    Host,
    /// Drop it (migrating: host memory is freed).
    Nothing,
}

/// A whole page's bytes read from one of its copies.
enum Source {
    Now(Vec<u8>),
    Nvme(NvmeCopy, u64),
}

impl Store {
    /// The original bytes (K rows then V rows, `rows` each) of each page, or
    /// `None` for a page whose bytes are lost. Host and device copies are read
    /// directly; NVMe copies in one batch, each checked against its CRC32C.
    /// A copy that fails its check or its read makes the page lost (gone,
    /// reason `integrity`) for every sequence sharing it; it is never served.
    pub(crate) fn read_originals(
        &self,
        layout: &Layout,
        pages: &[(Arc<PhysPage>, u32)],
    ) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let mut out: Vec<Option<Vec<u8>>> = vec![None; pages.len()];
        let mut pending = Vec::new();
        for (i, (page, rows)) in pages.iter().enumerate() {
            match self.source(page, layout, *rows)? {
                Some(Source::Now(bytes)) => out[i] = Some(bytes),
                Some(Source::Nvme(copy, version)) => pending.push((i, copy, version)),
                None => {}
            }
        }
        if pending.is_empty() {
            return Ok(out);
        }
        let nvme = self.nvme.as_ref().expect("nvme copies exist only with an nvme tier");
        let page_len = layout.page_bytes();
        let reads = pending
            .iter()
            .map(|(_, c, _)| (Arc::clone(&c.slot), AlignedBuf::zeroed(c.slot.reserved() as usize)))
            .collect();
        let mut promote = Vec::new();
        for ((i, copy, version), done) in pending.into_iter().zip(nvme.read_many(reads)) {
            let (page, rows) = &pages[i];
            let intact = match done.wait() {
                Ok(d) => match d.result {
                    Ok(()) if page_crc(page.id, &d.buf[..page_len]) == copy.crc => Some(d.buf),
                    Ok(()) => {
                        tracing::error!(
                            page = page.id,
                            offset = copy.slot.offset(),
                            "nvme page failed its CRC32C check"
                        );
                        None
                    }
                    Err(e) => {
                        tracing::error!(page = page.id, error = %e, "nvme page could not be read");
                        None
                    }
                },
                Err(e) => {
                    tracing::error!(page = page.id, error = %e, "nvme read abandoned");
                    None
                }
            };
            match intact {
                Some(buf) => {
                    out[i] = Some(rows_of(&buf, layout, *rows));
                    promote.push((Arc::clone(page), buf, version));
                }
                // Another copy may have appeared meanwhile; then it is used.
                None if !self.mark_lost(page, &copy) => {
                    if let Some(Source::Now(bytes)) = self.source(page, layout, *rows)? {
                        out[i] = Some(bytes);
                    }
                }
                None => {}
            }
        }
        if self.config.promote_on_read {
            self.promote(layout, promote);
        }
        Ok(out)
    }

    /// Where to read a page's bytes: now from host or device, or later from
    /// NVMe; `None` when lost.
    fn source(&self, page: &Arc<PhysPage>, layout: &Layout, rows: u32) -> StoreResult<Option<Source>> {
        let place = read(&page.place);
        if place.lost.is_some() {
            return Ok(None);
        }
        if let Some(host) = &place.host {
            let bytes = read_rows(&*self.host, host, layout, rows)?;
            // The LRU after the page lock is released: never an LRU lock
            // under a page lock (migration takes them the other way).
            drop(place);
            self.touch_host([page]);
            return Ok(Some(Source::Now(bytes)));
        }
        if let Some(device) = &place.device {
            return Ok(Some(Source::Now(read_rows(&*self.device, device, layout, rows)?)));
        }
        match &place.nvme {
            Some(copy) => Ok(Some(Source::Nvme(copy.clone(), place.version))),
            None => Err(StoreError::Internal(format!(
                "page {} has no copy and is not lost",
                page.id
            ))),
        }
    }

    /// Marks a page lost after its NVMe copy failed, unless another copy
    /// exists now. Returns whether it is lost.
    fn mark_lost(&self, page: &PhysPage, failed: &NvmeCopy) -> bool {
        let mut place = write(&page.place);
        let same = place.nvme.as_ref().is_some_and(|c| Arc::ptr_eq(&c.slot, &failed.slot));
        if place.lost.is_some() || place.host.is_some() || place.device.is_some() || !same {
            return place.lost.is_some();
        }
        let failed = place.nvme.take().expect("checked above");
        place.lost = Some(Reason::Integrity);
        let lost = Record::Lost {
            phys: page.id,
            reason: Reason::Integrity,
        };
        self.journal_retiring(vec![lost], vec![failed.slot]);
        drop(place);
        self.counters
            .transition(PageState::Cold(ColdTier::Nvme), PageState::Gone, Reason::Integrity, 1);
        true
    }

    /// Gives NVMe-only pages a host copy again (best effort: never makes
    /// room for it), so the next read is a memory read.
    fn promote(&self, layout: &Layout, pages: Vec<(Arc<PhysPage>, AlignedBuf, u64)>) {
        for (page, buf, version) in pages {
            let Ok(mut slot) = self.host.allocate(layout.page_bytes() as u64) else {
                return;
            };
            if self.host.write(&mut slot, 0, &buf[..layout.page_bytes()]).is_err() {
                continue;
            }
            let mut place = write(&page.place);
            if place.version == version && place.host.is_none() && place.lost.is_none() {
                let from = place.state();
                place.host = Some(slot);
                let to = place.state();
                drop(place);
                self.counted(from, to, Reason::Demand);
                self.touch_host([&page]);
            }
        }
    }

    /// Gives `page` a host copy now, making room if needed (appends and
    /// explicit moves need one).
    pub(crate) fn ensure_host(
        &self,
        page: &Arc<PhysPage>,
        layout: &Layout,
        reason: Reason,
        spent: &mut MigrationTime,
    ) -> StoreResult<()> {
        if read(&page.place).host.is_some() {
            return Ok(());
        }
        let whole = self.read_originals(layout, &[(Arc::clone(page), layout.page_size())])?;
        let Some(bytes) = whole.into_iter().next().flatten() else {
            return Err(StoreError::precondition("pages", "the page's bytes are lost"));
        };
        let mut slot = self.allocate_host(layout.page_bytes() as u64, spent)?;
        let v = layout.page_size() as usize * layout.row_bytes();
        let (k, vals) = bytes.split_at(bytes.len() / 2);
        self.host.write(&mut slot, 0, k)?;
        self.host.write(&mut slot, v as u64, vals)?;
        let mut place = write(&page.place);
        if place.host.is_none() {
            let from = place.state();
            place.host = Some(slot);
            let to = place.state();
            drop(place);
            self.counted(from, to, reason);
            self.touch_host([page]);
        }
        Ok(())
    }

    /// A host slot of `len` bytes; when the host is full, least recently used
    /// host pages migrate to NVMe first. Full only when both tiers are; a
    /// failed migration (ENOSPC, EIO) is reported as itself.
    pub(crate) fn allocate_host(&self, len: u64, spent: &mut MigrationTime) -> Result<Slot, TierError> {
        loop {
            match self.host.allocate(len) {
                Err(full @ TierError::Full { .. }) => {
                    if self.nvme.is_none() {
                        return Err(full);
                    }
                    let waiting = Instant::now();
                    let one = lock(&self.migrating);
                    spent.waited += waiting.elapsed();
                    let moving = Instant::now();
                    let moved = self.relieve_host_locked(len, &one);
                    spent.moving += moving.elapsed();
                    drop(one);
                    match moved {
                        // Nothing left to move; a migration that ran
                        // meanwhile may still have made room.
                        Ok(0) => return self.host.allocate(len),
                        Ok(_) => {}
                        Err(StoreError::ResourceExhausted(e) | StoreError::Unavailable(e)) => return Err(e),
                        Err(_) => return Err(full),
                    }
                }
                other => return other,
            }
        }
    }

    /// Migrates least recently used host pages to NVMe until about `bytes`
    /// (at least one batch) are free; returns the pages migrated.
    pub(crate) fn relieve_host(&self, bytes: u64) -> StoreResult<usize> {
        // One migration at a time: a second caller waits for the first's
        // room instead of finding its victims already taken.
        let one = lock(&self.migrating);
        self.relieve_host_locked(bytes, &one)
    }

    /// [`Self::relieve_host`] with the migration lock held.
    fn relieve_host_locked(&self, bytes: u64, _migrating: &std::sync::MutexGuard<'_, ()>) -> StoreResult<usize> {
        let mut victims = Vec::new();
        let mut skipped = Vec::new();
        let mut freed = 0u64;
        while (freed < bytes || victims.len() < MIGRATION_BATCH) && victims.len() < 4 * MIGRATION_BATCH {
            // One entry at a time, the LRU's lock released before the page's
            // is taken (never a page lock under an LRU lock).
            let Some((_, weak)) = lock(&self.host_lru).pop_lru() else {
                break;
            };
            let Some(page) = weak.upgrade() else { continue };
            if page.pinned() {
                skipped.push(page);
                continue;
            }
            let place = read(&page.place);
            if let (Some(host), None) = (&place.host, place.lost) {
                freed += host.reserved();
                drop(place);
                victims.push(page);
            }
        }
        // Pages created together (one write, one lane's run) have adjacent
        // ids: allocating their NVMe slots in id order keeps them adjacent on
        // disk too, so the reads of a later step can run sequentially.
        victims.sort_by_key(|p| p.id);
        self.touch_host(&skipped);
        let moved = self.copy_to_nvme(&victims, Keep::Nothing, Reason::CapacityPressure);
        // Pages that did not move keep their place in line.
        let kept: Vec<Arc<PhysPage>> = victims.into_iter().filter(|p| read(&p.place).host.is_some()).collect();
        self.touch_host(&kept);
        if let Err(e) = &moved {
            tracing::warn!(error = %e, "could not migrate host pages to nvme");
        }
        moved
    }

    /// Gives each page a current NVMe copy made from its host (or device)
    /// copy, writing one unless it has one, then keeps or drops the host
    /// copy. A page modified meanwhile keeps its host copy and gets no NVMe
    /// copy. All slots are reserved first: if NVMe is full, nothing moves.
    /// Each copy's `Persist` record is journalled under the page's lock, so
    /// the journal orders it with the page's other records. Returns the
    /// pages that moved or were copied.
    pub(crate) fn copy_to_nvme(&self, pages: &[Arc<PhysPage>], keep: Keep, reason: Reason) -> StoreResult<usize> {
        let Some(nvme) = self.nvme.as_ref() else {
            return Err(StoreError::precondition("action", "the nvme tier is not configured"));
        };
        let mut pending = Vec::new();
        let mut bufs = Vec::new();
        let mut moved = 0;
        for page in pages {
            let mut place = write(&page.place);
            if place.lost.is_some() {
                continue;
            }
            if place.nvme.is_some() {
                // Already current on NVMe: no I/O needed.
                if place.host.is_some() {
                    if keep == Keep::Nothing && !page.pinned() {
                        let from = place.state();
                        place.host = None;
                        let to = place.state();
                        drop(place);
                        self.counted(from, to, reason);
                    }
                    moved += 1;
                }
                continue;
            }
            let source = match (&place.host, &place.device) {
                (Some(host), _) => (&*self.host, host),
                (None, Some(device)) => (&*self.device, device),
                (None, None) => continue,
            };
            let mut buf = AlignedBuf::zeroed(source.1.len() as usize);
            source.0.read(source.1, 0, &mut buf)?;
            pending.push((Arc::clone(page), place.version, place.rows, page_crc(page.id, &buf)));
            bufs.push(buf);
        }
        let slots: Vec<Slot> = bufs
            .iter()
            .map(|b| self.allocate_nvme(&**nvme, b.len() as u64))
            .collect::<Result<_, _>>()?;
        let mut written = Vec::with_capacity(slots.len());
        for done in nvme.write_many(slots.into_iter().zip(bufs).collect()) {
            let d = done.wait().map_err(|e| {
                StoreError::Unavailable(TierError::Io {
                    op: "write",
                    offset: 0,
                    errno: None,
                    message: e.to_string(),
                })
            })?;
            d.result?;
            written.push((d.slot, d.buf));
        }
        for ((page, version, rows, crc), (slot, buf)) in pending.into_iter().zip(written) {
            let mut place = write(&page.place);
            if place.version != version || place.lost.is_some() || place.nvme.is_some() {
                continue; // changed meanwhile; the new NVMe slot is freed here
            }
            let record = Self::persist_record(&page, slot.offset(), slot.len(), crc, rows, &buf);
            let from = place.state();
            place.nvme = Some(NvmeCopy {
                slot: Arc::new(slot),
                crc,
                rows,
            });
            let superseded = place.durable_prefix.take().map(|c| c.slot);
            self.journal_retiring(vec![record], superseded.into_iter().collect());
            // A page pinned since it was chosen (an append about to fill
            // it, a swap-in) keeps its host copy.
            if keep == Keep::Nothing && !page.pinned() {
                place.host = None;
            }
            let to = place.state();
            drop(place);
            self.counted(from, to, reason);
            moved += 1;
        }
        Ok(moved)
    }

    /// An NVMe slot of `len` bytes. When NVMe is full, the journal is
    /// flushed first: extents it retired become free once it is.
    fn allocate_nvme(&self, nvme: &dyn Tier, len: u64) -> StoreResult<Slot> {
        match (nvme.allocate(len), &self.manifest) {
            (Err(TierError::Full { .. }), Some(manifest)) => {
                manifest.flush().map_err(StoreError::Manifest)?;
                Ok(nvme.allocate(len)?)
            }
            (slot, _) => Ok(slot?),
        }
    }

    fn counted(&self, from: PageState, to: PageState, reason: Reason) {
        if from != to {
            self.counters.transition(from, to, reason, 1);
        }
    }

    /// Keeps host memory between the watermarks: above the high one, least
    /// recently used pages migrate to NVMe until the low one.
    pub(crate) fn rebalance_host(&self) {
        if self.nvme.is_none() {
            return;
        }
        let capacity = self.host.capacity_bytes() as f64;
        let high = (capacity * self.config.host_high_watermark) as u64;
        let low = (capacity * self.config.host_low_watermark) as u64;
        if self.host.used_bytes() <= high {
            return;
        }
        while self.host.used_bytes() > low {
            let excess = self.host.used_bytes() - low;
            if !matches!(self.relieve_host(excess), Ok(n) if n > 0) {
                break;
            }
        }
    }

    /// Marks pages as just used in host memory.
    pub(crate) fn touch_host<'a>(&self, pages: impl IntoIterator<Item = &'a Arc<PhysPage>>) {
        let mut lru = lock(&self.host_lru);
        for page in pages {
            lru.put(page.id, Arc::downgrade(page));
        }
    }
}
