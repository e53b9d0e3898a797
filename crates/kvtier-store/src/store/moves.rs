//! A sequence as a move to another node carries it. The sending store
//! exports what a copy needs: the layout, hash chain and lanes, and per
//! page its original bytes, or its summary and why it was summarised, or
//! why it is gone, with the index entry (digest and key sketches) that a
//! summary or gone page keeps although its keys are no longer there to
//! give it, and whether its rows are durable. The receiving store starts
//! the copy without attaching anything (`create_moved`: the sender's pages,
//! in their states, are the copy), takes original pages through
//! `put_pages` like any write (shared by their hash, persisted where they
//! were durable), and appends summaries and gone pages as they were
//! (`import_page`), each journalled so that the copy survives a restart.

use std::sync::Arc;

use kvtier_core::{Layout, LogicalPage, PageIndex, Reason, SequenceKey, wire};

use super::{PutPages, Store};
use crate::catalog::{HeadRange, Sequence};
use crate::cost;
use crate::durability::{created_records, gone_record, summary_record};
use crate::host::MigrationTime;
use crate::page::{PhysPage, StoreLane, SummaryPage};
use crate::reader::Reader;
use crate::{StoreError, StoreResult};

/// What a move of a sequence starts from.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceExport {
    /// The sequence's layout.
    pub layout: Layout,
    /// Its prefix hash chain, as created.
    pub hashes: Vec<Vec<u8>>,
    /// Every lane, in lane order.
    pub lanes: Vec<LaneAt>,
    /// Whether any of its rows are durable here (the receiver must be able
    /// to persist them).
    pub durable: bool,
}

/// A lane named as writes name it: a layer that stores it (a shared-KV
/// group's first layer) and its KV head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneAt {
    /// The layer.
    pub layer: u32,
    /// The KV head.
    pub kv_head: u32,
    /// Pages the lane holds, whatever their state.
    pub pages: u32,
}

/// One page of a lane as a move carries it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportedPage {
    /// Positions the page covers (the last page may be partial).
    pub rows: u32,
    /// Its bytes, summary or reason.
    pub content: MovedContent,
    /// Some of its rows are durable here.
    pub durable: bool,
}

/// A moved page's content.
#[derive(Debug, Clone, PartialEq)]
pub enum MovedContent {
    /// The original K rows then V rows (`rows` of each).
    Original(Vec<u8>),
    /// A summary: `counts.len()` rows, K then V.
    Summary {
        /// Tokens each summary row stands for.
        counts: Vec<u32>,
        /// The summary rows.
        kv: Vec<u8>,
        /// Why the page was summarised.
        reason: Reason,
        /// The page's index entry, from its original keys.
        index_entry: Vec<u8>,
    },
    /// No bytes.
    Gone {
        /// Why the page is gone.
        reason: Reason,
        /// The page's index entry, from its original keys.
        index_entry: Vec<u8>,
    },
}

impl MovedContent {
    /// The page bytes it carries.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Original(kv) | Self::Summary { kv, .. } => kv.len(),
            Self::Gone { .. } => 0,
        }
    }
}

impl Store {
    /// What a move of sequence `key` starts from.
    pub fn export_sequence(&self, key: &SequenceKey) -> StoreResult<SequenceExport> {
        self.catalog.read(key, |seq| {
            let layout = &seq.layout;
            let mut lanes: Vec<Option<LaneAt>> = vec![None; seq.lanes.len()];
            for layer in 0..layout.num_layers() {
                for (kv_head, lane) in seq.lanes_of(layer, 0..layout.num_kv_heads()) {
                    lanes[lane].get_or_insert(LaneAt {
                        layer,
                        kv_head,
                        pages: seq.lanes[lane].num_pages() as u32,
                    });
                }
            }
            let durable = seq.lanes.iter().any(|lane| {
                lane.pages().any(|page| match page {
                    LogicalPage::Physical(r) => durable_rows(&r.page) > 0,
                    _ => false,
                })
            });
            Ok(SequenceExport {
                layout: (**layout).clone(),
                hashes: seq.hashes.iter().map(|h| h.to_vec()).collect(),
                lanes: lanes.into_iter().map(|l| l.expect("every lane has a layer")).collect(),
                durable,
            })
        })
    }

