//! Making selected pages hot: one batched swap-in per call (host → device,
//! NVMe → host → device), installed only into pages that did not change
//! meanwhile.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvtier_core::Reason;
use kvtier_tiers::{Slot, TierKind};

use super::HotSet;
use crate::page::PhysPage;
use crate::reader::Reader;
use crate::stats::Counters;
use crate::sync::{read, write};

/// Where the pages of one swap-in came from, and what it cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwapReport {
    pub already_hot: u32,
    pub from_host: u32,
    pub from_nvme: u32,
    /// Could not be made hot: no device room left that was not pinned, or
    /// the page's bytes were lost.
    pub not_hot: u32,
    pub host_micros: u64,
    pub nvme_micros: u64,
}

impl HotSet {
    /// Makes `pages` hot (the caller keeps them pinned). Host copies go to
    /// the device directly; NVMe-only pages are read in one batch (and kept
    /// in host memory, with promotion on read), then copied up.
    pub(crate) fn make_hot(&self, pages: &[Arc<PhysPage>], reason: Reason, reader: &Reader<'_>) -> SwapReport {
        let mut report = SwapReport::default();
        let (mut from_host, mut from_nvme) = (Vec::new(), Vec::new());
        for p in pages {
            let place = read(&p.place);
            if place.lost.is_some() {
                report.not_hot += 1;
            } else if place.device.is_some() {
                report.already_hot += 1;
            } else if place.host.is_some() {
                from_host.push(Arc::clone(p));
            } else {
                from_nvme.push(Arc::clone(p));
            }
        }
        let latency = &self.counters.latency;
        for (group, count, micros, source, histogram) in [
            (
                from_host,
                &mut report.from_host,
                &mut report.host_micros,
                TierKind::Host,
                &latency.swap_in_from_host,
            ),
            (
                from_nvme,
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
            let moved = self.copy_to_device(&group, reason, reader);
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
        report
    }

    /// Copies each page's bytes into a new device slot; returns how many
    /// became hot. Pages changed meanwhile, lost, or without device room
    /// stay as they are.
    fn copy_to_device(&self, pages: &[Arc<PhysPage>], reason: Reason, reader: &Reader<'_>) -> u32 {
        let Some(layout) = pages.first().map(|p| Arc::clone(&p.layout)) else {
            return 0;
        };
        let versions: Vec<u64> = pages.iter().map(|p| read(&p.place).version).collect();
        let requests: Vec<(Arc<PhysPage>, u32)> = pages.iter().map(|p| (Arc::clone(p), layout.page_size())).collect();
        let originals = match reader.originals(&layout, &requests) {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "swap-in could not read pages");
                return 0;
            }
        };
        // Reserve device room for every readable page, copy them all in one
        // batch, then install the copies of pages that did not change.
        let mut staged = Vec::new();
        for ((page, version), bytes) in pages.iter().zip(versions).zip(originals) {
            let Some(bytes) = bytes else { continue };
            let Ok(slot) = self.allocate(bytes.len() as u64, reader.host, page.owner()) else {
                break;
            };
            staged.push((page, version, bytes, slot));
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
            if self.install_device_copy(page, slot, version, reason) {
                hot.push(Arc::clone(page));
            }
        }
        let moved = hot.len() as u32;
        self.touch(&hot);
        moved
    }

    fn install_device_copy(&self, page: &PhysPage, slot: Slot, version: u64, reason: Reason) -> bool {
        let mut place = write(&page.place);
        if place.device.is_some() || place.lost.is_some() || place.version != version {
            return false;
        }
        let from = place.state();
        place.device = Some(slot);
        // Exclusive: the device copy replaces the host copy (an NVMe copy,
        // being durable, stays).
        let freed_host = if self.exclusive { place.host.take() } else { None };
        drop(place);
        drop(freed_host);
        self.counters.transition(from, kvtier_core::PageState::Hot, reason, 1);
        if reason == Reason::Prefetch {
            page.prefetched.store(true, Ordering::Release);
        }
        true
    }
}
