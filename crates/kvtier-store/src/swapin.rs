//! Making selected pages hot: one batched swap-in per call (host → device,
//! NVMe → host → device), background workers that run late swap-ins and
//! prefetches (demand first), and the accounting of both.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use kvtier_core::Reason;
use kvtier_tiers::Slot;

use crate::page::PhysPage;
use crate::stats::Counters;
use crate::sync::{lock, read, write};
use crate::{DeviceCache, Store};

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

type Job = Box<dyn FnOnce() + Send>;

/// Background workers: demand jobs (swap-ins past their deadline) always run
/// before prefetch jobs.
#[derive(Debug, Default)]
pub(crate) struct Workers {
    queue: Mutex<JobQueue>,
    ready: Condvar,
}

#[derive(Default)]
struct JobQueue {
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    /// Jobs taken and not finished yet.
    running: usize,
    closed: bool,
}

impl std::fmt::Debug for JobQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobQueue")
            .field("demand", &self.demand.len())
            .field("prefetch", &self.prefetch.len())
            .field("closed", &self.closed)
            .finish()
    }
}

/// Prefetch jobs waiting beyond this many are dropped: a prediction that
/// old is stale anyway.
const PREFETCH_BACKLOG: usize = 256;

impl Workers {
    pub(crate) fn start(threads: usize) -> Arc<Self> {
        let workers = Arc::new(Self::default());
        for i in 0..threads {
            let w = Arc::clone(&workers);
            let spawned = std::thread::Builder::new()
                .name(format!("kvtier-swap-{i}"))
                .spawn(move || w.run());
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start a swap-in worker");
            }
        }
        workers
    }

    fn run(&self) {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(job) = q.demand.pop_front().or_else(|| q.prefetch.pop_front()) {
                        q.running += 1;
                        break job;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            job();
            lock(&self.queue).running -= 1;
            self.ready.notify_all();
        }
    }

    /// Blocks until no job is queued or running.
    pub(crate) fn wait_idle(&self) {
        let mut q = lock(&self.queue);
        while q.running > 0 || !q.demand.is_empty() || !q.prefetch.is_empty() {
            q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub(crate) fn demand(&self, job: Job) {
        lock(&self.queue).demand.push_back(job);
        self.ready.notify_one();
    }

    /// Queues a prefetch; false when the backlog is full and it was dropped.
    pub(crate) fn prefetch(&self, job: Job) -> bool {
        let mut q = lock(&self.queue);
        if q.prefetch.len() >= PREFETCH_BACKLOG {
            return false;
        }
        q.prefetch.push_back(job);
        drop(q);
        self.ready.notify_one();
        true
    }

    pub(crate) fn close(&self) {
        lock(&self.queue).closed = true;
        self.ready.notify_all();
    }
}

impl Store {
    /// Makes `pages` hot (the caller keeps them pinned). Host copies go to
    /// the device directly; NVMe-only pages are read in one batch (and kept
    /// in host memory, with promotion on read), then copied up.
    pub(crate) fn make_hot(&self, pages: &[Arc<PhysPage>], reason: Reason) -> SwapReport {
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
        for (group, count, micros) in [
            (from_host, &mut report.from_host, &mut report.host_micros),
            (from_nvme, &mut report.from_nvme, &mut report.nvme_micros),
        ] {
            if group.is_empty() {
                continue;
            }
            let start = Instant::now();
            let moved = self.copy_to_device(&group, reason);
            *count = moved;
            report.not_hot += group.len() as u32 - moved;
            *micros = start.elapsed().as_micros() as u64;
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
    fn copy_to_device(&self, pages: &[Arc<PhysPage>], reason: Reason) -> u32 {
        let Some(layout) = pages.first().map(|p| Arc::clone(&p.layout)) else {
            return 0;
        };
        let versions: Vec<u64> = pages.iter().map(|p| read(&p.place).version).collect();
        let requests: Vec<(Arc<PhysPage>, u32)> = pages.iter().map(|p| (Arc::clone(p), layout.page_size())).collect();
        let originals = match self.read_originals(&layout, &requests) {
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
            let Ok(slot) = self.allocate_device(bytes.len() as u64) else {
                break;
            };
            staged.push((page, version, bytes, slot));
        }
        let batch = staged
            .iter_mut()
            .map(|(_, _, bytes, slot)| (slot, bytes.as_slice()))
            .collect();
        if let Err(e) = self.device.write_batch(batch) {
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
        self.touch_device(hot);
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
        let freed_host = if self.config.device_cache == DeviceCache::Exclusive {
            place.host.take()
        } else {
            None
        };
        drop(place);
        drop(freed_host);
        self.counters.transition(from, kvtier_core::PageState::Hot, reason, 1);
        if reason == Reason::Prefetch {
            page.prefetched.store(true, Ordering::Release);
        }
        true
    }

    /// Counts a selection's use of pages a prefetch brought up.
    pub(crate) fn note_used(&self, pages: &[Arc<PhysPage>]) {
        let used = pages
            .iter()
            .filter(|p| p.prefetched.swap(false, Ordering::AcqRel))
            .count();
        Counters::add(&self.counters.prefetch_used, used as u64);
    }

    /// Counts prefetched pages that left the device, or were freed, unused.
    pub(crate) fn note_wasted(&self, page: &PhysPage) {
        if page.prefetched.swap(false, Ordering::AcqRel) {
            Counters::add(&self.counters.prefetch_wasted, 1);
        }
    }
}
