//! The device tier in GPU memory: one `cuMemAlloc` of exactly the capacity,
//! carved into slots; single copies through the driver, batches (a swap-in
//! step) through the gather kernel or the copy engine.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaFunction, result, sys};
use kvtier_tiers::{ExtentAllocator, Slot, Tier, TierError, TierKind};

use crate::pinned::PinnedBuf;
use crate::{CudaError, Gpu, gather};

/// How a batch of pages reaches the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapPath {
    /// Stage the pages in mapped pinned memory, then one kernel launch
    /// gathers them into their slots and writes the page table.
    Kernel,
    /// One asynchronous copy per page on the copy engine, one sync.
    CopyEngine,
}

/// Device slots are 256-byte aligned: full-width loads and stores.
const GRANULE: u64 = 256;

/// The device tier in GPU memory on device 0: one `cuMemAlloc` of exactly the capacity, carved
/// into 256-byte aligned slots. Single reads and writes are synchronous driver copies;
/// [`Tier::write_batch`] (a swap-in step) takes the tier's [`SwapPath`].
#[derive(Debug)]
pub struct CudaDeviceTier {
    gpu: Arc<Gpu>,
    base: sys::CUdeviceptr,
    allocator: Arc<ExtentAllocator>,
    path: SwapPath,
    kernel: OnceLock<Result<CudaFunction, String>>,
    /// Staging for the kernel path and the device arrays it reads, grown as
    /// batches grow; one batch at a time.
    batch: Mutex<Option<BatchBuffers>>,
}

#[derive(Debug)]
struct BatchBuffers {
    staging: PinnedBuf,
    /// Device memory for four u64 arrays (sources, destinations, lengths,
    /// page table) of `entries` each.
    arrays: sys::CUdeviceptr,
    entries: usize,
}

// SAFETY: `base` is a device allocation owned by this value; the copies into
// it touch only the extents of slots borrowed by the caller (disjoint by the
// allocator), and batch buffers are used under their mutex.
unsafe impl Send for CudaDeviceTier {}
// SAFETY: as for `Send`.
unsafe impl Sync for CudaDeviceTier {}

fn io(e: impl std::fmt::Display) -> TierError {
    TierError::Io {
        op: "cuda",
        offset: 0,
        errno: None,
        message: e.to_string(),
    }
}

impl CudaDeviceTier {
    /// Allocates `capacity` bytes of device memory (nothing for 0) and sends batches by `path`.
    /// Errors: [`CudaError::Driver`] when the context cannot be bound or the allocation fails.
    /// The gather kernel is compiled at the first batch that needs it, not here.
    pub fn new(gpu: &Arc<Gpu>, capacity: u64, path: SwapPath) -> Result<Self, CudaError> {
        gpu.bind()?;
        let base = match capacity {
            0 => 0,
            // SAFETY: a fresh device allocation, freed in `Drop`.
            n => unsafe { result::malloc_sync(n as usize) }?,
        };
        Ok(Self {
            gpu: Arc::clone(gpu),
            base,
            allocator: ExtentAllocator::new(TierKind::Device, capacity, GRANULE),
            path,
            kernel: OnceLock::new(),
            batch: Mutex::new(None),
        })
    }

    /// How batches reach the device, as chosen at [`CudaDeviceTier::new`].
    pub fn path(&self) -> SwapPath {
        self.path
    }

    fn address(&self, slot: &Slot, offset: u64, len: usize) -> Result<sys::CUdeviceptr, TierError> {
        if !slot.is_from(&self.allocator) {
            return Err(TierError::ForeignSlot);
        }
        slot.check_range(offset, len)?;
        Ok(self.base + slot.offset() + offset)
    }

    /// The device page table written by the last batch: the device address
    /// of each page, in batch order.
    pub fn last_page_table(&self) -> Result<Vec<u64>, CudaError> {
        let guard = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        let Some(b) = guard.as_ref() else { return Ok(Vec::new()) };
        let mut table = vec![0u64; b.entries];
        self.gpu.bind()?;
        // SAFETY: the table array holds `entries` u64s at this offset of the
        // arrays allocation, which the mutex keeps alive and unchanged.
        unsafe { result::memcpy_dtoh_sync(&mut table, b.arrays + 3 * 8 * b.entries as u64) }?;
        Ok(table)
    }

