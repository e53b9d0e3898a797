//! Writes: whole pages (`put_pages`, with prefix sharing) and decode tokens
//! (`append_tokens`, filling the partial last page first).
//!
//! Both go through one pipeline, so that a refused write changes nothing:
//! validate; reserve every new page (an id, host room, device room when
//! caching writes); copy the bytes; publish to the page table and the lanes;
//! journal, and persist when asked.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use kvtier_core::{Layout, LogicalPage, PageIndex, Reason, SequenceKey, wire};
use kvtier_tiers::Slot;

use super::{Store, micros};
use crate::accounts::{Account, PageCharge};
use crate::catalog::{HeadRange, Sequence};
use crate::cost;
use crate::durability::{Acknowledged, map_record};
use crate::host::MigrationTime;
use crate::page::{AppendRefused, MemoryCopy, PageRef, PhysPage, Pins, Placement, ShareKey, StorePage, write_rows};
use crate::stats::Counters;
use crate::{StoreError, StoreResult};

/// Whole pages for one layer and a range of KV heads, starting at the end
/// of every lane in the range (a page boundary).
#[derive(Debug, Clone, Copy)]
pub struct PutPages<'a> {
    /// The layer written (a shared-KV group's layers write one lane).
    pub layer: u32,
    /// The KV heads written, one lane each.
    pub heads: HeadRange,
    /// The page the write starts at: every lane in the range must hold
    /// exactly `first_page` full pages.
    pub first_page: u32,
    /// Tokens covered; all pages are full except possibly the last.
    pub num_tokens: u32,
    /// Per head (head-major): K rows `[num_tokens][head_dim]`, then V rows.
    pub kv: &'a [u8],
    /// Make every row of the lanes written durable before acknowledging.
    pub persist: bool,
}

/// What a put stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutOutcome {
    /// New pages stored, over all lanes.
    pub pages_written: u64,
    /// Pages found already stored under their prefix hash: shared, not written.
    pub pages_shared: u64,
    /// What the acknowledgement guarantees.
    pub durability: Acknowledged,
}

/// Decode tokens for one layer and a range of KV heads, at the end of every
/// lane in the range.
#[derive(Debug, Clone, Copy)]
pub struct AppendTokens<'a> {
    /// The layer written (a shared-KV group's layers write one lane).
    pub layer: u32,
    /// The KV heads written; every lane in the range must hold the same tokens.
    pub heads: HeadRange,
    /// Tokens appended to each lane.
    pub num_tokens: u32,
    /// Per head (head-major): K rows `[num_tokens][head_dim]`, then V rows.
    pub kv: &'a [u8],
    /// If set, the lanes must hold exactly this many tokens (guards retries).
    pub expected_position: Option<u64>,
    /// As for [`PutPages::persist`].
    pub persist: bool,
}

/// What an append did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendOutcome {
    /// Tokens in each written lane afterwards.
    pub tokens: u64,
    /// New pages the append started, over all lanes (filling a partial last
    /// page opens none).
    pub pages_opened: u64,
    /// What the acknowledgement guarantees.
    pub durability: Acknowledged,
    /// Where the call spent its time.
    pub timing: AppendTiming,
}

/// Where an append spent its time, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AppendTiming {
    /// Waiting for the sequence's lock.
    pub lock_wait_us: u64,
    /// Host and device room for the new pages (and the partial page back in
    /// host memory), migration included.
    pub reserve_us: u64,
    /// Of that: waiting for a migration to NVMe already running ...
    pub migration_wait_us: u64,
    /// ... and migrating host pages to NVMe to make room.
    pub migration_us: u64,
    /// Journalling the new pages and, with persist, making the lanes durable.
    pub durability_us: u64,
    /// A registered policy that ran after the append.
    pub policy_us: u64,
    /// The whole call in the store.
    pub store_us: u64,
}

/// The K and V rows of one message, validated against the layout.
struct KvRows<'a> {
    kv: &'a [u8],
    row: usize,
    tokens: usize,
}

