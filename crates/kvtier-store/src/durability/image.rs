//! Replay: manifest records → the state a restart must recover (the
//! *image*). Pure: no tiers, no I/O; the store builds its pages from the
//! image (`recover.rs`).
//!
//! The rules that turn what the records say into lanes:
//! - a page mapped to a physical page with a recorded NVMe copy comes back
//!   with the copy's rows (its CRC is checked when it is read);
//! - a page mapped to a physical page recorded lost is gone with the
//!   recorded reason; a page recorded gone or summarised stays so;
//! - a page mapped to a physical page without a copy was only in memory:
//!   gone, `lost_on_restart`;
//! - a copy holding fewer rows than its page, on a page that is not the
//!   lane's last, is a durable prefix (rows were appended after it, none of
//!   them acknowledged durable, or a later persist would have replaced it):
//!   the lane ends there, since a lane has no holes inside a page;
//! - a lane whose last page is partial and `lost_on_restart` ends at that
//!   page's start instead, so that appends can continue the lane.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvtier_core::{Layout, Reason, SequenceKey};

use super::record::{PageAt, Record};

/// What a restart recovers.
#[derive(Debug, Default)]
pub(crate) struct Image {
    /// No page id below this was ever given out.
    pub(crate) next_page_id: u64,
    /// In the order they were created.
    pub(crate) sequences: Vec<SequenceImage>,
    /// The NVMe copy of every physical page some page of `sequences` maps.
    pub(crate) copies: HashMap<u64, CopyImage>,
}

