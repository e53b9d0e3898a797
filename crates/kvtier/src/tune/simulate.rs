//! Policies without an exact model — the device's loop policy (resident
//! subset and layer-ahead stream) and host memory's frequency policy
//! (S3-FIFO's queues and second chances) — run rather than modelled: the
//! trace's writes, reads, attaches and frees, of the pages the replay
//! samples, go through `kvtier_store::DeviceSimulation` or
//! `HostSimulation` (the store's own policy code) on a miniature tier, a
//! tier of the size times the sampling rate (Waldspurger et al., ATC'17),
//! one run per size.

use std::collections::HashMap;

use kvtier_store::{DevicePolicy, DeviceSimulation, HostPolicy, HostSimulation};
use serde::Serialize;

use super::pages::{PageKey, Walk, walk};
use crate::trace::Trace;

/// One size's miss ratio.
#[derive(Debug, Serialize)]
pub(crate) struct PolicyPoint {
    pub(crate) bytes: u64,
    pub(crate) fraction: f64,
    pub(crate) miss_ratio: f64,
}

/// A policy to simulate, on the tier it governs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Simulated {
    Device(DevicePolicy),
    Host(HostPolicy),
}

/// The stream the simulations replay: the sampled pages of each write,
/// read, attach and free, in order.
pub(crate) struct Stream {
    events: Vec<Step>,
    /// Pages the selections that swapped in chose (the device's reads),
    /// and pages read at all (host memory's).
    selected: u64,
    read: u64,
    /// Distinct pages sampled, and their mean size in bytes.
    pages: u64,
    page_bytes: f64,
    /// The share of the workload's pages the stream holds.
    rate: f64,
}

enum Step {
    /// Pages a call placed, which ran from `start_us` to `t_us` (µs into
    /// the recording).
    Write {
        start_us: u64,
        t_us: u64,
        pages: Vec<PageKey>,
    },
    /// A selection that swapped in (`hot`), or a read where the pages are.
    Read {
        t_us: u64,
        hot: bool,
        sequence: u64,
        layer: u32,
        layers: u32,
        pages: Vec<PageKey>,
    },
    Attach(Vec<PageKey>),
    Free(Vec<PageKey>),
}

impl Stream {
    /// The writes, reads, attaches and frees of `trace`, of the pages a
    /// replay at `rate` keeps (the recording's own sampling comes on top).
    pub(crate) fn of(trace: &Trace, rate: f64) -> Self {
        let mut seen: HashMap<PageKey, u64> = HashMap::new();
        let mut events = Vec::new();
        for step in walk(trace, rate) {
            let (e, pages) = match step {
                Walk::Access(e, pages) => (e, pages),
                Walk::Attach(keys) => {
                    events.push(Step::Attach(keys));
                    continue;
                }
                Walk::Free(keys) => {
                    events.push(Step::Free(keys));
                    continue;
                }
            };
            let bytes = trace.shapes[e.sequence].page_bytes() as u64;
            let pages: Vec<PageKey> = pages.into_iter().map(|(k, _)| k).collect();
            for &k in &pages {
                seen.insert(k, bytes);
            }
            let t_us = e.access.t_us;
            events.push(match e.write {
                true => Step::Write {
                    start_us: t_us.saturating_sub(e.access.us),
                    t_us,
                    pages,
                },
                false => Step::Read {
                    t_us,
                    hot: e.access.hot,
                    sequence: e.sequence as u64,
                    layer: e.access.layer,
                    layers: trace.shapes[e.sequence].layers,
                    pages,
                },
            });
        }
        let (mut selected, mut read) = (0, 0);
        for e in &events {
            if let Step::Read { hot, pages, .. } = e {
                read += pages.len() as u64;
                selected += if *hot { pages.len() as u64 } else { 0 };
            }
        }
        let pages = seen.len() as u64;
        Self {
            events,
            selected,
            read,
            pages,
            page_bytes: seen.values().sum::<u64>() as f64 / pages.max(1) as f64,
            rate: trace.header.sample * rate,
        }
    }

