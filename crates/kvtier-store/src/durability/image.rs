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

use kvtier_core::{Layout, PageIndex, Reason, SequenceKey};

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
    /// The page's index entry for its rows (`PageIndex::entry`: min row,
    /// max row, a sketch row per token), zeros when unknown.
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
struct Entry {
    rows: u32,
    digest: Vec<u8>,
    kind: EntryKind,
}

#[derive(Debug)]
enum EntryKind {
    Mapped(u64),
    Gone(Reason),
    Summary {
        reason: Reason,
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

/// The records applied so far.
#[derive(Debug, Default)]
struct Replay {
    seqs: HashMap<SequenceKey, Replayed>,
    /// Sequences in the order they were (last) created.
    order: Vec<SequenceKey>,
    copies: HashMap<u64, CopyImage>,
    lost: HashMap<u64, Reason>,
    next_page_id: u64,
}

/// Applies `records` in order and resolves them into an image.
pub(crate) fn replay(records: Vec<Record>) -> Image {
    let mut replay = Replay::default();
    for record in records {
        replay.apply(record);
    }
    replay.into_image()
}

impl Replay {
    fn apply(&mut self, record: Record) {
        match record {
            Record::Header { .. } => {}
            Record::Ids { next } => self.next_page_id = self.next_page_id.max(next),
            Record::Sequence { key, layout, hashes } => {
                self.order.retain(|k| *k != key);
                self.order.push(key.clone());
                let replayed = Replayed {
                    layout: Arc::new(layout),
                    hashes: hashes.into_iter().map(Arc::from).collect(),
                    pages: BTreeMap::new(),
                };
                self.seqs.insert(key, replayed);
            }
            Record::Drop { key } => {
                self.seqs.remove(&key);
            }
            Record::Map { at, phys, digest } => {
                self.next_page_id = self.next_page_id.max(phys.saturating_add(1));
                self.set(at, digest, EntryKind::Mapped(phys));
            }
            Record::Gone { at, reason, digest } => self.set(at, digest, EntryKind::Gone(reason)),
            Record::Summary {
                at,
                reason,
                digest,
                counts,
                kv,
            } => self.set(at, digest, EntryKind::Summary { reason, counts, kv }),
            Record::Persist {
                phys,
                offset,
                len,
                crc,
                rows,
                digest,
            } => {
                self.next_page_id = self.next_page_id.max(phys.saturating_add(1));
                if !self.lost.contains_key(&phys) {
                    let copy = CopyImage {
                        offset,
                        len,
                        crc,
                        rows,
                        digest,
                    };
                    self.copies.insert(phys, copy);
                }
            }
            Record::Unpersist { phys } => {
                self.copies.remove(&phys);
            }
            Record::Lost { phys, reason } => {
                self.copies.remove(&phys);
                self.lost.insert(phys, reason);
            }
        }
    }

    fn set(&mut self, at: PageAt, digest: Vec<u8>, kind: EntryKind) {
        if let Some(s) = self.seqs.get_mut(&at.key) {
            let entry = Entry {
                rows: at.rows,
                digest,
                kind,
            };
            s.pages.insert((at.lane, at.page), entry);
        }
    }

    fn into_image(mut self) -> Image {
        let mut image = Image {
            next_page_id: self.next_page_id,
            ..Image::default()
        };
        for key in std::mem::take(&mut self.order) {
            let Some(replayed) = self.seqs.remove(&key) else {
                continue;
            };
            let lanes = self.resolve_lanes(&key, &replayed);
            for page in lanes.iter().flatten() {
                if let PageKind::Copy { phys } = page.kind {
                    image.copies.insert(phys, self.copies[&phys].clone());
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

    /// Every lane of a replayed sequence, as a restart must recover it.
    fn resolve_lanes(&self, key: &SequenceKey, replayed: &Replayed) -> Vec<Vec<PageImage>> {
        let layout = &replayed.layout;
        let mut lanes: Vec<Vec<PageImage>> = vec![Vec::new(); layout.num_lanes()];
        let mut by_lane: BTreeMap<u32, BTreeMap<u32, &Entry>> = BTreeMap::new();
        for ((lane, page), entry) in &replayed.pages {
            by_lane.entry(*lane).or_default().insert(*page, entry);
        }
        for (lane, entries) in by_lane {
            let Some(out) = lanes.get_mut(lane as usize) else {
                tracing::warn!(sequence = %key, lane, "manifest names a lane beyond the layout; ignored");
                continue;
            };
            let last = entries.keys().next_back().copied().unwrap_or(0);
            for p in 0..=last {
                let (page, ends_lane) = self.resolve_page(layout, entries.get(&p).copied(), p < last);
                out.push(page);
                if ends_lane {
                    tracing::info!(sequence = %key, lane, page = p, "lane recovered up to a partially durable page");
                    break;
                }
            }
            if out
                .last()
                .is_some_and(|p| p.rows < layout.page_size() && p.kind == PageKind::Gone(Reason::LostOnRestart))
            {
                out.pop();
            }
        }
        lanes
    }

    /// One page (`inner`: not its lane's last), and whether the lane ends
    /// with it (a durable prefix).
    fn resolve_page(&self, layout: &Layout, entry: Option<&Entry>, inner: bool) -> (PageImage, bool) {
        let page_size = layout.page_size();
        let entry_len = |rows: u32| PageIndex::entry_len(layout.dtype(), layout.head_dim() as usize, rows);
        // A recorded index entry for exactly `rows` rows (or its digest
        // alone: sketches spilled, derived again from the page's keys), or
        // zeros.
        let digest_only = 2 * layout.head_dim() as usize * layout.dtype().size();
        let digest = |d: &Vec<u8>, rows: u32| {
            if d.len() == entry_len(rows) || d.len() == digest_only {
                d.clone()
            } else {
                vec![0; entry_len(rows)]
            }
        };
        // Every page but the last was full.
        let rows = |r: u32| if inner { page_size } else { r.clamp(1, page_size) };
        let Some(entry) = entry else {
            // Never recorded: in memory only.
            let kind = PageKind::Gone(Reason::LostOnRestart);
            let page = PageImage {
                rows: page_size,
                digest: vec![0; entry_len(page_size)],
                kind,
            };
            return (page, false);
        };
        let kind = match &entry.kind {
            EntryKind::Gone(reason) => PageKind::Gone(*reason),
            EntryKind::Summary { reason, counts, kv } => PageKind::Summary {
                reason: *reason,
                counts: counts.clone(),
                kv: kv.clone(),
            },
            EntryKind::Mapped(phys) => match (self.lost.get(phys), self.copies.get(phys)) {
                (Some(reason), _) => PageKind::Gone(*reason),
                (None, None) => PageKind::Gone(Reason::LostOnRestart),
                (None, Some(copy)) => {
                    let prefix = inner && copy.rows < page_size;
                    let rows = if prefix { copy.rows.max(1) } else { rows(copy.rows) };
                    // The fuller of the two records: a snapshot taken while the
                    // sketches were spilled holds the digest alone.
                    let recorded = if copy.digest.len() == entry_len(rows) || entry.digest.len() != entry_len(rows) {
                        &copy.digest
                    } else {
                        &entry.digest
                    };
                    let page = PageImage {
                        rows,
                        digest: digest(recorded, rows),
                        kind: PageKind::Copy { phys: *phys },
                    };
                    return (page, prefix);
                }
            },
        };
        let rows = rows(entry.rows);
        let page = PageImage {
            rows,
            digest: digest(&entry.digest, rows),
            kind,
        };
        (page, false)
    }
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
