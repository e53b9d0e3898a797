//! Rebuilding the store from the manifest after a restart, and writing the
//! checkpoint that compacts the manifest.
//!
//! A page comes back with its bytes if its physical page had an NVMe copy
//! recorded as written (its CRC is checked when it is read); a page that was
//! only in memory comes back `gone` with reason `lost_on_restart`, keeping
//! its position (and its digest when it was full).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvtier_core::{Layout, LogicalPage, PhysId, Reason, SequenceKey};

use crate::manifest::Record;
use crate::page::{NvmeCopy, PageRef, PhysPage, Placement, ShareKey};
use crate::sequence::Sequence;
use crate::sync::{lock, read};
use crate::{Store, StoreResult};

#[derive(Debug, Clone)]
struct RecPage {
    phys: Option<u64>,
    rows: u32,
    digest: Vec<u8>,
    unmapped: Option<Reason>,
}

#[derive(Debug)]
struct RecSeq {
    layout: Arc<Layout>,
    hashes: Vec<Arc<[u8]>>,
    pages: BTreeMap<(u32, u32), RecPage>,
}

#[derive(Debug, Clone)]
struct RecPhys {
    offset: u64,
    len: u64,
    crc: u32,
    rows: u32,
    digest: Vec<u8>,
}

/// What a restart found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    pub sequences: u64,
    /// Pages back with their bytes (on NVMe).
    pub pages: u64,
    /// Pages that were only in memory.
    pub lost_on_restart: u64,
}

impl Store {
    /// Replays manifest records into sequences and pages.
    pub(crate) fn recover(&self, records: Vec<Record>) -> StoreResult<Recovered> {
        let mut seqs: HashMap<SequenceKey, RecSeq> = HashMap::new();
        let mut order: Vec<SequenceKey> = Vec::new();
        let mut phys: HashMap<u64, RecPhys> = HashMap::new();
        let mut max_id = 0u64;
        for record in records {
            match record {
                Record::Sequence { key, layout, hashes } => {
                    order.push(key.clone());
                    let hashes = hashes.into_iter().map(Arc::from).collect();
                    seqs.insert(
                        key,
                        RecSeq {
                            layout: Arc::new(layout),
                            hashes,
                            pages: BTreeMap::new(),
                        },
                    );
                }
                Record::Drop { key } => {
                    seqs.remove(&key);
                }
                Record::Map {
                    key,
                    lane,
                    page,
                    phys: id,
                    rows,
                    digest,
                } => {
                    if let Some(s) = seqs.get_mut(&key) {
                        max_id = max_id.max(id.saturating_add(1));
                        let phys = (id != u64::MAX).then_some(id);
                        s.pages.insert(
                            (lane, page),
                            RecPage {
                                phys,
                                rows,
                                digest,
                                unmapped: None,
                            },
                        );
                    }
                }
                Record::Unmap {
                    key,
                    lane,
                    page,
                    reason,
                } => {
                    if let Some(p) = seqs.get_mut(&key).and_then(|s| s.pages.get_mut(&(lane, page))) {
                        p.unmapped = Some(reason);
                    }
                }
                Record::Persist {
                    phys: id,
                    offset,
                    len,
                    crc,
                    rows,
                    digest,
                } => {
                    max_id = max_id.max(id.saturating_add(1));
                    phys.insert(
                        id,
                        RecPhys {
                            offset,
                            len,
                            crc,
                            rows,
                            digest,
                        },
                    );
                }
                Record::Unpersist { phys: id } => {
                    phys.remove(&id);
                }
            }
        }
        self.set_next_page_id(max_id);
        let mut report = Recovered::default();
        let mut built: HashMap<u64, Option<(Arc<PhysPage>, RecPhys)>> = HashMap::new();
        let mut ids: HashMap<u64, PhysId> = HashMap::new();
        let mut sequences = Vec::new();
        for key in order {
            let Some(rec) = seqs.remove(&key) else { continue };
            let mut seq = Sequence::new(key.clone(), Arc::clone(&rec.layout), rec.hashes);
            let page_size = rec.layout.page_size();
            let entry_bytes = 2 * rec.layout.row_bytes();
            let mut lanes: BTreeMap<u32, Vec<(u32, RecPage)>> = BTreeMap::new();
            for ((lane, page), p) in rec.pages {
                lanes.entry(lane).or_default().push((page, p));
            }
            for (lane, pages) in lanes {
                let Some(target) = seq.lanes.get(lane as usize) else {
                    continue;
                };
                debug_assert_eq!(target.num_pages(), 0);
                let last = pages.last().map_or(0, |(p, _)| *p);
                let by_page: BTreeMap<u32, RecPage> = pages.into_iter().collect();
                for page in 0..=last {
                    let rec_page = by_page.get(&page);
                    let durable = rec_page
                        .filter(|p| p.unmapped.is_none())
                        .and_then(|p| p.phys)
                        .and_then(|id| self.rebuild_page(id, &rec.layout, &phys, &mut built).map(|b| (id, b)));
                    // Every page but the last was full.
                    let rows = |r: u32| if page < last { page_size } else { r.clamp(1, page_size) };
                    let hash = seq.hashes.get(page as usize).cloned();
                    let lane_ref = &mut seq.lanes[lane as usize];
                    match durable {
                        Some((_, (physical, info))) => {
                            let share = hash
                                .filter(|_| info.rows == page_size)
                                .map(|h| share_key_for(&key, &rec.layout, &h, lane));
                            let id = self.adopt(&mut ids, &physical, share);
                            let digest = if info.digest.len() == entry_bytes {
                                info.digest.clone()
                            } else {
                                vec![0; entry_bytes]
                            };
                            // Only a page's first rows were durable (rows
                            // were appended since): no write after that was
                            // acknowledged durable, so the lane ends here.
                            let ends_early = info.rows < page_size && page < last;
                            let rows = if ends_early { info.rows.max(1) } else { rows(info.rows) };
                            lane_ref.push_known(LogicalPage::Physical(PageRef { id, page: physical }), rows, &digest);
                            report.pages += 1;
                            if ends_early {
                                tracing::info!(sequence = %key, lane, page, rows, "lane recovered up to a partially durable page");
                                break;
                            }
                        }
                        None => {
                            let (reason, r, digest) = match rec_page {
                                Some(p) => (p.unmapped.unwrap_or(Reason::LostOnRestart), p.rows, p.digest.clone()),
                                None => (Reason::LostOnRestart, page_size, Vec::new()),
                            };
                            if reason == Reason::LostOnRestart {
                                report.lost_on_restart += 1;
                            }
                            let digest = if digest.len() == entry_bytes {
                                digest
                            } else {
                                vec![0; entry_bytes]
                            };
                            lane_ref.push_known(LogicalPage::Gone(reason), rows(r), &digest);
                        }
                    }
                }
            }
            report.sequences += 1;
            sequences.push(seq);
        }
        for seq in sequences {
            self.insert_recovered(seq);
        }
        Ok(report)
    }

