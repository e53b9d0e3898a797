//! Sketches of NVMe-cold pages leave memory (docs/CONCEPTS.md §3.1): the
//! sweep spills whole chunks of NVMe-only pages, and every ranking, every
//! page that goes, every checkpoint, restart and move sees the index as
//! if they had stayed. A twin sequence with the same keys, kept in memory,
//! is the model: both must always rank alike.

mod common;

use std::path::Path;
use std::sync::Arc;

use kvtier_core::rank::{Mode, Ranking};
use kvtier_core::select::{Aggregation, Budget};
use kvtier_core::sketch_column::SKETCH_CHUNK_PAGES;
use kvtier_core::{Action, ColdTier, DType, Layout, LayoutSpec, Reason, SequenceKey};
use kvtier_store::{HeadRange, IndexMemory, PageSelection, PutPages, SelectPages, SetPageState, Store, StoreConfig};

const PAGE: usize = 4;
const DIM: usize = 16;
const HEADS: u32 = 2;
/// Three full chunks and a partial one per lane, its last page partial.
const PAGES: usize = 3 * SKETCH_CHUNK_PAGES + 9;
const TOKENS: usize = PAGES * PAGE - 1;

fn layout() -> Layout {
    Layout::new(LayoutSpec {
        num_layers: 1,
        num_kv_heads: HEADS,
        num_query_heads: 2 * HEADS,
        head_dim: DIM as u32,
        dtype: DType::F16,
        page_size: PAGE as u32,
        layer_groups: vec![],
    })
    .unwrap()
}

fn open(dir: &Path) -> Arc<Store> {
    open_with(dir, true)
}

fn open_with(dir: &Path, spill_sketches: bool) -> Arc<Store> {
    Store::new(StoreConfig {
        spill_sketches,
        device_bytes: 1 << 20,
        host_bytes: 64 << 20,
        nvme: common::nvme(dir, 64 << 20, true),
        ..StoreConfig::default()
    })
    .unwrap()
}

fn key(s: &str) -> SequenceKey {
    SequenceKey::parse("t", s).unwrap()
}

fn heads() -> HeadRange {
    HeadRange { start: 0, count: HEADS }
}

/// Keys with a few heavy tokens, so that the sketch modes choose
/// differently from Quest; values a function of the position.
fn kv() -> Vec<u8> {
    let mut values = Vec::new();
    for h in 0..HEADS as usize {
        for part in 0..2 {
            for t in 0..TOKENS {
                for i in 0..DIM {
                    let x = ((t * 31 + i * 7 + h * 13 + part) % 17) as f32 / 4.0 - 2.0;
                    let heavy = if part == 0 && t % 37 == 5 { 3.0 } else { 1.0 };
                    values.push(x * heavy);
                }
            }
        }
    }
    DType::F16.encode(&values)
}

fn create(store: &Store, seq: &str) {
    store.create_sequence(key(seq), layout(), vec![]).unwrap();
    let req = PutPages {
        layer: 0,
        heads: heads(),
        first_page: 0,
        num_tokens: TOKENS as u32,
        kv: &kv(),
        persist: true,
    };
    store.put_pages(&key(seq), req).unwrap();
}

fn set_state(store: &Store, seq: &str, pages: PageSelection<'_>, action: Action) {
    let req = SetPageState {
        layer_start: 0,
        layer_count: 1,
        heads: heads(),
        pages,
        action,
        summary_rows: 1,
        reason: Reason::Explicit,
    };
    store.set_page_state(&key(seq), req).unwrap();
}

/// Every mode's choice and scores, for two queries and each aggregation.
fn rankings(store: &Arc<Store>, seq: &str) -> Vec<(Vec<u32>, Vec<f32>)> {
    let mut out = Vec::new();
    for salt in 0..2 {
        let queries: Vec<f32> = (0..2 * HEADS as usize * DIM)
            .map(|i| ((i * 5 + salt * 3) % 9) as f32 - 4.0)
            .collect();
        for mode in Mode::ALL {
            for aggregation in [Aggregation::Max, Aggregation::Mean, Aggregation::PerQueryHead] {
                let budget = Budget {
                    pages: 24,
                    sinks: 1,
                    window: 2,
                };
                let req = SelectPages {
                    ranking: Ranking::new(mode),
                    aggregation: Some(aggregation),
                    ..SelectPages::new(0, heads(), &queries, budget)
                };
                let selection = store.select_pages(&key(seq), req).unwrap();
                out.extend(selection.heads.into_iter().map(|h| {
                    (
                        h.pages.iter().map(|p| p.page).collect(),
                        h.pages.iter().map(|p| p.bound).collect(),
                    )
                }));
            }
        }
    }
    out
}

