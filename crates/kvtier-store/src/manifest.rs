//! The manifest: an append-only journal of which logical page of which
//! sequence maps to which physical page, and which physical pages have a
//! copy on NVMe (extent, CRC32C, digest). Replaying it after a crash tells
//! which pages are recoverable; a checkpoint rewrites it compactly.
//!
//! Each record is `[len u32][crc32c u32][payload]`, little-endian; replay
//! stops at the first record that is short or fails its CRC (a torn tail).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kvtier_core::{DType, LayerGroup, Layout, LayoutSpec, Reason, SequenceKey};
use kvtier_tiers::Slot;

use crate::sync::lock;

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

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Record {
    Sequence {
        key: SequenceKey,
        layout: Layout,
        hashes: Vec<Vec<u8>>,
    },
    Drop {
        key: SequenceKey,
    },
    /// Logical page `page` of lane `lane` maps to physical page `phys`, with
    /// `rows` tokens at that moment, and its digest when it was full.
    Map {
        key: SequenceKey,
        lane: u32,
        page: u32,
        phys: u64,
        rows: u32,
        digest: Vec<u8>,
    },
    /// The logical page no longer maps to a physical page.
    Unmap {
        key: SequenceKey,
        lane: u32,
        page: u32,
        reason: Reason,
    },
    /// Physical page `phys` has an NVMe copy.
    Persist {
        phys: u64,
        offset: u64,
        len: u64,
        crc: u32,
        rows: u32,
        digest: Vec<u8>,
    },
    /// Physical page `phys` no longer has one.
    Unpersist {
        phys: u64,
    },
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
    }
    fn key(&mut self, k: &SequenceKey) {
        self.bytes(k.tenant.as_str().as_bytes());
        self.bytes(k.sequence.as_str().as_bytes());
    }
}

struct Reader<'a>(&'a [u8]);

type Decoded<T> = Result<T, &'static str>;

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Decoded<&[u8]> {
        if self.0.len() < n {
            return Err("record too short");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Decoded<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Decoded<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Decoded<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn bytes(&mut self) -> Decoded<Vec<u8>> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> Decoded<String> {
        String::from_utf8(self.bytes()?).map_err(|_| "invalid UTF-8")
    }
    fn key(&mut self) -> Decoded<SequenceKey> {
        let (tenant, sequence) = (self.string()?, self.string()?);
        SequenceKey::parse(&tenant, &sequence).map_err(|_| "invalid sequence key")
    }
}

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
    }
}

fn reason_from(code: u8) -> Decoded<Reason> {
    Reason::ALL.get(code as usize).copied().ok_or("unknown reason")
}

impl Record {
    fn encode(&self, w: &mut Writer) {
        match self {
            Record::Sequence { key, layout, hashes } => {
                w.u8(1);
                w.key(key);
                let s = layout.spec();
                for v in [s.num_layers, s.num_kv_heads, s.num_query_heads, s.head_dim, s.page_size] {
                    w.u32(v);
                }
                w.u8(dtype_code(s.dtype));
                w.u32(s.layer_groups.len() as u32);
                for g in &s.layer_groups {
                    w.u32(g.first_layer);
                    w.u32(g.num_layers);
                }
                w.u32(hashes.len() as u32);
                for h in hashes {
                    w.bytes(h);
                }
            }
            Record::Drop { key } => {
                w.u8(2);
                w.key(key);
            }
            Record::Map {
                key,
                lane,
                page,
                phys,
                rows,
                digest,
            } => {
                w.u8(3);
                w.key(key);
                w.u32(*lane);
                w.u32(*page);
                w.u64(*phys);
                w.u32(*rows);
                w.bytes(digest);
            }
            Record::Unmap {
                key,
                lane,
                page,
                reason,
            } => {
                w.u8(4);
                w.key(key);
                w.u32(*lane);
                w.u32(*page);
                w.u8(reason.index() as u8);
            }
            Record::Persist {
                phys,
                offset,
                len,
                crc,
                rows,
                digest,
            } => {
                w.u8(5);
                w.u64(*phys);
                w.u64(*offset);
                w.u64(*len);
                w.u32(*crc);
                w.u32(*rows);
                w.bytes(digest);
            }
            Record::Unpersist { phys } => {
                w.u8(6);
                w.u64(*phys);
            }
        }
    }