    /// The physical page `id` with its NVMe extent claimed, built once and
    /// shared by every logical page that maps to it; `None` if it has no
    /// recorded NVMe copy or its extent cannot be claimed.
    fn rebuild_page(
        &self,
        id: u64,
        layout: &Arc<Layout>,
        phys: &HashMap<u64, RecPhys>,
        built: &mut HashMap<u64, Option<(Arc<PhysPage>, RecPhys)>>,
    ) -> Option<(Arc<PhysPage>, RecPhys)> {
        built
            .entry(id)
            .or_insert_with(|| {
                let info = phys.get(&id)?.clone();
                let nvme = self.nvme.as_ref()?;
                let slot = match nvme.claim(info.offset, info.len) {
                    Ok(slot) => slot,
                    Err(e) => {
                        tracing::error!(page = id, error = %e, "manifest extent cannot be claimed; page lost");
                        return None;
                    }
                };
                let place = Placement {
                    device: None,
                    host: None,
                    nvme: Some(NvmeCopy {
                        slot: Arc::new(slot),
                        crc: info.crc,
                        rows: info.rows,
                    }),
                    durable_prefix: None,
                    rows: info.rows,
                    version: 0,
                    lost: None,
                };
                let digest =
                    (info.digest.len() == 2 * layout.row_bytes()).then(|| info.digest.clone().into_boxed_slice());
                let page = Arc::new(PhysPage::new(id, Arc::clone(layout), digest, place));
                Some((page, info))
            })
            .clone()
    }

