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

mod ids;
mod image;
mod journal;
mod persist;
mod record;
mod recover;
mod snapshot;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvtier_tiers::{LOCK_WAIT, LockError, LockFile, Slot};

pub(crate) use ids::PageIds;
pub(crate) use image::Image;
pub use persist::Acknowledged;
pub(crate) use persist::page_crc;
pub(crate) use record::Record;
pub use recover::Recovered;

use journal::Journal;

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

/// The manifest's failures, kept apart from the tiers' I/O errors.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest {op} failed on {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("manifest {path} cannot be read: {why}")]
    Format { path: PathBuf, why: String },
    #[error("the data directory is in use: {0}")]
    InUse(LockError),
}

impl ManifestError {
    pub(crate) fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            op,
            path: path.to_owned(),
            source,
        }
    }
}

/// The manifest of a data directory: its lock, its journal, and when to
/// checkpoint it.
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

    /// Replaces the journal with `snapshot`'s records, followed by those
    /// appended while it was built. Returns the snapshot's bytes.
    pub(crate) fn checkpoint(&self, snapshot: impl FnOnce() -> Vec<Record>) -> Result<u64, ManifestError> {
        self.journal.checkpoint(snapshot)
    }
}