impl<'a> KvRows<'a> {
    fn new(layout: &Layout, heads: usize, tokens: u32, kv: &'a [u8]) -> StoreResult<Self> {
        if tokens == 0 {
            return Err(StoreError::invalid(wire::NUM_TOKENS, "must be at least 1"));
        }
        let (row, tokens) = (layout.row_bytes(), tokens as usize);
        let expected = heads as u128 * 2 * tokens as u128 * row as u128;
        if kv.len() as u128 != expected {
            return Err(StoreError::invalid(
                wire::KV,
                format!(
                    "is {} bytes, but {heads} KV heads × 2 (K, V) × {tokens} tokens × head_dim {} × {} bytes ({}) = {expected}",
                    kv.len(),
                    layout.head_dim(),
                    layout.dtype().size(),
                    layout.dtype()
                ),
            ));
        }
        let rows = Self { kv, row, tokens };
        let dtype = layout.dtype();
        for h in 0..heads {
            if let Some(i) = dtype.first_non_finite(rows.keys(h, 0..tokens)) {
                let d = layout.head_dim() as usize;
                return Err(StoreError::invalid(
                    wire::KV,
                    format!(
                        "key of head {h} (of the message), token {}, dim {} is NaN or infinite; keys must be finite",
                        i / d,
                        i % d
                    ),
                ));
            }
        }
        Ok(rows)
    }

    fn keys(&self, head: usize, tokens: Range<usize>) -> &'a [u8] {
        let base = head * 2 * self.tokens * self.row;
        &self.kv[base + tokens.start * self.row..base + tokens.end * self.row]
    }

    fn values(&self, head: usize, tokens: Range<usize>) -> &'a [u8] {
        let base = head * 2 * self.tokens * self.row + self.tokens * self.row;
        &self.kv[base + tokens.start * self.row..base + tokens.end * self.row]
    }
}

/// What one write adds to its lanes: every lane gets a page for each of
/// `ranges` (the message's token rows it holds), lane-major.
struct Batch<'a> {
    layout: Arc<Layout>,
    /// The sequence's tenant, whose quotas the new pages count against.
    owner: Arc<Account>,
    rows: KvRows<'a>,
    lanes: Vec<usize>,
    ranges: Vec<Range<usize>>,
}

/// A page a write adds: one already stored under its prefix hash (a
/// reference is held), or a new one.
enum Planned {
    Shared(PageRef),
    New(NewPage),
}

/// Storage and an id reserved for a new page, and the key it is shared
/// under once written.
struct NewPage {
    id: u64,
    host_slot: Slot,
    device_slot: Option<Slot>,
    key: Option<ShareKey>,
}

/// An append, the position it wrote at and the (lane, page)s it opened.
type Appended = (AppendOutcome, u64, Vec<(usize, usize)>);

/// The (lane, page)s a write added.
fn placed(published: &Published) -> Vec<(usize, usize)> {
    published.mapped.iter().map(|&(lane, page, _)| (lane, page)).collect()
}

/// What publishing a batch added.
#[derive(Default)]
struct Published {
    /// (lane, page, physical id) of every page added.
    mapped: Vec<(usize, usize, u64)>,
    written: u64,
    shared: u64,
    /// Pages made new for this write (some may have turned out shared).
    new_pages: u64,
}

impl Store {
    /// Writes whole pages at the end of the lanes (PutPages), sharing each
    /// full page already stored under its prefix hash. A refused write
    /// changes nothing; a failed persist leaves the pages written.
    pub fn put_pages(&self, key: &SequenceKey, req: PutPages<'_>) -> StoreResult<PutOutcome> {
        self.catalog.write(key, |seq| self.put_locked(seq, req))
    }

    fn put_locked(&self, seq: &mut Sequence, req: PutPages<'_>) -> StoreResult<PutOutcome> {
        let start = Instant::now();
        self.check_persist(req.persist)?;
        let batch = put_batch(seq, &req)?;
        let published = charged(seq, &batch, |seq| self.put_new(seq, &req, &batch))?;
        // Published: a failure from here on (persisting) leaves the pages,
        // and their charge, in place.
        let durability = self.finish_write(seq, &batch.lanes, &published.mapped, req.persist)?;
        Counters::add(&self.counters.pages_written, published.written);
        Counters::add(&self.counters.pages_shared, published.shared);
        Counters::add(&self.counters.bytes_written, req.kv.len() as u64);
        let step = u64::from(req.first_page) * u64::from(batch.layout.page_size());
        self.trace_write(seq, req.layer, step, &placed(&published), start);
        Ok(PutOutcome {
            pages_written: published.written,
            pages_shared: published.shared,
            durability,
        })
    }

