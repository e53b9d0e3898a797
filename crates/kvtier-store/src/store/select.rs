//! Query-driven selection (docs/CONCEPTS.md §3): score every page of each lane in
//! the head range through its digest, choose the top pages, report them in
//! position order with bound and state, count the gone ones that would have
//! been chosen, and optionally read the chosen pages.

use kvtier_core::rank::{ColdSketches, LaneQuery, MAX_CANDIDATES, Mode, Ranking};
use kvtier_core::reuse::rank_lane_reusing;
use kvtier_core::select::{Aggregation, Budget, Shard, select};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::{Layout, LogicalPage, PageState, Reason, SequenceKey, TenantId, parallel, wire};

use super::attend::HeadAttention;
use super::fetch::FetchedPage;
use super::trace::tiers_of;
use super::{Store, micros};
use crate::catalog::{HeadRange, Sequence};
use crate::device::SwapReport;
use crate::page::{PhysPage, Pins, StoreLane, state_of};
use crate::page_buf::PageBuf;
use crate::reader::{LaneSketches, Reader};
use crate::stats::{Counters, PrefetchKind};
use crate::{StoreError, StoreResult};

/// A SelectPages request: one layer's queries, and what to do with the
/// pages they choose.
#[derive(Debug, Clone, Copy)]
pub struct SelectPages<'a> {
    /// The layer to select in.
    pub layer: u32,
    /// The KV heads to select for, one lane each.
    pub heads: HeadRange,
    /// Post-RoPE queries of the query heads of `heads` (GQA group after
    /// group), `[query head][head_dim]`.
    pub queries: &'a [f32],
    /// Pages to choose per lane (per query head, without aggregation), sinks
    /// and window included.
    pub budget: Budget,
    /// How a GQA group's query heads score one page: max, mean, or one
    /// selection per query head; `None`: the mode's own
    /// ([`Mode::default_aggregation`]).
    pub aggregation: Option<Aggregation>,
    /// How pages are ranked: mode, candidates, softmax scale, top-p.
    pub ranking: Ranking,
    /// Context-parallel caller; `None` selects over the whole lane.
    pub shard: Option<Shard>,
    /// Also read the selected pages (gone pages have no data).
    pub with_data: bool,
    /// Make the selected pages hot, in one batched swap-in.
    pub swap_in: bool,
    /// Return by then: pages not hot yet come back cold with
    /// [`Miss::Deadline`] while their swap-in finishes in the background.
    pub deadline: Option<Duration>,
    /// Also promote, in the background and after demand swap-ins, the pages
    /// ranked next after the selection, up to this many per head.
    pub prefetch_pages: usize,
    /// Pin the selected pages (never demoted, moved or freed) for this long,
    /// or until the lease is released.
    pub lease: Option<Duration>,
}

impl SelectPages<'_> {
    /// The aggregation the request asked for, or its mode's own.
    pub fn aggregation(&self) -> Aggregation {
        self.aggregation
            .unwrap_or_else(|| self.ranking.mode.default_aggregation())
    }

    /// The most page bytes this selection reads from `seq` ([`data_bound`]).
    pub(super) fn data_bound(&self, seq: &Sequence) -> usize {
        data_bound(
            &seq.layout,
            seq.tokens(),
            self.budget.pages as u32,
            self.heads.count,
            self.aggregation(),
        )
    }
}

impl<'a> SelectPages<'a> {
    /// A plain selection: no data, swap-in, prefetch or lease.
    pub fn new(layer: u32, heads: HeadRange, queries: &'a [f32], budget: Budget) -> Self {
        Self {
            layer,
            heads,
            queries,
            budget,
            aggregation: None,
            ranking: Ranking::default(),
            shard: None,
            with_data: false,
            swap_in: false,
            deadline: None,
            prefetch_pages: 0,
            lease: None,
        }
    }
}

/// Why a selected page is not hot after a swap-in was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// Its swap-in did not finish before the deadline (it goes on).
    Deadline,
    /// The device had no room that was not pinned.
    NoRoom,
}

