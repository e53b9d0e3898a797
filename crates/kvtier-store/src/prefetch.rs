//! Asking the CPU for memory before it is needed. A read walks hundreds of
//! pages whose metadata live in separate allocations: the first touch of
//! each page's placement lock missed the cache and was most of the walk's
//! own time (75% of `Reader::contents` outside the copies, llama3-8b 8K
//! fetches). Asked for a few pages ahead, the misses overlap.

/// Pages ahead of the one being read whose metadata are asked for.
pub(crate) const AHEAD: usize = 8;

/// Pages ahead of the one being read whose bytes are asked for: far
/// enough that their first lines arrive while the page before is copied,
/// near enough that they are still cached when their turn comes.
pub(crate) const BYTES_AHEAD: usize = 2;

/// The cache line size of the CPUs this runs on (x86_64 and most arm64).
const LINE: usize = 64;

/// Starts loading every cache line `value` spans. A page's placement lock
/// and the placement behind it lie on two lines: prefetching only the
/// first left the second to miss for every page read (the server's time
/// per shm fetch, smollm2 over 4 sequences: 20.7-21.3 -> 20.0-20.3 us).
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    let start = std::ptr::from_ref(value).cast::<u8>();
    // Back to its line's start, then line by line past its end; prefetching
    // any address is harmless, so wrapping arithmetic is enough.
    let lead = start as usize % LINE;
    let first = start.wrapping_sub(lead);
    for offset in (0..lead + size_of::<T>()).step_by(LINE) {
        kvtier_tiers::prefetch_line(first.wrapping_add(offset));
    }
}