    /// Reserves, copies and publishes a put's pages.
    fn put_new(&self, seq: &mut Sequence, req: &PutPages<'_>, batch: &Batch<'_>) -> StoreResult<Published> {
        // Share what is already stored under its prefix hash.
        let mut wanted = Vec::with_capacity(batch.lanes.len() * batch.ranges.len());
        for &lane in &batch.lanes {
            for (i, range) in batch.ranges.iter().enumerate() {
                let full = range.len() == batch.layout.page_size() as usize;
                let p = req.first_page as usize + i;
                let key = (full && p < seq.hashes.len()).then(|| seq.share_key(p, lane));
                wanted.push(match key.as_ref().and_then(|k| self.catalog.share(k)) {
                    Some(r) => Ok(r),
                    None => Err(key),
                });
            }
        }
        let mut planned = self.reserve(batch, wanted, &mut MigrationTime::default())?;
        if let Err(e) = self.copy_new(batch, &mut planned) {
            self.release_planned(planned);
            return Err(e);
        }
        self.publish(seq, batch, planned)
    }

    /// Appends decode tokens to the lanes (AppendTokens): the partial last
    /// page is filled first, then new pages are opened; a registered policy
    /// may run afterwards. A refused append changes nothing.
    pub fn append_tokens(&self, key: &SequenceKey, req: AppendTokens<'_>) -> StoreResult<AppendOutcome> {
        let start = Instant::now();
        let mut appended = self.catalog.write(key, |seq| {
            let locked = Instant::now();
            let (mut appended, step, opened) = self.append_locked(seq, req)?;
            let policy = Instant::now();
            self.run_auto_policy(seq, req.layer);
            appended.timing.policy_us = micros(policy.elapsed());
            // Timed from the lock, as a selection is: waiting for another
            // call on the sequence is that call's time.
            self.trace_write(seq, req.layer, step, &opened, locked);
            appended.timing.lock_wait_us = micros(locked - start);
            Ok(appended)
        })?;
        appended.timing.store_us = micros(start.elapsed());
        Ok(appended)
    }

    /// Whether `append_tokens(key, req)` would be refused now, without
    /// writing: a decode step that selects and then appends checks its
    /// append before the selection moves anything.
    pub fn check_append(&self, key: &SequenceKey, req: AppendTokens<'_>) -> StoreResult<()> {
        self.check_persist(req.persist)?;
        self.catalog.read(key, |seq| append_batch(seq, &req).map(drop))
    }

    /// The append, the position it wrote at and the (lane, page)s it opened.
    fn append_locked(&self, seq: &mut Sequence, req: AppendTokens<'_>) -> StoreResult<Appended> {
        self.check_persist(req.persist)?;
        let (batch, tokens, fill) = append_batch(seq, &req)?;
        let mut timing = AppendTiming::default();
        let published = charged(seq, &batch, |seq| self.append_new(seq, &batch, fill, &mut timing))?;
        let journalling = Instant::now();
        let durability = self.finish_write(seq, &batch.lanes, &published.mapped, req.persist)?;
        timing.durability_us = micros(journalling.elapsed());
        Counters::add(&self.counters.pages_written, published.written);
        Counters::add(
            &self.counters.tokens_appended,
            u64::from(req.num_tokens) * batch.lanes.len() as u64,
        );
        Counters::add(&self.counters.bytes_written, req.kv.len() as u64);
        let outcome = AppendOutcome {
            tokens: tokens + u64::from(req.num_tokens),
            pages_opened: published.written,
            durability,
            timing,
        };
        Ok((outcome, tokens, placed(&published)))
    }

    /// A write's trace record, if a recording runs: the pages it placed.
    fn trace_write(&self, seq: &Sequence, layer: u32, step: u64, placed: &[(usize, usize)], start: Instant) {
        if let Some(tracer) = self.tracer(seq) {
            tracer.write(seq, layer, step, placed, micros(start.elapsed()));
        }
    }

