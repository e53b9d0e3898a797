//! What each change journals, and persisting writes: acknowledged only
//! once every row of the lanes they wrote would survive a restart.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvtier_core::{DigestColumn, LogicalPage, Reason};
use kvtier_tiers::Slot;

use super::record::PageAt;
use super::{Durability, Record};
use crate::movement::Keep;
use crate::page::{PhysPage, Placement, StoreLane};
use crate::sequence::Sequence;
use crate::sync::read;
use crate::{Store, StoreError, StoreResult};

/// What an acknowledged write guarantees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acknowledged {
    /// Held in memory: lost if the server stops.
    Memory,
    /// On NVMe and in the manifest, written to the OS but not synced:
    /// survives the server being killed, not a power loss.
    Relaxed,
    /// On NVMe and in the manifest, synced: survives a power loss.
    Fsync,
}

/// The CRC32C an NVMe copy of page `id` is stored with. The id is part of
/// it, so an extent holding another page's bytes fails the check.
pub(crate) fn page_crc(id: u64, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&id.to_le_bytes()), bytes)
}

impl Store {
    /// Queues manifest records (nothing without a manifest).
    pub(crate) fn journal(&self, records: Vec<Record>) {
        if let Some(manifest) = &self.manifest {
            manifest.append(records);
        }
    }

    /// Queues records that stop referring to the NVMe extents `retired`:
    /// those are reused only once the records are durable.
    pub(crate) fn journal_retiring(&self, records: Vec<Record>, retired: Vec<Arc<Slot>>) {
        if let Some(manifest) = &self.manifest {
            manifest.append_retiring(records, retired);
        }
    }

    /// Makes a client's change (eviction, summary, drop, policy) durable
    /// before it is acknowledged.
    pub(crate) fn commit_change(&self) -> StoreResult<()> {
        match &self.manifest {
            Some(m) => m.commit().map_err(StoreError::Manifest),
            None => Ok(()),
        }
    }

    /// The record mapping page `page` of lane `lane` to its physical page.
    pub(crate) fn map_record(seq: &Sequence, lane: usize, page: usize, phys: u64) -> Record {
        let at = page_at(seq, lane, page);
        let full = at.rows == seq.layout.page_size();
        Record::Map {
            digest: if full { digest(seq, lane, page) } else { Vec::new() },
            at,
            phys,
        }
    }

    /// The record of a page gone for `reason`.
    pub(crate) fn gone_record(seq: &Sequence, lane: usize, page: usize, reason: Reason) -> Record {
        Record::Gone {
            at: page_at(seq, lane, page),
            reason,
            digest: digest(seq, lane, page),
        }
    }

    /// The record of a page summarised for `reason`, `kv` its rows.
    pub(crate) fn summary_record(
        seq: &Sequence,
        lane: usize,
        page: usize,
        reason: Reason,
        counts: &[u32],
        kv: Vec<u8>,
    ) -> Record {
        Record::Summary {
            at: page_at(seq, lane, page),
            reason,
            digest: digest(seq, lane, page),
            counts: counts.to_vec(),
            kv,
        }
    }

    /// Journals the pages a write created (`mapped`: lane, page, physical
    /// id) and, when asked, persists the lanes it wrote before the write is
    /// acknowledged.
    pub(crate) fn finish_write(
        &self,
        seq: &mut Sequence,
        lanes: &[usize],
        mapped: &[(usize, usize, u64)],
        persist: bool,
    ) -> StoreResult<Acknowledged> {
        if self.manifest.is_some() {
            let records = mapped
                .iter()
                .map(|&(lane, page, phys)| Self::map_record(seq, lane, page, phys))
                .collect();
            self.journal(records);
        }
        if !persist {
            return Ok(Acknowledged::Memory);
        }
        self.persist_lanes(seq, lanes)
    }

