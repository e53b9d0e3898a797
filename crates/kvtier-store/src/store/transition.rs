//! Explicit state transitions for ranges of pages, all-or-nothing: every
//! page is checked against the state machine and every slot reserved before
//! anything changes.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvtier_core::{Action, ColdTier, LogicalPage, PageState, Reason, SequenceKey, Summary, wire};

use super::Store;
use crate::catalog::{HeadRange, Sequence, Target};
use crate::cost;
use crate::durability::{Keep, gone_record, summary_record};
use crate::host::MigrationTime;
use crate::page::{PhysPage, SummaryPage, state_of};
use crate::{StoreError, StoreResult};

/// A SetPageState request: one action for the same pages of every lane of
/// some layers and KV heads.
#[derive(Debug, Clone, Copy)]
pub struct SetPageState<'a> {
    /// The first layer.
    pub layer_start: u32,
    /// How many layers from `layer_start` (layers sharing one KV name their
    /// lane once).
    pub layer_count: u32,
    /// The KV heads of each layer.
    pub heads: HeadRange,
    /// Which pages of each lane.
    pub pages: PageSelection<'a>,
    /// The move to make: offload, migrate, swap in, summarize or evict.
    pub action: Action,
    /// Rows per summary (`Summarize` only), clamped to each page's tokens.
    pub summary_rows: u32,
    /// Why, as the transition counters record it.
    pub reason: Reason,
}

/// The pages of each lane a transition names.
#[derive(Debug, Clone, Copy)]
pub enum PageSelection<'a> {
    /// Pages `first..first + count` of every lane; `count == 0` means through
    /// the end of each lane.
    Range {
        /// The first page.
        first: u32,
        /// How many pages; 0: all from `first` on.
        count: u32,
    },
    /// These pages of every lane.
    List(&'a [u32]),
}

/// What a transition did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransitionOutcome {
    /// Pages the action was applied to, over all lanes named.
    pub pages: u64,
}

impl Store {
    /// Applies an explicit transition; a change that removes original
    /// bytes (evict, summarize) is in the manifest before this returns.
    pub fn set_page_state(&self, key: &SequenceKey, req: SetPageState<'_>) -> StoreResult<TransitionOutcome> {
        let outcome = self.catalog.write(key, |seq| {
            let targets = self.targets(seq, &req)?;
            self.apply_targets(seq, &targets, req.action, req.summary_rows, req.reason)?;
            Ok(TransitionOutcome {
                pages: targets.len() as u64,
            })
        })?;
        self.durable.commit()?;
        Ok(outcome)
    }

    /// Applies `action` to every target, all or nothing: each is checked
    /// against the state machine (and, to move, not leased) first.
    pub(crate) fn apply_targets(
        &self,
        seq: &mut Sequence,
        targets: &[Target],
        action: Action,
        summary_rows: u32,
        reason: Reason,
    ) -> StoreResult<()> {
        // Every (from, to) the action makes, counted once it is done.
        let mut made: BTreeMap<(usize, usize), (PageState, PageState, u64)> = BTreeMap::new();
        for t in targets {
            let to = t.from.apply(action).map_err(|e| {
                StoreError::precondition(
                    wire::ACTION,
                    format!("layer {} KV head {} page {}: {e}", t.layer, t.head, t.page),
                )
            })?;
            made.entry((t.from.index(), to.index())).or_insert((t.from, to, 0)).2 += 1;
        }
        if matches!(action, Action::Offload(_) | Action::Migrate(_)) {
            self.check_unpinned(seq, targets)?;
        }
        match action {
            Action::Offload(tier) => self.offload(seq, targets, tier, reason)?,
            Action::Migrate(tier) => self.migrate(seq, targets, tier, reason)?,
            Action::SwapIn => self.swap_in(seq, targets, reason)?,
            Action::Summarize => self.summarize(seq, targets, summary_rows, reason)?,
            Action::Evict => self.evict(seq, targets, reason),
        }
        // A swap-in counts the pages it made hot itself.
        if action != Action::SwapIn {
            for (from, to, pages) in made.into_values() {
                self.counters.transition(from, to, reason, pages);
            }
        }
        Ok(())
    }

