#![warn(missing_docs)]
//! Storage tiers. Every tier hands out [`Slot`]s (byte extents under an exact
//! capacity) and moves bytes in and out of them; the store decides what goes
//! where. Backends: [`ArenaTier`] (host memory; also the emulated device) and
//! [`NvmeTier`] (a file or block device through io_uring or pread/pwrite).

mod aligned;
mod arena;
mod cache;
mod completion;
#[cfg(feature = "testing")]
pub mod conformance;
mod extent;
#[cfg(feature = "testing")]
pub mod faults;
mod lock;
mod nvme;

use std::fmt;
use std::mem::MaybeUninit;
use std::sync::Arc;

pub use aligned::{AlignedBuf, IO_ALIGN};
pub use arena::ArenaTier;
pub use cache::{prefetch_line, prefetch_range};
pub use completion::{Abandoned, Completer, Completion, completion};
pub use extent::{ExtentAllocator, Slot};
pub use lock::{LOCK_WAIT, LockError, LockFile};
pub use nvme::{EngineChoice, NvmeConfig, NvmeTier};

/// Which level of the hierarchy a tier serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierKind {
    /// Hot: where workers read pages from.
    Device,
    /// Cold, fast: (pinned) host memory.
    Host,
    /// Cold, durable: a file or block device.
    Nvme,
}

impl TierKind {
    /// Every kind, from the hottest (`Device`) to the coldest (`Nvme`).
    pub const ALL: [TierKind; 3] = [TierKind::Device, TierKind::Host, TierKind::Nvme];

    /// The lowercase name (`device`, `host`, `nvme`) shown in stats and logs; also what
    /// `Display` prints.
    pub const fn name(self) -> &'static str {
        match self {
            TierKind::Device => "device",
            TierKind::Host => "host",
            TierKind::Nvme => "nvme",
        }
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a tier refused or failed an operation. Sizes and offsets are in bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    /// No free extent is large enough for the request. `free` may still exceed `requested`
    /// when the free bytes are fragmented; `largest_free` says how much one slot can get.
    #[error(
        "{tier} tier is full: {requested} bytes requested, {free} of {capacity} bytes free \
         (largest free extent {largest_free})"
    )]
    Full {
        /// The tier that refused.
        tier: TierKind,
        /// Bytes asked for, before rounding up to the tier's granule.
        requested: u64,
        /// Free bytes in all (the usable capacity less what live slots reserve).
        free: u64,
        /// The longest single free extent in bytes; 0 when nothing is free.
        largest_free: u64,
        /// The tier's capacity in bytes.
        capacity: u64,
    },
    /// A slot of zero bytes was requested.
    #[error("a slot must be at least one byte long")]
    ZeroLength,
    /// The slot was issued by another tier instance than the one asked to use it.
    #[error("the slot was allocated by another tier")]
    ForeignSlot,
    /// A range that does not lie within the slot (`offset + len` past its end, or overflowing).
    /// Owned-buffer calls also report a buffer too small for its slot this way, with `offset` 0
    /// and `len` the buffer's size.
    #[error("bytes {offset}..{end} are outside the {slot_len}-byte slot", end = offset + len)]
    OutOfBounds {
        /// Start of the refused range, in bytes from the start of the slot.
        offset: u64,
        /// Length of the refused range in bytes.
        len: u64,
        /// The slot's usable length in bytes.
        slot_len: u64,
    },
    /// The tier's backing memory or file could not be set up: mapping or allocating it,
    /// opening, locking or sizing the file, or starting its I/O engine.
    #[error("cannot reserve {bytes} bytes for the {tier} tier: {reason}")]
    Reserve {
        /// The tier being set up.
        tier: TierKind,
        /// The capacity asked for, in bytes.
        bytes: u64,
        /// What went wrong, as text.
        reason: String,
    },
    /// A transfer or sync failed in the backend (the kernel, the I/O engine, the CUDA driver).
    #[error("{op} at byte {offset} failed: {message}")]
    Io {
        /// The operation that failed: `read`, `write`, `fdatasync`, `cuda`.
        op: &'static str,
        /// Byte offset in the tier (its file, for the NVMe tier) where it failed; 0 when the
        /// operation has none (a sync, a CUDA call).
        offset: u64,
        /// The OS error number (ENOSPC, EIO, ...), when there is one.
        errno: Option<i32>,
        /// The error as text.
        message: String,
    },
    /// A claim ([`Tier::claim`]) named bytes that are not all free, or an offset that is not a
    /// multiple of the tier's granule.
    #[error("bytes {offset}..{end} are already in use", end = offset + len)]
    InUse {
        /// Start of the claimed extent in bytes.
        offset: u64,
        /// Length of the claimed extent in bytes, rounded up to the granule.
        len: u64,
    },
}

impl TierError {
    /// The device or filesystem has no space left.
    pub fn is_no_space(&self) -> bool {
        matches!(self, TierError::Io { errno: Some(e), .. } if *e == libc::ENOSPC)
    }
}

/// An owned-buffer read, finished: the buffer (holding the slot's bytes,
/// `len()` = the slot's length) and whether it worked.
#[derive(Debug)]
pub struct ReadDone {
    /// The buffer passed in; when the read succeeded, its `len()` bytes are the slot's.
    pub buf: AlignedBuf,
    /// Whether the read worked; on an error the buffer's bytes mean nothing.
    pub result: Result<(), TierError>,
}

