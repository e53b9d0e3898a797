//! Page-locked host memory, mapped into the device's address space: the
//! host tier when a GPU is present (its pages can be DMA'd or read by a
//! kernel directly), and the staging area of the swap-in kernel.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{result, sys};
use kvtier_tiers::{ExtentAllocator, Slot, Tier, TierError, TierKind};

use crate::{CudaError, Gpu};

/// A page-locked, device-mapped host allocation. Plain page-locked memory,
/// not write-combined: the CPU reads it too.
#[derive(Debug)]
pub(crate) struct PinnedBuf {
    gpu: Arc<Gpu>,
    pub(crate) host: NonNull<u8>,
    /// The same bytes as seen from the device.
    pub(crate) device: sys::CUdeviceptr,
    pub(crate) len: usize,
}

// SAFETY: the buffer is owned exclusively by this value; access to its bytes
// is coordinated by its owners (slot borrows, or the tier's staging lock).
unsafe impl Send for PinnedBuf {}
// SAFETY: as for `Send`; shared references never write through `host`.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub(crate) fn new(gpu: &Arc<Gpu>, len: usize) -> Result<Self, CudaError> {
        gpu.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a fresh allocation of `len` (at least 1) bytes; the pointer
        // is checked for null below.
        let raw = unsafe { result::malloc_host(len.max(1), flags) }?;
        let host = NonNull::new(raw.cast::<u8>()).ok_or(CudaError::Compile("cuMemHostAlloc returned null".into()))?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` is a mapped pinned allocation of this context; the
        // driver writes its device address into `device`.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, raw, 0) }.result();
        if let Err(e) = mapped {
            // SAFETY: allocated above by cuMemHostAlloc and not shared yet.
            unsafe { result::free_host(raw) }.ok();
            return Err(e.into());
        }
        Ok(Self {
            gpu: Arc::clone(gpu),
            host,
            device,
            len,
        })
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: allocated by cuMemHostAlloc in `new`; no slot or copy
        // outlives the owner that drops it.
        if let Err(e) = unsafe { result::free_host(self.host.as_ptr().cast()) } {
            tracing::error!(error = %e, "freeing pinned host memory failed");
        }
    }
}

/// The host tier in page-locked, device-mapped memory.
#[derive(Debug)]
pub struct PinnedHostTier {
    buf: PinnedBuf,
    allocator: Arc<ExtentAllocator>,
}

impl PinnedHostTier {
    /// Allocates `capacity` bytes of page-locked host memory mapped into the device, carved into
    /// 256-byte aligned slots. Errors: [`CudaError::Driver`] when the driver refuses the
    /// allocation or its mapping.
    pub fn new(gpu: &Arc<Gpu>, capacity: u64) -> Result<Self, CudaError> {
        Ok(Self {
            buf: PinnedBuf::new(gpu, capacity as usize)?,
            allocator: ExtentAllocator::new(TierKind::Host, capacity, 256),
        })
    }

    fn check(&self, slot: &Slot, offset: u64, len: usize) -> Result<*mut u8, TierError> {
        if !slot.is_from(&self.allocator) {
            return Err(TierError::ForeignSlot);
        }
        slot.check_range(offset, len)?;
        // SAFETY: the slot lies inside the allocation (allocator invariant)
        // and the range inside the slot (checked above).
        Ok(unsafe { self.buf.host.as_ptr().add((slot.offset() + offset) as usize) })
    }
}

impl Tier for PinnedHostTier {
    fn kind(&self) -> TierKind {
        TierKind::Host
    }
    fn backend(&self) -> &'static str {
        "cuda-pinned"
    }
    fn emulated(&self) -> bool {
        false
    }
    fn allocator(&self) -> &Arc<ExtentAllocator> {
        &self.allocator
    }
    fn write(&self, slot: &mut Slot, offset: u64, src: &[u8]) -> Result<(), TierError> {
        let dst = self.check(slot, offset, src.len())?;
        // SAFETY: `dst` addresses `src.len()` bytes of this slot, held
        // exclusively through `&mut Slot`; `src` is caller memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }
    fn prefetch(&self, slot: &Slot) {
        if let Ok(start) = self.check(slot, 0, slot.len() as usize) {
            kvtier_tiers::prefetch_range(start, slot.len() as usize);
        }
    }
    fn read(&self, slot: &Slot, offset: u64, dst: &mut [u8]) -> Result<(), TierError> {
        // SAFETY: `[u8]` and `[MaybeUninit<u8>]` have the same layout, and
        // `read_uninit` only writes initialised bytes into it.
        let dst = unsafe { &mut *(dst as *mut [u8] as *mut [std::mem::MaybeUninit<u8>]) };
        self.read_uninit(slot, offset, dst)
    }

    fn read_uninit(&self, slot: &Slot, offset: u64, dst: &mut [std::mem::MaybeUninit<u8>]) -> Result<(), TierError> {
        let src = self.check(slot, offset, dst.len())?;
        // SAFETY: `src` addresses `dst.len()` bytes of this slot; `&Slot`
        // excludes writers; `dst` is a unique borrow of other memory.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr().cast::<u8>(), dst.len()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(capacity: u64) -> PinnedHostTier {
        PinnedHostTier::new(&Gpu::open().expect("a GPU (the tests skip without one)"), capacity).unwrap()
    }

    kvtier_tiers::tier_conformance_tests!(
        pinned_host,
        tier,
        skip = crate::gpu_missing(),
        #[cfg_attr(kvtier_no_gpu, ignore = "no CUDA driver where this was built; run with --include-ignored on a GPU machine")]
    );
}
