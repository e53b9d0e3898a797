//! SetAccessTrace, and the record each traced operation leaves: which
//! pages of which (layer, KV head), from which tier (`access_trace.rs`
//! holds the format and the recorder).

use std::collections::BTreeMap;
use std::sync::Arc;

use kvtier_core::PageState;

use super::Store;
use crate::StoreResult;
use crate::access_trace::{HeadPages, SwapTiming, TraceConfig, TraceRecord, TraceStatus, Tracer, tier_letter};
use crate::catalog::Sequence;
use crate::device::SwapReport;
use crate::page::PhysPage;

impl Store {
    /// Starts recording page accesses to `config.path`; refused while a
    /// recording runs.
    pub fn start_access_trace(&self, config: TraceConfig) -> StoreResult<TraceStatus> {
        let device = if self.device.tier().emulated() {
            "emulated"
        } else {
            "gpu"
        };
        self.trace.start(config, "server", device)
    }

    /// Stops the recording (once everything queued is written) and returns
    /// its status; with none running, the last one's, if any.
    pub fn stop_access_trace(&self) -> Option<TraceStatus> {
        self.trace.stop()
    }

    /// The recording, if one runs, for a call on `seq`.
    pub(super) fn tracer(&self, seq: &Sequence) -> Option<Tracer> {
        self.trace.tracer(&seq.key, &seq.layout, &seq.hashes)
    }
}

/// Each chosen page's tier now (before a swap-in moves it), by (lane, page).
pub(super) fn tiers_of(chosen: &BTreeMap<(usize, usize), Arc<PhysPage>>) -> BTreeMap<(usize, usize), char> {
    chosen
        .iter()
        .map(|(&k, p)| (k, tier_letter(p.place.read().state())))
        .collect()
}

impl Tracer {
    /// A selection's record: the chosen pages of `lanes` ((KV head, lane)
    /// pairs) with the tier each was in before the swap-in.
    pub(super) fn selection(
        &self,
        seq: &Sequence,
        layer: u32,
        lanes: &[(u32, usize)],
        tiers: &BTreeMap<(usize, usize), char>,
        swap: Option<&SwapReport>,
        us: u64,
    ) {
        let mut access = self.access(layer, step_of(seq, lanes.first().map(|&(_, lane)| lane)), us);
        access.hot = swap.is_some();
        access.swap = swap.map(|s| SwapTiming {
            from_host: s.from_host,
            from_nvme: s.from_nvme,
            host_us: s.host_micros,
            nvme_us: s.nvme_micros,
        });
        for &(head, lane) in lanes {
            let pages = tiers.range((lane, 0)..(lane + 1, 0)).map(|(&(_, p), &t)| (p as u32, t));
            access.heads.push(self.head_pages(access.layer, head, pages));
        }
        self.record(TraceRecord::Read(access));
    }

    /// A fetch chunk's record: `chosen` are its (KV head, lane, page)s,
    /// head after head, and `states` each one's state when read.
    pub(super) fn fetch(
        &self,
        seq: &Sequence,
        layer: u32,
        chosen: &[(u32, usize, usize)],
        states: impl Iterator<Item = PageState>,
        us: u64,
    ) {
        let step = step_of(seq, chosen.first().map(|&(_, lane, _)| lane));
        let mut access = self.access(layer, step, us);
        let read: Vec<(u32, u32, char)> = chosen
            .iter()
            .zip(states)
            .map(|(&(head, _, page), state)| (head, page as u32, tier_letter(state)))
            .collect();
        for run in read.chunk_by(|a, b| a.0 == b.0) {
            let pages = run.iter().map(|&(_, page, tier)| (page, tier));
            access.heads.push(self.head_pages(access.layer, run[0].0, pages));
        }
        self.record(TraceRecord::Read(access));
    }

    /// A write's record: `placed` are the (lane, page) pairs it added, at
    /// position `step`.
    pub(super) fn write(&self, seq: &Sequence, layer: u32, step: u64, placed: &[(usize, usize)], us: u64) {
        let mut access = self.access(layer, step, us);
        let kv_heads = seq.layout.num_kv_heads() as usize;
        let mut by_head: BTreeMap<u32, Vec<(u32, char)>> = BTreeMap::new();
        for &(lane, page) in placed {
            let tier = seq.lanes[lane]
                .page(page)
                .map_or('G', |p| tier_letter(crate::page::state_of(p)));
            by_head
                .entry((lane % kv_heads) as u32)
                .or_default()
                .push((page as u32, tier));
        }
        for (head, pages) in by_head {
            access
                .heads
                .push(self.head_pages(access.layer, head, pages.into_iter()));
        }
        self.record(TraceRecord::Write(access));
    }

    /// The sampled pages of one head of stored layer `layer`, with their
    /// tiers.
    fn head_pages(&self, layer: u32, head: u32, pages: impl Iterator<Item = (u32, char)>) -> HeadPages {
        let (pages, from) = pages.filter(|&(p, _)| self.keeps(layer, head, p)).unzip();
        HeadPages { head, pages, from }
    }
}

/// The decode step a call on `lane` (any of its layer's) belongs to: the
/// position its layer has reached.
fn step_of(seq: &Sequence, lane: Option<usize>) -> u64 {
    lane.map_or(0, |lane| seq.lanes[lane].tokens())
}