    fn decode(payload: &[u8]) -> Decoded<Self> {
        let mut r = Reader(payload);
        let record = match r.u8()? {
            1 => {
                let key = r.key()?;
                let [num_layers, num_kv_heads, num_query_heads, head_dim, page_size] =
                    [r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?];
                let dtype = *DType::ALL.get(r.u8()? as usize).ok_or("unknown dtype")?;
                let groups = (0..r.u32()?)
                    .map(|_| {
                        Ok(LayerGroup {
                            first_layer: r.u32()?,
                            num_layers: r.u32()?,
                        })
                    })
                    .collect::<Decoded<_>>()?;
                let spec = LayoutSpec {
                    num_layers,
                    num_kv_heads,
                    num_query_heads,
                    head_dim,
                    dtype,
                    page_size,
                    layer_groups: groups,
                };
                let layout = Layout::new(spec).map_err(|_| "invalid layout")?;
                let hashes = (0..r.u32()?).map(|_| r.bytes()).collect::<Decoded<_>>()?;
                Record::Sequence { key, layout, hashes }
            }
            2 => Record::Drop { key: r.key()? },
            3 => Record::Map {
                key: r.key()?,
                lane: r.u32()?,
                page: r.u32()?,
                phys: r.u64()?,
                rows: r.u32()?,
                digest: r.bytes()?,
            },
            4 => Record::Unmap {
                key: r.key()?,
                lane: r.u32()?,
                page: r.u32()?,
                reason: reason_from(r.u8()?)?,
            },
            5 => Record::Persist {
                phys: r.u64()?,
                offset: r.u64()?,
                len: r.u64()?,
                crc: r.u32()?,
                rows: r.u32()?,
                digest: r.bytes()?,
            },
            6 => Record::Unpersist { phys: r.u64()? },
            _ => return Err("unknown record type"),
        };
        if !r.0.is_empty() {
            return Err("trailing bytes in record");
        }
        Ok(record)
    }
}

fn frame(records: &[Record], out: &mut Vec<u8>) {
    for record in records {
        let mut w = Writer(Vec::new());
        record.encode(&mut w);
        out.extend_from_slice(&(w.0.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(&w.0).to_le_bytes());
        out.extend_from_slice(&w.0);
    }
}

/// The records of a journal file up to the first torn or corrupt one, and
/// the byte length of that valid prefix.
pub(crate) fn replay(path: &Path) -> io::Result<(Vec<Record>, u64)> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => f.read_to_end(&mut bytes).map(drop)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    }
    let mut records = Vec::new();
    let mut at = 0usize;
    while at + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().expect("4 bytes"));
        let Some(payload) = bytes.get(at + 8..at + 8 + len) else {
            break;
        };
        if crc32c::crc32c(payload) != crc {
            break;
        }
        match Record::decode(payload) {
            Ok(r) => records.push(r),
            Err(why) => {
                tracing::warn!(offset = at, why, "manifest record unreadable; replay stops here");
                break;
            }
        }
        at += 8 + len;
    }
    if at < bytes.len() {
        tracing::warn!(
            valid = at,
            total = bytes.len(),
            "manifest has a torn or corrupt tail; it is ignored"
        );
    }
    Ok((records, at as u64))
}