    /// Resolves and checks the request's pages, in lane then page order.
    fn targets(&self, seq: &Sequence, req: &SetPageState<'_>) -> StoreResult<Vec<Target>> {
        let layers = seq.check_layers(req.layer_start, req.layer_count)?;
        let heads = seq.check_heads(req.heads)?;
        match req.action {
            Action::Offload(ColdTier::Nvme) | Action::Migrate(ColdTier::Nvme) if self.durable.nvme().is_none() => {
                return Err(StoreError::precondition(
                    wire::ACTION,
                    "the nvme tier is not configured",
                ));
            }
            Action::Summarize if req.summary_rows == 0 => {
                return Err(StoreError::invalid(
                    wire::SUMMARIZE_ROWS,
                    "must be at least 1 to summarize",
                ));
            }
            _ => {}
        }
        if let PageSelection::List(pages) = req.pages {
            let mut seen = BTreeMap::new();
            for (i, p) in pages.iter().enumerate() {
                if let Some(first) = seen.insert(*p, i) {
                    return Err(StoreError::invalid(
                        wire::PAGES.at(i),
                        format!("repeats pages[{first}]"),
                    ));
                }
            }
        }
        // Layers of one shared-KV group name the same lane once.
        let mut lanes = BTreeMap::new();
        for layer in layers {
            for (head, lane) in seq.lanes_of(layer, heads.clone()) {
                lanes.entry(lane).or_insert((layer, head));
            }
        }
        let mut targets = Vec::new();
        for (lane, (layer, head)) in lanes {
            let held = seq.lanes[lane].num_pages();
            let out_of_range = |field: String, p: usize| {
                StoreError::invalid(
                    field,
                    format!("page {p} is beyond layer {layer} KV head {head}, which holds {held} pages"),
                )
            };
            let pages: Vec<usize> = match req.pages {
                PageSelection::Range { first, count: 0 } if first as usize <= held => (first as usize..held).collect(),
                PageSelection::Range { first, count: 0 } => {
                    return Err(out_of_range(wire::FIRST_PAGE.into(), first as usize));
                }
                PageSelection::Range { first, count } => {
                    let end = first as usize + count as usize;
                    if end > held {
                        return Err(out_of_range(wire::PAGE_COUNT.into(), end - 1));
                    }
                    (first as usize..end).collect()
                }
                PageSelection::List(list) => {
                    if let Some((i, p)) = list.iter().enumerate().find(|(_, p)| **p as usize >= held) {
                        return Err(out_of_range(wire::PAGES.at(i), *p as usize));
                    }
                    list.iter().map(|p| *p as usize).collect()
                }
            };
            for page in pages {
                let Some(logical) = seq.lanes[lane].page(page) else {
                    return Err(out_of_range(wire::PAGES.at(page), page));
                };
                let from = state_of(logical);
                targets.push(Target {
                    layer,
                    head,
                    lane,
                    page,
                    from,
                });
            }
        }
        if targets.is_empty() {
            return Err(StoreError::invalid(wire::PAGE_COUNT, "selects no pages"));
        }
        Ok(targets)
    }

