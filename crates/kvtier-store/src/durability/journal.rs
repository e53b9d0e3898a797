//! The open manifest file: records buffered by writers, written in groups,
//! and rewritten as a checkpoint when the file has grown.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvtier_sync::{Mutex, Rank};
use kvtier_tiers::{Slot, Tier};

use super::record::{FORMAT_VERSION, Record, frame, frame_into};
use super::{Durability, ManifestError};

/// Records are buffered and written in groups; [`Journal::flush`] makes them
/// reach the OS (and the disk with [`Durability::Fsync`]).
///
/// An NVMe extent that a record stops referring to (a page's stale or freed
/// copy) is *retired* with that record and reused only once the record is as
/// durable as the journal promises: reused earlier, a crash would replay the
/// old record and point a page at another page's bytes.
///
/// Under [`Durability::Fsync`] the data file the records point into is
/// synced before every sync of the journal: a synced record must never
/// point at a copy whose bytes a power loss could still take.
#[derive(Debug)]
pub(crate) struct Journal {
    path: PathBuf,
    durability: Durability,
    /// The tier whose extents `Persist` records name (the NVMe tier).
    data: Option<Arc<dyn Tier>>,
    /// Appenders hold this lock only to copy their bytes in, never across
    /// I/O; it is the last lock in the store's order.
    pending: Mutex<Pending>,
    /// The file side: held by one flush or checkpoint at a time, in order.
    file: Mutex<JournalFile>,
}

#[derive(Debug, Default)]
struct Pending {
    /// Records framed but not yet written.
    bytes: Vec<u8>,
    /// Extents retired by those records.
    retired: Vec<Arc<Slot>>,
}

#[derive(Debug)]
struct JournalFile {
    file: File,
    /// Bytes in the file.
    len: u64,
    /// Bytes of the last checkpoint (0 before the first).
    checkpoint_len: u64,
    /// While a checkpoint is being built: every byte written to the file
    /// since it began, which goes after the snapshot in the new file.
    tail: Option<Vec<u8>>,
    /// Extents whose retiring records are written but not yet synced
    /// ([`Durability::Fsync`] only).
    unsynced: Vec<Arc<Slot>>,
}

/// Framed snapshot bytes kept before they are written to the file.
const SNAPSHOT_WRITE_BYTES: usize = 1 << 20;

/// The file a checkpoint's snapshot is being written to. Records go to it
/// as they are made, through a buffer of about [`SNAPSHOT_WRITE_BYTES`]:
/// the snapshot, a copy of every page's index entry, is never in memory
/// whole (it was, framed, up to twice over while its buffer grew: a
/// transient of several times the metadata budget).
#[derive(Debug)]
pub(crate) struct SnapshotOut {
    file: File,
    framed: Vec<u8>,
    /// Bytes written to the file so far.
    written: u64,
}

impl SnapshotOut {
    /// Appends `records` to the snapshot.
    pub(crate) fn write(&mut self, records: &[Record]) -> io::Result<()> {
        frame_into(records, &mut self.framed);
        if self.framed.len() >= SNAPSHOT_WRITE_BYTES {
            self.write_framed()?;
        }
        Ok(())
    }

    fn write_framed(&mut self) -> io::Result<()> {
        self.file.write_all(&self.framed)?;
        self.written += self.framed.len() as u64;
        self.framed.clear();
        Ok(())
    }
}

impl Journal {
    /// Opens the journal for appending after its valid prefix of `valid` bytes
    /// (dropping a torn tail); a new or empty file gets its header.
    pub(crate) fn open(path: &Path, valid: u64, durability: Durability) -> Result<Self, ManifestError> {
        let io = |op, e| ManifestError::io(op, path, e);
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(false)
            .open(path)
            .map_err(|e| io("open", e))?;
        file.set_len(valid).map_err(|e| io("truncate", e))?;
        let journal = Self {
            path: path.to_owned(),
            durability,
            data: None,
            pending: Mutex::new(Rank::JournalPending, Pending::default()),
            file: Mutex::new(
                Rank::JournalFile,
                JournalFile {
                    file,
                    len: valid,
                    checkpoint_len: 0,
                    tail: None,
                    unsynced: Vec::new(),
                },
            ),
        };
        if valid == 0 {
            journal.append(&[Record::Header {
                version: FORMAT_VERSION,
            }]);
            journal.flush(true)?;
        }
        Ok(journal)
    }

    pub(crate) fn durability(&self) -> Durability {
        self.durability
    }

    /// Names the tier whose extents the records point into, synced before
    /// the journal under `Fsync`.
    pub(crate) fn set_data(&mut self, data: Arc<dyn Tier>) {
        self.data = Some(data);
    }