/// The open journal. Records are buffered and written in groups; `flush`
/// makes them reach the OS (and the disk with [`Durability::Fsync`]).
///
/// An NVMe extent that a record stops referring to (a page's stale or freed
/// copy) is *retired* with that record and reused only once the record is as
/// durable as the journal promises: reused earlier, a crash would replay the
/// old record and point a page at another page's bytes.
#[derive(Debug)]
pub(crate) struct Journal {
    path: PathBuf,
    durability: Durability,
    /// Appenders hold this lock only to copy their bytes in, never across I/O.
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

impl Journal {
    /// Opens the journal for appending after its valid prefix of `valid` bytes
    /// (dropping a torn tail).
    pub(crate) fn open(path: &Path, valid: u64, durability: Durability) -> io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(false)
            .open(path)?;
        file.set_len(valid)?;
        Ok(Self {
            path: path.to_owned(),
            durability,
            pending: Mutex::default(),
            file: Mutex::new(JournalFile {
                file,
                len: valid,
                checkpoint_len: 0,
                tail: None,
                unsynced: Vec::new(),
            }),
        })
    }

    pub(crate) fn durability(&self) -> Durability {
        self.durability
    }

    pub(crate) fn append(&self, records: &[Record]) {
        if !records.is_empty() {
            frame(records, &mut lock(&self.pending).bytes);
        }
    }

    /// Appends `records`, which stop referring to the extents `retired`:
    /// those are freed for reuse once the records are durable.
    pub(crate) fn append_retiring(&self, records: &[Record], retired: Vec<Arc<Slot>>) {
        let mut pending = lock(&self.pending);
        frame(records, &mut pending.bytes);
        pending.retired.extend(retired);
    }

    /// Writes buffered records to the file; with `Fsync` durability and
    /// `sync`, waits for the disk.
    pub(crate) fn flush(&self, sync: bool) -> io::Result<()> {
        self.flush_locked(&mut lock(&self.file), sync)
    }

    /// Like `flush(false)`, unless the file is busy (a checkpoint finishing):
    /// then the records wait for the next call instead of the caller waiting.
    pub(crate) fn flush_if_idle(&self) -> io::Result<()> {
        match self.file.try_lock() {
            Ok(mut f) => self.flush_locked(&mut f, false),
            Err(std::sync::TryLockError::WouldBlock) => Ok(()),
            Err(std::sync::TryLockError::Poisoned(p)) => self.flush_locked(&mut p.into_inner(), false),
        }
    }