    /// Fills the partial pages, then reserves, copies and publishes the new
    /// ones.
    fn append_new(
        &self,
        seq: &mut Sequence,
        batch: &Batch<'_>,
        fill: usize,
        timing: &mut AppendTiming,
    ) -> StoreResult<Published> {
        let mut migration = MigrationTime::default();
        let reserving = Instant::now();
        // The partial pages are written in place, in memory. They stay
        // pinned until the write publishes, so that making room for the new
        // pages (host migration, device demotion) cannot take the copies
        // the fill writes to.
        let partial = partial_pages(seq, &batch.lanes, fill);
        let _filling = Pins::new(partial.clone());
        let reader = self.reader();
        for page in &partial {
            reader.ensure_host(page, &batch.layout, Reason::Demand, &mut migration)?;
        }
        let wanted = (0..batch.lanes.len() * batch.ranges.len()).map(|_| Err(None)).collect();
        let mut planned = self.reserve(batch, wanted, &mut migration)?;
        timing.reserve_us = micros(reserving.elapsed());
        timing.migration_wait_us = micros(migration.waited);
        timing.migration_us = micros(migration.moving);
        // The new pages first: their slots are this write's alone, so a
        // failure there changes nothing.
        self.copy_new(batch, &mut planned)?;
        self.fill_partial(seq, batch, &partial, fill)?;
        if fill > 0 {
            for (h, &lane) in batch.lanes.iter().enumerate() {
                seq.lanes[lane].extend_last(batch.rows.keys(h, 0..fill));
            }
        }
        self.publish(seq, batch, planned)
    }

    fn check_persist(&self, persist: bool) -> StoreResult<()> {
        if persist && !self.durable.can_persist() {
            return Err(StoreError::precondition(
                wire::PERSIST,
                "persisting needs the nvme tier and its manifest",
            ));
        }
        Ok(())
    }

    /// Reserves a page for each of `wanted` (lane-major, as `batch`):
    /// already shared ones are kept, new ones get an id and host room (and,
    /// when caching writes, device room, newest pages first since they are
    /// the likeliest to be read next). A failure releases what was taken.
    fn reserve(
        &self,
        batch: &Batch<'_>,
        wanted: Vec<Result<PageRef, Option<ShareKey>>>,
        migration: &mut MigrationTime,
    ) -> StoreResult<Vec<Planned>> {
        let new = wanted.iter().filter(|w| w.is_err()).count() as u64;
        let mut wanted = wanted.into_iter();
        let mut planned = Vec::with_capacity(wanted.len());
        let len = batch.layout.page_bytes() as u64;
        let failed = match self.durable.page_ids(new) {
            Err(e) => Some(e),
            Ok(mut ids) => loop {
                let plan = match wanted.next() {
                    None => break None,
                    Some(Ok(r)) => Planned::Shared(r),
                    Some(Err(key)) => match (
                        ids.next(),
                        self.host.allocate(len, &self.durable, migration, &batch.owner),
                    ) {
                        (Some(id), Ok(host_slot)) => Planned::New(NewPage {
                            id,
                            host_slot,
                            device_slot: None,
                            key,
                        }),
                        (_, Err(e)) => break Some(e),
                        (None, Ok(_)) => break Some(StoreError::Internal("fewer page ids than pages".into())),
                    },
                };
                planned.push(plan);
            },
        };
        if let Some(e) = failed {
            // Nothing half-reserved stays: references held are released,
            // reserved slots return as they drop.
            self.release_planned(planned);
            self.release(wanted.filter_map(|w| w.ok().map(StorePage::Physical)));
            return Err(e);
        }
        if self.config.cache_writes_on_device {
            self.reserve_device(batch, &mut planned, len);
        }
        Ok(planned)
    }

    /// Device copies for new pages, best effort, newest pages first.
    fn reserve_device(&self, batch: &Batch<'_>, planned: &mut [Planned], len: u64) {
        let per_lane = batch.ranges.len();
        for i in (0..per_lane).rev() {
            for h in 0..batch.lanes.len() {
                if let Some(Planned::New(page)) = planned.get_mut(h * per_lane + i) {
                    match self.device.allocate(len, &self.host, &batch.owner, false) {
                        Ok(slot) => page.device_slot = Some(slot),
                        Err(_) => return,
                    }
                }
            }
        }
    }

