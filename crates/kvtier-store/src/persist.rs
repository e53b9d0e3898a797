//! What reaches the manifest, and writes that are acknowledged only once
//! they would survive a restart.

use std::sync::Arc;

use kvtier_core::{DigestColumn, LogicalPage};
use kvtier_tiers::Slot;

use crate::manifest::{Durability, Record};
use crate::page::PhysPage;
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

impl Store {
    /// Queues manifest records (a no-op without an NVMe tier).
    pub(crate) fn log(&self, records: Vec<Record>) {
        if let Some(journal) = &self.journal {
            journal.append(&records);
        }
    }

    /// Queues records that stop referring to the NVMe extents `retired`:
    /// those are reused only once the records are durable.
    pub(crate) fn log_retiring(&self, records: Vec<Record>, retired: Vec<Arc<Slot>>) {
        if let Some(journal) = &self.journal {
            journal.append_retiring(&records, retired);
        }
    }

    /// The physical page just pushed as the last page of `lane`, and the
    /// manifest record that maps it.
    pub(crate) fn mapped(&self, seq: &Sequence, lane: usize) -> (Arc<PhysPage>, Option<Record>) {
        let l = &seq.lanes[lane];
        let p = l.num_pages() - 1;
        let Some(LogicalPage::Physical(r)) = l.page(p) else {
            unreachable!("just pushed a physical page")
        };
        let rows = l.rows_in(p);
        let full = rows == seq.layout.page_size();
        let record = self.journal.is_some().then(|| Record::Map {
            key: seq.key.clone(),
            lane: lane as u32,
            page: p as u32,
            phys: r.page.id,
            rows,
            digest: if full {
                l.digests().entry(p).to_vec()
            } else {
                Vec::new()
            },
        });
        (Arc::clone(&r.page), record)
    }

    /// Records the pages a write created and, when asked, persists the
    /// pages it touched before the write is acknowledged.
    pub(crate) fn finish_write(
        &self,
        touched: Vec<(Arc<PhysPage>, Option<Record>)>,
        persist: bool,
    ) -> StoreResult<Acknowledged> {
        let (pages, records): (Vec<_>, Vec<_>) = touched.into_iter().unzip();
        self.log(records.into_iter().flatten().collect());
        if !persist {
            return Ok(Acknowledged::Memory);
        }
        self.persist_pages(&pages)
    }

    /// Gives every page a current NVMe copy (keeping its host copy), then
    /// makes data and manifest durable as configured.
    pub(crate) fn persist_pages(&self, pages: &[Arc<PhysPage>]) -> StoreResult<Acknowledged> {
        let (Some(nvme), Some(journal)) = (&self.nvme, &self.journal) else {
            return Err(StoreError::precondition("persist", "persisting needs the nvme tier"));
        };
        self.copy_to_nvme(pages, crate::movement::Keep::Host, kvtier_core::Reason::Explicit)?;
        if journal.durability() == Durability::Fsync {
            nvme.sync()?;
        }
        journal.flush(true).map_err(|e| manifest_write_error(&e))?;
        Ok(match journal.durability() {
            Durability::Fsync => Acknowledged::Fsync,
            Durability::Relaxed => Acknowledged::Relaxed,
        })
    }

    /// The manifest record of a page's new NVMe copy.
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

    /// Unpersist records for pages being freed that had an NVMe copy (or a
    /// durable prefix); their extents are reused once the records are
    /// durable.
    pub(crate) fn log_freed(&self, freed: &[Arc<PhysPage>]) {
        let mut records = Vec::new();
        let mut retired = Vec::new();
        for page in freed {
            let place = read(&page.place);
            let copies: Vec<_> = [&place.nvme, &place.durable_prefix]
                .into_iter()
                .flatten()
                .map(|c| Arc::clone(&c.slot))
                .collect();
            if !copies.is_empty() {
                records.push(Record::Unpersist { phys: page.id });
                retired.extend(copies);
            }
        }
        self.log_retiring(records, retired);
    }
}

pub(crate) fn manifest_write_error(e: &std::io::Error) -> StoreError {
    StoreError::Unavailable(io_error("manifest write", e))
}

pub(crate) fn io_error(op: &'static str, e: &std::io::Error) -> kvtier_tiers::TierError {
    kvtier_tiers::TierError::Io {
        op,
        offset: 0,
        errno: e.raw_os_error(),
        message: e.to_string(),
    }
}