    /// The physical page of a target the state machine admitted as holding
    /// original bytes.
    fn physical<'s>(seq: &'s Sequence, t: &Target) -> StoreResult<&'s crate::page::PageRef> {
        match seq.lanes[t.lane].page(t.page) {
            Some(LogicalPage::Physical(r)) => Ok(r),
            _ => Err(StoreError::Internal(format!(
                "layer {} KV head {} page {} has no physical page",
                t.layer, t.head, t.page
            ))),
        }
    }

    /// Leased pages may not move.
    fn check_unpinned(&self, seq: &Sequence, targets: &[Target]) -> StoreResult<()> {
        for t in targets {
            if Self::physical(seq, t)?.page.pinned() {
                return Err(StoreError::precondition(
                    wire::ACTION,
                    format!(
                        "layer {} KV head {} page {} is leased or being swapped in; it cannot move now",
                        t.layer, t.head, t.page
                    ),
                ));
            }
        }
        Ok(())
    }

    fn pages_of(seq: &Sequence, targets: &[Target]) -> StoreResult<Vec<Arc<PhysPage>>> {
        targets
            .iter()
            .map(|t| Self::physical(seq, t).map(|r| Arc::clone(&r.page)))
            .collect()
    }

    /// hot → cold(tier): make sure the backing copy exists in `tier`, then
    /// drop the device copy.
    fn offload(&self, seq: &Sequence, targets: &[Target], tier: ColdTier, reason: Reason) -> StoreResult<()> {
        let pages = Self::pages_of(seq, targets)?;
        let reader = self.reader();
        for page in &pages {
            reader.ensure_host(page, &seq.layout, reason, &mut MigrationTime::default())?;
        }
        if tier == ColdTier::Nvme {
            self.durable.write_copies(&pages, Keep::Nothing, reason)?;
        }
        for page in &pages {
            // Refused only for a page without a device copy (another path
            // dropped it meanwhile); counted by the caller.
            let dropped = page.place.write().drop_device();
            if dropped.is_some() {
                self.device.note_wasted(page);
            }
            drop(dropped);
        }
        self.device.forget(pages.iter().map(|p| p.id));
        Ok(())
    }

    /// cold(a) → cold(b).
    fn migrate(&self, seq: &Sequence, targets: &[Target], tier: ColdTier, reason: Reason) -> StoreResult<()> {
        let pages = Self::pages_of(seq, targets)?;
        let reader = self.reader();
        match tier {
            ColdTier::Nvme => self.durable.write_copies(&pages, Keep::Nothing, reason).map(drop),
            ColdTier::Host => pages
                .iter()
                .try_for_each(|p| reader.ensure_host(p, &seq.layout, reason, &mut MigrationTime::default())),
        }
    }

    /// cold → hot, all or nothing: the device's one swap-in path, which
    /// counts the transitions it makes.
    fn swap_in(&self, seq: &Sequence, targets: &[Target], reason: Reason) -> StoreResult<()> {
        let pages = Self::pages_of(seq, targets)?;
        self.device.make_all_hot(&pages, reason, &self.reader()).map(drop)
    }

    /// hot | cold → summary: compute and store every summary, then swap them
    /// in and release the originals.
    fn summarize(&self, seq: &mut Sequence, targets: &[Target], rows: u32, reason: Reason) -> StoreResult<()> {
        let bytes = cost::summary(u64::from(rows)) * targets.len() as u64;
        seq.charge.grow(bytes)?;
        let summarized = self.summarize_charged(seq, targets, rows, reason);
        if summarized.is_err() {
            seq.charge.shrink(bytes);
        }
        summarized
    }

    fn summarize_charged(&self, seq: &mut Sequence, targets: &[Target], rows: u32, reason: Reason) -> StoreResult<()> {
        let layout = Arc::clone(&seq.layout);
        let pages: Vec<(Arc<PhysPage>, u32)> = Self::pages_of(seq, targets)?
            .into_iter()
            .zip(targets)
            .map(|(p, t)| (p, seq.lanes[t.lane].rows_in(t.page)))
            .collect();
        let originals = self.reader().originals(&layout, &pages)?;
        let mut summaries = Vec::with_capacity(targets.len());
        let owner = Arc::clone(seq.charge.account());
        for (t, original) in targets.iter().zip(originals) {
            let Some(original) = original else {
                return Err(StoreError::precondition(
                    wire::PAGES,
                    "a page lost its bytes while being summarized",
                ));
            };
            let (keys, values) = original.split_at(original.len() / 2);
            // A page that goes keeps its index: spilled sketches come back.
            seq.lanes[t.lane].restore_sketch(t.page, keys);
            let summary = Summary::chunk_means(layout.dtype(), layout.head_dim() as usize, keys, values, rows);
            let len = summary.kv.len() as u64;
            let mut slot = self
                .host
                .allocate(len, &self.durable, &mut MigrationTime::default(), &owner)?;
            self.host.tier().write(&mut slot, 0, &summary.kv)?;
            summaries.push((
                SummaryPage {
                    counts: summary.counts,
                    slot,
                    reason,
                },
                summary.kv,
            ));
        }
        let mut records = Vec::new();
        let mut old = Vec::with_capacity(targets.len());
        for (t, (page, kv)) in targets.iter().zip(summaries) {
            records.push(summary_record(seq, t.lane, t.page, reason, &page.counts, kv));
            old.push(seq.lanes[t.lane].replace(t.page, LogicalPage::Summary(page)));
        }
        self.durable.journal(|| records);
        self.release(old);
        tracing::debug!(sequence = %seq.key, pages = targets.len(), reason = reason.name(), "summarized");
        Ok(())
    }

    /// hot | cold | summary → gone.
    fn evict(&self, seq: &mut Sequence, targets: &[Target], reason: Reason) {
        self.restore_sketches(seq, targets);
        let old: Vec<_> = targets
            .iter()
            .map(|t| seq.lanes[t.lane].replace(t.page, LogicalPage::Gone(reason)))
            .collect();
        self.durable.journal(|| {
            targets
                .iter()
                .map(|t| gone_record(seq, t.lane, t.page, reason))
                .collect()
        });
        self.release(old);
    }
}