    /// The miss ratio of `policy` on its tier of `bytes` (host memory
    /// migrating between `watermarks`, high and low).
    pub(crate) fn miss_ratio(&self, policy: Simulated, bytes: u64, watermarks: (f64, f64)) -> anyhow::Result<f64> {
        let tier_pages = (bytes as f64 * self.rate / self.page_bytes.max(1.0)).round() as u64;
        let counted = match policy {
            Simulated::Device(_) => self.selected,
            Simulated::Host(_) => self.read,
        };
        if tier_pages == 0 {
            // No page fits: every counted page misses.
            return Ok(if counted > 0 { 1.0 } else { 0.0 });
        }
        let missed = match policy {
            Simulated::Device(policy) => self.device_misses(policy, tier_pages)?,
            Simulated::Host(policy) => self.host_misses(policy, tier_pages, watermarks)?,
        };
        Ok(missed as f64 / counted.max(1) as f64)
    }

    /// Selected pages not on a device of `device_pages` under `policy`
    /// (host memory holds every page).
    fn device_misses(&self, policy: DevicePolicy, device_pages: u64) -> anyhow::Result<u64> {
        let mut sim = DeviceSimulation::new(policy, device_pages, self.pages)?;
        let mut missed = 0u64;
        for event in &self.events {
            match event {
                Step::Write { pages, .. } => {
                    for &k in pages {
                        sim.write(k)?;
                    }
                }
                Step::Read {
                    hot: true,
                    t_us: _,
                    sequence,
                    layer,
                    layers,
                    pages,
                } => missed += sim.select(*sequence, *layer, *layers, pages)?,
                // A read in place makes nothing hot.
                Step::Read { hot: false, .. } => {}
                Step::Attach(pages) => {
                    for k in pages {
                        sim.attach(k);
                    }
                }
                Step::Free(pages) => {
                    for k in pages {
                        sim.free(k);
                    }
                }
            }
        }
        Ok(missed)
    }

    /// Pages read but not in host memory of `host_pages` under `policy`
    /// (NVMe holds every page), with its background migration between
    /// `(high, low)` at the store's cadence in the recording's time.
    fn host_misses(&self, policy: HostPolicy, host_pages: u64, (high, low): (f64, f64)) -> anyhow::Result<u64> {
        let mut sim = HostSimulation::new(policy, host_pages, self.pages, high, low)?;
        let tick = kvtier_store::BACKGROUND_TICK.as_micros() as u64;
        let mut next_tick = 0;
        let mut missed = 0u64;
        for event in &self.events {
            // A round due by the end of this call runs before it, or
            // inside it when due while a write ran.
            let mut inside = false;
            if let Step::Write { t_us, .. } | Step::Read { t_us, .. } = event
                && *t_us >= next_tick
            {
                match event {
                    Step::Write { start_us, .. } if *start_us <= next_tick => inside = true,
                    _ => sim.background(),
                }
                next_tick = (t_us / tick + 1) * tick;
            }
            match event {
                Step::Write { pages, .. } => sim.write(pages, inside)?,
                Step::Read { pages, .. } => missed += sim.read(pages)?,
                Step::Attach(pages) => {
                    for k in pages {
                        sim.attach(k);
                    }
                }
                Step::Free(pages) => {
                    for k in pages {
                        sim.free(k);
                    }
                }
            }
        }
        Ok(missed)
    }

    /// `policy`'s miss ratio at each of `fractions` of `working_set`, the
    /// sizes simulated over the cores.
    pub(crate) fn curve(
        &self,
        policy: Simulated,
        working_set: u64,
        fractions: &[f64],
        watermarks: (f64, f64),
    ) -> anyhow::Result<Vec<PolicyPoint>> {
        let cores = kvtier_core::parallel::cores();
        kvtier_core::parallel::map(fractions, cores, |&fraction| {
            let bytes = (working_set as f64 * fraction) as u64;
            Ok(PolicyPoint {
                bytes,
                fraction,
                miss_ratio: self.miss_ratio(policy, bytes, watermarks)?,
            })
        })
        .into_iter()
        .collect()
    }
}