/// In both sequences: evicts pages `(first, count)` and summarises others.
fn evict_and_summarize(store: &Store, (first, count): (u32, u32), summarized: (u32, u32)) {
    for seq in ["spilled", "model"] {
        set_state(store, seq, PageSelection::Range { first, count }, Action::Evict);
        let (first, count) = summarized;
        set_state(store, seq, PageSelection::Range { first, count }, Action::Summarize);
    }
}

fn offload(store: &Store, seq: &str) {
    set_state(
        store,
        seq,
        PageSelection::Range {
            first: 0,
            count: PAGES as u32,
        },
        Action::Offload(ColdTier::Nvme),
    );
}

#[test]
fn spilled_sketches_rank_go_restart_and_come_back_as_resident_ones() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    create(&store, "spilled");
    create(&store, "model");
    let resident = store.index_memory();
    assert_eq!(resident.spilled_pages, 0);
    assert_eq!(rankings(&store, "spilled"), rankings(&store, "model"));

    // Only "spilled" goes to NVMe: its chunks leave memory, the model's stay.
    offload(&store, "spilled");
    // (The background sweeps too, about once a second: what is checked is
    // the state a sweep leaves, not which sweep did it.) The chunk holding
    // the partial last page stays: that page still grows.
    store.sweep_sketches();
    let after = store.index_memory();
    assert_eq!(after.spilled_pages, 2 * 3 * SKETCH_CHUNK_PAGES as u64);
    let chunk_bytes = (SKETCH_CHUNK_PAGES * PAGE * kvtier_core::sketch::row_bytes(DIM)) as u64;
    assert!(
        after.sketch_bytes + 2 * 3 * chunk_bytes <= resident.sketch_bytes,
        "six chunks' memory given back: {after:?} against {resident:?}"
    );
    assert_eq!(store.sweep_sketches(), (0, 0), "a second sweep finds nothing new");
    assert_eq!(rankings(&store, "spilled"), rankings(&store, "model"));

    // Pages that go keep their index: evicted and summarised ones too.
    // (These writes also give back, first, the sketches the rankings
    // above read: `sketch` and `cuboid` read every spilled page.)
    evict_and_summarize(&store, (70, 3), (150, 2));
    let read_back = store.index_memory();
    assert!(
        read_back.spilled_pages + 2 * 5 < after.spilled_pages,
        "sketches read to rank are back: {read_back:?} against {after:?}"
    );
    assert_eq!(rankings(&store, "spilled"), rankings(&store, "model"));
    let want = rankings(&store, "model");

    // A checkpoint taken while spilled, then restarts: every page comes
    // back NVMe-cold, the model's too.
    store.checkpoint();
    drop(store);
    for _ in 0..2 {
        let store = open(dir.path());
        assert_eq!(rankings(&store, "spilled"), want);
        assert_eq!(rankings(&store, "model"), want);
        store.sweep_sketches();
        assert_eq!(rankings(&store, "spilled"), want);
        store.checkpoint();
    }

    // Pages back in memory: a chunk most of whose pages are is restored.
    let store = open(dir.path());
    store.sweep_sketches();
    let cold = store.index_memory();
    set_state(
        &store,
        "spilled",
        PageSelection::Range {
            first: 0,
            count: SKETCH_CHUNK_PAGES as u32,
        },
        Action::Migrate(ColdTier::Host),
    );
    store.sweep_sketches();
    let warm: IndexMemory = store.index_memory();
    assert_eq!(warm.spilled_pages, cold.spilled_pages - 2 * SKETCH_CHUNK_PAGES as u64);
    assert!(warm.sketch_bytes > cold.sketch_bytes);
    assert_eq!(rankings(&store, "spilled"), want);
}