    /// Pages of one lane from `first_page` on, until their bytes would pass
    /// `max_bytes` (at least one page while any remain); none past the end.
    /// Original bytes are read wherever they are (NVMe included, without
    /// giving them a host copy: the sequence is leaving).
    pub fn export_pages(
        &self,
        key: &SequenceKey,
        at: LaneAt,
        first_page: u32,
        max_bytes: usize,
    ) -> StoreResult<Vec<ExportedPage>> {
        self.catalog.read(key, |seq| {
            seq.check_layer(at.layer)?;
            let lane_index = seq.layout.lane(at.layer, at.kv_head);
            let lane = &seq.lanes[lane_index];
            let mut out = Vec::new();
            let mut originals: Vec<(usize, Arc<PhysPage>, u32)> = Vec::new();
            let mut bytes = 0usize;
            for p in first_page as usize..lane.num_pages() {
                let rows = lane.rows_in(p);
                let page = lane.page(p).expect("page in range");
                let (content, durable) = match page {
                    LogicalPage::Physical(r) => {
                        originals.push((out.len(), Arc::clone(&r.page), rows));
                        bytes += 2 * rows as usize * seq.layout.row_bytes();
                        (MovedContent::Original(Vec::new()), durable_rows(&r.page) > 0)
                    }
                    LogicalPage::Summary(s) => {
                        let mut kv = vec![0; s.slot.len() as usize];
                        self.host.tier().read(&s.slot, 0, &mut kv)?;
                        bytes += kv.len();
                        let content = MovedContent::Summary {
                            counts: s.counts.clone(),
                            kv,
                            reason: s.reason,
                            index_entry: exported_entry(&seq.layout, lane, p),
                        };
                        (content, false)
                    }
                    LogicalPage::Gone(reason) => (
                        MovedContent::Gone {
                            reason: *reason,
                            index_entry: exported_entry(&seq.layout, lane, p),
                        },
                        false,
                    ),
                };
                out.push(ExportedPage { rows, content, durable });
                if bytes >= max_bytes {
                    break;
                }
            }
            let reader = Reader {
                promote: false,
                ..self.reader()
            };
            let wanted: Vec<(Arc<PhysPage>, u32)> = originals.iter().map(|(_, p, r)| (Arc::clone(p), *r)).collect();
            for ((i, page, _), bytes) in originals.iter().zip(reader.originals(&seq.layout, &wanted)?) {
                out[*i].content = match bytes {
                    Some(kv) => MovedContent::Original(kv),
                    // Lost meanwhile (its stored copy failed its check): it
                    // moves as the gone page it now is.
                    None => MovedContent::Gone {
                        reason: page.place.read().lost().unwrap_or(Reason::Integrity),
                        index_entry: exported_entry(&seq.layout, lane, first_page as usize + i),
                    },
                };
            }
            Ok(out)
        })
    }

    /// Starts the copy of a sequence a move brings: like a create, but
    /// nothing is attached (every page comes from the sender, in its state).
    pub fn create_moved(&self, key: SequenceKey, layout: Layout, prefix_hashes: Vec<Vec<u8>>) -> StoreResult<()> {
        let cost = cost::sequence(&key, &layout, &prefix_hashes);
        let hashes = super::sequences::check_hashes(prefix_hashes)?;
        if self.catalog.contains(&key) {
            return Err(super::sequences::already_exists(&key));
        }
        let charge = self.accounts.open(&key, cost, false)?;
        let seq = Sequence::new(key.clone(), Arc::new(layout), hashes, charge);
        self.catalog
            .insert(seq, |seq| self.durable.journal(|| created_records(seq, 0)))
            .map_err(|_| super::sequences::already_exists(&key))?;
        tracing::info!(sequence = %key, "receiving a moved sequence");
        Ok(())
    }

