//! What a replay calls a page, and the walk it takes through a trace.
//!
//! A page of a sequence's own is named by (sequence, page); a page under
//! a prefix chain hash by the hash alone, so that every sequence naming
//! it names one page, as the store shares one (a shared prompt prefix
//! counts once for its bytes and once per access, whoever reads it). The
//! walk adds what the trace's records imply: a sequence's first record
//! attaches the leading pages of its chain that other sequences hold (one
//! request's use of them), and its drop frees its own pages and the chain
//! pages no sequence holds any more.

use std::collections::{HashMap, HashSet};

use kvtier_core::hash::mix64;

use crate::trace::{Event, Trace};

/// Whose a page is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum PageName {
    /// Page `page` of the trace's sequence `sequence`.
    Own { sequence: u32, page: u32 },
    /// The page under a chain hash (salted, as the trace names it).
    Chain(u64),
}

/// One page of one (stored layer, KV head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PageKey {
    pub(crate) name: PageName,
    pub(crate) layer: u32,
    pub(crate) head: u32,
}

impl PageKey {
    /// Whether a replay sampled at `rate` keeps this page (all of its
    /// accesses or none). Seeded apart from the recorder's hash, so that
    /// both samplings compose to the product of their rates.
    pub(crate) fn kept(&self, rate: f64) -> bool {
        const SEED: u64 = 0x9e37_79b9_7f4a_7c15;
        let name = match self.name {
            PageName::Own { sequence, page } => mix64(mix64(u64::from(sequence) ^ SEED) ^ u64::from(page)),
            PageName::Chain(hash) => mix64(hash ^ SEED.rotate_left(17)),
        };
        let hash = mix64(mix64(name ^ u64::from(self.layer)) ^ u64::from(self.head));
        kvtier_core::hash::keeps(hash, rate)
    }
}

/// The name of page `page` of the trace's sequence `sequence`.
fn name_of(trace: &Trace, sequence: usize, page: u32) -> PageName {
    match trace.prefixes[sequence].get(page as usize) {
        Some(&hash) => PageName::Chain(hash),
        None => PageName::Own {
            sequence: sequence as u32,
            page,
        },
    }
}

/// The pages of `e` a replay at `rate` keeps, each with the tier the
/// recording served it from.
pub(crate) fn sampled_pages(trace: &Trace, e: &Event, rate: f64) -> Vec<(PageKey, Option<char>)> {
    let layer = e.access.layer;
    e.access
        .heads
        .iter()
        .flat_map(|h| {
            let mut served = h.from.chars();
            h.pages.iter().map(move |&p| {
                let key = PageKey {
                    name: name_of(trace, e.sequence, p),
                    layer,
                    head: h.head,
                };
                (key, served.next())
            })
        })
        .filter(|(k, _)| k.kept(rate))
        .collect()
}

/// One step of the walk through a trace.
pub(crate) enum Walk<'a> {
    /// An access, after any `Attach` its sequence's first one implies,
    /// with its kept pages and the tier each was served from.
    Access(&'a Event, Vec<(PageKey, Option<char>)>),
    /// A new sequence attached these pages (of the sample), which other
    /// sequences hold.
    Attach(Vec<PageKey>),
    /// These pages (of the sample) lost their last sequence.
    Free(Vec<PageKey>),
}

/// The trace's accesses in order, with the attaches and frees they imply,
/// of the pages a replay at `rate` keeps.
pub(crate) fn walk(trace: &Trace, rate: f64) -> Vec<Walk<'_>> {
    let mut out = Vec::with_capacity(trace.events.len());
    // Sequences holding each chain hash; pages each sequence touched.
    let mut holders: HashMap<u64, u32> = HashMap::new();
    let mut started = vec![false; trace.shapes.len()];
    let mut own: Vec<HashSet<PageKey>> = vec![HashSet::new(); trace.shapes.len()];
    let mut drops = trace.drops.iter().peekable();
    // Every kept page of `hashes` in every (layer, KV head) of `sequence`.
    let chain_pages = |sequence: usize, hashes: &[u64]| -> Vec<PageKey> {
        let shape = &trace.shapes[sequence];
        let mut keys = Vec::new();
        for &hash in hashes {
            for layer in 0..shape.layers {
                for head in 0..shape.kv_heads {
                    let key = PageKey {
                        name: PageName::Chain(hash),
                        layer,
                        head,
                    };
                    if key.kept(rate) {
                        keys.push(key);
                    }
                }
            }
        }
        keys
    };
    for (i, e) in trace.events.iter().enumerate() {
        while let Some(&(_, sequence)) = drops.next_if(|&&(before, _)| before <= i) {
            let mut freed: Vec<PageKey> = std::mem::take(&mut own[sequence]).into_iter().collect();
            let mut released = Vec::new();
            if started[sequence] {
                for &hash in &trace.prefixes[sequence] {
                    let count = holders.entry(hash).or_default();
                    *count = count.saturating_sub(1);
                    if *count == 0 {
                        holders.remove(&hash);
                        released.push(hash);
                    }
                }
            }
            freed.extend(chain_pages(sequence, &released));
            out.push(Walk::Free(freed));
        }
        let s = e.sequence;
        if !started[s] {
            started[s] = true;
            let prefix = &trace.prefixes[s];
            let stored = prefix.iter().take_while(|h| holders.contains_key(h)).count();
            let attached = chain_pages(s, &prefix[..stored]);
            if !attached.is_empty() {
                out.push(Walk::Attach(attached));
            }
            for &hash in prefix {
                *holders.entry(hash).or_default() += 1;
            }
        }
        let pages = sampled_pages(trace, e, rate);
        own[s].extend(
            pages
                .iter()
                .filter(|(k, _)| matches!(k.name, PageName::Own { .. }))
                .map(|(k, _)| *k),
        );
        out.push(Walk::Access(e, pages));
    }
    out
}
