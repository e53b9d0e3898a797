//! The sequence catalog: every sequence (its layout, hash chain and lanes of
//! logical pages) and the table of physical pages they map, with their
//! reference counts and share keys.
//!
//! Locks: the map of sequences is held only to find, add or remove one;
//! each sequence has its own lock (read for reads, write for changes); the
//! page table is held only for bookkeeping, never across I/O or a copy.
//! A sequence's lock may be held when the map or the table is taken, never
//! the other way round.

mod sequence;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use kvtier_core::{Layout, LogicalPage, PageTableError, PhysicalPages, SequenceKey, TenantId};
use kvtier_sync::{Mutex, Rank, RwLock, RwLockReadGuard, RwLockWriteGuard};

use sequence::Deferred;
pub use sequence::HeadRange;
pub(crate) use sequence::{Sequence, Target};

use crate::page::{PageRef, PhysPage, ShareKey, StorePage};
use crate::{StoreError, StoreResult};

/// How long a checkpoint's snapshot lets waiting writers go first before
/// each lane: longer than a woken writer takes to be scheduled on a busy
/// machine, short enough that a stream of writers cannot hold it off.
const YIELD_TO_WRITERS: Duration = Duration::from_millis(10);

/// A sequence behind its lock, how many writers wait for it, and what
/// is left for the next one (the sequence's own list, reached here
/// without its lock).
#[derive(Debug)]
pub(crate) struct Cell {
    seq: RwLock<Sequence>,
    writers: AtomicU32,
    deferred: Arc<Mutex<Deferred>>,
}

impl Cell {
    fn new(seq: Sequence) -> Arc<Self> {
        Arc::new(Self {
            deferred: Arc::clone(&seq.deferred),
            seq: RwLock::new(Rank::Sequence, seq),
            writers: AtomicU32::new(0),
        })
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Sequence> {
        self.seq.read()
    }

    /// The write lock, with what the background left done first.
    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, Sequence> {
        self.writers.fetch_add(1, Ordering::AcqRel);
        let mut guard = self.seq.write();
        self.writers.fetch_sub(1, Ordering::AcqRel);
        self.run_deferred(&mut guard);
        guard
    }

    /// Makes the changes left for this writer ([`Sequence::deferred`]).
    fn run_deferred(&self, seq: &mut Sequence) {
        let deferred = std::mem::take(&mut *self.deferred.lock());
        deferred.run(seq);
    }

    /// What is left for the next writer, without the sequence's lock.
    pub(crate) fn deferred(&self) -> kvtier_sync::MutexGuard<'_, Deferred> {
        self.deferred.lock()
    }

    /// The write lock unless a reader or writer holds it now: the
    /// background's only way to write a sequence, so that it never waits
    /// out a call's NVMe I/O (it leaves its change to the next writer).
    pub(crate) fn try_write(&self) -> Option<RwLockWriteGuard<'_, Sequence>> {
        let mut guard = self.seq.try_write()?;
        self.run_deferred(&mut guard);
        Some(guard)
    }

    /// Whether a reader would wait now: a writer holds the lock or waits
    /// for it (std's lock lets waiting writers go first). A hint: by the
    /// time the reader takes the lock, that may have changed.
    pub(crate) fn would_wait(&self) -> bool {
        self.seq.try_read().is_none()
    }

    /// For a background reader that takes the lock again and again (a
    /// checkpoint, one lane at a time): waits first until no writer is
    /// waiting. std's `RwLock` wakes a waiting writer when the last reader
    /// leaves, but a reader that comes straight back can take the lock
    /// before the woken writer runs, again and again: an append waited out
    /// a whole checkpoint's snapshot that way (0.3–0.8 s at llama3-8b 32K).
    /// Waits at most `YIELD_TO_WRITERS`, so that writers queueing on a busy
    /// sequence one after another cannot starve the checkpoint either.
    pub(crate) fn read_behind_writers(&self) -> RwLockReadGuard<'_, Sequence> {
        let deadline = Instant::now() + YIELD_TO_WRITERS;
        while self.writers.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(50));
        }
        self.seq.read()
    }
}

#[derive(Debug)]
pub(crate) struct Catalog {
    sequences: RwLock<HashMap<SequenceKey, Arc<Cell>>>,
    pages: Mutex<PhysicalPages<Arc<PhysPage>, ShareKey>>,
}

