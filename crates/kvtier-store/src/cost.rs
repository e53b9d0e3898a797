//! What each kind of metadata costs, in bytes: the sizes of the structures
//! themselves plus a fixed allowance per allocation for what the allocator
//! and the maps add (an estimate, stated with each constant).

use std::mem::size_of;

use kvtier_core::policy::TokenStats;
use kvtier_core::{Layout, PageIndex, SequenceKey};

use crate::catalog::Sequence;
use crate::page::{PhysPage, StoreLane, StorePage};

/// Per physical page beyond the struct: its `Arc`, its entry in the page
/// table and in one LRU (a hash-map slot and a list node each).
const PHYSICAL_PAGE_EXTRA: u64 = 16 + 64 + 64;

/// Per sequence beyond the struct: its cell, lock and entry in the map.
const SEQUENCE_EXTRA: u64 = 128;

/// Per prefix hash beyond its bytes: the `Arc` header and the pointer.
const HASH_EXTRA: u64 = 32;
/// A sequence with no pages: its struct, key, prefix hashes and lanes.
pub(crate) fn sequence(key: &SequenceKey, layout: &Layout, hashes: &[impl AsRef<[u8]>]) -> u64 {
    let lanes = (layout.num_lanes() * (size_of::<StoreLane>() + size_of::<usize>())) as u64;
    let hashes: u64 = hashes.iter().map(|h| h.as_ref().len() as u64 + HASH_EXTRA).sum();
    let key = (key.tenant.as_str().len() + key.sequence.as_str().len()) as u64;
    size_of::<Sequence>() as u64 + SEQUENCE_EXTRA + key + hashes + lanes
}

/// `logical` new pages in the lanes' tables (entry and index: digest and
/// sketches), of which `physical` are new physical pages (`shareable`: with
/// the index entry a shared page carries).
pub(crate) fn pages(layout: &Layout, logical: u64, physical: u64, shareable: bool) -> u64 {
    let index = PageIndex::entry_len(layout.dtype(), layout.head_dim() as usize, layout.page_size());
    let entry = (size_of::<StorePage>() + index) as u64;
    logical * entry + physical * physical_page(layout, shareable)
}

/// One physical page: its struct, its `Arc`, its page-table and LRU
/// entries, and, if it may be shared, the index entry it carries for the
/// sequences that attach it (charged to the page itself, see
/// `accounts::PageCharge`).
pub(crate) fn physical_page(layout: &Layout, shareable: bool) -> u64 {
    let entry = match shareable {
        true => PageIndex::entry_len(layout.dtype(), layout.head_dim() as usize, layout.page_size()),
        false => 0,
    };
    (size_of::<PhysPage>() + entry) as u64 + PHYSICAL_PAGE_EXTRA
}

/// Policy statistics of `lanes` lanes growing by `tokens` positions
/// each (`new`: the lanes get their statistics now).
pub(crate) fn attention(stats: &TokenStats, lanes: u64, tokens: u64, new: bool) -> u64 {
    let base = if new { size_of::<TokenStats>() as u64 } else { 0 };
    lanes * (base + tokens * stats.bytes_per_token() as u64)
}

/// A summary's row counts.
pub(crate) fn summary(rows: u64) -> u64 {
    rows * size_of::<u32>() as u64
}
