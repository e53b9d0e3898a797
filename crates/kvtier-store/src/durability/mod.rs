//! Durability: what survives a restart, a crash or a checkpoint, and how.
//! Everything that decides it is in this folder: the record format
//! (`record.rs`), the journal and its checkpoints (`journal.rs`), what a
//! persist writes and which records each change journals (`persist.rs`),
//! the checkpoint's snapshot (`snapshot.rs`), replay (`image.rs`: records
//! to the state a restart must recover) and recovery (`recover.rs`: that
//! state back into the store), page ids (`ids.rs`).
//!
//! # Invariants
//!
//! 1. **Ids are never reused.** A physical page id is given out once per data
//!    directory, from blocks reserved in the manifest before use; no value in
//!    the id space means anything but a page (no sentinels).
//! 2. **Acknowledged rows come back.** A row acknowledged `RELAXED` (or
//!    `FSYNC`) comes back bit-exact after any later sequence of crashes,
//!    restarts and checkpoints, unless a client later evicted, summarised or
//!    dropped it, or its stored copy failed its CRC. Then it is gone (or a
//!    summary) with that reason, and the reason survives every later restart.
//! 3. **A persist covers the lane.** A persisting write makes durable every
//!    row of each (layer, KV head) it wrote, from the first row to its last,
//!    rows appended earlier without persist included.
//! 4. **Nothing is served from the wrong place.** No byte is served at a
//!    position where it was not written: a copy's CRC covers the page id as
//!    well as its bytes, so even a misdirected extent fails its check instead
//!    of passing for another page.
//! 5. **Client changes are durable when acknowledged.** An acknowledged
//!    eviction, summary, drop or policy is in the manifest (written to the
//!    OS; synced under `fsync`) before the response, so a crash cannot undo
//!    it. (A policy that runs by itself inside an append is journalled with
//!    the next flush, like the append.)
//! 6. **One server per data directory.** The manifest's lock file (and the
//!    NVMe file) are locked before anything is read; a second server is
//!    refused with the holder's pid and command line.
//!
//! # How the records keep them
//!
//! - Every record *sets* one thing: a sequence, a logical page (`Map`,
//!   `Gone`, `Summary`), a physical page's copy (`Persist`, `Unpersist`) or
//!   its loss (`Lost`). Replay is "last record wins" per thing, so a
//!   checkpoint may be built while records keep coming: the records written
//!   from its start on are appended after it, and re-applying one the
//!   snapshot already holds changes nothing.
//! - Records about a page are appended while the lock that guards what they
//!   describe is held (a sequence's lock for logical pages, a physical page's
//!   placement lock for its copies), so the journal orders them as the
//!   changes happened.
//! - An NVMe extent is reused only once the record that stopped referring to
//!   it is durable (`Journal::append_retiring`).
//! - A persist gives every page of the written lanes from the lane's durable
//!   watermark on a current NVMe copy before the records are flushed; the
//!   acknowledgement comes after the flush (and the syncs under `fsync`).
//! - Under `fsync` the NVMe data file is synced before every sync of the
//!   manifest (and before a checkpoint replaces it): a synced record never
//!   names a copy whose bytes a power loss could still take.

mod copies;
mod ids;
mod image;
mod journal;
mod manifest;
mod persist;
mod record;
mod recover;
mod snapshot;

use std::sync::Arc;

use kvtier_tiers::{Slot, Tier};

pub(crate) use copies::{CopyRead, Keep};
pub(crate) use image::Image;
pub(crate) use manifest::Manifest;
pub use persist::Acknowledged;
pub(crate) use persist::{created_records, gone_record, map_record, summary_record};
pub(crate) use record::Record;
pub use recover::Recovered;

use crate::error::ManifestError;
use crate::stats::Counters;
use crate::{StoreError, StoreResult};
use ids::PageIds;

/// Whether an acknowledgement waits for the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Data and journal are fdatasync'ed before a persisting write is
    /// acknowledged: survives power loss.
    Fsync,
    /// Written to the OS before the acknowledgement, not synced: survives the
    /// process being killed, not power loss.
    Relaxed,
}

/// What survives a restart: the manifest (when there is an NVMe tier),
/// pages' copies on NVMe, and page ids. Everything the store journals goes
/// through it.
#[derive(Debug)]
pub(crate) struct Durable {
    manifest: Option<Manifest>,
    nvme: Option<Arc<dyn Tier>>,
    /// The memory tiers copies are made from.
    host: Arc<dyn Tier>,
    device: Arc<dyn Tier>,
    ids: PageIds,
    counters: Arc<Counters>,
}

impl Durable {
    /// `next_page_id`: the first id never given out (from the recovered
    /// image, or 0).
    pub(crate) fn new(
        mut manifest: Option<Manifest>,
        next_page_id: u64,
        tiers: [&Arc<dyn Tier>; 2],
        nvme: Option<Arc<dyn Tier>>,
        counters: Arc<Counters>,
    ) -> Self {
        if let (Some(m), Some(nvme)) = (manifest.as_mut(), &nvme) {
            m.set_data(Arc::clone(nvme));
        }
        Self {
            manifest,
            nvme,
            device: Arc::clone(tiers[0]),
            host: Arc::clone(tiers[1]),
            ids: PageIds::starting_at(next_page_id),
            counters,
        }
    }

    pub(crate) fn nvme(&self) -> Option<&Arc<dyn Tier>> {
        self.nvme.as_ref()
    }

    /// Whether writes can be persisted (an NVMe tier and its manifest).
    pub(crate) fn can_persist(&self) -> bool {
        self.manifest.is_some()
    }

    /// `n` fresh page ids, never given before in this data directory.
    pub(crate) fn page_ids(&self, n: u64) -> StoreResult<std::ops::Range<u64>> {
        self.ids.take(n, self.manifest.as_ref()).map_err(StoreError::Manifest)
    }

    /// Queues manifest records (nothing without a manifest). `records` is
    /// built only when there is one.
    pub(crate) fn journal(&self, records: impl FnOnce() -> Vec<Record>) {
        if let Some(manifest) = &self.manifest {
            manifest.append(records());
        }
    }

    /// Queues records that stop referring to the NVMe extents `retired`:
    /// those are reused only once the records are durable.
    pub(crate) fn journal_retiring(&self, records: Vec<Record>, retired: Vec<Arc<Slot>>) {
        if let Some(manifest) = &self.manifest {
            manifest.append_retiring(records, retired);
        }
    }

    /// Makes what is journalled so far as durable as configured: a client's
    /// change (eviction, summary, drop, policy) before it is acknowledged.
    pub(crate) fn commit(&self) -> StoreResult<()> {
        match &self.manifest {
            Some(m) => m.commit().map_err(StoreError::Manifest),
            None => Ok(()),
        }
    }

    /// The background thread's flush: never waits for a checkpoint.
    pub(crate) fn flush_if_idle(&self) {
        if let Some(manifest) = &self.manifest
            && let Err(e) = manifest.flush_if_idle()
        {
            tracing::error!(error = %e, "manifest flush failed");
        }
    }

    /// Whether the manifest has grown enough to be rewritten.
    pub(crate) fn wants_checkpoint(&self) -> bool {
        self.manifest.as_ref().is_some_and(Manifest::wants_checkpoint)
    }
}
