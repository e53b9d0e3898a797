//! Device policies without an exact model — the loop policy's resident
//! subset and layer-ahead stream — run rather than modelled: the trace's
//! writes and swap-in selections, of the pages the replay samples, go
//! through `kvtier_store::DeviceSimulation` (the store's own policy code)
//! on a miniature device, a device of the size times the sampling rate
//! (Waldspurger et al., ATC'17), one run per size.

use std::collections::HashMap;

use kvtier_store::{DevicePolicy, DeviceSimulation};
use serde::Serialize;

use super::{PageKey, sampled_pages};
use crate::trace::Trace;

/// One size's simulated device miss ratio.
#[derive(Debug, Serialize)]
pub(crate) struct PolicyPoint {
    pub(crate) bytes: u64,
    pub(crate) fraction: f64,
    pub(crate) device_miss_ratio: f64,
}

/// The stream the simulations replay: the sampled pages of each write and
/// each selection that swapped in, in order.
pub(crate) struct Stream {
    events: Vec<Step>,
    /// Pages the selections chose, over all of them.
    selected: u64,
    /// Distinct pages sampled, and their mean size in bytes.
    pages: u64,
    page_bytes: f64,
    /// The share of the workload's pages the stream holds.
    rate: f64,
}

enum Step {
    Write(Vec<PageKey>),
    Select {
        sequence: u64,
        layer: u32,
        layers: u32,
        pages: Vec<PageKey>,
    },
}

impl Stream {
    /// The writes and swap-in selections of `trace`, of the pages a replay
    /// at `rate` keeps (the recording's own sampling comes on top).
    pub(crate) fn of(trace: &Trace, rate: f64) -> Self {
        let mut seen: HashMap<PageKey, u64> = HashMap::new();
        let mut events = Vec::new();
        for e in &trace.events {
            let bytes = trace.shapes[e.sequence].page_bytes() as u64;
            let pages: Vec<PageKey> = sampled_pages(e, rate).into_iter().map(|(k, _)| k).collect();
            for &k in &pages {
                seen.insert(k, bytes);
            }
            if e.write {
                events.push(Step::Write(pages));
            } else if e.access.hot {
                events.push(Step::Select {
                    sequence: e.sequence as u64,
                    layer: e.access.layer,
                    layers: trace.shapes[e.sequence].layers,
                    pages,
                });
            }
        }
        let pages = seen.len() as u64;
        let selected = events
            .iter()
            .map(|e| match e {
                Step::Select { pages, .. } => pages.len() as u64,
                Step::Write(_) => 0,
            })
            .sum();
        Self {
            events,
            selected,
            pages,
            page_bytes: seen.values().sum::<u64>() as f64 / pages.max(1) as f64,
            rate: trace.header.sample * rate,
        }
    }

    /// The device miss ratio of `policy` on a device of `bytes`.
    pub(crate) fn miss_ratio(&self, policy: DevicePolicy, bytes: u64) -> anyhow::Result<f64> {
        let device_pages = (bytes as f64 * self.rate / self.page_bytes.max(1.0)).round() as u64;
        if device_pages == 0 {
            // No page fits: every selected page misses.
            return Ok(if self.selected > 0 { 1.0 } else { 0.0 });
        }
        let mut sim = DeviceSimulation::new(policy, device_pages, self.pages)?;
        let mut missed = 0u64;
        for event in &self.events {
            match event {
                Step::Write(pages) => {
                    for &k in pages {
                        sim.write(k)?;
                    }
                }
                Step::Select {
                    sequence,
                    layer,
                    layers,
                    pages,
                } => missed += sim.select(*sequence, *layer, *layers, pages)?,
            }
        }
        Ok(missed as f64 / self.selected.max(1) as f64)
    }

    /// `policy`'s miss ratio at each of `fractions` of `working_set`, the
    /// sizes simulated over the cores.
    pub(crate) fn curve(
        &self,
        policy: DevicePolicy,
        working_set: u64,
        fractions: &[f64],
    ) -> anyhow::Result<Vec<PolicyPoint>> {
        let cores = kvtier_core::parallel::cores();
        kvtier_core::parallel::map(fractions, cores, |&fraction| {
            let bytes = (working_set as f64 * fraction) as u64;
            Ok(PolicyPoint {
                bytes,
                fraction,
                device_miss_ratio: self.miss_ratio(policy, bytes)?,
            })
        })
        .into_iter()
        .collect()
    }
}