    /// Adds a logical reference to a rebuilt physical page (registered
    /// under its share key the first time).
    fn adopt(&self, ids: &mut HashMap<u64, PhysId>, page: &Arc<PhysPage>, key: Option<ShareKey>) -> PhysId {
        let mut table = lock(&self.pages);
        if let Some(&id) = ids.get(&page.id) {
            table.acquire(id).expect("recovered pages are live");
            return id;
        }
        let id = match table.insert(Arc::clone(page), key) {
            Ok(id) => id,
            // Two recovered pages claim one prefix: keep the first shared.
            Err((_, page)) => table
                .insert(page, None)
                .map_err(|(e, _)| e)
                .expect("unkeyed inserts succeed"),
        };
        ids.insert(page.id, id);
        id
    }

    /// Everything needed to rebuild the current state: the checkpoint that
    /// replaces the manifest. A sequence is read one lane at a time, so a
    /// write waits for at most one lane's records; what changes meanwhile is
    /// journalled after the snapshot and replayed over it.
    pub(crate) fn checkpoint_records(&self) -> Vec<Record> {
        let mut records = Vec::new();
        let mut persisted: BTreeMap<u64, Record> = BTreeMap::new();
        for cell in self.sequence_cells() {
            let lanes = {
                let seq = read(&cell);
                if seq.dropped {
                    continue;
                }
                records.push(Record::Sequence {
                    key: seq.key.clone(),
                    layout: (*seq.layout).clone(),
                    hashes: seq.hashes.iter().map(|h| h.to_vec()).collect(),
                });
                seq.lanes.len()
            };
            for lane in 0..lanes {
                let seq = read(&cell);
                if seq.dropped {
                    break;
                }
                lane_records(&seq, lane, &mut records, &mut persisted);
            }
        }
        records.extend(persisted.into_values());
        records
    }

    /// Rewrites the manifest as a checkpoint of the current state.
    pub(crate) fn checkpoint(&self) {
        let Some(journal) = &self.journal else { return };
        let started = std::time::Instant::now();
        match journal.checkpoint(|| self.checkpoint_records()) {
            Ok(bytes) => tracing::info!(
                bytes,
                ms = started.elapsed().as_millis() as u64,
                "manifest checkpoint written"
            ),
            Err(e) => tracing::error!(error = %e, "manifest checkpoint failed; the journal keeps growing"),
        }
    }
}

fn share_key_for(key: &SequenceKey, layout: &Arc<Layout>, hash: &Arc<[u8]>, lane: u32) -> ShareKey {
    ShareKey {
        tenant: key.tenant.clone(),
        layout: Arc::clone(layout),
        hash: Arc::clone(hash),
        lane,
    }
}

/// The Map and Unmap records of one lane, and the Persist record of each
/// physical page it maps that has an NVMe copy (once per page).
fn lane_records(seq: &Sequence, lane_index: usize, records: &mut Vec<Record>, persisted: &mut BTreeMap<u64, Record>) {
    let full = seq.layout.page_size();
    let lane = &seq.lanes[lane_index];
    for (p, logical) in lane.pages().enumerate() {
        let rows = lane.rows_in(p);
        let (phys, unmapped, has_copy) = match logical {
            LogicalPage::Physical(r) => {
                let place = read(&r.page.place);
                let copy = place.nvme.as_ref().or(place.durable_prefix.as_ref());
                if let Some(copy) = copy {
                    // The lane's digest covers at least the copy's rows, so
                    // it bounds them (a partial page's digest included).
                    persisted.entry(r.page.id).or_insert_with(|| Record::Persist {
                        phys: r.page.id,
                        offset: copy.slot.offset(),
                        len: copy.slot.len(),
                        crc: copy.crc,
                        rows: copy.rows,
                        digest: lane.digests().entry(p).to_vec(),
                    });
                }
                (r.page.id, place.lost, copy.is_some())
            }
            LogicalPage::Summary(_) => (u64::MAX, Some(Reason::LostOnRestart), false),
            LogicalPage::Gone(reason) => (u64::MAX, Some(*reason), false),
        };
        records.push(Record::Map {
            key: seq.key.clone(),
            lane: lane_index as u32,
            page: p as u32,
            phys,
            rows,
            // A page recovered from its copy takes the copy's digest; one
            // that is not keeps this one (full pages only, as journalled).
            digest: if rows == full && !has_copy {
                lane.digests().entry(p).to_vec()
            } else {
                Vec::new()
            },
        });
        if let Some(reason) = unmapped {
            records.push(Record::Unmap {
                key: seq.key.clone(),
                lane: lane_index as u32,
                page: p as u32,
                reason,
            });
        }
    }
}
