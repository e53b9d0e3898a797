//! Writes: whole pages (`put_pages`, with prefix sharing) and decode tokens
//! (`append_tokens`, filling the partial last page first).
//!
//! Both run in phases so that a refused write changes nothing: validate,
//! reserve every slot, copy the bytes, then publish to the page table and
//! the lanes.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use kvtier_core::{DigestColumn, Layout, LogicalPage, PageTableError, Reason};
use kvtier_tiers::Slot;

use crate::durability::Acknowledged;
use crate::movement::MigrationTime;
use crate::page::{PageRef, PhysPage, Pins, Placement, ShareKey, StorePage, write_rows};
use crate::sequence::{HeadRange, Sequence};
use crate::stats::Counters;
use crate::store::share_key;
use crate::sync::{lock, read, write};
use crate::{Store, StoreError, StoreResult};

/// Whole pages for one layer and a range of KV heads, starting at the end
/// of every lane in the range (a page boundary).
#[derive(Debug, Clone, Copy)]
pub struct PutPages<'a> {
    pub layer: u32,
    pub heads: HeadRange,
    pub first_page: u32,
    /// Tokens covered; all pages are full except possibly the last.
    pub num_tokens: u32,
    /// Per head (head-major): K rows `[num_tokens][head_dim]`, then V rows.
    pub kv: &'a [u8],
    /// Also write the pages to NVMe and record them in the manifest before
    /// acknowledging, so that they survive a restart.
    pub persist: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutOutcome {
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
    pub layer: u32,
    pub heads: HeadRange,
    pub num_tokens: u32,
    /// Per head (head-major): K rows `[num_tokens][head_dim]`, then V rows.
    pub kv: &'a [u8],
    /// If set, the lanes must hold exactly this many tokens (guards retries).
    pub expected_position: Option<u64>,
    /// As for [`PutPages::persist`].
    pub persist: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendOutcome {
    /// Tokens in each written lane afterwards.
    pub tokens: u64,
    pub pages_opened: u64,
    /// What the acknowledgement guarantees.
    pub durability: Acknowledged,
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

fn micros(d: std::time::Duration) -> u64 {
    d.as_micros() as u64
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
            return Err(StoreError::invalid("num_tokens", "must be at least 1"));
        }
        let (row, tokens) = (layout.row_bytes(), tokens as usize);
        let expected = heads as u128 * 2 * tokens as u128 * row as u128;
        if kv.len() as u128 != expected {
            return Err(StoreError::invalid(
                "kv",
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
                    "kv",
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

/// Storage (and an id) reserved for a page about to be written.
struct NewPage {
    id: u64,
    host: Slot,
    device: Option<Slot>,
}

enum Planned {
    /// Already stored under its prefix hash; a reference is held.
    Shared(PageRef),
    /// To be written; storage not reserved yet.
    Unreserved(Option<ShareKey>),
    /// To be written into `page`.
    New { page: NewPage, key: Option<ShareKey> },
}

impl Store {
    pub fn put_pages(&self, key: &kvtier_core::SequenceKey, req: PutPages<'_>) -> StoreResult<PutOutcome> {
        self.with_sequence_mut(key, |seq| self.put_pages_locked(seq, req))
    }

    fn put_pages_locked(&self, seq: &mut Sequence, req: PutPages<'_>) -> StoreResult<PutOutcome> {
        self.check_persist(req.persist)?;
        seq.check_layer("layer", req.layer)?;
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
                    "first_page",
                    format!(
                        "is {}, but layer {} KV head {h} holds {tokens} tokens; {hint}",
                        req.first_page, req.layer
                    ),
                ));
            }
        }
        let lanes: Vec<usize> = seq.lanes_of(req.layer, heads).map(|(_, lane)| lane).collect();
        let pages = (req.num_tokens as usize).div_ceil(page_size);
        let token_range = |i: usize| i * page_size..((i + 1) * page_size).min(rows.tokens);

        // Reserve: share what is already stored under its prefix hash,
        // allocate the rest. A failure releases what was taken.
        let mut planned: Vec<Planned> = Vec::with_capacity(lanes.len() * pages);
        {
            let mut table = lock(&self.pages);
            for &lane in &lanes {
                for i in 0..pages {
                    let full = token_range(i).len() == page_size;
                    let key = seq
                        .hashes
                        .get(req.first_page as usize + i)
                        .filter(|_| full)
                        .map(|hash| share_key(seq, hash, lane));
                    let shared = key.as_ref().and_then(|k| table.find(k)).map(|id| {
                        table.acquire(id).expect("registered pages are live");
                        let page = Arc::clone(table.get(id).expect("registered pages are live"));
                        PageRef { id, page }
                    });
                    planned.push(match shared {
                        Some(r) => Planned::Shared(r),
                        None => Planned::Unreserved(key),
                    });
                }
            }
        }
        if let Err(e) = self.reserve_new_pages(&layout, &mut planned, pages, &mut MigrationTime::default()) {
            self.release_planned(planned);
            return Err(e);
        }

        // Copy the bytes into the reserved slots.
        let copied = planned.iter_mut().enumerate().try_for_each(|(j, plan)| match plan {
            Planned::New { page, .. } => {
                let t = token_range(j % pages);
                self.fill(
                    page,
                    &layout,
                    rows.keys(j / pages, t.clone()),
                    rows.values(j / pages, t),
                )
            }
            Planned::Shared(_) | Planned::Unreserved(_) => Ok(()),
        });
        if let Err(e) = copied {
            self.release_planned(planned);
            return Err(e);
        }

        // Publish.
        let (mut written, mut shared) = (0u64, 0u64);
        let mut hot = Vec::new();
        let mut mapped = Vec::new();
        let mut table = lock(&self.pages);
        for (j, plan) in planned.into_iter().enumerate() {
            let (h, i) = (j / pages, j % pages);
            let lane = &mut seq.lanes[lanes[h]];
            let keys = rows.keys(h, token_range(i));
            let n = token_range(i).len();
            let phys = match plan {
                Planned::Shared(r) => {
                    shared += 1;
                    let page = Arc::clone(&r.page);
                    let digest = page.digest.as_deref().expect("shared pages keep their digest");
                    lane.push_full_page(LogicalPage::Physical(r), digest);
                    page.id
                }
                Planned::New { page, key: None } => {
                    written += 1;
                    let page = self.phys_page(page, &layout, n, None);
                    let id = table.insert(Arc::clone(&page), None).map_err(|(e, _)| internal(e))?;
                    if read_device(&page) {
                        hot.push(Arc::clone(&page));
                    }
                    let phys = page.id;
                    lane.push_page(LogicalPage::Physical(PageRef { id, page }), keys);
                    phys
                }
                Planned::New { page, key: Some(key) } => {
                    let mut digest = DigestColumn::new(layout.dtype(), layout.head_dim() as usize);
                    digest.open_page(keys);
                    let page = self.phys_page(page, &layout, n, Some(digest.entry(0).into()));
                    let r = match table.insert(Arc::clone(&page), Some(key)) {
                        Ok(id) => {
                            written += 1;
                            if read_device(&page) {
                                hot.push(Arc::clone(&page));
                            }
                            PageRef { id, page }
                        }
                        // Another sequence stored the same prefix meanwhile:
                        // use its page; ours is freed as it drops here.
                        Err((PageTableError::KeyTaken(id), _)) => {
                            shared += 1;
                            table.acquire(id).map_err(internal)?;
                            let page = Arc::clone(table.get(id).expect("registered pages are live"));
                            PageRef { id, page }
                        }
                        Err((e, _)) => return Err(internal(e)),
                    };
                    let phys = r.page.id;
                    lane.push_full_page(LogicalPage::Physical(r), digest.entry(0));
                    phys
                }
                Planned::Unreserved(_) => unreachable!("every new page was reserved"),
            };
            mapped.push((lanes[h], lane.num_pages() - 1, phys));
        }
        drop(table);
        self.touch_device(hot);
        let durability = self.finish_write(seq, &lanes, &mapped, req.persist)?;
        Counters::add(&self.counters.pages_written, written);
        Counters::add(&self.counters.pages_shared, shared);
        Counters::add(&self.counters.bytes_written, req.kv.len() as u64);
        Ok(PutOutcome {
            pages_written: written,
            pages_shared: shared,
            durability,
        })
    }

    pub fn append_tokens(&self, key: &kvtier_core::SequenceKey, req: AppendTokens<'_>) -> StoreResult<AppendOutcome> {
        let start = Instant::now();
        let mut appended = self.with_sequence_mut(key, |seq| {
            let locked = Instant::now();
            let mut appended = self.append_locked(seq, req)?;
            let policy = Instant::now();
            self.run_auto_policy(seq, req.layer);
            appended.timing.policy_us = micros(policy.elapsed());
            appended.timing.lock_wait_us = micros(locked - start);
            Ok(appended)
        })?;
        appended.timing.store_us = micros(start.elapsed());
        Ok(appended)
    }

    fn append_locked(&self, seq: &mut Sequence, req: AppendTokens<'_>) -> StoreResult<AppendOutcome> {
        self.check_persist(req.persist)?;
        seq.check_layer("layer", req.layer)?;
        let heads = seq.check_heads(req.heads)?;
        let layout = Arc::clone(&seq.layout);
        let rows = KvRows::new(&layout, heads.len(), req.num_tokens, req.kv)?;
        let lanes: Vec<(u32, usize)> = seq.lanes_of(req.layer, heads).collect();
        let tokens = seq.lanes[lanes[0].1].tokens();
        if let Some(&(h, lane)) = lanes.iter().find(|(_, lane)| seq.lanes[*lane].tokens() != tokens) {
            return Err(StoreError::precondition(
                "kv_head_start",
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
                "position",
                format!(
                    "is {expected}, but layer {} holds {tokens} tokens in these KV heads",
                    req.layer
                ),
            ));
        }
        let plan = seq.lanes[lanes[0].1].plan_append(req.num_tokens);
        if plan.fill > 0 {
            for &(h, lane) in &lanes {
                let lane = &seq.lanes[lane];
                let last = lane.num_pages() - 1;
                let lost = match lane.page(last) {
                    Some(LogicalPage::Physical(r)) => read(&r.page.place).lost.is_some(),
                    _ => true,
                };
                if lost {
                    return Err(StoreError::precondition(
                        "position",
                        format!(
                            "appending at {tokens} writes into page {last} of layer {} KV head {h}, \
                             which no longer holds its original bytes",
                            req.layer
                        ),
                    ));
                }
            }
        }

        // The partial pages are written in place, in memory. They stay
        // pinned until the write publishes, so that making room for the new
        // pages (host migration, device demotion) cannot take the copies
        // the fill writes to.
        let partial: Vec<Arc<PhysPage>> = lanes
            .iter()
            .filter(|_| plan.fill > 0)
            .filter_map(
                |&(_, lane)| match seq.lanes[lane].page(seq.lanes[lane].num_pages() - 1) {
                    Some(LogicalPage::Physical(r)) => Some(Arc::clone(&r.page)),
                    _ => None,
                },
            )
            .collect();
        let _filling = Pins::new(partial.clone());
        let mut timing = AppendTiming::default();
        let mut migration = MigrationTime::default();
        let reserving = Instant::now();
        for page in &partial {
            self.ensure_host(page, &layout, Reason::Demand, &mut migration)?;
        }
        let mut planned: Vec<Planned> = (0..lanes.len() * plan.new_pages.len())
            .map(|_| Planned::Unreserved(None))
            .collect();
        self.reserve_new_pages(&layout, &mut planned, plan.new_pages.len(), &mut migration)?;
        timing.reserve_us = micros(reserving.elapsed());
        timing.migration_wait_us = micros(migration.waited);
        timing.migration_us = micros(migration.moving);
        let opened = planned.len() as u64;

        // Fill the partial last pages in place, then the new pages. A pinned
        // page keeps a memory copy (an exclusive device cache may move it
        // from host to device meanwhile); checked for all before any is
        // written, so the fill is all or nothing.
        if let Some(page) = partial.iter().find(|p| {
            let place = read(&p.place);
            place.host.is_none() && place.device.is_none()
        }) {
            return Err(StoreError::Internal(format!(
                "page {} lost its memory copies while pinned for an append",
                page.id
            )));
        }
        let fill = plan.fill as usize;
        for (h, (page, &(_, lane))) in partial.iter().zip(&lanes).enumerate() {
            let lane = &seq.lanes[lane];
            let first_row = lane.rows_in(lane.num_pages() - 1);
            let mut place = write(&page.place);
            let place = &mut *place;
            let (k, v) = (rows.keys(h, 0..fill), rows.values(h, 0..fill));
            if let Some(host) = place.host.as_mut() {
                write_rows(&*self.host, host, &layout, first_row, k, v)?;
            }
            if let Some(device) = place.device.as_mut() {
                write_rows(&*self.device, device, &layout, first_row, k, v)?;
            }
            // An NVMe copy no longer holds the page, only its first rows.
            if let Some(copy) = place.nvme.take() {
                place.durable_prefix = Some(copy);
            }
            place.rows += fill as u32;
            place.touch_bytes();
        }
        let per_lane = plan.new_pages.len();
        let page_tokens = |i: usize| {
            let start = fill + plan.new_pages[..i].iter().map(|r| *r as usize).sum::<usize>();
            start..start + plan.new_pages[i] as usize
        };
        for (j, p) in planned.iter_mut().enumerate() {
            let Planned::New { page, .. } = p else {
                unreachable!("appends plan new pages only")
            };
            let t = page_tokens(j % per_lane);
            self.fill(
                page,
                &layout,
                rows.keys(j / per_lane, t.clone()),
                rows.values(j / per_lane, t),
            )?;
        }

        // Publish.
        let mut hot = Vec::new();
        let mut mapped = Vec::new();
        let mut table = lock(&self.pages);
        let mut planned = planned.into_iter();
        for (h, &(_, lane_index)) in lanes.iter().enumerate() {
            let lane = &mut seq.lanes[lane_index];
            if fill > 0 {
                lane.extend_last(rows.keys(h, 0..fill));
            }
            for i in 0..per_lane {
                let Some(Planned::New { page, .. }) = planned.next() else {
                    unreachable!("appends plan new pages only")
                };
                let page = self.phys_page(page, &layout, page_tokens(i).len(), None);
                let id = table.insert(Arc::clone(&page), None).map_err(|(e, _)| internal(e))?;
                if read_device(&page) {
                    hot.push(Arc::clone(&page));
                }
                let lane = &mut seq.lanes[lane_index];
                let phys = page.id;
                lane.push_page(
                    LogicalPage::Physical(PageRef { id, page }),
                    rows.keys(h, page_tokens(i)),
                );
                mapped.push((lane_index, lane.num_pages() - 1, phys));
            }
        }
        drop(table);
        self.touch_device(hot);
        let lane_indices: Vec<usize> = lanes.iter().map(|&(_, lane)| lane).collect();
        let journalling = Instant::now();
        let durability = self.finish_write(seq, &lane_indices, &mapped, req.persist)?;
        timing.durability_us = micros(journalling.elapsed());
        Counters::add(&self.counters.pages_written, opened);
        Counters::add(
            &self.counters.tokens_appended,
            u64::from(req.num_tokens) * lanes.len() as u64,
        );
        Counters::add(&self.counters.bytes_written, req.kv.len() as u64);
        Ok(AppendOutcome {
            tokens: tokens + u64::from(req.num_tokens),
            pages_opened: opened,
            durability,
            timing,
        })
    }

    fn check_persist(&self, persist: bool) -> StoreResult<()> {
        if persist && self.manifest.is_none() {
            return Err(StoreError::precondition(
                "persist",
                "persisting needs the nvme tier and its manifest",
            ));
        }
        Ok(())
    }

    /// Allocates host (and, when caching writes, device) slots for every
    /// planned new page; `planned` is lane-major with `per_lane` pages each.
    /// Host room is required. Device room is best effort and goes to the
    /// newest pages first, since they are the likeliest to be read next.
    fn reserve_new_pages(
        &self,
        layout: &Layout,
        planned: &mut [Planned],
        per_lane: usize,
        migration: &mut MigrationTime,
    ) -> StoreResult<()> {
        let len = layout.page_bytes() as u64;
        let new = planned.iter().filter(|p| matches!(p, Planned::Unreserved(_))).count();
        let mut ids = self
            .ids
            .take(new as u64, self.manifest.as_ref())
            .map_err(StoreError::Manifest)?;
        for plan in planned.iter_mut() {
            if let Planned::Unreserved(key) = plan {
                let page = NewPage {
                    id: ids.next().expect("one id per new page"),
                    host: self.allocate_host(len, migration)?,
                    device: None,
                };
                *plan = Planned::New { page, key: key.take() };
            }
        }
        if !self.config.cache_writes_on_device || per_lane == 0 {
            return Ok(());
        }
        let lanes = planned.len() / per_lane;
        'newest_first: for i in (0..per_lane).rev() {
            for h in 0..lanes {
                if let Planned::New { page, .. } = &mut planned[h * per_lane + i] {
                    match self.allocate_device(len) {
                        Ok(slot) => page.device = Some(slot),
                        Err(_) => break 'newest_first,
                    }
                }
            }
        }
        Ok(())
    }

    fn fill(&self, page: &mut NewPage, layout: &Layout, keys: &[u8], values: &[u8]) -> StoreResult<()> {
        write_rows(&*self.host, &mut page.host, layout, 0, keys, values)?;
        if let Some(device) = page.device.as_mut() {
            write_rows(&*self.device, device, layout, 0, keys, values)?;
        }
        Ok(())
    }

    fn phys_page(&self, page: NewPage, layout: &Arc<Layout>, rows: usize, digest: Option<Box<[u8]>>) -> Arc<PhysPage> {
        let place = Placement::new(page.device, page.host, rows as u32);
        let page = Arc::new(PhysPage::new(page.id, Arc::clone(layout), digest, place));
        self.touch_host([&page]);
        page
    }

    fn release_planned(&self, planned: Vec<Planned>) {
        self.release(planned.into_iter().filter_map(|p| match p {
            Planned::Shared(r) => Some(StorePage::Physical(r)),
            Planned::Unreserved(_) | Planned::New { .. } => None,
        }));
    }
}

fn read_device(page: &PhysPage) -> bool {
    crate::sync::read(&page.place).device.is_some()
}

fn internal(e: PageTableError) -> StoreError {
    StoreError::Internal(e.to_string())
}