    fn kernel(&self) -> Result<&CudaFunction, TierError> {
        self.kernel
            .get_or_init(|| gather::compile(&self.gpu).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(io)
    }

    /// Buffers big enough for `pages` pages of `bytes` staged bytes in all.
    fn buffers<'a>(
        &self,
        slot: &'a mut Option<BatchBuffers>,
        pages: usize,
        bytes: usize,
    ) -> Result<&'a mut BatchBuffers, CudaError> {
        let fits = slot
            .as_ref()
            .is_some_and(|b| b.entries >= pages && b.staging.len >= bytes);
        if !fits {
            let entries = pages.next_power_of_two().max(64);
            let staging = PinnedBuf::new(&self.gpu, bytes.next_power_of_two().max(1 << 20))?;
            if let Some(old) = slot.take() {
                // SAFETY: the old arrays are not in use: batches run under the
                // mutex and synchronise before returning.
                unsafe { result::free_sync(old.arrays) }.ok();
            }
            // SAFETY: a fresh device allocation, freed when replaced or in `Drop`.
            let arrays = unsafe { result::malloc_sync(4 * 8 * entries) }?;
            *slot = Some(BatchBuffers {
                staging,
                arrays,
                entries,
            });
        }
        Ok(slot.as_mut().expect("just ensured"))
    }

    fn copy_batch(&self, writes: &mut [(&mut Slot, &[u8])]) -> Result<(), TierError> {
        self.gpu.bind().map_err(io)?;
        let dst: Vec<u64> = writes
            .iter()
            .map(|(slot, src)| self.address(slot, 0, src.len()))
            .collect::<Result<_, _>>()?;
        let lens: Vec<u64> = writes.iter().map(|(_, src)| src.len() as u64).collect();
        let stream = self.gpu.stream.cu_stream();
        let mut guard = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        match self.path {
            SwapPath::CopyEngine => {
                let b = self.buffers(&mut guard, writes.len(), 0).map_err(io)?;
                for ((_, src), &to) in writes.iter().zip(&dst) {
                    // SAFETY: `to` addresses `src.len()` bytes of a slot held
                    // by `&mut`; `src` stays borrowed until the sync below.
                    unsafe { result::memcpy_htod_async(to, src, stream) }.map_err(io)?;
                }
                // SAFETY: the table array has room for `entries >= n` u64s;
                // `dst` lives until the sync below.
                unsafe { result::memcpy_htod_async(b.arrays + 3 * 8 * b.entries as u64, &dst, stream) }.map_err(io)?;
            }
            SwapPath::Kernel => {
                let func = self.kernel()?.clone();
                let total: usize = writes.iter().map(|(_, s)| s.len().next_multiple_of(256)).sum();
                let b = self.buffers(&mut guard, writes.len(), total).map_err(io)?;
                let mut src = Vec::with_capacity(writes.len());
                let mut at = 0usize;
                for (_, bytes) in writes.iter() {
                    // SAFETY: `at + len <= total <= staging.len`; the staging
                    // buffer is used by one batch at a time (the mutex).
                    unsafe {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.staging.host.as_ptr().add(at), bytes.len());
                    }
                    src.push(b.staging.device + at as u64);
                    at += bytes.len().next_multiple_of(256);
                }
                let e = 8 * b.entries as u64;
                let arrays = [b.arrays, b.arrays + e, b.arrays + 2 * e, b.arrays + 3 * e];
                for (array, values) in arrays.iter().zip([&src, &dst, &lens]) {
                    // SAFETY: each array has room for `entries >= n` u64s;
                    // the host vectors live until the sync below.
                    unsafe { result::memcpy_htod_async(*array, values, stream) }.map_err(io)?;
                }
                // SAFETY: sources are staged mapped pinned bytes, destinations
                // disjoint slots of this allocation, lengths theirs; all stay
                // valid until the synchronisation below.
                unsafe { gather::launch(&self.gpu.stream, &func, arrays, writes.len() as u32) }.map_err(io)?;
            }
        }
        self.gpu.stream.synchronize().map_err(io)
    }
}