    fn flush_locked(&self, f: &mut JournalFile, sync: bool) -> io::Result<()> {
        let Pending { bytes, retired } = std::mem::take(&mut *lock(&self.pending));
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
                let mut pending = lock(&self.pending);
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
                f.file.sync_data()?;
                f.unsynced.clear();
            }
            Durability::Fsync => {}
        }
        Ok(())
    }

    /// Whether the journal has grown enough to be worth rewriting: past a
    /// floor, and by as much as its last checkpoint (so rewriting costs at
    /// most about as many bytes as were journalled).
    pub(crate) fn wants_checkpoint(&self, floor: u64) -> bool {
        let f = lock(&self.file);
        f.len > floor.max(2 * f.checkpoint_len)
    }

    /// Replaces the journal with a checkpoint of the current state, built by
    /// `snapshot` while records keep being appended: everything written from
    /// the moment the checkpoint begins is kept and goes after the snapshot
    /// (replaying records is idempotent, so one the snapshot already
    /// reflects does no harm). The snapshot is written and synced with no
    /// lock held; only the tail is written under the file lock. The new file
    /// is renamed over the old one, so a crash leaves one or the other.
    /// Returns the snapshot's bytes.
    pub(crate) fn checkpoint(&self, snapshot: impl FnOnce() -> Vec<Record>) -> io::Result<u64> {
        {
            let mut f = lock(&self.file);
            self.flush_locked(&mut f, true)?;
            f.tail = Some(Vec::new());
        }
        let written = self.write_checkpoint(snapshot);
        if written.is_err() {
            lock(&self.file).tail = None;
        }
        written
    }

    fn write_checkpoint(&self, snapshot: impl FnOnce() -> Vec<Record>) -> io::Result<u64> {
        let tmp = self.path.with_extension("checkpoint");
        let mut bytes = Vec::new();
        frame(&snapshot(), &mut bytes);
        let mut out = File::create(&tmp)?;
        out.write_all(&bytes)?;
        out.sync_all()?;
        let mut f = lock(&self.file);
        self.flush_locked(&mut f, false)?;
        let tail = f.tail.take().unwrap_or_default();
        out.write_all(&tail)?;
        out.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let old = std::mem::replace(&mut f.file, OpenOptions::new().read(true).write(true).open(&self.path)?);
        f.len = (bytes.len() + tail.len()) as u64;
        f.checkpoint_len = bytes.len() as u64;
        let written = f.checkpoint_len;
        drop(f);
        // Closing the replaced file frees its blocks, which can take a while
        // for a large one: not under the lock that flushes wait for.
        drop(old);
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> SequenceKey {
        SequenceKey::parse("t", s).unwrap()
    }

    fn records() -> Vec<Record> {
        let layout = Layout::new(LayoutSpec {
            num_layers: 3,
            num_kv_heads: 2,
            num_query_heads: 4,
            head_dim: 8,
            dtype: DType::Bf16,
            page_size: 16,
            layer_groups: vec![LayerGroup {
                first_layer: 1,
                num_layers: 2,
            }],
        })
        .unwrap();
        vec![
            Record::Sequence {
                key: key("a"),
                layout,
                hashes: vec![b"h0".to_vec(), vec![]],
            },
            Record::Map {
                key: key("a"),
                lane: 3,
                page: 7,
                phys: 99,
                rows: 16,
                digest: vec![1, 2, 3],
            },
            Record::Persist {
                phys: 99,
                offset: 8192,
                len: 4096,
                crc: 0xdead_beef,
                rows: 16,
                digest: vec![9; 32],
            },
            Record::Unmap {
                key: key("a"),
                lane: 3,
                page: 7,
                reason: Reason::Policy,
            },
            Record::Unpersist { phys: 99 },
            Record::Drop { key: key("a") },
        ]
    }

    #[test]
    fn records_round_trip_and_a_torn_tail_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest");
        let journal = Journal::open(&path, 0, Durability::Fsync).unwrap();
        journal.append(&records());
        journal.flush(true).unwrap();
        let (back, valid) = replay(&path).unwrap();
        assert_eq!(back, records());
        // A torn write: half a record more.
        let mut bytes = std::fs::read(&path).unwrap();
        let full = bytes.len();
        bytes.extend_from_slice(&[40, 0, 0, 0, 1, 2, 3]);
        std::fs::write(&path, &bytes).unwrap();
        let (back, at) = replay(&path).unwrap();
        assert_eq!((back.len(), at, valid), (6, full as u64, full as u64));
        // A flipped byte inside the last record: replay stops before it.
        bytes.truncate(full);
        let last = bytes.len() - 3;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(replay(&path).unwrap().0.len(), 5);
    }

    #[test]
    fn a_checkpoint_replaces_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest");
        let journal = Journal::open(&path, 0, Durability::Relaxed).unwrap();
        journal.append(&records());
        journal.flush(false).unwrap();
        journal.checkpoint(|| records()[..2].to_vec()).unwrap();
        journal.append(&[Record::Drop { key: key("b") }]);
        journal.flush(false).unwrap();
        let (back, _) = replay(&path).unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back[2], Record::Drop { key: key("b") });
    }

    #[test]
    fn records_written_while_a_checkpoint_is_built_follow_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest");
        let journal = Journal::open(&path, 0, Durability::Fsync).unwrap();
        journal.append(&records());
        journal
            .checkpoint(|| {
                // Appended and even flushed to the old file mid-checkpoint.
                journal.append(&[Record::Drop { key: key("a") }]);
                journal.flush(true).unwrap();
                journal.append(&[Record::Drop { key: key("b") }]);
                records()[..1].to_vec()
            })
            .unwrap();
        let (back, len) = replay(&path).unwrap();
        assert_eq!(back[0], records()[0]);
        assert_eq!(
            &back[1..],
            [Record::Drop { key: key("a") }, Record::Drop { key: key("b") }]
        );
        assert_eq!(len, lock(&journal.file).len);
    }
}
