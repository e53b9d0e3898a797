//! Making pages hot: the one swap-in path, for selections and prefetches
//! (best effort) and explicit transitions (all or nothing). Device room is
//! reserved first, then host copies go up directly and NVMe-only pages are
//! read in one batch (kept in host memory, with promotion on read); a copy
//! is installed only into a page that did not change meanwhile.

use std::sync::Arc;
use std::time::Instant;

use kvtier_core::Reason;
use kvtier_tiers::{Slot, TierError, TierKind};

use super::HotSet;
use crate::host::HostCache;
use crate::page::PhysPage;
use crate::reader::Reader;
use crate::stats::{Counters, Latency};
use crate::{StoreError, StoreResult};

/// Where the pages of one swap-in came from, and what it cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwapReport {
    /// Pages that were hot already: nothing to copy.
    pub already_hot: u32,
    /// Pages made hot from their copy in host memory.
    pub from_host: u32,
    /// Pages made hot from NVMe (read in one batch).
    pub from_nvme: u32,
    /// Could not be made hot: no device room left that was not pinned, or
    /// the page's bytes were lost.
    pub not_hot: u32,
    /// Microseconds the host copies took.
    pub host_micros: u64,
    /// Microseconds the NVMe reads and their copies took.
    pub nvme_micros: u64,
}

/// The pages of one swap-in by where their bytes come from.
struct Sources {
    from_host: Vec<Arc<PhysPage>>,
    from_nvme: Vec<Arc<PhysPage>>,
}

impl HotSet {
    /// Makes as many of `pages` hot as device room allows (the caller
    /// keeps them pinned): the rest stay cold, counted as not hot.
    pub(crate) fn make_hot(&self, pages: &[Arc<PhysPage>], reason: Reason, reader: &Reader<'_>) -> SwapReport {
        let (mut report, sources) = self.sources(pages);
        // Under the loop policy only an explicit swap-in takes a resident
        // page's room: on a loop, keeping the subset is what hits.
        let take_resident = reason == Reason::Explicit;
        let (host_slots, short) = self.reserve(&sources.from_host, reader.host, take_resident);
        let nvme_slots = match short {
            None => self.reserve(&sources.from_nvme, reader.host, take_resident).0,
            Some(_) => Vec::new(),
        };
        self.swap(sources, host_slots, nvme_slots, reason, reader, &mut report);
        report
    }

    /// Makes every one of `pages` hot, or fails with no page moved when
    /// the device has no room for them all (pages lost meanwhile stay
    /// gone). The caller holds their sequence's lock.
    pub(crate) fn make_all_hot(
        &self,
        pages: &[Arc<PhysPage>],
        reason: Reason,
        reader: &Reader<'_>,
    ) -> StoreResult<SwapReport> {
        let needed: u64 = pages.iter().map(|p| p.layout.page_bytes() as u64).sum();
        if needed > self.tier.capacity_bytes() {
            return Err(StoreError::ResourceExhausted(TierError::Full {
                tier: TierKind::Device,
                requested: needed,
                free: self.tier.capacity_bytes().saturating_sub(self.tier.used_bytes()),
                largest_free: 0,
                capacity: self.tier.capacity_bytes(),
            }));
        }
        let (mut report, sources) = self.sources(pages);
        let host_slots = match self.reserve(&sources.from_host, reader.host, true) {
            (slots, None) => slots,
            (_, Some(e)) => return Err(e),
        };
        let nvme_slots = match self.reserve(&sources.from_nvme, reader.host, true) {
            (slots, None) => slots,
            (_, Some(e)) => return Err(e),
        };
        self.swap(sources, host_slots, nvme_slots, reason, reader, &mut report);
        Ok(report)
    }

    /// Sorts pages by where their bytes are; lost and hot ones are counted.
    fn sources(&self, pages: &[Arc<PhysPage>]) -> (SwapReport, Sources) {
        let mut report = SwapReport::default();
        let (mut from_host, mut from_nvme) = (Vec::new(), Vec::new());
        for p in pages {
            let place = p.place.read();
            if place.lost().is_some() {
                report.not_hot += 1;
            } else if place.device().is_some() {
                report.already_hot += 1;
            } else if place.host().is_some() {
                from_host.push(Arc::clone(p));
            } else {
                from_nvme.push(Arc::clone(p));
            }
        }
        (report, Sources { from_host, from_nvme })
    }

