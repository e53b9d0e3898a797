//! Policies without an exact model — the device's loop policy (resident
//! subset and layer-ahead stream), host memory's frequency policy
//! (S3-FIFO's queues and second chances) and the store's host LRU (which
//! promotes a page read from NVMe only where memory has room, and
//! migrates in background rounds) — run rather than modelled: the
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
    /// When host memory's background migration rounds ended (µs into the
    /// recording, in order): a round that finds memory above its high
    /// watermark chases the writes that go on while it runs and ends with
    /// memory at the low one (unless nothing more can move).
    rounds: Vec<u64>,
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
        // Where the recording does not mark the rounds: at the store's
        // cadence from its start (whole ticks; the store's phase, and its
        // rounds' own length, are not in such a trace).
        let rounds = trace.rounds.clone().unwrap_or_else(|| {
            let tick = kvtier_store::BACKGROUND_TICK.as_micros() as u64;
            let end = trace.events.iter().map(|e| e.access.t_us).max().unwrap_or(0);
            (0..=end / tick).map(|k| k * tick).collect()
        });
        Self {
            events,
            selected,
            read,
            pages,
            page_bytes: seen.values().sum::<u64>() as f64 / pages.max(1) as f64,
            rate: trace.header.sample * rate,
            rounds,
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
    /// (NVMe holds every page), run as `host` says, with its background
    /// migration rounds where the stream has them.
    fn host_misses(&self, policy: HostPolicy, host_pages: u64, host: HostSetting) -> anyhow::Result<u64> {
        let (high, low) = host.watermarks;
        let mut sim = HostSimulation::new(policy, host_pages, self.pages, (high, low), host.promote_on_read)?;
        let mut rounds = self.rounds.iter().copied().peekable();
        let mut missed = 0u64;
        for event in &self.events {
            // The rounds ended by the end of this call: those that ended
            // before it began run once before it (a second in a row would
            // find memory below its watermarks), those that ended while a
            // write ran, once inside it.
            let mut inside = false;
            if let Step::Write { t_us, .. } | Step::Read { t_us, .. } = event {
                let write_began = match event {
                    Step::Write { start_us, .. } => Some(*start_us),
                    _ => None,
                };
                let mut before = false;
                while let Some(r) = rounds.next_if(|&r| r <= *t_us) {
                    match write_began {
                        Some(began) if r >= began => inside = true,
                        _ => before = true,
                    }
                }
                if before {
                    sim.background();
                }
            }
            match event {
                Step::Write { pages, .. } => {
                    // A chain page already stored is shared, not written
                    // (one more request uses it; its place in line stays).
                    let written: Vec<PageKey> = pages
                        .iter()
                        .filter(|&&k| !(matches!(k.name, PageName::Chain(_)) && sim.attach(&k)))
                        .copied()
                        .collect();
                    sim.write(&written, inside)?
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
    /// twice, a background tick apart: with the watermarks at 0.5 each
    /// round migrates the 256 least recently used pages first (four of the
    /// store's batches), and the reads miss them; at 1 nothing migrates.
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

    /// A recording that marks the background's rounds is replayed with
    /// those rounds, not the cadence: the same write and two reads as
    /// above, with no round, with one between the reads (only the second
    /// read misses), with one before each read, and, without promotion
    /// on read, with one ending exactly as the first read does (both
    /// reads miss the pages it migrated).
    #[test]
    fn marked_rounds_replace_the_stores_cadence() {
        let pages: Vec<u32> = (0..512).collect();
        let mut t = trace(
            &[&[]],
            &[(0, true, &pages), (0, false, &pages), (0, false, &pages)],
            &[],
        );
        let bytes = 512 * t.shapes[0].page_bytes() as u64;
        let mut miss = |rounds: &[u64], promote_on_read| {
            t.rounds = Some(rounds.to_vec());
            let host = HostSetting {
                watermarks: (0.5, 0.5),
                promote_on_read,
            };
            Stream::of(&t, 1.0)
                .miss_ratio(Simulated::Host(HostPolicy::Lru), bytes, host)
                .unwrap()
        };
        assert_eq!(miss(&[], true), 0.0);
        assert_eq!(miss(&[45_000], true), 0.25);
        assert_eq!(miss(&[0, 30_000, 60_000], true), 0.5);
        assert_eq!(miss(&[30_000], false), 0.5);
    }

    /// A round that ended while a write ran runs inside it, after its
    /// pages hold their slots and before they join the queues, so it
    /// migrates older pages; one that ended before the write began runs
    /// before it. Host memory of 512 pages, watermarks 0.5: 256 pages
    /// written at 0, 256 more by a write from 20 to 30 ms, all read at
    /// 60 ms. Inside the second write the round finds the first write's
    /// 256 in line and migrates them (the read misses half); before it,
    /// memory is at its low watermark and nothing moves.
    #[test]
    fn a_round_inside_a_write_migrates_older_pages() {
        let (old, new): (Vec<u32>, Vec<u32>) = ((0..256).collect(), (256..512).collect());
        let all: Vec<u32> = (0..512).collect();
        let mut t = trace(&[&[]], &[(0, true, &old), (0, true, &new), (0, false, &all)], &[]);
        // Events are 30 ms apart: the second write ends at 30 ms.
        t.events[1].access.us = 10_000;
        let bytes = 512 * t.shapes[0].page_bytes() as u64;
        let mut miss = |rounds: &[u64]| {
            t.rounds = Some(rounds.to_vec());
            let host = HostSetting {
                watermarks: (0.5, 0.5),
                promote_on_read: false,
            };
            Stream::of(&t, 1.0)
                .miss_ratio(Simulated::Host(HostPolicy::Lru), bytes, host)
                .unwrap()
        };
        assert_eq!(miss(&[25_000]), 0.5);
        assert_eq!(miss(&[15_000]), 0.0);
    }
}
