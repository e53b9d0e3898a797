//! The NVMe tier: page slots in a file (or block device) opened with
//! `O_DIRECT`, moved in batches through io_uring, or through `pread`/`pwrite`
//! threads where io_uring is refused.

mod op;
mod psync;
mod uring;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use op::{Finish, IoDone, IoOp, Keep, OpKind};

use crate::completion::{Completion, completion};
use crate::{AlignedBuf, ExtentAllocator, IO_ALIGN, ReadDone, Slot, Tier, TierError, TierKind, WriteDone};

/// Which I/O engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineChoice {
    /// io_uring if this process may use it, else psync (with a log line).
    Auto,
    /// io_uring; [`NvmeTier::open`] fails if this process may not use it.
    Uring,
    /// `pread`/`pwrite` on a pool of threads, one per unit of queue depth; works everywhere.
    Psync,
}

/// How to open an [`NvmeTier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeConfig {
    /// The backing file or block device. A missing file is created, and a shorter one grown to
    /// the capacity; existing bytes are kept.
    pub path: PathBuf,
    /// Bytes to use, rounded down to a multiple of [`IO_ALIGN`].
    pub capacity: u64,
    /// Which I/O engine moves the bytes.
    pub engine: EngineChoice,
    /// Operations in flight at once.
    pub queue_depth: u32,
    /// Open with `O_DIRECT` (bypass the page cache). Off only for
    /// filesystems that refuse it.
    pub direct: bool,
}

#[derive(Debug)]
enum Engine {
    Uring(uring::Uring),
    Psync(psync::Psync),
}

/// A tier in a file or block device, opened with `O_DIRECT` (unless configured off) and
/// locked against other processes, with 4 KiB aligned slots. I/O goes through io_uring or
/// `pread`/`pwrite` threads ([`EngineChoice`]). Bytes survive a restart: recovery takes its
/// slots back with [`Tier::claim`].
#[derive(Debug)]
pub struct NvmeTier {
    allocator: Arc<ExtentAllocator>,
    file: Arc<File>,
    engine: Engine,
    config: NvmeConfig,
}

fn io_error(op: &'static str, offset: u64, e: &io::Error) -> TierError {
    TierError::Io {
        op,
        offset,
        errno: e.raw_os_error(),
        message: e.to_string(),
    }
}

impl NvmeTier {
    /// Opens (creating if needed) the backing file and starts the engine.
    /// Existing contents are kept: recovery reads them.
    pub fn open(config: NvmeConfig) -> Result<Self, TierError> {
        let reserve_error = |e: io::Error| TierError::Reserve {
            tier: TierKind::Nvme,
            bytes: config.capacity,
            reason: format!("{}: {e}", config.path.display()),
        };
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true).truncate(false);
        if config.direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = options.open(&config.path).map_err(reserve_error)?;
        // Two processes over one file would hand out the same extents.
        if !crate::lock::lock_exclusive(&file, crate::LOCK_WAIT).map_err(reserve_error)? {
            return Err(TierError::Reserve {
                tier: TierKind::Nvme,
                bytes: config.capacity,
                reason: format!(
                    "{} is in use by another process (another kvtier server with the same nvme path?)",
                    config.path.display()
                ),
            });
        }
        let usable = config.capacity / IO_ALIGN as u64 * IO_ALIGN as u64;
        let is_regular = file.metadata().map_err(reserve_error)?.is_file();
        if is_regular && file.metadata().map_err(reserve_error)?.len() < usable {
            file.set_len(usable).map_err(reserve_error)?;
        }
        let file = Arc::new(file);
        let engine = match config.engine {
            EngineChoice::Psync => Engine::Psync(
                psync::Psync::start(Arc::clone(&file), config.queue_depth as usize).map_err(reserve_error)?,
            ),
            EngineChoice::Uring => {
                Engine::Uring(uring::Uring::start(Arc::clone(&file), config.queue_depth).map_err(reserve_error)?)
            }
            EngineChoice::Auto => {
                match uring::probe().and_then(|()| uring::Uring::start(Arc::clone(&file), config.queue_depth)) {
                    Ok(ring) => Engine::Uring(ring),
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring is refused here; the nvme tier uses pread/pwrite threads");
                        Engine::Psync(
                            psync::Psync::start(Arc::clone(&file), config.queue_depth as usize)
                                .map_err(reserve_error)?,
                        )
                    }
                }
            }
        };
        Ok(Self {
            allocator: ExtentAllocator::new(TierKind::Nvme, usable, IO_ALIGN as u64),
            file,
            engine,
            config,
        })
    }

    /// Whether io_uring can be used by this process.
    pub fn uring_available() -> Result<(), String> {
        uring::probe().map_err(|e| e.to_string())
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &NvmeConfig {
        &self.config
    }

    fn submit(&self, ops: Vec<IoOp>) {
        match &self.engine {
            Engine::Uring(u) => u.submit(ops),
            Engine::Psync(p) => p.submit(ops),
        }
    }

    /// Runs one operation and waits for it (callers that hold the slot).
    fn blocking(&self, kind: OpKind, offset: u64, len: usize, buf: AlignedBuf) -> Result<AlignedBuf, TierError> {
        let name = if kind == OpKind::Read { "read" } else { "write" };
        let (tx, wait) = completion::<IoDone>();
        let done: Finish = Box::new(move |d| tx.complete(d));
        self.submit(vec![IoOp {
            kind,
            offset,
            len,
            buf,
            keep: Keep::Borrowed,
            done,
        }]);
        let done = wait.wait().map_err(|e| io_error(name, offset, &io::Error::other(e)))?;
        done.result.map_err(|e| io_error(name, offset, &e))?;
        Ok(done.buf)
    }

    /// The aligned file range covering `[offset, offset + len)` of a slot.
    fn span(slot: &Slot, offset: u64, len: usize) -> (u64, usize) {
        let a = IO_ALIGN as u64;
        let start = offset / a * a;
        let end = (offset + len as u64).div_ceil(a) * a;
        (slot.offset() + start, (end - start) as usize)
    }

    fn check(&self, slot: &Slot, offset: u64, len: usize) -> Result<(), TierError> {
        if !slot.is_from(&self.allocator) {
            return Err(TierError::ForeignSlot);
        }
        slot.check_range(offset, len)
    }
}

