//! Storage tiers. Every tier hands out [`Slot`]s (byte extents under an exact
//! capacity) and moves bytes in and out of them; the store decides what goes
//! where. Backends: [`ArenaTier`] (host memory; also the emulated device).

mod arena;
#[cfg(feature = "testing")]
pub mod conformance;
mod extent;

use std::fmt;

pub use arena::ArenaTier;
pub use extent::{ExtentAllocator, Slot};

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
    pub const ALL: [TierKind; 3] = [TierKind::Device, TierKind::Host, TierKind::Nvme];

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

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    #[error(
        "{tier} tier is full: {requested} bytes requested, {free} of {capacity} bytes free \
         (largest free extent {largest_free})"
    )]
    Full {
        tier: TierKind,
        requested: u64,
        free: u64,
        largest_free: u64,
        capacity: u64,
    },
    #[error("a slot must be at least one byte long")]
    ZeroLength,
    #[error("the slot was allocated by another tier")]
    ForeignSlot,
    #[error("bytes {offset}..{end} are outside the {slot_len}-byte slot", end = offset + len)]
    OutOfBounds { offset: u64, len: u64, slot_len: u64 },
    #[error("cannot reserve {bytes} bytes of memory for the {tier} tier: {reason}")]
    Reserve { tier: TierKind, bytes: u64, reason: String },
}

/// A storage tier: an exact byte budget carved into slots.
///
/// Implementations are shared between threads. A slot is exclusively owned by
/// whoever holds it: writing takes `&mut Slot`, reading `&Slot`, so the borrow
/// checker rules out a read racing a write of the same bytes, and slots never
/// overlap. Dropping a slot returns its bytes to the tier.
pub trait Tier: Send + Sync + fmt::Debug {
    fn kind(&self) -> TierKind;
    /// Implementation name as shown in stats and logs (`host-arena`, `emulated`).
    fn backend(&self) -> &'static str;
    /// True when this tier stands in for hardware that is absent (the emulated
    /// device); every output that reports on it says so.
    fn emulated(&self) -> bool;
    fn capacity_bytes(&self) -> u64;
    /// Bytes reserved by live slots, including alignment padding; never above
    /// the capacity.
    fn used_bytes(&self) -> u64;
    /// Number of live slots.
    fn slots(&self) -> u64;
    /// Reserves a slot of `len` bytes, or says the tier is full.
    fn allocate(&self, len: u64) -> Result<Slot, TierError>;
    /// Copies `src` into the slot at `offset`.
    fn write(&self, slot: &mut Slot, offset: u64, src: &[u8]) -> Result<(), TierError>;
    /// Copies slot bytes at `offset` into `dst`.
    fn read(&self, slot: &Slot, offset: u64, dst: &mut [u8]) -> Result<(), TierError>;
}
