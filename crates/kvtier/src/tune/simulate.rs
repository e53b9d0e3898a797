//! Policies without an exact model — the device's loop policy (resident
//! subset and layer-ahead stream), host memory's frequency policy
//! (S3-FIFO's queues and second chances) and the store's host LRU (which
//! promotes a page read from NVMe only where memory has room, and
//! migrates in background rounds the calls make due) — run rather than modelled: the
//! trace's writes, reads, attaches and frees, of the pages the replay
//! samples, go through `kvtier_store::DeviceSimulation` or
//! `HostSimulation` (the store's own policy code) on a miniature tier, a
//! tier of the size times the sampling rate (Waldspurger et al., ATC'17),
//! one run per size.

use std::collections::HashMap;

use kvtier_store::{DevicePolicy, DeviceSimulation, HostPolicy, HostSimulation};
use serde::Serialize;

use super::pages::{PageKey, PageName, Walk, walk};
use crate::trace::Trace;

/// One size's miss ratio.
#[derive(Debug, Serialize)]
pub(crate) struct PolicyPoint {
    pub(crate) bytes: u64,
    pub(crate) fraction: f64,
    pub(crate) miss_ratio: f64,
}

/// How the recording server ran host memory, as its config has it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostSetting {
    /// `host_high_watermark`, `host_low_watermark`: the background
    /// migration's bounds.
    pub(crate) watermarks: (f64, f64),
    /// `promote_on_read`: a page read from NVMe comes back to memory.
    pub(crate) promote_on_read: bool,
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
    /// Pages a call placed.
    Write(Vec<PageKey>),
    /// A selection that swapped in (`hot`), or a read where the pages are.
    Read {
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
            events.push(match e.write {
                true => Step::Write(pages),
                false => Step::Read {
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

    /// The miss ratio of `policy` on its tier of `bytes` (host memory run
    /// as `host` says).
    pub(crate) fn miss_ratio(&self, policy: Simulated, bytes: u64, host: HostSetting) -> anyhow::Result<f64> {
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
            Simulated::Host(policy) => self.host_misses(policy, tier_pages, host)?,
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
                Step::Write(pages) => {
                    for &k in pages {
                        sim.write(k)?;
                    }
                }
                Step::Read {
                    hot: true,
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
    /// (NVMe holds every page), run as `host` says (its background rounds
    /// fall due where the calls make them).
    fn host_misses(&self, policy: HostPolicy, host_pages: u64, host: HostSetting) -> anyhow::Result<u64> {
        let (high, low) = host.watermarks;
        let mut sim = HostSimulation::new(policy, host_pages, self.pages, (high, low), host.promote_on_read)?;
        let mut missed = 0u64;
        for event in &self.events {
            match event {
                Step::Write(pages) => {
                    // A chain page already stored is shared, not written
                    // (one more request uses it; its place in line stays).
                    let written: Vec<PageKey> = pages
                        .iter()
                        .filter(|&&k| !(matches!(k.name, PageName::Chain(_)) && sim.attach(&k)))
                        .copied()
                        .collect();
                    sim.write(&written)?
                }
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
        host: HostSetting,
    ) -> anyhow::Result<Vec<PolicyPoint>> {
        let cores = kvtier_core::parallel::cores();
        kvtier_core::parallel::map(fractions, cores, |&fraction| {
            let bytes = (working_set as f64 * fraction) as u64;
            Ok(PolicyPoint {
                bytes,
                fraction,
                miss_ratio: self.miss_ratio(policy, bytes, host)?,
            })
        })
        .into_iter()
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tune::pages::tests::trace;

    /// Host memory of 512 pages filled by one write, then read whole
    /// twice: with the watermarks at 0.5, a round opens as the write's
    /// pages join the queues and takes half of them, which the first read
    /// misses (and promotes back, which opens another round, which the
    /// second read misses); at 1 nothing migrates.
    #[test]
    fn background_rounds_migrate_down_to_the_low_watermark_between_calls() {
        let pages: Vec<u32> = (0..512).collect();
        let t = trace(
            &[&[]],
            &[(0, true, &pages), (0, false, &pages), (0, false, &pages)],
            &[],
        );
        let stream = Stream::of(&t, 1.0);
        let bytes = 512 * t.shapes[0].page_bytes() as u64;
        let miss = |high, low| {
            let host = HostSetting {
                watermarks: (high, low),
                promote_on_read: true,
            };
            stream
                .miss_ratio(Simulated::Host(HostPolicy::Lru), bytes, host)
                .unwrap()
        };
        assert_eq!(miss(1.0, 1.0), 0.0);
        assert_eq!(miss(0.5, 0.5), 0.5);
    }

    /// A round opens inside the write that takes memory past its high
    /// watermark and takes the pages in line then (the first write's: the
    /// second's join the queues after all their slots are taken): host
    /// memory of 512 pages, 256 pages written, 256 more, all read.
    #[test]
    fn a_round_opens_inside_the_write_that_passes_the_high_watermark() {
        let (old, new): (Vec<u32>, Vec<u32>) = ((0..256).collect(), (256..512).collect());
        let all: Vec<u32> = (0..512).collect();
        let t = trace(&[&[]], &[(0, true, &old), (0, true, &new), (0, false, &all)], &[]);
        let bytes = 512 * t.shapes[0].page_bytes() as u64;
        let stream = Stream::of(&t, 1.0);
        let miss = |high| {
            let host = HostSetting {
                watermarks: (high, high),
                promote_on_read: false,
            };
            stream
                .miss_ratio(Simulated::Host(HostPolicy::Lru), bytes, host)
                .unwrap()
        };
        assert_eq!((miss(0.5), miss(1.0)), (0.5, 0.0));
    }
}