    /// Appends pages a move brings to the end of their lane, from
    /// `first_page` (the lane's next page): runs of original pages as one
    /// put each (shared by their prefix hash; a run through a page that was
    /// durable persisted, which makes every row of the lane before it
    /// durable too), summaries and gone pages as they were. Returns the
    /// pages written.
    pub fn import_pages(
        &self,
        key: &SequenceKey,
        lane: LaneAt,
        first_page: u32,
        pages: Vec<ExportedPage>,
    ) -> StoreResult<u64> {
        let (layout, _) = self.shape(key)?;
        let count = pages.len() as u64;
        // Persisting the last durable page covers every page before it.
        let last_durable = pages.iter().rposition(|p| p.durable);
        let mut run: Vec<(usize, ExportedPage)> = Vec::new();
        let put = |run: &mut Vec<(usize, ExportedPage)>| {
            let persist = run.last().is_some_and(|(at, _)| last_durable.is_some_and(|d| *at <= d));
            let run = std::mem::take(run);
            self.put_run(key, lane, first_page, &layout, run, persist)
        };
        for (at, page) in pages.into_iter().enumerate() {
            let place = (first_page + at as u32, page.rows, at);
            let (reason, index_entry, summary) = match page.content {
                MovedContent::Original(_) => {
                    run.push((at, page));
                    // A run ends at the last durable page: it persists, and
                    // what follows does not.
                    if Some(at) == last_durable {
                        put(&mut run)?;
                    }
                    continue;
                }
                MovedContent::Gone { reason, index_entry } => (reason, index_entry, None),
                MovedContent::Summary {
                    counts,
                    kv,
                    reason,
                    index_entry,
                } => (reason, index_entry, Some((counts, kv))),
            };
            put(&mut run)?;
            self.import_page(key, lane, place, reason, index_entry, summary)?;
        }
        put(&mut run)?;
        Ok(count)
    }

    /// One put of consecutive original pages (`(index in the message,
    /// page)`): K rows of every page, then V rows of every page.
    fn put_run(
        &self,
        key: &SequenceKey,
        lane: LaneAt,
        first_page: u32,
        layout: &Layout,
        run: Vec<(usize, ExportedPage)>,
        persist: bool,
    ) -> StoreResult<()> {
        let Some(&(first, _)) = run.first() else { return Ok(()) };
        let row = layout.row_bytes();
        let mut tokens = 0u32;
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for (at, page) in &run {
            check_rows(layout, page.rows, *at)?;
            let MovedContent::Original(kv) = &page.content else {
                continue;
            };
            let half = page.rows as usize * row;
            if kv.len() != 2 * half {
                return Err(StoreError::invalid(
                    wire::moved_page(*at, wire::MOVED_PAGE_KV),
                    format!(
                        "is {} bytes, but {} tokens of K and V take {}",
                        kv.len(),
                        page.rows,
                        2 * half
                    ),
                ));
            }
            keys.extend_from_slice(&kv[..half]);
            values.extend_from_slice(&kv[half..]);
            tokens += page.rows;
        }
        keys.extend_from_slice(&values);
        self.put_pages(
            key,
            PutPages {
                layer: lane.layer,
                heads: HeadRange {
                    start: lane.kv_head,
                    count: 1,
                },
                first_page: first_page + first as u32,
                num_tokens: tokens,
                kv: &keys,
                persist,
            },
        )
        .map(drop)
    }

    /// Appends a gone page, or with `summary` (counts and rows) a summary,
    /// that a move brings at the end of its lane (page `page`, which must be
    /// the lane's next, after a full page), with the reason and index entry
    /// it had; durable before this returns. `at` is the page's index in its
    /// message, for the fields errors name.
    fn import_page(
        &self,
        key: &SequenceKey,
        lane_at: LaneAt,
        (page, rows, at): (u32, u32, usize),
        reason: Reason,
        index_entry: Vec<u8>,
        summary: Option<(Vec<u32>, Vec<u8>)>,
    ) -> StoreResult<()> {
        self.catalog.write(key, |seq| {
            seq.check_layer(lane_at.layer)?;
            if lane_at.kv_head >= seq.layout.num_kv_heads() {
                return Err(StoreError::invalid(
                    wire::MOVED_KV_HEAD,
                    format!(
                        "is {}, but the layout has {} KV heads",
                        lane_at.kv_head,
                        seq.layout.num_kv_heads()
                    ),
                ));
            }
            let lane = seq.layout.lane(lane_at.layer, lane_at.kv_head);
            let held = seq.lanes[lane].num_pages();
            if page as usize != held || seq.lanes[lane].room_in_last() != 0 {
                return Err(StoreError::precondition(
                    wire::MOVED_FIRST_PAGE,
                    format!(
                        "page {page} is not the next page of layer {} KV head {}, which holds {held} pages{}",
                        lane_at.layer,
                        lane_at.kv_head,
                        if seq.lanes[lane].room_in_last() != 0 {
                            ", the last partial"
                        } else {
                            ""
                        }
                    ),
                ));
            }
            check_rows(&seq.layout, rows, at)?;
            check_entry(&seq.layout, rows, &index_entry, at)?;
            if let Some((counts, kv)) = &summary {
                check_summary(&seq.layout, rows, counts, kv, at)?;
            }
            // Charged before anything is allocated: a refusal allocates nothing.
            let summary_rows = summary.as_ref().map_or(0, |(counts, _)| counts.len() as u64);
            let charge = cost::pages(&seq.layout, 1, 0, false) + cost::summary(summary_rows);
            seq.charge.grow(charge)?;
            let p = page as usize;
            let Some((counts, kv)) = summary else {
                seq.lanes[lane].push_known(LogicalPage::Gone(reason), &index_entry, rows);
                self.durable.journal(|| vec![gone_record(seq, lane, p, reason)]);
                return Ok(());
            };
            let owner = Arc::clone(seq.charge.account());
            let slot = match self.summary_slot(&owner, &kv) {
                Ok(slot) => slot,
                Err(e) => {
                    seq.charge.shrink(charge);
                    return Err(e);
                }
            };
            let page = SummaryPage {
                counts: counts.clone(),
                slot,
                reason,
            };
            seq.lanes[lane].push_known(LogicalPage::Summary(page), &index_entry, rows);
            self.durable
                .journal(|| vec![summary_record(seq, lane, p, reason, &counts, kv)]);
            Ok(())
        })?;
        self.durable.commit()
    }