    /// Device slots for `pages`, in order, until one cannot be had (then
    /// its error too).
    fn reserve(
        &self,
        pages: &[Arc<PhysPage>],
        host: &HostCache,
        take_resident: bool,
    ) -> (Vec<Slot>, Option<StoreError>) {
        let mut slots = Vec::with_capacity(pages.len());
        for page in pages {
            match self.allocate(page.layout.page_bytes() as u64, host, page.owner(), take_resident) {
                Ok(slot) => slots.push(slot),
                Err(e) => return (slots, Some(e)),
            }
        }
        (slots, None)
    }

    /// Copies each source group into its reserved slots (pages past the
    /// slots stay cold) and reports it.
    fn swap(
        &self,
        sources: Sources,
        host_slots: Vec<Slot>,
        nvme_slots: Vec<Slot>,
        reason: Reason,
        reader: &Reader<'_>,
        report: &mut SwapReport,
    ) {
        let latency: &Latency = &self.counters.latency;
        for (group, slots, count, micros, source, histogram) in [
            (
                sources.from_host,
                host_slots,
                &mut report.from_host,
                &mut report.host_micros,
                TierKind::Host,
                &latency.swap_in_from_host,
            ),
            (
                sources.from_nvme,
                nvme_slots,
                &mut report.from_nvme,
                &mut report.nvme_micros,
                TierKind::Nvme,
                &latency.swap_in_from_nvme,
            ),
        ] {
            let Some(page_bytes) = group.first().map(|p| p.layout.page_bytes() as u64) else {
                continue;
            };
            let start = Instant::now();
            let moved = self.copy_to_device(&group[..slots.len()], slots, reason, reader);
            *count = moved;
            report.not_hot += group.len() as u32 - moved;
            let elapsed = start.elapsed();
            *micros = elapsed.as_micros() as u64;
            histogram.observe(elapsed);
            self.counters
                .moved(source, TierKind::Device, u64::from(moved) * page_bytes);
        }
        if reason == Reason::Demand {
            Counters::add(&self.counters.swapped_from_host, u64::from(report.from_host));
            Counters::add(&self.counters.swapped_from_nvme, u64::from(report.from_nvme));
        }
    }

    /// Copies each page's bytes into its slot; returns how many became
    /// hot. Pages changed meanwhile, lost, or made hot by another path stay
    /// as they are (their slots are freed).
    fn copy_to_device(&self, pages: &[Arc<PhysPage>], slots: Vec<Slot>, reason: Reason, reader: &Reader<'_>) -> u32 {
        let Some(layout) = pages.first().map(|p| Arc::clone(&p.layout)) else {
            return 0;
        };
        let versions: Vec<u64> = pages.iter().map(|p| p.place.read().version()).collect();
        let requests: Vec<(Arc<PhysPage>, u32)> = pages.iter().map(|p| (Arc::clone(p), layout.page_size())).collect();
        let originals = match reader.originals(&layout, &requests) {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "swap-in could not read pages");
                return 0;
            }
        };
        // Copy every readable page in one batch, then install the copies of
        // pages that did not change.
        let mut staged = Vec::with_capacity(pages.len());
        for (((page, version), bytes), slot) in pages.iter().zip(versions).zip(originals).zip(slots) {
            if let Some(bytes) = bytes {
                staged.push((page, version, bytes, slot));
            }
        }
        let batch = staged
            .iter_mut()
            .map(|(_, _, bytes, slot)| (slot, bytes.as_slice()))
            .collect();
        if let Err(e) = self.tier.write_batch(batch) {
            tracing::warn!(error = %e, "swap-in copy to the device failed");
            return 0;
        }
        let mut hot = Vec::new();
        for (page, version, _, slot) in staged {
            if self.install(page, slot, version, reason) {
                hot.push(Arc::clone(page));
            }
        }
        let moved = hot.len() as u32;
        self.touch(&hot);
        if self.policy == super::DevicePolicy::Loop {
            self.admit(hot.iter());
        }
        moved
    }

    fn install(&self, page: &PhysPage, slot: Slot, version: u64, reason: Reason) -> bool {
        let installed = page.place.write().install_device(slot, version, self.exclusive);
        let Ok((change, freed_host)) = installed else {
            return false;
        };
        drop(freed_host);
        self.counters.counted(change.from, change.to, reason);
        if reason == Reason::Prefetch {
            self.mark_arrived(page);
        }
        true
    }
}