    fn sync_data(&self) -> io::Result<()> {
        match &self.data {
            Some(data) => data.sync().map_err(io::Error::other),
            None => Ok(()),
        }
    }

    pub(crate) fn append(&self, records: &[Record]) {
        if !records.is_empty() {
            let framed = frame(records);
            self.pending.lock().bytes.extend_from_slice(&framed);
        }
    }

    /// Appends `records`, which stop referring to the extents `retired`:
    /// those are freed for reuse once the records are durable.
    pub(crate) fn append_retiring(&self, records: &[Record], retired: Vec<Arc<Slot>>) {
        let framed = frame(records);
        let mut pending = self.pending.lock();
        pending.bytes.extend_from_slice(&framed);
        pending.retired.extend(retired);
    }

    /// Writes buffered records to the file; with `Fsync` durability and
    /// `sync`, waits for the disk.
    pub(crate) fn flush(&self, sync: bool) -> Result<(), ManifestError> {
        self.flush_locked(&mut self.file.lock(), sync)
            .map_err(|e| ManifestError::io("write", &self.path, e))
    }

    /// Like `flush(false)`, unless the file is busy (a checkpoint finishing):
    /// then the records wait for the next call instead of the caller waiting.
    pub(crate) fn flush_if_idle(&self) -> Result<(), ManifestError> {
        let flushed = match self.file.try_lock() {
            Some(mut f) => self.flush_locked(&mut f, false),
            None => Ok(()),
        };
        flushed.map_err(|e| ManifestError::io("write", &self.path, e))
    }

    fn flush_locked(&self, f: &mut JournalFile, sync: bool) -> io::Result<()> {
        let Pending { bytes, retired } = std::mem::take(&mut *self.pending.lock());
        if !bytes.is_empty() {
            let written = {
                use std::os::unix::fs::FileExt;
                f.file.write_all_at(&bytes, f.len)
            };
            if let Err(e) = written {
                // Keep the records, ahead of any appended meanwhile, for the
                // next attempt; cut off anything half-written so the file
                // stays a valid prefix.
                let _ = f.file.set_len(f.len);
                let mut pending = self.pending.lock();
                pending.bytes.splice(0..0, bytes);
                pending.retired.extend(retired);
                return Err(e);
            }
            f.len += bytes.len() as u64;
            if let Some(tail) = &mut f.tail {
                tail.extend_from_slice(&bytes);
            }
        }
        f.unsynced.extend(retired);
        match self.durability {
            // In the OS's hands: survives the process being killed.
            Durability::Relaxed => f.unsynced.clear(),
            // Retired extents are worth a sync even when none was asked
            // for: until then they cannot be reused.
            Durability::Fsync if sync || !f.unsynced.is_empty() => {
                self.sync_data()?;
                f.file.sync_data()?;
                f.unsynced.clear();
            }
            Durability::Fsync => {}
        }
        Ok(())
    }

    /// Whether the journal has grown enough to be worth rewriting: past
    /// `floor`, and by as much as its last checkpoint (so rewriting costs at
    /// most about as many bytes as were journalled).
    pub(crate) fn wants_checkpoint(&self, floor: u64) -> bool {
        let f = self.file.lock();
        f.len > floor.max(2 * f.checkpoint_len)
    }

    /// Replaces the journal with a checkpoint of the current state, which
    /// `snapshot` writes while records keep being appended: everything
    /// written from the moment the checkpoint begins is kept and goes after
    /// the snapshot (every record sets state, so one the snapshot already
    /// reflects does no harm). The snapshot is written and synced with no
    /// lock held; only the tail is written under the file lock. The new
    /// file is renamed over the old one, so a crash leaves one or the
    /// other. Returns the snapshot's bytes.
    pub(crate) fn checkpoint(
        &self,
        snapshot: impl FnOnce(&mut SnapshotOut) -> io::Result<()>,
    ) -> Result<u64, ManifestError> {
        {
            let mut f = self.file.lock();
            self.flush_locked(&mut f, true)
                .map_err(|e| ManifestError::io("write", &self.path, e))?;
            f.tail = Some(Vec::new());
        }
        let written = self.write_checkpoint(snapshot);
        if written.is_err() {
            self.file.lock().tail = None;
        }
        written.map_err(|e| ManifestError::io("checkpoint", &self.path, e))
    }