/// One chosen page.
#[derive(Debug, Clone, PartialEq)]
pub struct SelectedPage {
    /// The page's number in its lane.
    pub page: u32,
    /// The score the page was ranked by, aggregated over the group (or one
    /// query head's): `U` (quest), the cuboid's score, or the estimated
    /// attention mass (sketch, two-stage; −1 for a page two-stage did not
    /// re-rank).
    pub bound: f32,
    /// After the swap-in, if one was asked for.
    pub state: PageState,
    /// Why the page is still cold after the swap-in asked for; `None` when
    /// no swap-in was asked for or the page is not cold.
    pub miss: Option<Miss>,
}

/// The choice for one KV head (or one query head, without aggregation).
#[derive(Debug, Clone, PartialEq)]
pub struct HeadSelection {
    /// The KV head whose lane the pages are in.
    pub kv_head: u32,
    /// With [`Aggregation::PerQueryHead`], the query head that chose; `None`
    /// when the group's heads were aggregated.
    pub query_head: Option<u32>,
    /// In position order. Gone pages are listed (never served with data).
    pub pages: Vec<SelectedPage>,
    /// Chosen pages that are gone: the quality cost of eviction, visible.
    pub selected_but_gone: u32,
}

/// A selection; its pages' bytes owned (`Vec<u8>`) or ranges of the
/// [`PageBuf`] the selection read them into.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection<B = Vec<u8>> {
    /// The choice per KV head (per query head, without aggregation), in
    /// head order.
    pub heads: Vec<HeadSelection>,
    /// With `with_data`: every selected page that is not gone, once per
    /// (KV head, page), by KV head then position.
    pub data: Vec<FetchedPage<B>>,
    /// Pages scored (lane pages × KV heads) and the index bytes read
    /// (digests, and sketch rows).
    pub pages_scored: u64,
    /// Index bytes the scoring read: digests, and sketch rows.
    pub digest_bytes: u64,
    /// Lanes chosen from their last ranking's scores instead of ranked
    /// ([`Ranking::reuse`]).
    pub lanes_reused: u32,
    /// What the swap-in did (zeros without one, or past its deadline).
    pub swap: SwapReport,
    /// The swap-in was still running at its deadline: the call was
    /// answered then. Its pages show their state as of the answer; one the
    /// swap-in made hot in between is hot, without a miss.
    pub past_deadline: bool,
    /// Pages queued for prefetching.
    pub prefetch_queued: u32,
    /// The lease pinning the selected pages, and when it expires.
    pub lease: Option<(u64, Instant)>,
    /// Where the call spent its time.
    pub timing: SelectTiming,
    /// The mode that ranked.
    pub mode: Mode,
    /// With [`Store::select_attending`]: each query head's attention over
    /// what it chose, in query-head order (and no data).
    pub attention: Vec<HeadAttention>,
}

impl<B> Selection<B> {
    /// The same selection with each page of its data mapped by `f`.
    pub fn map_data<C>(self, f: impl FnMut(FetchedPage<B>) -> FetchedPage<C>) -> Selection<C> {
        Selection {
            heads: self.heads,
            data: self.data.into_iter().map(f).collect(),
            pages_scored: self.pages_scored,
            digest_bytes: self.digest_bytes,
            lanes_reused: self.lanes_reused,
            swap: self.swap,
            past_deadline: self.past_deadline,
            prefetch_queued: self.prefetch_queued,
            lease: self.lease,
            timing: self.timing,
            mode: self.mode,
            attention: self.attention,
        }
    }
}

/// Where a selection spent its time, in microseconds (the swap-in's is in
/// its report).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SelectTiming {
    /// Scoring digests and choosing pages.
    pub rank_us: u64,
    /// Reading the chosen pages' bytes.
    pub read_us: u64,
    /// Attending over them ([`Store::select_attending`]).
    pub attend_us: u64,
    /// The whole call, waiting for the sequence included.
    pub store_us: u64,
}

/// The most index bytes (digests and resident sketches, of all the next
/// layer's lanes) [`Store::warm_next_layer`] reads: a quarter of a core's cache here
/// (2 MiB), so that what it warms is still there for the call.
const WARM_MAX_BYTES: usize = 512 << 10;