    fn release_planned(&self, planned: Vec<Planned>) {
        self.release(planned.into_iter().filter_map(|p| match p {
            Planned::Shared(r) => Some(StorePage::Physical(r)),
            Planned::New(_) => None,
        }));
    }

    /// Fills the partial last pages in place with the message's first
    /// `fill` rows. Every page keeps a memory copy while pinned (an
    /// exclusive device cache may move it from host to device meanwhile);
    /// checked for all before any is written, so the fill is all or nothing.
    fn fill_partial(
        &self,
        seq: &Sequence,
        batch: &Batch<'_>,
        partial: &[Arc<PhysPage>],
        fill: usize,
    ) -> StoreResult<()> {
        if let Some(page) = partial.iter().find(|p| {
            let place = p.place.read();
            place.host().is_none() && place.device().is_none()
        }) {
            return Err(StoreError::Internal(format!(
                "page {} lost its memory copies while pinned for an append",
                page.id
            )));
        }
        let layout = &batch.layout;
        for (h, (page, &lane)) in partial.iter().zip(&batch.lanes).enumerate() {
            let l = &seq.lanes[lane];
            let first_row = l.rows_in(l.num_pages() - 1);
            let (k, v) = (batch.rows.keys(h, 0..fill), batch.rows.values(h, 0..fill));
            let (host, device) = (self.host.tier(), self.device.tier());
            // An append changes no page's state: the memory copy stays.
            let _same_state = page
                .place
                .write()
                .append_rows(fill as u32, |copy, slot| match copy {
                    MemoryCopy::Host => write_rows(&**host, slot, layout, first_row, k, v),
                    MemoryCopy::Device => write_rows(&**device, slot, layout, first_row, k, v),
                })
                .map_err(|e| match e {
                    AppendRefused::Write(e) => StoreError::from(e),
                    AppendRefused::NoMemoryCopy => StoreError::Internal(format!(
                        "page {} lost its memory copies while pinned for an append",
                        page.id
                    )),
                })?;
        }
        Ok(())
    }

    /// Copies the message's rows into every new page's reserved slots.
    fn copy_new(&self, batch: &Batch<'_>, planned: &mut [Planned]) -> StoreResult<()> {
        let per_lane = batch.ranges.len();
        planned.iter_mut().enumerate().try_for_each(|(j, plan)| {
            let Planned::New(page) = plan else { return Ok(()) };
            let (h, range) = (j / per_lane, batch.ranges[j % per_lane].clone());
            let (keys, values) = (batch.rows.keys(h, range.clone()), batch.rows.values(h, range));
            write_rows(&**self.host.tier(), &mut page.host_slot, &batch.layout, 0, keys, values)?;
            if let Some(device) = page.device_slot.as_mut() {
                write_rows(&**self.device.tier(), device, &batch.layout, 0, keys, values)?;
            }
            Ok(())
        })
    }

    /// Adds the batch's pages to the page table and the lanes.
    fn publish(&self, seq: &mut Sequence, batch: &Batch<'_>, planned: Vec<Planned>) -> StoreResult<Published> {
        let per_lane = batch.ranges.len();
        let mut out = Published::default();
        let mut hot = Vec::new();
        for (j, plan) in planned.into_iter().enumerate() {
            let (h, range) = (j / per_lane, batch.ranges[j % per_lane].clone());
            let lane = batch.lanes[h];
            let keys = batch.rows.keys(h, range.clone());
            let (r, shared) = match plan {
                // Another request uses the page: granted here, where the
                // write can no longer be refused.
                Planned::Shared(r) => {
                    r.page.attached_again();
                    (r, true)
                }
                Planned::New(page) => {
                    out.new_pages += 1;
                    let charge = seq.charge.split(cost::physical_page(&batch.layout, page.key.is_some()));
                    self.new_physical(page, batch, range.len(), keys, charge)?
                }
            };
            if shared {
                out.shared += 1;
            } else {
                out.written += 1;
                if r.page.place.read().device().is_some() {
                    hot.push(Arc::clone(&r.page));
                }
            }
            let phys = r.page.id;
            match r.page.index_entry.clone() {
                Some(entry) => {
                    let rows = seq.layout.page_size();
                    seq.lanes[lane].push_known(LogicalPage::Physical(r), &entry, rows)
                }
                None => seq.lanes[lane].push_page(LogicalPage::Physical(r), keys),
            }
            out.mapped.push((lane, seq.lanes[lane].num_pages() - 1, phys));
        }
        self.device.touch(&hot);
        Ok(out)
    }