    fn write_checkpoint(&self, snapshot: impl FnOnce(&mut SnapshotOut) -> io::Result<()>) -> io::Result<u64> {
        let tmp = self.path.with_extension("checkpoint");
        let mut snapshot_out = SnapshotOut {
            file: File::create(&tmp)?,
            framed: Vec::with_capacity(SNAPSHOT_WRITE_BYTES),
            written: 0,
        };
        snapshot(&mut snapshot_out)?;
        snapshot_out.write_framed()?;
        let SnapshotOut {
            file: mut out,
            written: snapshot_len,
            ..
        } = snapshot_out;
        out.sync_all()?;
        let mut f = self.file.lock();
        self.flush_locked(&mut f, false)?;
        let tail = f.tail.take().unwrap_or_default();
        out.write_all(&tail)?;
        if self.durability == Durability::Fsync {
            // The snapshot and the tail name copies installed meanwhile.
            self.sync_data()?;
        }
        out.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        // From the rename on, the new file is the journal, whatever fails
        // after it: records written to the replaced one would be lost.
        let old = std::mem::replace(&mut f.file, out);
        f.len = snapshot_len + tail.len() as u64;
        f.checkpoint_len = snapshot_len;
        drop(f);
        // Closing the replaced file frees its blocks, which can take a while
        // for a large one: not under the lock that flushes wait for.
        drop(old);
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(snapshot_len)
    }

    /// Bytes in the file (tests compare it with what replay reads).
    #[cfg(test)]
    fn len(&self) -> u64 {
        self.file.lock().len
    }
}

#[cfg(test)]
mod tests {
    use super::super::record::read_file;
    use super::super::record::tests::{at, key, records};
    use super::*;

    fn header() -> Record {
        Record::Header {
            version: FORMAT_VERSION,
        }
    }

    #[test]
    fn a_new_journal_starts_with_its_header_and_keeps_what_it_flushed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest");
        let journal = Journal::open(&path, 0, Durability::Fsync).unwrap();
        journal.append(&records()[1..]);
        journal.flush(true).unwrap();
        let (back, valid) = read_file(&path).unwrap();
        assert_eq!((back, valid), (records(), journal.len()));
    }

    #[test]
    fn a_checkpoint_replaces_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest");
        let journal = Journal::open(&path, 0, Durability::Relaxed).unwrap();
        journal.append(&records()[1..]);
        journal.flush(false).unwrap();
        journal.checkpoint(|out| out.write(&records()[..2])).unwrap();
        journal.append(&[Record::Drop { key: key("b") }]);
        journal.flush(false).unwrap();
        let (back, _) = read_file(&path).unwrap();
        assert_eq!(back, [&records()[..2], &[Record::Drop { key: key("b") }]].concat());
    }

    #[test]
    fn a_snapshot_larger_than_its_buffer_goes_to_the_file_whole_and_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest");
        let journal = Journal::open(&path, 0, Durability::Relaxed).unwrap();
        // Gone records of 64 KiB digests, 4 per write: the buffer goes to
        // the file in the middle of several writes, a write crosses it.
        let big = |i: u8| Record::Gone {
            at: at("a", 0, u32::from(i), 16),
            reason: kvtier_core::Reason::Policy,
            digest: vec![i; 64 << 10],
        };
        let snapshot: Vec<Record> = std::iter::once(header()).chain((0..72).map(big)).collect();
        let written = journal
            .checkpoint(|out| snapshot.chunks(4).try_for_each(|records| out.write(records)))
            .unwrap();
        assert!(written > 4 * SNAPSHOT_WRITE_BYTES as u64, "{written} bytes");
        journal.append(&[Record::Drop { key: key("a") }]);
        journal.flush(false).unwrap();
        let (back, len) = read_file(&path).unwrap();
        assert_eq!(back, [snapshot, vec![Record::Drop { key: key("a") }]].concat());
        assert_eq!(len, journal.len());
        assert_eq!(written, frame(&back[..back.len() - 1]).len() as u64);
    }

    #[test]
    fn records_written_while_a_checkpoint_is_built_follow_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest");
        let journal = Journal::open(&path, 0, Durability::Fsync).unwrap();
        journal.append(&records()[1..]);
        journal
            .checkpoint(|out| {
                out.write(&[header()])?;
                // Appended and even flushed to the old file mid-checkpoint.
                journal.append(&[Record::Drop { key: key("a") }]);
                journal.flush(true).unwrap();
                journal.append(&[Record::Drop { key: key("b") }]);
                Ok(())
            })
            .unwrap();
        let (back, len) = read_file(&path).unwrap();
        assert_eq!(
            back,
            [header(), Record::Drop { key: key("a") }, Record::Drop { key: key("b") }]
        );
        assert_eq!(len, journal.len());
    }
}
