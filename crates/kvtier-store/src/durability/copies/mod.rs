//! Pages' copies on NVMe: written from memory in batches with their
//! `Persist` records, read back in batches and checked against their CRC,
//! given up with a `Lost` or `Unpersist` record.

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Instant;

use kvtier_core::{Layout, Reason, wire};
use kvtier_tiers::{AlignedBuf, Slot, Tier, TierError, TierKind};

use super::{Durable, Record};
use crate::page::{Lost, NvmeCopy, PhysPage};
use crate::stats::Counters;
use crate::{StoreError, StoreResult};

/// The CRC32C an NVMe copy of page `id` is stored with. The id is part of
/// it, so an extent holding another page's bytes fails the check.
fn page_crc(id: u64, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&id.to_le_bytes()), bytes)
}

/// What happens to a page's host copy once its NVMe copy is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Keep it (persisting: the page stays fast and becomes durable).
    Host,
    /// Drop it (migrating: host memory is freed), unless the page is
    /// pinned (an append about to fill it, a swap-in).
    Nothing,
}

/// A copy being written: the page as it was read.
#[derive(Debug)]
struct CopyJob {
    page: Arc<PhysPage>,
    version: u64,
    rows: u32,
    crc: u32,
}

/// One NVMe copy read back.
#[derive(Debug)]
pub(crate) enum CopyRead {
    /// The slot's bytes, which passed their check.
    Intact(AlignedBuf),
    /// The copy failed its check or its read: the page is lost now.
    Lost,
    /// The copy failed, but the page has another copy by now: read that.
    Elsewhere,
}

impl Durable {
    /// Gives each page a current NVMe copy made from its host (or device)
    /// copy, writing one unless it has one, then keeps or drops the host
    /// copy. A page modified meanwhile keeps its host copy and gets no NVMe
    /// copy. All slots are reserved first: if NVMe is full, nothing moves.
    /// Each copy's `Persist` record is journalled under the page's lock, so
    /// the journal orders it with the page's other records. Returns the
    /// pages that moved or were copied.
    pub(crate) fn write_copies(&self, pages: &[Arc<PhysPage>], keep: Keep, reason: Reason) -> StoreResult<usize> {
        self.write_copies_noting(pages, keep, reason, &mut |_| {})
    }

