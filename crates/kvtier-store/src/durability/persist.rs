//! Persisting writes, acknowledged only once every row of the lanes they
//! wrote would survive a restart, and the records that describe a
//! sequence's logical pages.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvtier_core::{LogicalPage, Reason, wire};

use super::record::PageAt;
use super::{Durability, Durable, Keep, Record};
use crate::catalog::Sequence;
use crate::page::{PhysPage, Placement, StoreLane};
use crate::{StoreError, StoreResult};

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

impl Durable {
    /// Gives every page of `lanes` that holds original bytes a current NVMe
    /// copy (keeping its host copy), from each lane's durable watermark to
    /// its end, then makes data and manifest durable as configured. Every
    /// row of those lanes is durable once this returns `Ok`.
    pub(crate) fn persist_lanes(&self, seq: &mut Sequence, lanes: &[usize]) -> StoreResult<Acknowledged> {
        let (Some(_), Some(manifest)) = (&self.nvme, &self.manifest) else {
            return Err(StoreError::precondition(
                wire::PERSIST,
                "persisting needs the nvme tier",
            ));
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
        self.write_copies(&pages, Keep::Host, Reason::Explicit)?;
        // Nothing changes a page's bytes while its sequence is locked for
        // writing, so every page must have its copy now (or have lost its
        // bytes, which is reported as such).
        if let Some(page) = pages.iter().find(|p| needs_copy(&p.place.read())) {
            return Err(StoreError::Internal(format!(
                "page {} has no NVMe copy after persisting",
                page.id
            )));
        }
        // Under fsync, the commit syncs the NVMe data before the manifest.
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

/// The records that start a sequence: itself, and the pages it attached.
pub(crate) fn created_records(seq: &Sequence, attached_pages: usize) -> Vec<Record> {
    let mut records = vec![Record::Sequence {
        key: seq.key.clone(),
        layout: (*seq.layout).clone(),
        hashes: seq.hashes.iter().map(|h| h.to_vec()).collect(),
    }];
    for (lane, l) in seq.lanes.iter().enumerate() {
        for page in 0..attached_pages {
            if let Some(LogicalPage::Physical(r)) = l.page(page) {
                records.push(map_record(seq, lane, page, r.page.id));
            }
        }
    }
    records
}

fn page_at(seq: &Sequence, lane: usize, page: usize) -> PageAt {
    PageAt {
        key: seq.key.clone(),
        lane: lane as u32,
        page: page as u32,
        rows: seq.lanes[lane].rows_in(page),
    }
}

/// The page's index entry (digest and sketches) as the manifest keeps it.
fn digest(seq: &Sequence, lane: usize, page: usize) -> Vec<u8> {
    seq.lanes[lane].index_entry(page)
}

/// Pages from `from` on that hold original bytes without a current copy.
fn unpersisted(lane: &StoreLane, from: usize) -> Vec<Arc<PhysPage>> {
    (from..lane.num_pages())
        .filter_map(|p| match lane.page(p) {
            Some(LogicalPage::Physical(r)) if needs_copy(&r.page.place.read()) => Some(Arc::clone(&r.page)),
            _ => None,
        })
        .collect()
}

fn needs_copy(place: &Placement) -> bool {
    place.lost().is_none() && place.nvme().is_none()
}