    /// A new physical page from its reserved storage, registered (under its
    /// share key, when it has one: if another sequence stored the same
    /// prefix meanwhile, that page is used and this one is freed).
    fn new_physical(
        &self,
        page: NewPage,
        batch: &Batch<'_>,
        rows: usize,
        keys: &[u8],
        charge: PageCharge,
    ) -> StoreResult<(PageRef, bool)> {
        let layout = &batch.layout;
        let entry = page
            .key
            .as_ref()
            .map(|_| Box::from(PageIndex::entry_of(layout.dtype(), layout.head_dim() as usize, keys)));
        let place = Placement::written(page.device_slot, page.host_slot, rows as u32);
        let physical = Arc::new(PhysPage::new(page.id, Arc::clone(layout), entry, place, charge));
        self.host.touch_written([&physical]);
        self.catalog.publish(physical, page.key)
    }

    /// Journals the pages a write added (`mapped`: lane, page, physical id)
    /// and, when asked, persists the lanes it wrote before the write is
    /// acknowledged.
    fn finish_write(
        &self,
        seq: &mut Sequence,
        lanes: &[usize],
        mapped: &[(usize, usize, u64)],
        persist: bool,
    ) -> StoreResult<Acknowledged> {
        self.durable.journal(|| {
            mapped
                .iter()
                .map(|&(lane, page, phys)| map_record(seq, lane, page, phys))
                .collect()
        });
        if !persist {
            return Ok(Acknowledged::Memory);
        }
        self.durable.persist_lanes(seq, lanes)
    }
}

/// Validates a put: it must start at the end of every lane in its range,
/// on a page boundary.
/// Runs a write's publishing part with its pages' metadata charged first,
/// each page as a new physical one: refused before anything happens when
/// that passes a limit, refunded when the write fails; as the write
/// publishes, a new page's physical part moves to the page itself (see
/// `PageCharge`) and a shared page's is refunded.
fn charged(
    seq: &mut Sequence,
    batch: &Batch<'_>,
    write: impl FnOnce(&mut Sequence) -> StoreResult<Published>,
) -> StoreResult<Published> {
    let pages = (batch.lanes.len() * batch.ranges.len()) as u64;
    // At most: every page new, and shareable if the sequence has prefix
    // hashes (only full pages under a hash are).
    let bytes = cost::pages(&batch.layout, pages, pages, !seq.hashes.is_empty());
    let before = seq.charge.bytes();
    seq.charge.grow(bytes)?;
    let published = write(seq);
    match &published {
        // What stays with the sequence is its logical pages' part: new
        // pages took their physical part with them.
        Ok(_) => {
            let kept = before + cost::pages(&batch.layout, pages, 0, false);
            seq.charge.shrink(seq.charge.bytes().saturating_sub(kept))
        }
        // What has not moved to pages published before the failure.
        Err(_) => seq.charge.shrink(seq.charge.bytes().saturating_sub(before)),
    }
    published
}

