//! Asking the CPU for memory before it is needed.

/// Starts loading the cache line holding `addr` (a hint: nothing is read,
/// nothing can fault, and it does nothing where unsupported).
#[inline(always)]
pub fn prefetch_line(addr: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching reads no memory architecturally and cannot fault,
    // whatever the address. SSE is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}