impl Default for Catalog {
    fn default() -> Self {
        Self {
            sequences: RwLock::new(Rank::Sequences, HashMap::new()),
            pages: Mutex::new(Rank::PageTable, PhysicalPages::default()),
        }
    }
}

impl Catalog {
    /// The cell of sequence `key`.
    pub(crate) fn cell(&self, key: &SequenceKey) -> StoreResult<Arc<Cell>> {
        self.sequences.read().get(key).cloned().ok_or_else(|| not_found(key))
    }

    /// Runs `f` on the sequence with its lock held for reading.
    pub(crate) fn read<T>(&self, key: &SequenceKey, f: impl FnOnce(&Sequence) -> StoreResult<T>) -> StoreResult<T> {
        let cell = self.cell(key)?;
        let seq = cell.read();
        if seq.dropped {
            return Err(not_found(key));
        }
        f(&seq)
    }

    /// Runs `f` on the sequence with its lock held for writing.
    pub(crate) fn write<T>(
        &self,
        key: &SequenceKey,
        f: impl FnOnce(&mut Sequence) -> StoreResult<T>,
    ) -> StoreResult<T> {
        let cell = self.cell(key)?;
        let mut seq = cell.write();
        if seq.dropped {
            return Err(not_found(key));
        }
        f(&mut seq)
    }

    pub(crate) fn contains(&self, key: &SequenceKey) -> bool {
        self.sequences.read().contains_key(key)
    }

    /// Adds a sequence unless its key is taken (then gives it back);
    /// `announce` runs under the map's lock, so that what it journals comes
    /// after the `Drop` of an earlier sequence under the same key.
    pub(crate) fn insert(&self, seq: Sequence, announce: impl FnOnce(&Sequence)) -> Result<(), Box<Sequence>> {
        let mut sequences = self.sequences.write();
        if sequences.contains_key(&seq.key) {
            return Err(Box::new(seq));
        }
        announce(&seq);
        sequences.insert(seq.key.clone(), Cell::new(seq));
        Ok(())
    }

    /// Removes sequence `key` from the map (its cell lives on with its
    /// holders, marked dropped by the caller).
    pub(crate) fn remove(&self, key: &SequenceKey) {
        self.sequences.write().remove(key);
    }

    /// Every sequence's key, as of now.
    pub(crate) fn keys(&self) -> Vec<SequenceKey> {
        self.sequences.read().keys().cloned().collect()
    }

    /// Every sequence's cell, as of now.
    pub(crate) fn cells(&self) -> Vec<Arc<Cell>> {
        self.sequences.read().values().cloned().collect()
    }

    /// A new reference to the page stored under `key`, if one is (the
    /// write that asks counts it as attached again once it publishes).
    pub(crate) fn share(&self, key: &ShareKey) -> Option<PageRef> {
        let mut table = self.pages.lock();
        let id = table.find(key)?;
        table.acquire(id).ok()?;
        let page = Arc::clone(table.get(id)?);
        Some(PageRef { id, page })
    }

    /// Registers a new physical page (under `key` when it is shareable).
    /// If another page took the key meanwhile, that one is referenced
    /// instead and `shared` comes back true (the new page is dropped).
    pub(crate) fn publish(&self, page: Arc<PhysPage>, key: Option<ShareKey>) -> StoreResult<(PageRef, bool)> {
        let mut table = self.pages.lock();
        match table.insert(Arc::clone(&page), key) {
            Ok(id) => Ok((PageRef { id, page }, false)),
            Err((PageTableError::KeyTaken(id), _)) => {
                table.acquire(id).map_err(internal)?;
                let page = Arc::clone(table.get(id).ok_or_else(|| internal(PageTableError::Unknown(id)))?);
                page.attached_again();
                Ok((PageRef { id, page }, true))
            }
            Err((e, _)) => Err(internal(e)),
        }
    }

    /// Registers a recovered physical page under `key`, or unkeyed if
    /// another recovered page holds the key (two copies of one prefix: the
    /// first stays shared).
    pub(crate) fn adopt(&self, page: Arc<PhysPage>, key: Option<ShareKey>) -> StoreResult<PageRef> {
        let mut table = self.pages.lock();
        let id = match table.insert(Arc::clone(&page), key) {
            Ok(id) => id,
            Err((_, page)) => table.insert(page, None).map_err(|(e, _)| internal(e))?,
        };
        Ok(PageRef { id, page })
    }