    /// [`Self::write_copies`], calling `host_freed` with each page whose
    /// host copy it drops, just before that slot frees (the host cache
    /// keeps its count of bytes about to free in step with the tier's).
    pub(crate) fn write_copies_noting(
        &self,
        pages: &[Arc<PhysPage>],
        keep: Keep,
        reason: Reason,
        host_freed: &mut dyn FnMut(&PhysPage),
    ) -> StoreResult<usize> {
        let Some(nvme) = self.nvme.as_ref() else {
            return Err(StoreError::precondition(
                wire::ACTION,
                "the nvme tier is not configured",
            ));
        };
        let mut moved = 0;
        let mut pending = Vec::new();
        let mut bufs = Vec::new();
        for page in pages {
            // A read lock is enough to copy the bytes out: `install` takes
            // the copy only if the page's version has not moved since.
            let place = page.place.read();
            if place.lost().is_some() {
                continue;
            }
            if place.nvme().is_some() {
                // Already current on NVMe: no I/O needed.
                drop(place);
                moved += usize::from(self.settle_current(page, keep, reason, host_freed));
                continue;
            }
            let (tier, slot): (&dyn Tier, &Slot) = match (place.host(), place.device()) {
                (Some(host), _) => (&*self.host, host),
                (None, Some(device)) => (&*self.device, device),
                (None, None) => continue,
            };
            let mut buf = AlignedBuf::zeroed(slot.len() as usize);
            tier.read(slot, 0, &mut buf)?;
            let (version, rows) = (place.version(), place.rows());
            drop(place);
            pending.push(CopyJob {
                page: Arc::clone(page),
                version,
                rows,
                crc: page_crc(page.id, &buf),
            });
            bufs.push(buf);
        }
        let mut jobs = Vec::with_capacity(pending.len());
        let mut writes = Vec::with_capacity(pending.len());
        for (job, buf) in pending.into_iter().zip(bufs) {
            let len = buf.len() as u64;
            match job
                .page
                .owner()
                .slot(TierKind::Nvme, len, false, || self.allocate(&**nvme, len))
            {
                Ok(slot) => {
                    jobs.push(job);
                    writes.push((slot, buf));
                }
                // Migrating, a tenant past its NVMe quota keeps its pages in
                // memory while the others' move.
                Err(StoreError::OverLimit(e)) if keep == Keep::Nothing => {
                    tracing::debug!(page = job.page.id, error = %e, "not migrated");
                }
                Err(e) => return Err(e),
            }
        }
        let pending = jobs;
        let mut written = Vec::with_capacity(writes.len());
        let writing = Instant::now();
        for done in nvme.write_many(writes) {
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
        if !written.is_empty() {
            self.counters.latency.nvme_write.observe(writing.elapsed());
        }
        for (job, (slot, buf)) in pending.iter().zip(written) {
            if self.install(job, slot, &buf, keep, reason, host_freed) {
                moved += 1;
                self.counters
                    .moved(TierKind::Host, TierKind::Nvme, job.page.layout.page_bytes() as u64);
            }
        }
        Ok(moved)
    }

    /// Installs a written copy, unless the page changed meanwhile (then the
    /// new slot is freed as it drops here).
    fn install(
        &self,
        job: &CopyJob,
        slot: Slot,
        bytes: &[u8],
        keep: Keep,
        reason: Reason,
        host_freed: &mut dyn FnMut(&PhysPage),
    ) -> bool {
        let CopyJob {
            page,
            version,
            rows,
            crc,
        } = job;
        let (rows, crc) = (*rows, *crc);
        let record = persist_record(page, slot.offset(), slot.len(), crc, rows, bytes);
        let copy = NvmeCopy {
            slot: Arc::new(slot),
            crc,
            rows,
        };
        let keep_host = keep != Keep::Nothing || page.pinned();
        let mut place = page.place.write();
        let Ok(done) = place.install_nvme(copy, *version, keep_host) else {
            return false;
        };
        // Journaled under the page's lock, so the journal orders this
        // record after any earlier one about the page.
        self.journal_retiring(vec![record], done.superseded.into_iter().collect());
        drop(place);
        if let Some(host) = done.dropped_host {
            host_freed(page);
            drop(host);
            self.host_copy_dropped(reason);
        }
        self.counters.counted(done.change.from, done.change.to, reason);
        true
    }

    /// A page's host copy went because its NVMe copy is current: a
    /// migration when the host cache needed the room.
    fn host_copy_dropped(&self, reason: Reason) {
        if reason == Reason::CapacityPressure {
            Counters::add(&self.counters.pages_migrated, 1);
        }
    }

    /// A page whose NVMe copy is current: drops its host copy unless asked
    /// to keep it (or pinned). Whether it counts as moved or copied.
    fn settle_current(
        &self,
        page: &PhysPage,
        keep: Keep,
        reason: Reason,
        host_freed: &mut dyn FnMut(&PhysPage),
    ) -> bool {
        let mut place = page.place.write();
        if place.lost().is_some() || place.nvme().is_none() || place.host().is_none() {
            return false;
        }
        if keep == Keep::Nothing
            && !page.pinned()
            && let Some((change, host)) = place.drop_host()
        {
            drop(place);
            host_freed(page);
            drop(host);
            self.host_copy_dropped(reason);
            self.counters.counted(change.from, change.to, reason);
        }
        true
    }

    /// An NVMe slot of `len` bytes. When NVMe is full, the journal is
    /// flushed first: extents it retired become free once it is.
    fn allocate(&self, nvme: &dyn Tier, len: u64) -> StoreResult<Slot> {
        match (nvme.allocate(len), &self.manifest) {
            (Err(TierError::Full { .. }), Some(manifest)) => {
                manifest.flush().map_err(StoreError::Manifest)?;
                Ok(nvme.allocate(len)?)
            }
            (slot, _) => Ok(slot?),
        }
    }

    /// Reads NVMe copies in one batch, each checked against its CRC32C. A
    /// copy that fails its check or its read makes its page lost (gone,
    /// reason `integrity`, for every sequence sharing it), unless the page
    /// has another copy by now.
    pub(crate) fn read_copies(&self, layout: &Layout, copies: Vec<(Arc<PhysPage>, NvmeCopy)>) -> Vec<CopyRead> {
        let Some(nvme) = self.nvme.as_ref() else {
            return copies.iter().map(|_| CopyRead::Lost).collect();
        };
        let page_len = layout.page_bytes();
        let reads = copies
            .iter()
            .map(|(_, c)| (Arc::clone(&c.slot), AlignedBuf::zeroed(c.slot.reserved() as usize)))
            .collect();
        let mut out = Vec::with_capacity(copies.len());
        let reading = Instant::now();
        for ((page, copy), done) in copies.into_iter().zip(nvme.read_many(reads)) {
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
            if intact.is_none() {
                Counters::add(&self.counters.integrity_failures, 1);
            }
            out.push(match intact {
                Some(buf) => CopyRead::Intact(buf),
                None if self.mark_lost(&page, &copy) => CopyRead::Lost,
                None => CopyRead::Elsewhere,
            });
        }
        if !out.is_empty() {
            self.counters.latency.nvme_read.observe(reading.elapsed());
        }
        out
    }

    /// Marks a page lost after its NVMe copy failed, unless another copy
    /// exists now. Returns whether it is lost.
    fn mark_lost(&self, page: &PhysPage, failed: &NvmeCopy) -> bool {
        let mut place = page.place.write();
        match place.lose_nvme_copy(&failed.slot) {
            Lost::Now { change, failed } => {
                let lost = Record::Lost {
                    phys: page.id,
                    reason: Reason::Integrity,
                };
                self.journal_retiring(vec![lost], vec![failed]);
                drop(place);
                self.counters.counted(change.from, change.to, Reason::Integrity);
                true
            }
            Lost::Already => true,
            Lost::Elsewhere => false,
        }
    }

    /// Journals the pages being freed that had an NVMe copy (or a durable
    /// prefix); their extents are reused once the records are durable.
    pub(crate) fn journal_freed(&self, freed: &[Arc<PhysPage>]) {
        for page in freed {
            let place = page.place.read();
            let copies: Vec<_> = [place.nvme(), place.durable_prefix()]
                .into_iter()
                .flatten()
                .map(|c| Arc::clone(&c.slot))
                .collect();
            if !copies.is_empty() {
                self.journal_retiring(vec![Record::Unpersist { phys: page.id }], copies);
            }
        }
    }
}

/// The record of a page's new NVMe copy of `bytes` (the whole slot), of
/// which the first `rows` rows are the page's.
fn persist_record(page: &PhysPage, offset: u64, len: u64, crc: u32, rows: u32, bytes: &[u8]) -> Record {
    let layout = &page.layout;
    let keys = &bytes[..rows as usize * layout.row_bytes()];
    Record::Persist {
        phys: page.id,
        offset,
        len,
        crc,
        rows,
        digest: if keys.is_empty() {
            Vec::new()
        } else {
            kvtier_core::PageIndex::entry_of(layout.dtype(), layout.head_dim() as usize, keys)
        },
    }
}