    /// Makes everything a move brought so far durable as journalled (the
    /// receiver's last step before it takes the sequence over).
    pub fn commit_moved(&self, key: &SequenceKey) -> StoreResult<()> {
        self.catalog.read(key, |_| Ok(()))?;
        self.durable.commit()
    }

    /// A host slot holding a summary's rows.
    fn summary_slot(&self, owner: &Arc<crate::accounts::Account>, kv: &[u8]) -> StoreResult<kvtier_tiers::Slot> {
        let mut slot = self
            .host
            .allocate(kv.len() as u64, &self.durable, &mut MigrationTime::default(), owner)?;
        self.host.tier().write(&mut slot, 0, kv)?;
        Ok(slot)
    }
}

/// Rows of a physical page covered by its NVMe copy (current, or the
/// durable prefix an append has not yet superseded).
fn durable_rows(page: &PhysPage) -> u32 {
    let place = page.place.read();
    place.nvme().or(place.durable_prefix()).map_or(0, |copy| copy.rows)
}

fn check_rows(layout: &Layout, rows: u32, at: usize) -> StoreResult<()> {
    if rows == 0 || rows > layout.page_size() {
        return Err(StoreError::invalid(
            wire::moved_page(at, wire::MOVED_PAGE_TOKENS),
            format!("is {rows}, but a page holds 1..={} tokens", layout.page_size()),
        ));
    }
    Ok(())
}

/// Page `p`'s whole index entry, as a move carries it: one whose sketches
/// cannot be derived again (its keys lost while they were spilled) carries
/// zero rows, which rank as zero keys there as here.
fn exported_entry(layout: &Layout, lane: &StoreLane, p: usize) -> Vec<u8> {
    let mut entry = lane.index_entry(p);
    entry.resize(
        PageIndex::entry_len(layout.dtype(), layout.head_dim() as usize, lane.rows_in(p)),
        0,
    );
    entry
}

fn check_entry(layout: &Layout, rows: u32, entry: &[u8], at: usize) -> StoreResult<()> {
    let want = PageIndex::entry_len(layout.dtype(), layout.head_dim() as usize, rows);
    if entry.len() != want {
        return Err(StoreError::invalid(
            wire::moved_page(at, wire::MOVED_PAGE_INDEX_ENTRY),
            format!(
                "is {} bytes, but a page of {rows} tokens has a {want}-byte entry",
                entry.len()
            ),
        ));
    }
    Ok(())
}

fn check_summary(layout: &Layout, rows: u32, counts: &[u32], kv: &[u8], at: usize) -> StoreResult<()> {
    let covered: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    if counts.is_empty() || counts.contains(&0) || covered != u64::from(rows) {
        return Err(StoreError::invalid(
            wire::moved_page(at, wire::MOVED_PAGE_COUNTS),
            format!(
                "must be {} counts of at least 1 summing to the page's {rows} tokens",
                if counts.is_empty() {
                    "1 or more".to_owned()
                } else {
                    counts.len().to_string()
                }
            ),
        ));
    }
    let want = 2 * counts.len() * layout.row_bytes();
    if kv.len() != want {
        return Err(StoreError::invalid(
            wire::moved_page(at, wire::MOVED_PAGE_KV),
            format!("is {} bytes, but {} summary rows take {want}", kv.len(), counts.len()),
        ));
    }
    Ok(())
}