    /// Another reference to a registered page (another sequence's).
    pub(crate) fn acquire(&self, r: &PageRef) -> StoreResult<PageRef> {
        self.pages.lock().acquire(r.id).map_err(internal)?;
        r.page.attached_again();
        Ok(PageRef {
            id: r.id,
            page: Arc::clone(&r.page),
        })
    }

    /// Adds a recovered sequence.
    pub(crate) fn insert_recovered(&self, seq: Sequence) {
        self.sequences.write().insert(seq.key.clone(), Cell::new(seq));
    }

    /// Releases logical pages' references: the physical pages that lost
    /// their last one come back (summaries free their slot as they drop).
    pub(crate) fn release(&self, logical: impl IntoIterator<Item = StorePage>) -> Vec<Arc<PhysPage>> {
        let mut table = self.pages.lock();
        let mut freed = Vec::new();
        for page in logical {
            if let LogicalPage::Physical(r) = page {
                match table.release(r.id) {
                    Ok(Some(page)) => freed.push(page),
                    Ok(None) => {}
                    Err(e) => tracing::error!(error = %e, "page table out of step; page leaked"),
                }
            }
        }
        freed
    }

    /// How many of `refs` name pages that more than one logical page maps.
    pub(crate) fn shared(&self, refs: impl IntoIterator<Item = kvtier_core::PhysId>) -> u64 {
        let table = self.pages.lock();
        refs.into_iter()
            .filter(|id| table.refs(*id).is_some_and(|r| r > 1))
            .count() as u64
    }

    /// Physical pages stored.
    pub(crate) fn physical_pages(&self) -> u64 {
        self.pages.lock().len() as u64
    }

    /// Attaches to a new sequence the longest run of leading pages stored
    /// for every lane under its hash chain (shared, not copied); returns
    /// how many.
    pub(crate) fn attach_prefix(&self, seq: &mut Sequence) -> u64 {
        let mut table = self.pages.lock();
        let mut attached = 0;
        for p in 0..seq.hashes.len() {
            // Every lane's page first, then the references: all or none.
            let found: Option<Vec<(kvtier_core::PhysId, Arc<PhysPage>)>> = (0..seq.lanes.len())
                .map(|lane| {
                    let id = table.find(&seq.share_key(p, lane))?;
                    let page = table.get(id)?;
                    page.index_entry.is_some().then(|| (id, Arc::clone(page)))
                })
                .collect();
            let Some(found) = found else { break };
            if found.iter().any(|(id, _)| table.acquire(*id).is_err()) {
                break;
            }
            for (lane, (id, page)) in found.into_iter().enumerate() {
                page.attached_again();
                let entry = page.index_entry.clone().unwrap_or_default();
                // Shared pages are full pages.
                let rows = seq.layout.page_size();
                seq.lanes[lane].push_known(LogicalPage::Physical(PageRef { id, page }), &entry, rows);
            }
            attached = p as u64 + 1;
        }
        attached
    }

    /// How many leading pages of `hashes` are stored for every lane of
    /// `layout` in `tenant`: what a create with them would attach.
    pub(crate) fn stored_prefix(&self, tenant: &TenantId, layout: &Arc<Layout>, hashes: &[Arc<[u8]>]) -> u64 {
        let table = self.pages.lock();
        let stored = |hash: &Arc<[u8]>| {
            (0..layout.num_lanes()).all(|lane| {
                let key = ShareKey {
                    tenant: tenant.clone(),
                    layout: Arc::clone(layout),
                    hash: Arc::clone(hash),
                    lane: lane as u32,
                };
                table
                    .find(&key)
                    .and_then(|id| table.get(id))
                    .is_some_and(|page| page.index_entry.is_some())
            })
        };
        hashes.iter().take_while(|h| stored(h)).count() as u64
    }
}

pub(crate) fn not_found(key: &SequenceKey) -> StoreError {
    StoreError::NotFound {
        what: format!("sequence {key}"),
    }
}

fn internal(e: PageTableError) -> StoreError {
    StoreError::Internal(e.to_string())
}