impl Drop for CudaDeviceTier {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        let batch = self.batch.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(b) = batch {
            // SAFETY: allocated by cuMemAlloc; no batch is running (`&mut self`).
            unsafe { result::free_sync(b.arrays) }.ok();
        }
        if self.base != 0 {
            // SAFETY: allocated by cuMemAlloc in `new`; slots are plain
            // offsets and cannot reach it once the tier is gone.
            unsafe { result::free_sync(self.base) }.ok();
        }
    }
}

impl Tier for CudaDeviceTier {
    fn kind(&self) -> TierKind {
        TierKind::Device
    }
    fn backend(&self) -> &'static str {
        "cuda"
    }
    fn emulated(&self) -> bool {
        false
    }
    fn allocator(&self) -> &Arc<ExtentAllocator> {
        &self.allocator
    }
    fn write(&self, slot: &mut Slot, offset: u64, src: &[u8]) -> Result<(), TierError> {
        let to = self.address(slot, offset, src.len())?;
        self.gpu.bind().map_err(io)?;
        // SAFETY: `to` addresses `src.len()` bytes of a slot held by `&mut`.
        unsafe { result::memcpy_htod_sync(to, src) }.map_err(io)
    }
    fn read(&self, slot: &Slot, offset: u64, dst: &mut [u8]) -> Result<(), TierError> {
        let from = self.address(slot, offset, dst.len())?;
        self.gpu.bind().map_err(io)?;
        // SAFETY: `from` addresses `dst.len()` bytes of a slot held by `&`.
        unsafe { result::memcpy_dtoh_sync(dst, from) }.map_err(io)
    }
    fn write_batch(&self, mut writes: Vec<(&mut Slot, &[u8])>) -> Result<(), TierError> {
        if writes.is_empty() {
            return Ok(());
        }
        self.copy_batch(&mut writes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_tiers::conformance::pattern;

    fn tier(capacity: u64, path: SwapPath) -> CudaDeviceTier {
        CudaDeviceTier::new(
            &Gpu::open().expect("a GPU (the tests skip without one)"),
            capacity,
            path,
        )
        .unwrap()
    }

    kvtier_tiers::tier_conformance_tests!(
        cuda_device,
        |capacity| tier(capacity, SwapPath::Kernel),
        skip = crate::gpu_missing(),
        #[cfg_attr(kvtier_no_gpu, ignore = "no CUDA driver where this was built; run with --include-ignored on a GPU machine")]
    );

    /// The gather kernel and the copy engine put the same bytes in the same
    /// places and write the same page table.
    #[test]
    #[cfg_attr(
        kvtier_no_gpu,
        ignore = "no CUDA driver where this was built; run with --include-ignored on a GPU machine"
    )]
    fn kernel_and_copy_engine_agree_bit_exact() {
        if let Some(reason) = crate::gpu_missing() {
            println!("skipped: {reason}");
            return;
        }
        for size in [12usize, 4096, 8192, 65_536 + 24] {
            let pages: Vec<Vec<u8>> = (0..37).map(|i| pattern(i * 7 + size as u64, size)).collect();
            let mut tables = Vec::new();
            for path in [SwapPath::Kernel, SwapPath::CopyEngine] {
                let t = tier(64 << 20, path);
                let mut slots: Vec<Slot> = pages.iter().map(|p| t.allocate(p.len() as u64).unwrap()).collect();
                t.write_batch(slots.iter_mut().zip(&pages).map(|(s, p)| (s, p.as_slice())).collect())
                    .unwrap();
                for (slot, page) in slots.iter().zip(&pages) {
                    let mut back = vec![0u8; page.len()];
                    t.read(slot, 0, &mut back).unwrap();
                    assert_eq!(&back, page, "{path:?} size {size}");
                }
                let table = t.last_page_table().unwrap();
                let expected: Vec<u64> = slots.iter().map(|s| t.base + s.offset()).collect();
                assert_eq!(&table[..slots.len()], &expected[..], "{path:?} page table");
                tables.push(table[..slots.len()].iter().zip(&expected).all(|(a, b)| a == b));
            }
            assert!(tables.iter().all(|ok| *ok));
        }
    }
}
