//! The manifest of a data directory: its lock, its journal, and when to
//! checkpoint it.

use std::path::Path;
use std::sync::Arc;

use kvtier_tiers::{LOCK_WAIT, LockFile, Slot, Tier};

use super::image::{self, Image};
use super::journal::{Journal, SnapshotOut};
use super::record::{self, Record};
use super::{Durability, ManifestError};

/// A data directory's manifest, open and locked.
#[derive(Debug)]
pub(crate) struct Manifest {
    journal: Journal,
    checkpoint_bytes: u64,
    _lock: LockFile,
}

impl Manifest {
    /// Locks the manifest at `path` (through `path.lock`), replays it and
    /// opens it for appending. Returns the state to recover.
    pub(crate) fn open(
        path: &Path,
        durability: Durability,
        checkpoint_bytes: u64,
    ) -> Result<(Self, Image), ManifestError> {
        let lock = LockFile::acquire(&path.with_extension("lock"), LOCK_WAIT).map_err(ManifestError::InUse)?;
        let (records, valid) = record::read_file(path)?;
        let journal = Journal::open(path, valid, durability)?;
        let manifest = Self {
            journal,
            checkpoint_bytes,
            _lock: lock,
        };
        Ok((manifest, image::replay(records)))
    }

    pub(crate) fn durability(&self) -> Durability {
        self.journal.durability()
    }

    /// Names the NVMe tier the records point into (see [`Journal`]).
    pub(crate) fn set_data(&mut self, nvme: Arc<dyn Tier>) {
        self.journal.set_data(nvme);
    }

    pub(crate) fn append(&self, records: Vec<Record>) {
        self.journal.append(&records);
    }

    /// Appends records that stop referring to the extents `retired`: those
    /// are reused only once the records are durable.
    pub(crate) fn append_retiring(&self, records: Vec<Record>, retired: Vec<Arc<Slot>>) {
        self.journal.append_retiring(&records, retired);
    }

    /// Makes everything appended so far as durable as the configured
    /// durability promises: written to the OS, and synced under `fsync`.
    pub(crate) fn commit(&self) -> Result<(), ManifestError> {
        self.journal.flush(true)
    }

    /// Writes what is buffered unless a checkpoint holds the file (the
    /// background thread's flush: it never waits).
    pub(crate) fn flush_if_idle(&self) -> Result<(), ManifestError> {
        self.journal.flush_if_idle()
    }

    /// Writes what is buffered, waiting for the file if it must.
    pub(crate) fn flush(&self) -> Result<(), ManifestError> {
        self.journal.flush(false)
    }

    /// Whether the journal has grown enough to be rewritten.
    pub(crate) fn wants_checkpoint(&self) -> bool {
        self.journal.wants_checkpoint(self.checkpoint_bytes)
    }

    /// Replaces the journal with the records `snapshot` writes, followed by
    /// those appended while it wrote them. Returns the snapshot's bytes.
    pub(crate) fn checkpoint(
        &self,
        snapshot: impl FnOnce(&mut SnapshotOut) -> std::io::Result<()>,
    ) -> Result<u64, ManifestError> {
        self.journal.checkpoint(snapshot)
    }
}