/// The most page bytes a selection with data returns: its budget per KV
/// head (per query head, with that aggregation), at most every page of the
/// longest lane (of `tokens`), for each of `kv_heads` KV heads.
pub fn data_bound(layout: &Layout, tokens: u64, budget_pages: u32, kv_heads: u32, aggregation: Aggregation) -> usize {
    let per_head = match aggregation {
        Aggregation::PerQueryHead => u64::from(budget_pages) * u64::from(layout.group_size()),
        Aggregation::Max | Aggregation::Mean => u64::from(budget_pages),
    };
    let pages = per_head.min(tokens.div_ceil(u64::from(layout.page_size())));
    let heads = u64::from(kv_heads.min(layout.num_kv_heads()));
    let bytes = pages.saturating_mul(heads).saturating_mul(layout.page_bytes() as u64);
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

impl Store {
    /// Selects pages (docs/CONCEPTS.md §3) and, as asked, makes them hot, prefetches
    /// what comes next, leases them and reads them.
    pub fn select_pages(self: &Arc<Self>, key: &SequenceKey, req: SelectPages<'_>) -> StoreResult<Selection> {
        let start = Instant::now();
        let mut selection = self.catalog.read(key, |seq| {
            let room = match req.with_data {
                true => req.data_bound(seq),
                false => 0,
            };
            let mut room = Vec::with_capacity(room);
            let mut buf = PageBuf::new(room.spare_capacity_mut());
            let selection = self.select_locked(seq, req, &mut buf)?;
            Ok(selection.map_data(|p| p.owned(&buf)))
        })?;
        self.timed(&mut selection, req.swap_in, start);
        Ok(selection)
    }

    /// Like [`Self::select_pages`], the pages' bytes read straight into
    /// `buf`, which must hold [`data_bound`] bytes.
    pub fn select_pages_into(
        self: &Arc<Self>,
        key: &SequenceKey,
        req: SelectPages<'_>,
        buf: &mut PageBuf<'_>,
    ) -> StoreResult<Selection<Range<usize>>> {
        let start = Instant::now();
        let mut selection = self.catalog.read(key, |seq| self.select_locked(seq, req, buf))?;
        self.timed(&mut selection, req.swap_in, start);
        Ok(selection)
    }

    /// Records a selection's time in the store; one with a swap-in (a
    /// decode step's layer) also by the slowest tier its pages came from.
    pub(super) fn timed<B>(&self, selection: &mut Selection<B>, swap_in: bool, start: Instant) {
        let elapsed = start.elapsed();
        selection.timing.store_us = micros(elapsed);
        if swap_in {
            let latency = &self.counters.latency;
            let class = match &selection.swap {
                // Answered before its swap-in finished: the report is empty.
                _ if selection.past_deadline => &latency.selection_past_deadline,
                s if s.from_nvme > 0 => &latency.selection_from_nvme,
                s if s.from_host > 0 => &latency.selection_from_host,
                _ => &latency.selection_hot,
            };
            class.observe(elapsed);
        }
    }

    pub(super) fn select_locked(
        self: &Arc<Self>,
        seq: &Sequence,
        req: SelectPages<'_>,
        buf: &mut PageBuf<'_>,
    ) -> StoreResult<Selection<Range<usize>>> {
        let start = Instant::now();
        seq.check_layer(req.layer)?;
        let heads = seq.check_heads(req.heads)?;
        check_request(seq, &req)?;
        // Traced: selections that touch pages' bytes.
        let tracer = (req.swap_in || req.with_data).then(|| self.tracer(seq)).flatten();
        let mut out = Selection {
            heads: Vec::new(),
            data: Vec::new(),
            pages_scored: 0,
            digest_bytes: 0,
            lanes_reused: 0,
            swap: SwapReport::default(),
            past_deadline: false,
            prefetch_queued: 0,
            lease: None,
            timing: SelectTiming::default(),
            mode: req.ranking.mode,
            attention: Vec::new(),
        };
        let ranking = Instant::now();
        let mut ranked = Ranked::default();
        let lanes: Vec<(u32, usize)> = seq.lanes_of(req.layer, heads).collect();
        // Lanes are ranked independently, over the cores when there is
        // enough to scan, and merged in request order: the same selection
        // as one thread would make.
        let scan: usize = lanes
            .iter()
            .map(|&(_, l)| index_scan_bytes(&seq.layout, seq.lanes[l].tokens(), req.budget.pages, &req.ranking))
            .sum();
        let threads = parallel::threads_for(lanes.len(), scan, parallel::cores());
        let indexed: Vec<(usize, (u32, usize))> = lanes.iter().copied().enumerate().collect();
        let reader = self.reader();
        for lane in parallel::map(&indexed, threads, |&(i, lane)| rank_lane(seq, &req, reader, i, lane)) {
            out.pages_scored += lane.pages_scored;
            out.digest_bytes += lane.digest_bytes;
            out.lanes_reused += u32::from(lane.reused);
            out.heads.extend(lane.heads);
            ranked.chosen.extend(lane.chosen);
            ranked.next.extend(lane.next);
        }
        out.timing.rank_us = micros(ranking.elapsed());
        let chosen: Vec<Arc<PhysPage>> = ranked.chosen.values().cloned().collect();
        let tiers = tracer.as_ref().map(|_| tiers_of(&ranked.chosen));
        // A use of the pages, counted once: a speculative selection (a
        // prefetch query: no swap-in, no data) only looks. The loop policy
        // streams ahead: what the next layer chose last step is brought up
        // while this layer is served.
        let (swapped, ahead) = self.device.serve_selection(
            (&seq.key, req.layer, seq.layout.num_layers()),
            &chosen,
            req.swap_in || req.with_data,
            || req.swap_in.then(|| self.swap_in_for(chosen.clone(), req.deadline)),
        );
        if let Some((swap, past_deadline)) = swapped {
            (out.swap, out.past_deadline) = (swap, past_deadline);
        }
        if let Some(ttl) = req.lease {
            out.lease = Some(self.leases.grant(&seq.key.tenant, chosen, ttl));
        }
        settle_states(seq, &lanes, &mut out.heads, req.swap_in.then_some(out.past_deadline));
        if req.with_data {
            let reading = Instant::now();
            out.data = self.read_selected(seq, &lanes, &ranked.chosen, &out.heads, buf)?;
            out.timing.read_us = micros(reading.elapsed());
        }
        // Prefetches start once the chosen pages are read (and marked used):
        // started before, one could demote a page this layer is reading.
        if !ahead.is_empty() {
            out.prefetch_queued += self.prefetch(ahead, PrefetchKind::LayerAhead);
        }
        if req.prefetch_pages > 0 {
            let next: Vec<Arc<PhysPage>> = ranked
                .next
                .into_iter()
                .filter(|(k, _)| !ranked.chosen.contains_key(k))
                .map(|(_, p)| p)
                .filter(|p| p.place.read().state() != PageState::Hot)
                .collect();
            out.prefetch_queued += self.prefetch(next, PrefetchKind::Asked);
        }
        if let (Some(tracer), Some(tiers)) = (tracer, tiers) {
            let swap = req.swap_in.then_some(&out.swap);
            tracer.selection(seq, req.layer, &lanes, &tiers, swap, micros(start.elapsed()));
        }
        Ok(out)
    }

    /// Schedules background promotion of the pages a speculative query
    /// (typically for a layer ahead) would select, plus the next-ranked ones
    /// up to `prefetch_pages`; returns how many were queued.
    pub fn prefetch_query(self: &Arc<Self>, key: &SequenceKey, req: SelectPages<'_>) -> StoreResult<u32> {
        self.catalog.read(key, |seq| {
            // Speculative: it neither answers from a lane's kept ranking
            // nor replaces it.
            let plain = SelectPages {
                swap_in: false,
                with_data: false,
                lease: None,
                deadline: None,
                ranking: Ranking {
                    reuse: None,
                    ..req.ranking
                },
                ..req
            };
            let selection = self.select_locked(seq, plain, &mut PageBuf::new(&mut []))?;
            let lanes: BTreeMap<u32, usize> = seq.lanes_of(req.layer, seq.check_heads(req.heads)?).collect();
            let mut pages: BTreeMap<u64, Arc<PhysPage>> = BTreeMap::new();
            for head in &selection.heads {
                let lane = &seq.lanes[lanes[&head.kv_head]];
                for sp in head.pages.iter().filter(|p| matches!(p.state, PageState::Cold(_))) {
                    if let Some(LogicalPage::Physical(r)) = lane.page(sp.page as usize) {
                        pages.insert(r.page.id, Arc::clone(&r.page));
                    }
                }
            }
            Ok(selection.prefetch_queued + self.prefetch(pages.into_values().collect(), PrefetchKind::Asked))
        })
    }

    /// Brings what a selection in the layer after `layer` (the first after
    /// the last) of `key` reads first, its lanes' index and pages' places,
    /// into this core's caches: for the thread that answers a decode
    /// loop's calls, after one layer's call, while the engine computes
    /// until the next layer's. The model's work between calls had left
    /// them in memory only: SmolLM2 at 1/8 over a polling region, kvtier
    /// per step 6.1-6.2 -> 5.3-5.5 ms (A/B, one run). Only where they fit
    /// well in a core's cache (`WARM_MAX_BYTES`); nothing where the
    /// sequence or heads do not exist.
    pub fn warm_next_layer(&self, key: &SequenceKey, layer: u32, heads: HeadRange) {
        let _ = self.catalog.read(key, |seq| {
            let Ok(heads) = seq.check_heads(heads) else {
                return Ok(());
            };
            let next = layer.saturating_add(1) % seq.layout.num_layers().max(1);
            let lanes: Vec<(u32, usize)> = seq.lanes_of(next, heads).collect();
            let bytes: usize = lanes
                .iter()
                .map(|&(_, l)| {
                    let index = seq.lanes[l].index();
                    index.digests().byte_len() + index.resident_sketch_bytes()
                })
                .sum();
            if bytes > WARM_MAX_BYTES {
                return Ok(());
            }
            for (_, l) in lanes {
                let lane = &seq.lanes[l];
                lane.index().warm();
                for p in 0..lane.num_pages() {
                    if let Some(LogicalPage::Physical(r)) = lane.page(p) {
                        std::hint::black_box(r.page.place.read().state());
                    }
                }
            }
            Ok(())
        });
    }

    /// Ends one of `tenant`'s leases before it expires; false if it has no
    /// such lease (any more).
    pub fn release_lease(&self, tenant: &TenantId, id: u64) -> bool {
        self.leases.release(tenant, id)
    }

    /// Makes `pages` hot, inline or, with a deadline, on a worker while the
    /// caller waits at most that long. Returns the report and whether the
    /// deadline passed first.
    fn swap_in_for(self: &Arc<Self>, pages: Vec<Arc<PhysPage>>, deadline: Option<Duration>) -> (SwapReport, bool) {
        let pins = Pins::new(pages);
        let Some(deadline) = deadline else {
            return (
                self.device.make_hot(pins.pages(), Reason::Demand, &self.reader()),
                false,
            );
        };
        let (tx, mut rx) = kvtier_tiers::completion();
        let store = Arc::clone(self);
        self.device.workers().demand(Box::new(move || {
            tx.complete(store.device.make_hot(pins.pages(), Reason::Demand, &store.reader()))
        }));
        match rx.wait_timeout(deadline) {
            Some(Ok(report)) => (report, false),
            // Still running (or its worker stopped): report what is hot now.
            _ => (SwapReport::default(), true),
        }
    }

    /// Queues a background promotion of `pages`; returns how many.
    fn prefetch(self: &Arc<Self>, pages: Vec<Arc<PhysPage>>, kind: PrefetchKind) -> u32 {
        if pages.is_empty() {
            return 0;
        }
        let count = pages.len() as u32;
        // Dropped with the job, run or refused: its unused marks go too.
        let marks = self.device.mark_queued(&pages, kind);
        let pins = Pins::new(pages);
        let store = Arc::clone(self);
        let queued = self.device.workers().prefetch(Box::new(move || {
            store.device.make_hot(pins.pages(), Reason::Prefetch, &store.reader());
            drop(marks);
        }));
        if queued { count } else { 0 }
    }

    /// Reads every chosen (KV head, page) once, in head then position order;
    /// gone pages are never served.
    fn read_selected(
        &self,
        seq: &Sequence,
        lanes: &[(u32, usize)],
        chosen: &BTreeMap<(usize, usize), Arc<PhysPage>>,
        heads: &[HeadSelection],
        buf: &mut PageBuf<'_>,
    ) -> StoreResult<Vec<FetchedPage<Range<usize>>>> {
        let layout = &seq.layout;
        let wanted: Vec<(u32, &StoreLane, Vec<usize>)> = lanes
            .iter()
            .map(|&(h, lane_index)| {
                let lane = &seq.lanes[lane_index];
                let mut wanted: Vec<usize> = heads
                    .iter()
                    .filter(|s| s.kv_head == h)
                    .flat_map(|s| s.pages.iter().map(|p| p.page as usize))
                    .filter(|p| {
                        chosen.contains_key(&(lane_index, *p)) || matches!(lane.page(*p), Some(LogicalPage::Summary(_)))
                    })
                    .collect();
                wanted.sort_unstable();
                wanted.dedup();
                (h, lane, wanted)
            })
            .collect();
        let runs: Vec<(&StoreLane, &[usize])> = wanted
            .iter()
            .map(|(_, lane, pages)| (*lane, pages.as_slice()))
            .collect();
        let before = buf.used();
        let read = self.read_runs(layout, &runs, buf)?;
        let chosen = wanted
            .iter()
            .flat_map(|(h, lane, pages)| pages.iter().map(move |&p| (*h, *lane, p)));
        let data = chosen
            .zip(read)
            .filter(|(_, (state, _))| *state != PageState::Gone)
            .map(|((h, lane, p), (state, content))| FetchedPage {
                kv_head: h,
                page: p as u32,
                state,
                rows: lane.rows_in(p),
                content,
                digest: None,
            })
            .collect();
        Counters::add(&self.counters.bytes_read, (buf.used() - before) as u64);
        Ok(data)
    }
}

/// The physical pages a selection chose, and those ranked next (to
/// prefetch), by (lane, page).
#[derive(Default)]
struct Ranked {
    chosen: BTreeMap<(usize, usize), Arc<PhysPage>>,
    next: BTreeMap<(usize, usize), Arc<PhysPage>>,
}

/// One lane's ranking: its heads' choices, and its physical pages chosen
/// and ranked next, by (lane, page).
struct LaneRank {
    heads: Vec<HeadSelection>,
    chosen: Vec<((usize, usize), Arc<PhysPage>)>,
    next: Vec<((usize, usize), Arc<PhysPage>)>,
    pages_scored: u64,
    digest_bytes: u64,
    /// Chosen from its last ranking's scores ([`Ranking::reuse`]).
    reused: bool,
}

/// Ranks every page of one lane (the `i`-th of the request, KV head `h`)
/// as the request's mode says, and chooses.
fn rank_lane(
    seq: &Sequence,
    req: &SelectPages<'_>,
    reader: Reader<'_>,
    i: usize,
    (h, lane_index): (u32, usize),
) -> LaneRank {
    let layout = &seq.layout;
    let (d, group) = (layout.head_dim() as usize, layout.group_size() as usize);
    let lane = &seq.lanes[lane_index];
    // Sketches spilled from the index (NVMe-cold pages') are read again
    // only for the pages the mode scores by them.
    let cold = LaneSketches::new(reader, layout, lane);
    let query = LaneQuery {
        index: lane.index(),
        cold: (lane.index().spilled_pages() > 0).then_some(&cold as &dyn ColdSketches),
        tokens: lane.tokens(),
        queries: &req.queries[i * group * d..(i + 1) * group * d],
        aggregation: req.aggregation(),
        budget: req.budget,
        shard: req.shard,
        ranking: req.ranking,
    };
    // Only a selection that asks for reuse touches the kept ranking. It is
    // taken out while ranking: a concurrent selection of the lane ranks in
    // full rather than wait, and the last to finish leaves its ranking.
    let mut last = None;
    let slot = &seq.last_rankings[lane_index];
    if req.ranking.reuse.is_some() {
        last = slot.lock().take();
    }
    let (ranked, reused) = rank_lane_reusing(&query, &mut last);
    if last.is_some() {
        *slot.lock() = last;
    }
    // Sketches read back stay for the steps after, where that costs only
    // their own memory, taken back by the next writer: this call holds the
    // read lock only. At most as many changes wait as the sequence has
    // lanes: selections with no write between them read again.
    let derived = cold.take_derived();
    if !derived.is_empty() {
        seq.deferred.lock().push_unless(seq.lanes.len(), move |seq| {
            for (p, rows) in derived {
                seq.lanes[lane_index].readmit_sketch(p, &rows);
            }
        });
    }
    let mut out = LaneRank {
        heads: Vec::new(),
        chosen: Vec::new(),
        next: Vec::new(),
        pages_scored: if reused { 0 } else { lane.num_pages() as u64 },
        digest_bytes: ranked.bytes_scanned,
        reused,
    };
    let physical = |p: usize| match lane.page(p) {
        Some(LogicalPage::Physical(r)) => Some(Arc::clone(&r.page)),
        _ => None,
    };
    for head in ranked.heads {
        let query_head = head.query_head.map(|g| h * group as u32 + g);
        if req.prefetch_pages > 0 {
            // The next `prefetch_pages` pages by score after what was chosen
            // (a top-p cut may have chosen fewer than the budget); two-stage
            // prefetches among its re-ranked candidates only.
            let cut = req.ranking.top_p.is_some() && req.ranking.mode.estimates_mass();
            let wider = Budget {
                pages: if cut { head.chosen.len() } else { req.budget.pages } + req.prefetch_pages,
                ..req.budget
            };
            let ranked = |p: usize| req.ranking.mode != Mode::TwoStage || head.scores[p] >= 0.0;
            for p in select(&head.scores, wider, req.shard) {
                if head.chosen.binary_search(&p).is_err()
                    && ranked(p)
                    && let Some(page) = physical(p)
                {
                    out.next.push(((lane_index, p), page));
                }
            }
        }
        let pages = head
            .chosen
            .iter()
            .map(|&p| {
                if let Some(page) = physical(p) {
                    out.chosen.push(((lane_index, p), page));
                }
                SelectedPage {
                    page: p as u32,
                    bound: head.scores[p],
                    state: PageState::Gone,
                    miss: None,
                }
            })
            .collect();
        out.heads.push(HeadSelection {
            kv_head: h,
            query_head,
            pages,
            selected_but_gone: 0,
        });
    }
    out
}

/// About how many index bytes ranking one lane of `tokens` tokens reads:
/// digests, and the sketch rows the mode scores (cuboids are made from
/// every sketch).
pub fn index_scan_bytes(layout: &Layout, tokens: u64, budget_pages: usize, ranking: &Ranking) -> usize {
    let pages = tokens.div_ceil(u64::from(layout.page_size())) as usize;
    let column = pages.saturating_mul(2 * layout.row_bytes());
    let sketches = (tokens as usize).saturating_mul(kvtier_core::sketch::row_bytes(layout.head_dim() as usize));
    match ranking.mode {
        Mode::Quest => column,
        Mode::Cuboid | Mode::Sketch => sketches,
        Mode::TwoStage => {
            let wide = budget_pages.saturating_mul(ranking.candidates as usize).min(pages);
            column.saturating_add(sketches / pages.max(1) * wide)
        }
    }
}

/// Each selected page's state as of now, and, after a swap-in (`Some(timed
/// out)`), why a page is not hot.
fn settle_states(seq: &Sequence, lanes: &[(u32, usize)], heads: &mut [HeadSelection], swapped: Option<bool>) {
    let lane_of: BTreeMap<u32, usize> = lanes.iter().copied().collect();
    for head in heads {
        let lane = &seq.lanes[lane_of[&head.kv_head]];
        for sp in &mut head.pages {
            sp.state = lane.page(sp.page as usize).map_or(PageState::Gone, state_of);
            if let (Some(timed_out), PageState::Cold(_)) = (swapped, sp.state) {
                sp.miss = Some(if timed_out { Miss::Deadline } else { Miss::NoRoom });
            }
        }
        head.selected_but_gone = head.pages.iter().filter(|p| p.state == PageState::Gone).count() as u32;
    }
}

fn check_request(seq: &Sequence, req: &SelectPages<'_>) -> StoreResult<()> {
    let layout = &seq.layout;
    let (d, group) = (layout.head_dim() as usize, layout.group_size() as usize);
    let expected = req.heads.count as usize * group * d;
    if req.queries.len() != expected {
        return Err(StoreError::invalid(
            wire::QUERIES,
            format!(
                "holds {} f32 values, but {} KV heads × {group} query heads each × head_dim {d} = {expected}",
                req.queries.len(),
                req.heads.count
            ),
        ));
    }
    if let Some(i) = req.queries.iter().position(|q| !q.is_finite()) {
        return Err(StoreError::invalid(
            wire::QUERIES,
            format!(
                "element {i} (query head {} of the request, dim {}) is not finite",
                i / d,
                i % d
            ),
        ));
    }
    let b = req.budget;
    if b.pages == 0 {
        return Err(StoreError::invalid(wire::BUDGET_PAGES, "must be at least 1"));
    }
    if b.sinks + b.window > b.pages {
        return Err(StoreError::invalid(
            wire::SINK_PAGES,
            format!(
                "sink_pages ({}) + window_pages ({}) exceed budget_pages ({}); they count against the budget",
                b.sinks, b.window, b.pages
            ),
        ));
    }
    check_ranking(&req.ranking, b)?;
    if let Some(s) = req.shard {
        if s.world == 0 || s.world > 4096 {
            return Err(StoreError::invalid(
                wire::SHARD_WORLD,
                format!("is {}, must be in 1..=4096", s.world),
            ));
        }
        if s.rank >= s.world {
            return Err(StoreError::invalid(
                wire::SHARD_RANK,
                format!("is {}, must be below world ({})", s.rank, s.world),
            ));
        }
    }
    Ok(())
}

fn check_ranking(r: &Ranking, b: Budget) -> StoreResult<()> {
    if r.mode == Mode::TwoStage && !(1..=MAX_CANDIDATES).contains(&r.candidates) {
        return Err(StoreError::invalid(
            wire::CANDIDATES,
            format!("is {}, must be in 1..={MAX_CANDIDATES}", r.candidates),
        ));
    }
    if let Some(scale) = r.softmax_scale
        && !(scale.is_finite() && scale > 0.0)
    {
        return Err(StoreError::invalid(
            wire::SOFTMAX_SCALE,
            format!("is {scale}, must be finite and positive"),
        ));
    }
    if let Some(similarity) = r.reuse
        && !(similarity > 0.0 && similarity <= 1.0)
    {
        return Err(StoreError::invalid(
            wire::REUSE_SIMILARITY,
            format!("is {similarity}, must be in (0, 1] (a cosine similarity; 0: rank every step)"),
        ));
    }
    if let Some(top_p) = r.top_p {
        if !r.mode.estimates_mass() {
            return Err(StoreError::invalid(
                wire::TOP_P,
                format!(
                    "needs a mode that estimates attention mass (sketch or two-stage), not {}",
                    r.mode
                ),
            ));
        }
        if !(top_p.p > 0.0 && top_p.p <= 1.0) {
            return Err(StoreError::invalid(
                wire::TOP_P,
                format!("is {}, must be in (0, 1]", top_p.p),
            ));
        }
        if top_p.min_pages > b.pages {
            return Err(StoreError::invalid(
                wire::MIN_PAGES,
                format!(
                    "is {}, above budget_pages ({}), the most a top-p selection takes",
                    top_p.min_pages, b.pages
                ),
            ));
        }
    }
    Ok(())
}
