//! What a replay calls a page, and the walk it takes through a trace.
//!
//! A page of a sequence's own is named by (sequence, page); a page under
//! a prefix chain hash by the hash alone, so that every sequence naming
//! it names one page, as the store shares one (a shared prompt prefix
//! counts once for its bytes and once per access, whoever reads it). The
//! walk adds what the trace's records imply: a sequence's first record
//! attaches the leading pages of its chain that are stored (one request's
//! use of them), and its drop frees its own pages and the chain pages no
//! sequence holds any more. A chain page read before any recorded write
//! of it was stored before the recording began, by a sequence the trace
//! never saw: stored from the start and never freed.

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

/// Every page name of `e`, sampled or not.
fn names<'a>(trace: &'a Trace, e: &'a Event) -> impl Iterator<Item = PageName> + 'a {
    e.access
        .heads
        .iter()
        .flat_map(move |h| h.pages.iter().map(move |&p| name_of(trace, e.sequence, p)))
}

/// The chain hashes whose first access in the trace is a read: stored
/// before the recording began.
fn stored_before(trace: &Trace) -> HashSet<u64> {
    let mut seen = HashSet::new();
    let mut before = HashSet::new();
    for e in &trace.events {
        for name in names(trace, e) {
            if let PageName::Chain(hash) = name
                && seen.insert(hash)
                && !e.write
            {
                before.insert(hash);
            }
        }
    }
    before
}

