//! An exact-capacity extent allocator: best fit over free extents, with
//! coalescing on free. Pure bookkeeping; the tier owns the bytes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::{TierError, TierKind};

/// Carves one tier's capacity into [`Slot`]s, best fit, coalescing neighbours on free. Pure
/// bookkeeping behind one mutex; shared as an `Arc` because every slot frees itself through it.
#[derive(Debug)]
pub struct ExtentAllocator {
    tier: TierKind,
    capacity: u64,
    granule: u64,
    state: Mutex<Extents>,
}

#[derive(Debug, Default)]
struct Extents {
    /// Free extents: offset → length.
    by_offset: BTreeMap<u64, u64>,
    /// Free extents ordered by (length, offset), for best fit.
    by_size: BTreeSet<(u64, u64)>,
    used: u64,
    live: u64,
}

/// A reserved extent of a tier. Dropping it frees the extent.
pub struct Slot {
    offset: u64,
    len: u64,
    reserved: u64,
    allocator: Arc<ExtentAllocator>,
    /// A counter this slot's reserved bytes are in while it lives (a
    /// tenant's bytes in this tier, say).
    meter: Option<Arc<AtomicU64>>,
}

impl ExtentAllocator {
    /// `granule` (a power of two) is the alignment of every offset and the
    /// rounding of every reservation.
    pub fn new(tier: TierKind, capacity: u64, granule: u64) -> Arc<Self> {
        assert!(granule.is_power_of_two(), "granule must be a power of two");
        // Only whole granules are usable, so that every extent stays aligned.
        let usable = capacity / granule * granule;
        let mut extents = Extents::default();
        if usable > 0 {
            extents.by_offset.insert(0, usable);
            extents.by_size.insert((usable, 0));
        }
        Arc::new(Self {
            tier,
            capacity,
            granule,
            state: Mutex::new(extents),
        })
    }