#[derive(Debug)]
pub(crate) struct SequenceImage {
    pub(crate) key: SequenceKey,
    pub(crate) layout: Arc<Layout>,
    pub(crate) hashes: Vec<Arc<[u8]>>,
    /// One per lane of the layout, each page with its rows (all but the
    /// last page of a lane are full).
    pub(crate) lanes: Vec<Vec<PageImage>>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PageImage {
    pub(crate) rows: u32,
    /// `2 · row_bytes` (min row then max row), zeros when unknown.
    pub(crate) digest: Vec<u8>,
    pub(crate) kind: PageKind,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PageKind {
    /// The bytes are in physical page `phys`'s NVMe copy.
    Copy {
        phys: u64,
    },
    Summary {
        reason: Reason,
        counts: Vec<u32>,
        kv: Vec<u8>,
    },
    Gone(Reason),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CopyImage {
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) crc: u32,
    pub(crate) rows: u32,
    pub(crate) digest: Vec<u8>,
}

/// A logical page as the records left it.
#[derive(Debug)]
enum Entry {
    Mapped {
        phys: u64,
        rows: u32,
        digest: Vec<u8>,
    },
    Gone {
        rows: u32,
        reason: Reason,
        digest: Vec<u8>,
    },
    Summary {
        rows: u32,
        reason: Reason,
        digest: Vec<u8>,
        counts: Vec<u32>,
        kv: Vec<u8>,
    },
}

#[derive(Debug)]
struct Replayed {
    layout: Arc<Layout>,
    hashes: Vec<Arc<[u8]>>,
    pages: BTreeMap<(u32, u32), Entry>,
}

/// Applies `records` in order and resolves them into an image.
pub(crate) fn replay(records: Vec<Record>) -> Image {
    let mut seqs: HashMap<SequenceKey, Replayed> = HashMap::new();
    let mut order: Vec<SequenceKey> = Vec::new();
    let mut copies: HashMap<u64, CopyImage> = HashMap::new();
    let mut lost: HashMap<u64, Reason> = HashMap::new();
    let mut next_page_id = 0u64;
    for record in records {
        match record {
            Record::Header { .. } => {}
            Record::Ids { next } => next_page_id = next_page_id.max(next),
            Record::Sequence { key, layout, hashes } => {
                order.retain(|k| *k != key);
                order.push(key.clone());
                let replayed = Replayed {
                    layout: Arc::new(layout),
                    hashes: hashes.into_iter().map(Arc::from).collect(),
                    pages: BTreeMap::new(),
                };
                seqs.insert(key, replayed);
            }
            Record::Drop { key } => {
                seqs.remove(&key);
            }
            Record::Map { at, phys, digest } => {
                next_page_id = next_page_id.max(phys.saturating_add(1));
                let rows = at.rows;
                set_page(&mut seqs, at, Entry::Mapped { phys, rows, digest });
            }
            Record::Gone { at, reason, digest } => {
                let rows = at.rows;
                set_page(&mut seqs, at, Entry::Gone { rows, reason, digest });
            }
            Record::Summary {
                at,
                reason,
                digest,
                counts,
                kv,
            } => {
                let rows = at.rows;
                let entry = Entry::Summary {
                    rows,
                    reason,
                    digest,
                    counts,
                    kv,
                };
                set_page(&mut seqs, at, entry);
            }
            Record::Persist {
                phys,
                offset,
                len,
                crc,
                rows,
                digest,
            } => {
                next_page_id = next_page_id.max(phys.saturating_add(1));
                if !lost.contains_key(&phys) {
                    copies.insert(
                        phys,
                        CopyImage {
                            offset,
                            len,
                            crc,
                            rows,
                            digest,
                        },
                    );
                }
            }
            Record::Unpersist { phys } => {
                copies.remove(&phys);
            }
            Record::Lost { phys, reason } => {
                copies.remove(&phys);
                lost.insert(phys, reason);
            }
        }
    }
    let mut image = Image {
        next_page_id,
        ..Image::default()
    };
    for key in order {
        let Some(replayed) = seqs.remove(&key) else { continue };
        let lanes = resolve_lanes(&key, &replayed, &copies, &lost);
        for page in lanes.iter().flatten() {
            if let PageKind::Copy { phys } = page.kind {
                image.copies.insert(phys, copies[&phys].clone());
            }
        }
        image.sequences.push(SequenceImage {
            key,
            layout: replayed.layout,
            hashes: replayed.hashes,
            lanes,
        });
    }
    image
}

fn set_page(seqs: &mut HashMap<SequenceKey, Replayed>, at: PageAt, entry: Entry) {
    if let Some(s) = seqs.get_mut(&at.key) {
        s.pages.insert((at.lane, at.page), entry);
    }
}

fn resolve_lanes(
    key: &SequenceKey,
    replayed: &Replayed,
    copies: &HashMap<u64, CopyImage>,
    lost: &HashMap<u64, Reason>,
) -> Vec<Vec<PageImage>> {
    let layout = &replayed.layout;
    let (page_size, entry_bytes) = (layout.page_size(), 2 * layout.row_bytes());
    let digest = |d: &Vec<u8>| {
        if d.len() == entry_bytes {
            d.clone()
        } else {
            vec![0; entry_bytes]
        }
    };
    let mut lanes: Vec<Vec<PageImage>> = vec![Vec::new(); layout.num_lanes()];
    let mut by_lane: BTreeMap<u32, Vec<(u32, &Entry)>> = BTreeMap::new();
    for ((lane, page), entry) in &replayed.pages {
        by_lane.entry(*lane).or_default().push((*page, entry));
    }
    for (lane, entries) in by_lane {
        let Some(out) = lanes.get_mut(lane as usize) else {
            tracing::warn!(sequence = %key, lane, "manifest names a lane beyond the layout; ignored");
            continue;
        };
        let last = entries.last().map_or(0, |(p, _)| *p);
        let entries: BTreeMap<u32, &Entry> = entries.into_iter().collect();
        for p in 0..=last {
            // Every page but the last was full.
            let rows = |r: u32| if p < last { page_size } else { r.clamp(1, page_size) };
            let page = match entries.get(&p) {
                // Never recorded: in memory only.
                None => PageImage {
                    rows: page_size,
                    digest: vec![0; entry_bytes],
                    kind: PageKind::Gone(Reason::LostOnRestart),
                },
                Some(Entry::Gone {
                    rows: r,
                    reason,
                    digest: d,
                }) => PageImage {
                    rows: rows(*r),
                    digest: digest(d),
                    kind: PageKind::Gone(*reason),
                },
                Some(Entry::Summary {
                    rows: r,
                    reason,
                    digest: d,
                    counts,
                    kv,
                }) => PageImage {
                    rows: rows(*r),
                    digest: digest(d),
                    kind: PageKind::Summary {
                        reason: *reason,
                        counts: counts.clone(),
                        kv: kv.clone(),
                    },
                },
                Some(Entry::Mapped {
                    phys,
                    rows: r,
                    digest: d,
                }) => match (lost.get(phys), copies.get(phys)) {
                    (Some(reason), _) => PageImage {
                        rows: rows(*r),
                        digest: digest(d),
                        kind: PageKind::Gone(*reason),
                    },
                    (None, Some(copy)) => {
                        let prefix = p < last && copy.rows < page_size;
                        out.push(PageImage {
                            rows: if prefix { copy.rows.max(1) } else { rows(copy.rows) },
                            digest: digest(if copy.digest.len() == entry_bytes {
                                &copy.digest
                            } else {
                                d
                            }),
                            kind: PageKind::Copy { phys: *phys },
                        });
                        if prefix {
                            tracing::info!(sequence = %key, lane, page = p, rows = copy.rows, "lane recovered up to a partially durable page");
                            break;
                        }
                        continue;
                    }
                    (None, None) => PageImage {
                        rows: rows(*r),
                        digest: digest(d),
                        kind: PageKind::Gone(Reason::LostOnRestart),
                    },
                },
            };
            out.push(page);
        }
        if out
            .last()
            .is_some_and(|p| p.rows < page_size && p.kind == PageKind::Gone(Reason::LostOnRestart))
        {
            out.pop();
        }
    }
    lanes
}

#[cfg(test)]
mod tests {
    use kvtier_core::{DType, LayoutSpec};

    use super::*;

    const PAGE: u32 = 4;

    fn key(s: &str) -> SequenceKey {
        SequenceKey::parse("t", s).unwrap()
    }

    fn sequence(name: &str) -> Record {
        let layout = Layout::new(LayoutSpec {
            num_layers: 1,
            num_kv_heads: 1,
            num_query_heads: 1,
            head_dim: 2,
            dtype: DType::F32,
            page_size: PAGE,
            layer_groups: vec![],
        })
        .unwrap();
        Record::Sequence {
            key: key(name),
            layout,
            hashes: vec![],
        }
    }

    fn at(name: &str, page: u32, rows: u32) -> PageAt {
        PageAt {
            key: key(name),
            lane: 0,
            page,
            rows,
        }
    }

    fn map(name: &str, page: u32, phys: u64, rows: u32) -> Record {
        Record::Map {
            at: at(name, page, rows),
            phys,
            digest: vec![],
        }
    }

    fn persist(phys: u64, rows: u32) -> Record {
        Record::Persist {
            phys,
            offset: phys * 4096,
            len: 4096,
            crc: 0,
            rows,
            digest: vec![],
        }
    }

    /// (rows, kind) of lane 0 of the only sequence.
    fn lane(records: Vec<Record>) -> Vec<(u32, PageKind)> {
        let image = replay(records);
        image.sequences[0].lanes[0]
            .iter()
            .map(|p| (p.rows, p.kind.clone()))
            .collect()
    }

    fn copy(phys: u64) -> PageKind {
        PageKind::Copy { phys }
    }

    #[test]
    fn ids_are_never_given_again_even_when_no_page_names_them_any_more() {
        let image = replay(vec![
            Record::Ids { next: 100 },
            sequence("a"),
            map("a", 0, 7, 4),
            Record::Drop { key: key("a") },
        ]);
        assert_eq!(image.next_page_id, 100);
        let image = replay(vec![sequence("a"), map("a", 0, 700, 4), persist(900, 4)]);
        assert_eq!(image.next_page_id, 901);
    }

    #[test]
    fn copies_gone_pages_summaries_and_lost_pages() {
        let gone = Record::Gone {
            at: at("a", 1, 4),
            reason: Reason::Explicit,
            digest: vec![],
        };
        let summary = Record::Summary {
            at: at("a", 2, 4),
            reason: Reason::Policy,
            digest: vec![],
            counts: vec![4],
            kv: vec![1; 16],
        };
        let pages = lane(vec![
            sequence("a"),
            map("a", 0, 1, 4),
            persist(1, 4),
            map("a", 1, 2, 4),
            persist(2, 4),
            gone,
            map("a", 2, 3, 4),
            summary,
            map("a", 3, 4, 4),
            persist(4, 4),
            Record::Lost {
                phys: 4,
                reason: Reason::Integrity,
            },
            map("a", 4, 5, 4),
            map("a", 5, 6, 2),
            persist(6, 2),
        ]);
        assert_eq!(
            pages,
            [
                (4, copy(1)),
                (4, PageKind::Gone(Reason::Explicit)),
                (
                    4,
                    PageKind::Summary {
                        reason: Reason::Policy,
                        counts: vec![4],
                        kv: vec![1; 16]
                    }
                ),
                (4, PageKind::Gone(Reason::Integrity)),
                (4, PageKind::Gone(Reason::LostOnRestart)),
                (2, copy(6)),
            ]
        );
    }

    #[test]
    fn a_durable_prefix_ends_the_lane_and_a_lost_partial_tail_is_cut() {
        // Page 0's copy holds 3 rows; rows were appended in memory since.
        let pages = lane(vec![
            sequence("a"),
            map("a", 0, 1, 3),
            persist(1, 3),
            map("a", 1, 2, 2),
            persist(2, 4),
        ]);
        assert_eq!(pages, [(3, copy(1))]);
        // The last page was only in memory and partial: the lane ends before it.
        let pages = lane(vec![
            sequence("a"),
            map("a", 0, 1, 4),
            persist(1, 4),
            map("a", 1, 2, 4),
            map("a", 2, 3, 1),
        ]);
        assert_eq!(pages, [(4, copy(1)), (4, PageKind::Gone(Reason::LostOnRestart))]);
    }

    #[test]
    fn a_sequence_created_again_starts_empty_and_its_old_copies_are_not_used() {
        let image = replay(vec![
            sequence("a"),
            map("a", 0, 1, 4),
            persist(1, 4),
            Record::Drop { key: key("a") },
            sequence("a"),
            map("a", 0, 2, 4),
        ]);
        let pages: Vec<_> = image.sequences[0].lanes[0].iter().map(|p| p.kind.clone()).collect();
        assert_eq!(pages, [PageKind::Gone(Reason::LostOnRestart)]);
        assert!(image.copies.is_empty());
    }
}