/// The trace's accesses in order, with the attaches and frees they imply,
/// of the pages a replay at `rate` keeps.
pub(crate) fn walk(trace: &Trace, rate: f64) -> Vec<Walk<'_>> {
    let mut out = Vec::with_capacity(trace.events.len());
    // Chain hashes with pages stored, and how many sequences hold each
    // (one more, never released, for those stored before the recording);
    // the pages each sequence touched of its own.
    let mut stored = stored_before(trace);
    let mut holders: HashMap<u64, u32> = stored.iter().map(|&hash| (hash, 1)).collect();
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
            if std::mem::take(&mut started[sequence]) {
                for &hash in &trace.prefixes[sequence] {
                    let count = holders.entry(hash).or_default();
                    *count = count.saturating_sub(1);
                    if *count == 0 {
                        holders.remove(&hash);
                        stored.remove(&hash);
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
            // The store attaches the leading pages stored under the chain.
            let attached = prefix.iter().take_while(|h| stored.contains(h)).count();
            let attached = chain_pages(s, &prefix[..attached]);
            if !attached.is_empty() {
                out.push(Walk::Attach(attached));
            }
            for &hash in prefix {
                *holders.entry(hash).or_default() += 1;
            }
        }
        if e.write {
            stored.extend(names(trace, e).filter_map(|name| match name {
                PageName::Chain(hash) => Some(hash),
                PageName::Own { .. } => None,
            }));
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

#[cfg(test)]
pub(crate) mod tests {
    use kvtier_store::{Access, HeadPages, TRACE_FORMAT, TraceHeader};

    use super::*;
    use crate::shape::Shape;

    const SHARED: [u64; 2] = [0xa1, 0xa2];

    /// Sequences of one layer and one KV head, each with `prefixes`' chain,
    /// and `events` as (sequence, write, pages), 30 ms apart (more than a
    /// background tick); `drops` as in [`Trace`].
    pub(crate) fn trace(prefixes: &[&[u64]], events: &[(usize, bool, &[u32])], drops: &[(usize, usize)]) -> Trace {
        let events = events
            .iter()
            .enumerate()
            .map(|(i, &(sequence, write, pages))| Event {
                sequence,
                write,
                access: Access {
                    t_us: i as u64 * 30_000,
                    seq: sequence as u64,
                    layer: 0,
                    step: 0,
                    heads: vec![HeadPages {
                        head: 0,
                        pages: pages.to_vec(),
                        from: String::new(),
                    }],
                    hot: false,
                    us: 0,
                    swap: None,
                },
            })
            .collect();
        Trace {
            header: TraceHeader {
                kvtier_trace: TRACE_FORMAT,
                source: "test".into(),
                sample: 1.0,
                working_set_bytes: None,
                device: None,
            },
            shapes: vec![Shape::custom([1, 1, 1, 64], "f16", 16).unwrap(); prefixes.len()],
            prefixes: prefixes.iter().map(|p| p.to_vec()).collect(),
            drops: drops.to_vec(),
            events,
            ended: None,
        }
    }

    fn chain(hash: u64) -> PageKey {
        PageKey {
            name: PageName::Chain(hash),
            layer: 0,
            head: 0,
        }
    }

    fn own(sequence: u32, page: u32) -> PageKey {
        PageKey {
            name: PageName::Own { sequence, page },
            layer: 0,
            head: 0,
        }
    }

    /// The walk's steps as (kind, sorted keys); an access by its pages.
    fn steps(trace: &Trace) -> Vec<(&'static str, Vec<PageKey>)> {
        let sorted = |mut keys: Vec<PageKey>| {
            keys.sort_by_key(|k| format!("{k:?}"));
            keys
        };
        walk(trace, 1.0)
            .into_iter()
            .map(|w| match w {
                Walk::Access(_, pages) => ("access", sorted(pages.into_iter().map(|(k, _)| k).collect())),
                Walk::Attach(keys) => ("attach", sorted(keys)),
                Walk::Free(keys) => ("free", sorted(keys)),
            })
            .collect()
    }

    #[test]
    fn sequences_sharing_a_chain_name_one_page_and_the_last_drop_frees_it() {
        let t = trace(
            &[&SHARED, &SHARED, &[]],
            &[
                (0, true, &[0, 1, 2]),
                (1, false, &[0, 1, 2]),
                (1, true, &[2]),
                (2, true, &[0]),
            ],
            &[(3, 0), (3, 1)],
        );
        assert_eq!(
            steps(&t),
            vec![
                ("access", vec![chain(0xa1), chain(0xa2), own(0, 2)]),
                ("attach", vec![chain(0xa1), chain(0xa2)]),
                ("access", vec![chain(0xa1), chain(0xa2), own(1, 2)]),
                ("access", vec![own(1, 2)]),
                // The first drop frees its own page only: the other
                // sequence still holds the chain.
                ("free", vec![own(0, 2)]),
                ("free", vec![chain(0xa1), chain(0xa2), own(1, 2)]),
                ("access", vec![own(2, 0)]),
            ]
        );
    }

    #[test]
    fn a_chain_is_attached_only_once_its_pages_are_written() {
        let t = trace(
            &[&SHARED, &SHARED, &SHARED],
            &[(0, true, &[2]), (1, true, &[0, 1]), (2, false, &[0])],
            &[],
        );
        assert_eq!(
            steps(&t),
            vec![
                // Sequence 0 holds the chain but has written none of it.
                ("access", vec![own(0, 2)]),
                ("access", vec![chain(0xa1), chain(0xa2)]),
                ("attach", vec![chain(0xa1), chain(0xa2)]),
                ("access", vec![chain(0xa1)]),
            ]
        );
    }

    #[test]
    fn a_chain_read_before_any_write_was_stored_before_and_is_never_freed() {
        let t = trace(
            &[&SHARED[..1], &SHARED[..1], &[]],
            &[(0, false, &[0]), (1, false, &[0]), (2, true, &[0])],
            &[(1, 0), (2, 1)],
        );
        assert_eq!(
            steps(&t),
            vec![
                ("attach", vec![chain(0xa1)]),
                ("access", vec![chain(0xa1)]),
                ("free", vec![]),
                ("attach", vec![chain(0xa1)]),
                ("access", vec![chain(0xa1)]),
                ("free", vec![]),
                ("access", vec![own(2, 0)]),
            ]
        );
    }
}