    /// The capacity in bytes as given to [`ExtentAllocator::new`]; only whole granules of it are
    /// handed out.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes reserved by live slots, each rounded up to the granule.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    /// Number of live slots (allocated and not yet dropped).
    pub fn live(&self) -> u64 {
        self.lock().live
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Extents> {
        // The state is updated only by panic-free code, so a poisoned lock
        // still holds consistent bookkeeping.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves `len` bytes (rounded up to the granule) from the smallest free extent that holds
    /// them. Errors: [`TierError::ZeroLength`] for `len == 0`; [`TierError::Full`] when no free
    /// extent is large enough.
    pub fn allocate(self: &Arc<Self>, len: u64) -> Result<Slot, TierError> {
        if len == 0 {
            return Err(TierError::ZeroLength);
        }
        let reserved = len.div_ceil(self.granule).saturating_mul(self.granule);
        let mut s = self.lock();
        let Some(&(size, offset)) = s.by_size.range((reserved, 0)..).next() else {
            return Err(TierError::Full {
                tier: self.tier,
                requested: len,
                free: self.capacity / self.granule * self.granule - s.used,
                largest_free: s.by_size.last().map_or(0, |e| e.0),
                capacity: self.capacity,
            });
        };
        s.by_size.remove(&(size, offset));
        s.by_offset.remove(&offset);
        if size > reserved {
            s.by_offset.insert(offset + reserved, size - reserved);
            s.by_size.insert((size - reserved, offset + reserved));
        }
        s.used += reserved;
        s.live += 1;
        Ok(Slot {
            offset,
            len,
            reserved,
            allocator: Arc::clone(self),
            meter: None,
        })
    }

    /// Reserves exactly `[offset, offset + len)` (rounded to the granule),
    /// for extents named by a manifest at recovery.
    pub fn allocate_at(self: &Arc<Self>, offset: u64, len: u64) -> Result<Slot, TierError> {
        if len == 0 {
            return Err(TierError::ZeroLength);
        }
        let reserved = len.div_ceil(self.granule).saturating_mul(self.granule);
        let in_use = TierError::InUse { offset, len: reserved };
        if !offset.is_multiple_of(self.granule) {
            return Err(in_use);
        }
        let mut s = self.lock();
        let Some((&start, &size)) = s.by_offset.range(..=offset).next_back() else {
            return Err(in_use);
        };
        if start + size < offset + reserved {
            return Err(in_use);
        }
        s.by_offset.remove(&start);
        s.by_size.remove(&(size, start));
        if offset > start {
            s.by_offset.insert(start, offset - start);
            s.by_size.insert((offset - start, start));
        }
        let end = start + size;
        if end > offset + reserved {
            s.by_offset.insert(offset + reserved, end - offset - reserved);
            s.by_size.insert((end - offset - reserved, offset + reserved));
        }
        s.used += reserved;
        s.live += 1;
        Ok(Slot {
            offset,
            len,
            reserved,
            allocator: Arc::clone(self),
            meter: None,
        })
    }

    fn free(&self, mut offset: u64, mut len: u64) {
        let mut s = self.lock();
        s.used -= len;
        s.live -= 1;
        if let Some((&prev, &prev_len)) = s.by_offset.range(..offset).next_back()
            && prev + prev_len == offset
        {
            s.by_offset.remove(&prev);
            s.by_size.remove(&(prev_len, prev));
            offset = prev;
            len += prev_len;
        }
        if let Some(next_len) = s.by_offset.remove(&(offset + len)) {
            s.by_size.remove(&(next_len, offset + len));
            len += next_len;
        }
        s.by_offset.insert(offset, len);
        s.by_size.insert((len, offset));
    }
}

impl Slot {
    /// Byte offset within the tier; a multiple of the tier's granule.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Usable length, as requested.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the usable length is zero, which an allocator never issues (it refuses zero
    /// lengths).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes counted against the tier (length rounded up to the granule).
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Counts this slot in `meter` until it is dropped. The caller has
    /// already added `self.reserved()` to it (so that it could refuse
    /// first); a slot already metered leaves its old meter.
    pub fn metered(mut self, meter: Arc<AtomicU64>) -> Self {
        if let Some(old) = self.meter.replace(meter) {
            old.fetch_sub(self.reserved, Ordering::AcqRel);
        }
        self
    }

    /// True if `allocator` issued this slot.
    pub fn is_from(&self, allocator: &Arc<ExtentAllocator>) -> bool {
        Arc::ptr_eq(&self.allocator, allocator)
    }

    /// Checks that `[offset, offset + len)` lies within the slot.
    pub fn check_range(&self, offset: u64, len: usize) -> Result<(), TierError> {
        let len = len as u64;
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(TierError::OutOfBounds {
                offset,
                len,
                slot_len: self.len,
            }),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(meter) = &self.meter {
            meter.fetch_sub(self.reserved, Ordering::AcqRel);
        }
        self.allocator.free(self.offset, self.reserved);
    }
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slot")
            .field("tier", &self.allocator.tier)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_coalesce_back_to_one_extent() {
        let a = ExtentAllocator::new(TierKind::Host, 1000, 64);
        let slots: Vec<Slot> = (0..15).map(|_| a.allocate(60).unwrap()).collect();
        assert_eq!(a.used(), 960);
        assert!(matches!(a.allocate(1), Err(TierError::Full { free: 0, .. })));
        // Free every other slot: 7 holes of 64 bytes, none of 128.
        let (odd, even): (Vec<_>, Vec<_>) = slots.into_iter().enumerate().partition(|(i, _)| i % 2 == 1);
        drop(odd);
        assert!(matches!(
            a.allocate(128),
            Err(TierError::Full {
                free: 448,
                largest_free: 64,
                ..
            })
        ));
        drop(even);
        assert_eq!((a.used(), a.live()), (0, 0));
        assert_eq!(a.allocate(960).unwrap().offset(), 0);
    }

    #[test]
    fn claimed_extents_are_reserved_exactly() {
        let a = ExtentAllocator::new(TierKind::Nvme, 4096 * 8, 4096);
        let x = a.allocate_at(4096 * 3, 5000).unwrap();
        assert_eq!((x.offset(), x.reserved()), (4096 * 3, 8192));
        assert!(matches!(a.allocate_at(4096 * 4, 1), Err(TierError::InUse { .. })));
        assert!(matches!(a.allocate_at(100, 1), Err(TierError::InUse { .. })));
        let rest: Vec<Slot> = (0..6).map(|_| a.allocate(4096).unwrap()).collect();
        assert!(rest.iter().all(|s| s.offset() < 4096 * 3 || s.offset() >= 4096 * 5));
        drop((x, rest));
        assert_eq!(a.allocate(4096 * 8).unwrap().offset(), 0);
    }

    #[test]
    fn best_fit_prefers_the_smallest_hole() {
        let g = 64;
        let a = ExtentAllocator::new(TierKind::Host, 10 * g, g);
        let s: Vec<Slot> = [1, 2, 1, 1, 1].iter().map(|n| a.allocate(n * g).unwrap()).collect();
        let [_a, b, _c, d, _e] = <[Slot; 5]>::try_from(s).unwrap();
        let (b_at, d_at) = (b.offset(), d.offset());
        drop((b, d));
        // Holes: 2 granules at b, 1 at d, 4 at the tail.
        assert_eq!(a.allocate(g).unwrap().offset(), d_at);
        let x = a.allocate(g).unwrap();
        assert_eq!(x.offset(), d_at, "the freed slot's hole is reused first");
        let y = a.allocate(2 * g).unwrap();
        assert_eq!(y.offset(), b_at);
    }
}