impl Tier for NvmeTier {
    fn kind(&self) -> TierKind {
        TierKind::Nvme
    }

    fn backend(&self) -> &'static str {
        match self.engine {
            Engine::Uring(_) => "uring",
            Engine::Psync(_) => "psync",
        }
    }

    fn emulated(&self) -> bool {
        false
    }

    fn allocator(&self) -> &Arc<ExtentAllocator> {
        &self.allocator
    }

    fn write(&self, slot: &mut Slot, offset: u64, src: &[u8]) -> Result<(), TierError> {
        self.check(slot, offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let (at, len) = Self::span(slot, offset, src.len());
        let head = (offset % IO_ALIGN as u64) as usize;
        // Partial blocks keep their other bytes: read them first.
        let mut buf = if head == 0 && src.len().is_multiple_of(IO_ALIGN) {
            AlignedBuf::zeroed(len)
        } else {
            self.blocking(OpKind::Read, at, len, AlignedBuf::zeroed(len))?
        };
        buf.set_len(len);
        buf[head..head + src.len()].copy_from_slice(src);
        self.blocking(OpKind::Write, at, len, buf).map(drop)
    }

    fn read(&self, slot: &Slot, offset: u64, dst: &mut [u8]) -> Result<(), TierError> {
        self.check(slot, offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let (at, len) = Self::span(slot, offset, dst.len());
        let mut buf = self.blocking(OpKind::Read, at, len, AlignedBuf::zeroed(len))?;
        buf.set_len(len);
        let head = (offset % IO_ALIGN as u64) as usize;
        dst.copy_from_slice(&buf[head..head + dst.len()]);
        Ok(())
    }

    fn read_many(&self, reads: Vec<(Arc<Slot>, AlignedBuf)>) -> Vec<Completion<ReadDone>> {
        let mut ops = Vec::with_capacity(reads.len());
        let mut out = Vec::with_capacity(reads.len());
        for (slot, buf) in reads {
            match owned_check(&self.allocator, &slot, &buf, false) {
                Err(e) => out.push(Completion::ready(ReadDone { buf, result: Err(e) })),
                Ok(()) => {
                    let (offset, len, size) = (slot.offset(), slot.reserved() as usize, slot.len() as usize);
                    let (tx, wait) = completion();
                    let done: Finish = Box::new(move |mut d: IoDone| {
                        d.buf.set_len(size);
                        tx.complete(ReadDone {
                            buf: d.buf,
                            result: d.result.map_err(|e| io_error("read", offset, &e)),
                        })
                    });
                    ops.push(IoOp {
                        kind: OpKind::Read,
                        offset,
                        len,
                        buf,
                        keep: Keep::Shared(slot),
                        done,
                    });
                    out.push(wait);
                }
            }
        }
        self.submit(ops);
        out
    }

    fn write_many(&self, writes: Vec<(Slot, AlignedBuf)>) -> Vec<Completion<WriteDone>> {
        let mut ops = Vec::with_capacity(writes.len());
        let mut out = Vec::with_capacity(writes.len());
        for (slot, buf) in writes {
            match owned_check(&self.allocator, &slot, &buf, true) {
                Err(e) => out.push(Completion::ready(WriteDone {
                    slot,
                    buf,
                    result: Err(e),
                })),
                Ok(()) => {
                    let (offset, len) = (slot.offset(), slot.reserved() as usize);
                    let (tx, wait) = completion();
                    let done: Finish = Box::new(move |d: IoDone| {
                        let Keep::Owned(slot) = d.keep else {
                            unreachable!("writes own their slot")
                        };
                        tx.complete(WriteDone {
                            slot,
                            buf: d.buf,
                            result: d.result.map_err(|e| io_error("write", offset, &e)),
                        })
                    });
                    ops.push(IoOp {
                        kind: OpKind::Write,
                        offset,
                        len,
                        buf,
                        keep: Keep::Owned(slot),
                        done,
                    });
                    out.push(wait);
                }
            }
        }
        self.submit(ops);
        out
    }

    fn sync(&self) -> Result<(), TierError> {
        self.file.sync_data().map_err(|e| io_error("fdatasync", 0, &e))
    }
}

/// Owned-buffer operations move whole slots: the buffer must hold one, and
/// what a write puts in it must fit the slot.
fn owned_check(allocator: &Arc<ExtentAllocator>, slot: &Slot, buf: &AlignedBuf, write: bool) -> Result<(), TierError> {
    if !slot.is_from(allocator) {
        return Err(TierError::ForeignSlot);
    }
    if buf.capacity() < slot.reserved() as usize || (write && buf.len() > slot.len() as usize) {
        return Err(TierError::OutOfBounds {
            offset: 0,
            len: buf.len() as u64,
            slot_len: slot.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tier on a fresh file that is unlinked at once: it lives exactly as
    /// long as the tier.
    fn tier(capacity: u64, engine: EngineChoice) -> NvmeTier {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("kvtier-nvme-test-{}-{n}", std::process::id()));
        let tier = NvmeTier::open(NvmeConfig {
            path: path.clone(),
            capacity,
            engine,
            queue_depth: 16,
            direct: true,
        })
        .unwrap();
        std::fs::remove_file(&path).unwrap();
        tier
    }

    /// Why io_uring tests cannot run here, unless the environment demands
    /// them (`KVTIER_REQUIRE_URING=1`), in which case they fail instead.
    fn uring_refused() -> Option<String> {
        let reason = NvmeTier::uring_available().err()?;
        assert!(
            std::env::var_os("KVTIER_REQUIRE_URING").is_none(),
            "io_uring required but refused: {reason}"
        );
        Some(format!("io_uring is refused by this kernel or sandbox: {reason}"))
    }

    crate::tier_conformance_tests!(psync, |capacity| tier(capacity, EngineChoice::Psync));
    crate::tier_conformance_tests!(
        uring,
        |capacity| tier(capacity, EngineChoice::Uring),
        skip = uring_refused()
    );

    #[test]
    fn auto_picks_an_engine_and_says_which() {
        let t = tier(1 << 20, EngineChoice::Auto);
        let expected = if NvmeTier::uring_available().is_ok() {
            "uring"
        } else {
            "psync"
        };
        assert_eq!((t.kind(), t.backend(), t.emulated()), (TierKind::Nvme, expected, false));
    }

    #[test]
    fn reopening_keeps_the_bytes_and_claims_extents() {
        let dir = tempfile::tempdir().unwrap();
        let config = NvmeConfig {
            path: dir.path().join("nvme.data"),
            capacity: 1 << 20,
            engine: EngineChoice::Auto,
            queue_depth: 4,
            direct: true,
        };
        let data = crate::conformance::pattern(3, 10_000);
        let offset = {
            let t = NvmeTier::open(config.clone()).unwrap();
            let mut slot = t.allocate(10_000).unwrap();
            t.write(&mut slot, 0, &data).unwrap();
            t.sync().unwrap();
            slot.offset()
        };
        let t = NvmeTier::open(config).unwrap();
        let slot = t.claim(offset, 10_000).unwrap();
        let mut back = vec![0u8; 10_000];
        t.read(&slot, 0, &mut back).unwrap();
        assert_eq!(back, data);
        assert!(matches!(t.claim(offset, 1), Err(TierError::InUse { .. })));
    }

    #[test]
    fn a_file_in_use_by_another_tier_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let config = NvmeConfig {
            path: dir.path().join("nvme.data"),
            capacity: 1 << 20,
            engine: EngineChoice::Psync,
            queue_depth: 4,
            direct: true,
        };
        let first = NvmeTier::open(config.clone()).unwrap();
        let err = NvmeTier::open(config.clone()).unwrap_err();
        assert!(err.to_string().contains("in use by another process"), "{err}");
        drop(first);
        NvmeTier::open(config).unwrap();
    }
}