/// An owned-buffer write, finished: the slot and buffer back.
#[derive(Debug)]
pub struct WriteDone {
    /// The slot written, handed back to its owner.
    pub slot: Slot,
    /// The buffer written from, back for reuse.
    pub buf: AlignedBuf,
    /// Whether the write worked; on an error the slot's bytes are not to be trusted.
    pub result: Result<(), TierError>,
}

/// A storage tier: an exact byte budget carved into slots.
///
/// Implementations are shared between threads. A slot is exclusively owned by
/// whoever holds it: writing takes `&mut Slot`, reading `&Slot`, so the borrow
/// checker rules out a read racing a write of the same bytes, and slots never
/// overlap. Dropping a slot returns its bytes to the tier.
pub trait Tier: Send + Sync + fmt::Debug {
    /// The level of the hierarchy this tier serves.
    fn kind(&self) -> TierKind;
    /// Implementation name as shown in stats and logs (`host-arena`, `emulated`).
    fn backend(&self) -> &'static str;
    /// True when this tier stands in for hardware that is absent (the emulated
    /// device); every output that reports on it says so.
    fn emulated(&self) -> bool;
    /// The allocator that carves this tier's capacity into slots.
    fn allocator(&self) -> &Arc<ExtentAllocator>;
    /// The tier's exact byte budget: live slots never reserve more ([`Tier::used_bytes`]).
    fn capacity_bytes(&self) -> u64 {
        self.allocator().capacity()
    }
    /// Bytes reserved by live slots, including alignment padding; never above
    /// the capacity.
    fn used_bytes(&self) -> u64 {
        self.allocator().used()
    }
    /// Number of live slots.
    fn slots(&self) -> u64 {
        self.allocator().live()
    }
    /// Reserves a slot of `len` bytes, or says the tier is full.
    fn allocate(&self, len: u64) -> Result<Slot, TierError> {
        self.allocator().allocate(len)
    }
    /// Reserves exactly the slot at `offset` (one named by a manifest when
    /// recovering), or says why not.
    fn claim(&self, offset: u64, len: u64) -> Result<Slot, TierError> {
        self.allocator().allocate_at(offset, len)
    }
    /// Copies `src` into the slot at `offset`.
    fn write(&self, slot: &mut Slot, offset: u64, src: &[u8]) -> Result<(), TierError>;
    /// A hint that the slot's bytes are about to be read: a memory tier
    /// starts loading them. By default nothing.
    fn prefetch(&self, _slot: &Slot) {}

    /// Copies slot bytes at `offset` into `dst`.
    fn read(&self, slot: &Slot, offset: u64, dst: &mut [u8]) -> Result<(), TierError>;

    /// Like [`Tier::read`], into memory that need not be initialised (a
    /// response buffer's spare room, a client's shared-memory window); all
    /// of `dst` is written when it succeeds. Memory tiers copy straight into
    /// it; the default zeroes it first, then reads.
    fn read_uninit(&self, slot: &Slot, offset: u64, dst: &mut [MaybeUninit<u8>]) -> Result<(), TierError> {
        // SAFETY: `dst` is valid for writes of its length; once zeroed, every
        // byte is initialised, so viewing it as `[u8]` is sound.
        let dst = unsafe {
            std::ptr::write_bytes(dst.as_mut_ptr(), 0, dst.len());
            &mut *(dst as *mut [MaybeUninit<u8>] as *mut [u8])
        };
        self.read(slot, offset, dst)
    }

    /// Reads whole slots into owned buffers (capacity at least the slot's
    /// reserved length), submitted together. Dropping a completion before it
    /// finishes is safe: the operation keeps its slot and buffer until done.
    fn read_many(&self, reads: Vec<(Arc<Slot>, AlignedBuf)>) -> Vec<Completion<ReadDone>> {
        reads
            .into_iter()
            .map(|(slot, mut buf)| {
                let result = if buf.capacity() < slot.len() as usize {
                    Err(TierError::OutOfBounds {
                        offset: 0,
                        len: buf.capacity() as u64,
                        slot_len: slot.len(),
                    })
                } else {
                    buf.set_len(slot.len() as usize);
                    self.read(&slot, 0, &mut buf)
                };
                Completion::ready(ReadDone { buf, result })
            })
            .collect()
    }

    /// Writes owned buffers (at most a slot long) to the start of slots,
    /// submitted together; each slot comes back with its completion.
    fn write_many(&self, writes: Vec<(Slot, AlignedBuf)>) -> Vec<Completion<WriteDone>> {
        writes
            .into_iter()
            .map(|(mut slot, buf)| {
                let result = self.write(&mut slot, 0, &buf);
                Completion::ready(WriteDone { slot, buf, result })
            })
            .collect()
    }

    /// Copies many host buffers into slots at offset 0 as one batch (a swap-in
    /// step): device tiers move them with one kernel or one stream sync.
    fn write_batch(&self, writes: Vec<(&mut Slot, &[u8])>) -> Result<(), TierError> {
        writes.into_iter().try_for_each(|(slot, src)| self.write(slot, 0, src))
    }

    /// Makes completed writes durable (nothing to do for memory tiers).
    fn sync(&self) -> Result<(), TierError> {
        Ok(())
    }
}