fn put_batch<'a>(seq: &Sequence, req: &PutPages<'a>) -> StoreResult<Batch<'a>> {
    seq.check_layer(req.layer)?;
    let heads = seq.check_heads(req.heads)?;
    let layout = Arc::clone(&seq.layout);
    let rows = KvRows::new(&layout, heads.len(), req.num_tokens, req.kv)?;
    let page_size = layout.page_size() as usize;
    let start = u64::from(req.first_page) * page_size as u64;
    for (h, lane) in seq.lanes_of(req.layer, heads.clone()) {
        let tokens = seq.lanes[lane].tokens();
        if tokens != start {
            let hint = if tokens.is_multiple_of(page_size as u64) {
                format!("PutPages continues at page {}", tokens / page_size as u64)
            } else {
                "its last page is partial; continue with AppendTokens".to_owned()
            };
            return Err(StoreError::precondition(
                wire::FIRST_PAGE,
                format!(
                    "is {}, but layer {} KV head {h} holds {tokens} tokens; {hint}",
                    req.first_page, req.layer
                ),
            ));
        }
    }
    let pages = rows.tokens.div_ceil(page_size);
    let ranges = (0..pages)
        .map(|i| i * page_size..((i + 1) * page_size).min(rows.tokens))
        .collect();
    Ok(Batch {
        lanes: seq.lanes_of(req.layer, heads).map(|(_, lane)| lane).collect(),
        layout,
        owner: Arc::clone(seq.charge.account()),
        rows,
        ranges,
    })
}

/// Validates an append: every lane of its range holds the same tokens (as
/// many as `expected_position`, when given), and a partial last page it
/// writes into still holds its original bytes. Returns the batch of new
/// pages, the lanes' tokens before, and how many rows fill the partial
/// last pages.
fn append_batch<'a>(seq: &Sequence, req: &AppendTokens<'a>) -> StoreResult<(Batch<'a>, u64, usize)> {
    seq.check_layer(req.layer)?;
    let heads = seq.check_heads(req.heads)?;
    let layout = Arc::clone(&seq.layout);
    let rows = KvRows::new(&layout, heads.len(), req.num_tokens, req.kv)?;
    let lanes: Vec<(u32, usize)> = seq.lanes_of(req.layer, heads).collect();
    let tokens = seq.lanes[lanes[0].1].tokens();
    if let Some(&(h, lane)) = lanes.iter().find(|(_, lane)| seq.lanes[*lane].tokens() != tokens) {
        return Err(StoreError::precondition(
            wire::KV_HEAD_START,
            format!(
                "layer {} KV heads {} and {h} hold different lengths ({tokens} and {} tokens); append to each head range separately",
                req.layer,
                lanes[0].0,
                seq.lanes[lane].tokens()
            ),
        ));
    }
    if let Some(expected) = req.expected_position.filter(|p| *p != tokens) {
        return Err(StoreError::precondition(
            wire::POSITION,
            format!(
                "is {expected}, but layer {} holds {tokens} tokens in these KV heads",
                req.layer
            ),
        ));
    }
    let plan = seq.lanes[lanes[0].1].plan_append(req.num_tokens);
    let fill = plan.fill as usize;
    if fill > 0
        && let Some(&(h, lane)) = lanes.iter().find(|(_, lane)| {
            let l = &seq.lanes[*lane];
            !matches!(l.page(l.num_pages() - 1), Some(LogicalPage::Physical(r)) if r.page.place.read().lost().is_none())
        })
    {
        return Err(StoreError::precondition(
            wire::POSITION,
            format!(
                "appending at {tokens} writes into page {} of layer {} KV head {h}, \
                 which no longer holds its original bytes",
                seq.lanes[lane].num_pages() - 1,
                req.layer
            ),
        ));
    }
    let mut at = fill;
    let ranges = plan
        .new_pages
        .iter()
        .map(|&n| {
            at += n as usize;
            at - n as usize..at
        })
        .collect();
    let batch = Batch {
        lanes: lanes.into_iter().map(|(_, lane)| lane).collect(),
        layout,
        owner: Arc::clone(seq.charge.account()),
        rows,
        ranges,
    };
    Ok((batch, tokens, fill))
}

/// The physical last page of each of `lanes` when `fill` rows go into it.
fn partial_pages(seq: &Sequence, lanes: &[usize], fill: usize) -> Vec<Arc<PhysPage>> {
    if fill == 0 {
        return Vec::new();
    }
    lanes
        .iter()
        .filter_map(|&lane| match seq.lanes[lane].page(seq.lanes[lane].num_pages() - 1) {
            Some(LogicalPage::Physical(r)) => Some(Arc::clone(&r.page)),
            _ => None,
        })
        .collect()
}
