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

/// Starts loading the cache line holding `value`.
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    kvtier_tiers::prefetch_line(std::ptr::from_ref(value).cast::<u8>());
}