    /// Gives every page of `lanes` that holds original bytes a current NVMe
    /// copy (keeping its host copy), from each lane's durable watermark to
    /// its end, then makes data and manifest durable as configured. Every
    /// row of those lanes is durable once this returns `Ok`.
    fn persist_lanes(&self, seq: &mut Sequence, lanes: &[usize]) -> StoreResult<Acknowledged> {
        let (Some(nvme), Some(manifest)) = (&self.nvme, &self.manifest) else {
            return Err(StoreError::precondition("persist", "persisting needs the nvme tier"));
        };
        let mut pages: BTreeMap<u64, Arc<PhysPage>> = BTreeMap::new();
        for &lane in lanes {
            pages.extend(
                unpersisted(&seq.lanes[lane], seq.persisted[lane])
                    .into_iter()
                    .map(|p| (p.id, p)),
            );
        }
        let pages: Vec<Arc<PhysPage>> = pages.into_values().collect();
        self.copy_to_nvme(&pages, Keep::Host, Reason::Explicit)?;
        // Nothing changes a page's bytes while its sequence is locked for
        // writing, so every page must have its copy now (or have lost its
        // bytes, which is reported as such).
        if let Some(page) = pages.iter().find(|p| needs_copy(&read(&p.place))) {
            return Err(StoreError::Internal(format!(
                "page {} has no NVMe copy after persisting",
                page.id
            )));
        }
        if manifest.durability() == Durability::Fsync {
            nvme.sync()?;
        }
        manifest.commit().map_err(StoreError::Manifest)?;
        for &lane in lanes {
            let l = &seq.lanes[lane];
            seq.persisted[lane] = l.num_pages() - usize::from(l.room_in_last() > 0);
        }
        Ok(match manifest.durability() {
            Durability::Fsync => Acknowledged::Fsync,
            Durability::Relaxed => Acknowledged::Relaxed,
        })
    }

    /// The manifest record of a page's new NVMe copy of `bytes` (the whole
    /// slot), of which the first `rows` rows are the page's.
    pub(crate) fn persist_record(page: &PhysPage, offset: u64, len: u64, crc: u32, rows: u32, bytes: &[u8]) -> Record {
        let layout = &page.layout;
        let mut digest = DigestColumn::new(layout.dtype(), layout.head_dim() as usize);
        let keys = &bytes[..rows as usize * layout.row_bytes()];
        if !keys.is_empty() {
            digest.open_page(keys);
        }
        Record::Persist {
            phys: page.id,
            offset,
            len,
            crc,
            rows,
            digest: if keys.is_empty() {
                Vec::new()
            } else {
                digest.entry(0).to_vec()
            },
        }
    }

    /// Journals the pages being freed that had an NVMe copy (or a durable
    /// prefix); their extents are reused once the records are durable.
    pub(crate) fn journal_freed(&self, freed: &[Arc<PhysPage>]) {
        for page in freed {
            let place = read(&page.place);
            let copies: Vec<_> = [&place.nvme, &place.durable_prefix]
                .into_iter()
                .flatten()
                .map(|c| Arc::clone(&c.slot))
                .collect();
            if !copies.is_empty() {
                self.journal_retiring(vec![Record::Unpersist { phys: page.id }], copies);
            }
        }
    }
}

fn page_at(seq: &Sequence, lane: usize, page: usize) -> PageAt {
    PageAt {
        key: seq.key.clone(),
        lane: lane as u32,
        page: page as u32,
        rows: seq.lanes[lane].rows_in(page),
    }
}

fn digest(seq: &Sequence, lane: usize, page: usize) -> Vec<u8> {
    seq.lanes[lane].digests().entry(page).to_vec()
}

/// Pages from `from` on that hold original bytes without a current copy.
fn unpersisted(lane: &StoreLane, from: usize) -> Vec<Arc<PhysPage>> {
    (from..lane.num_pages())
        .filter_map(|p| match lane.page(p) {
            Some(LogicalPage::Physical(r)) if needs_copy(&read(&r.page.place)) => Some(Arc::clone(&r.page)),
            _ => None,
        })
        .collect()
}

fn needs_copy(place: &Placement) -> bool {
    place.lost.is_none() && place.nvme.is_none()
}