#[test]
fn pages_without_bytes_keep_their_sketches_loose_and_spilling_off_keeps_all() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    create(&store, "spilled");
    create(&store, "model");
    let resident = store.index_memory();
    // Three pages of the second chunk go before the NVMe offload: with
    // no bytes to derive them from, they keep their sketches, and the
    // chunk still gives its memory back (they are kept loose).
    for seq in ["spilled", "model"] {
        set_state(&store, seq, PageSelection::Range { first: 70, count: 3 }, Action::Evict);
    }
    for (first, count) in [(0, 70), (73, PAGES as u32 - 73)] {
        let pages = PageSelection::Range { first, count };
        set_state(&store, "spilled", pages, Action::Offload(ColdTier::Nvme));
    }
    store.sweep_sketches();
    let after = store.index_memory();
    assert_eq!(after.spilled_pages, 2 * (3 * SKETCH_CHUNK_PAGES as u64 - 3));
    let entry = (PAGE * kvtier_core::sketch::row_bytes(DIM)) as u64;
    let chunk_bytes = SKETCH_CHUNK_PAGES as u64 * entry;
    // A loose page's rows and its map entry.
    let loose = entry + std::mem::size_of::<(usize, Box<[u8]>)>() as u64;
    assert!(
        after.sketch_bytes + 2 * 3 * chunk_bytes <= resident.sketch_bytes + 2 * 3 * loose,
        "six chunks' memory given back, six loose pages kept: {after:?} against {resident:?}"
    );

    // Evicting and summarising spilled pages brings back theirs alone.
    evict_and_summarize(&store, (3, 2), (140, 1));
    let went = store.index_memory();
    assert_eq!(went.spilled_pages, after.spilled_pages - 2 * 3);
    assert_eq!(
        went.sketch_bytes,
        after.sketch_bytes + 2 * 3 * loose,
        "loose pages cost their own rows"
    );
    assert_eq!(rankings(&store, "spilled"), rankings(&store, "model"));
    // Two-stage alone: it reads back its candidates only (8 × 4 a lane),
    // and they stay for the rankings after, loose: their own memory.
    // First the rankings above are given back (the next write) and
    // spilled again (a sweep).
    for seq in ["spilled", "model"] {
        set_state(&store, seq, PageSelection::Range { first: 1, count: 1 }, Action::Evict);
    }
    store.sweep_sketches();
    let before = store.index_memory();
    let two_stage = |store: &Arc<Store>| {
        let queries: Vec<f32> = (0..2 * HEADS as usize * DIM).map(|i| (i % 7) as f32 - 3.0).collect();
        let budget = Budget {
            pages: 8,
            sinks: 1,
            window: 2,
        };
        let req = SelectPages {
            ranking: Ranking::new(Mode::TwoStage),
            ..SelectPages::new(0, heads(), &queries, budget)
        };
        store.select_pages(&key("spilled"), req).unwrap().heads
    };
    let first = two_stage(&store);
    for seq in ["spilled", "model"] {
        set_state(&store, seq, PageSelection::Range { first: 2, count: 1 }, Action::Evict);
    }
    let read = store.index_memory();
    assert!(
        read.spilled_pages + 2 * 8 < before.spilled_pages,
        "{read:?} against {before:?}"
    );
    assert!(
        read.sketch_bytes <= before.sketch_bytes + 2 * 8 * 4 * loose,
        "candidates kept loose: {read:?} against {before:?}"
    );
    assert_eq!(first, two_stage(&store), "the same choice from the sketches read back");
    assert_eq!(rankings(&store, "spilled"), rankings(&store, "model"));
    let want = rankings(&store, "model");
    store.checkpoint();
    drop(store);

    // Spilling off: what the checkpoint left spilled comes back, and
    // ranks the same.
    let store = open_with(dir.path(), false);
    store.sweep_sketches();
    let all = store.index_memory();
    assert_eq!(all.spilled_pages, 0);
    assert_eq!(rankings(&store, "spilled"), want);
    assert_eq!(rankings(&store, "model"), want);
}
