//! Which host pages migrate to NVMe first when host memory needs room.
//!
//! Recency alone lets one tenant's burst of one-off prompts push another
//! tenant's hot prompt prefix out of host memory: the prefix is used by
//! every request, but between two requests the burst writes more than the
//! tier holds, and under LRU the prefix is then the oldest. Frequency is
//! what tells them apart, counted once per request (a page attached by
//! another sequence through its prefix hash), never once per read: a
//! decode step reads every page of its sequence, which would make any
//! long request look frequent (vLLM found per-block touches broke ARC).
//!
//! [`HostPolicy::Frequency`] is S3-FIFO (Yang et al., SOSP'23) on LRU
//! queues. Every page starts in the small queue; at its turn there it
//! migrates unless it holds a second chance (another request attached
//! it), in which case it moves to the main queue. A burst of one-off pages churns
//! through the small queue alone. The main queue gives up pages only when
//! it holds more than 90% of the host's pages (or nothing else is left):
//! at its turn there a page spends a second chance (one per request beyond
//! the first, up to three) and goes back to the most recent end, and
//! migrates when it has none left, so a prefix no longer used ages out.
//! A page read back from NVMe starts in the small queue again (there is no
//! ghost queue): it returns to main when another request attaches it.
//! Chances only reorder: when the room asked for is not found without
//! them, the pages passed over go too, least recent first, so no write is
//! refused for them.

/// How host memory chooses the pages that migrate to NVMe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostPolicy {
    /// The least recently used pages that are not pinned.
    #[default]
    Lru,
    /// Least recently used first, but a page that more than one request
    /// attached gets a second chance per extra request.
    Frequency,
}

crate::named::named_choices!(HostPolicy { Lru => "lru", Frequency => "frequency" });
