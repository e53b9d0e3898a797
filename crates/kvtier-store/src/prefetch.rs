//! Asking the CPU for memory before it is needed. A read walks hundreds of
//! pages whose metadata live in separate allocations: the first touch of
//! each page's placement lock missed the cache and was most of the walk's
//! own time (75% of `Reader::contents` outside the copies, llama3-8b 8K
//! fetches). Asked for a few pages ahead, the misses overlap.

/// Pages ahead of the one being read whose metadata are asked for.
pub(crate) const AHEAD: usize = 8;

/// Starts loading the cache line holding `value` (a hint: nothing is
/// read, nothing can fault, and it does nothing where unsupported).
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching reads no memory architecturally and cannot fault,
    // whatever the address; this one is a live reference besides. SSE is
    // part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(std::ptr::from_ref(value).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}
