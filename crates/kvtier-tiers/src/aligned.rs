//! Heap buffers aligned for O_DIRECT: 4 KiB-aligned start and capacity, so
//! they can be handed to the kernel as they are, and memcpy into them never
//! hits 4 KiB aliasing.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every [`AlignedBuf`], and the unit of direct I/O.
pub const IO_ALIGN: usize = 4096;

/// An owned heap buffer whose start and capacity are multiples of [`IO_ALIGN`], zeroed at
/// allocation. It derefs to its first `len()` bytes; direct I/O may use the whole capacity.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively, like `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes; its capacity is `len` rounded up to
    /// [`IO_ALIGN`] (at least one block).
    pub fn zeroed(len: usize) -> Self {
        let capacity = len.max(1).div_ceil(IO_ALIGN) * IO_ALIGN;
        let layout = Layout::from_size_align(capacity, IO_ALIGN).expect("buffer size fits in isize");
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        Self { ptr, len, capacity }
    }

    /// A buffer holding a copy of `data`.
    pub fn copy_of(data: &[u8]) -> Self {
        let mut buf = Self::zeroed(data.len());
        buf.copy_from_slice(data);
        buf
    }

    /// Bytes in use. I/O may use the whole capacity.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no bytes are in use; the capacity is still at least one block.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated: a multiple of [`IO_ALIGN`], at least one block and at least `len()`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Changes the length within the capacity (bytes beyond the old length
    /// keep whatever they held; they were zeroed at allocation).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity, "length beyond capacity");
        self.len = len;
    }

    /// The whole capacity, for the kernel to read into or write from.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `capacity >= len` initialised (zeroed)
        // bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.capacity, IO_ALIGN).expect("layout was valid at allocation");
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_rounded() {
        for len in [0, 1, 4095, 4096, 4097, 70_000] {
            let b = AlignedBuf::zeroed(len);
            assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0);
            assert_eq!(b.capacity() % IO_ALIGN, 0);
            assert!(b.capacity() >= len.max(1));
            assert!(b.iter().all(|x| *x == 0));
        }
        let b = AlignedBuf::copy_of(b"page");
        assert_eq!(&b[..], b"page");
    }
}
