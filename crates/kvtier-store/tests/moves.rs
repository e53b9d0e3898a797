//! Moving a sequence to another store, as a drain does between nodes: a
//! sequence built by random puts, appends (persisted or not), offloads,
//! summaries and evictions, with a hash chain it shares with another
//! sequence, is exported lane by lane in small chunks and imported into a
//! second store that already holds pages of the same prompt. The copy must
//! read back exactly as the original (every page's state, rows, bytes and
//! digest), rank exactly as it in every selection mode (the index entries
//! of summaries and gone pages came with them), share what the receiver
//! already stored, and keep every durable row across the receiver's
//! restart.

mod common;

use std::path::Path;
use std::sync::Arc;

use kvtier_core::rank::{Mode, Ranking};
use kvtier_core::select::Budget;
use kvtier_core::{Action, ColdTier, DType, LayerGroup, Layout, LayoutSpec, PageState, Reason, SequenceKey};
use kvtier_store::{
    AppendTokens, FetchPages, FetchedPage, HeadRange, MovedContent, PageContent, PageList, PageSelection, PutPages,
    SelectPages, SetPageState, Store, StoreConfig,
};
use proptest::prelude::*;

const DIM: usize = 4;
const PAGE: usize = 4;
const HEADS: u32 = 2;

/// Three layers, the last two sharing one KV (two stored layers).
fn layout() -> Layout {
    Layout::new(LayoutSpec {
        num_layers: 3,
        num_kv_heads: HEADS,
        num_query_heads: HEADS * 2,
        head_dim: DIM as u32,
        dtype: DType::F32,
        page_size: PAGE as u32,
        layer_groups: vec![LayerGroup {
            first_layer: 1,
            num_layers: 2,
        }],
    })
    .unwrap()
}

fn open(dir: &Path) -> Arc<Store> {
    Store::new(StoreConfig {
        device_bytes: 64 << 10,
        host_bytes: 1 << 20,
        nvme: common::nvme(dir, 8 << 20, false),
        ..StoreConfig::default()
    })
    .unwrap()
}

fn key(s: &str) -> SequenceKey {
    SequenceKey::parse("t", s).unwrap()
}

/// K then V rows, head-major, for `heads` heads and `tokens` tokens:
/// distinct finite values per (seed, head, token, element).
fn kv(seed: u32, heads: u32, tokens: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for h in 0..heads {
        for part in 0..2u32 {
            for t in 0..tokens {
                for i in 0..DIM {
                    let v = (seed * 97 + h * 13 + part * 5) as f32 + t as f32 * 0.5 + i as f32 * 0.125;
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    out
}

#[derive(Debug, Clone)]
enum Op {
    /// Whole pages to every head of a stored layer (0 or 1).
    Put { layer: u32, pages: u32, persist: bool },
    /// Tokens to every head of a stored layer.
    Append { layer: u32, tokens: u32, persist: bool },
    /// A transition of one page of one lane (wrapped into range).
    Set {
        layer: u32,
        head: u32,
        page: u32,
        action: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..2u32, 1..4u32, any::<bool>()).prop_map(|(layer, pages, persist)| Op::Put { layer, pages, persist }),
        (0..2u32, 1..7u32, any::<bool>()).prop_map(|(layer, tokens, persist)| Op::Append { layer, tokens, persist }),
        (0..2u32, 0..HEADS, 0..16u32, 0..4u8).prop_map(|(layer, head, page, action)| Op::Set {
            layer,
            head,
            page,
            action
        }),
    ]
}

/// Applies `op` to `seq` in `store`; a refused op (a put on a partial
/// page, a transition the state machine forbids) changes nothing.
fn apply(store: &Store, seq: &str, op: &Op, seed: u32) {
    let k = key(seq);
    let heads = HeadRange { start: 0, count: HEADS };
    match *op {
        Op::Put { layer, pages, persist } => {
            let held = lane_tokens(store, seq, layer);
            if !held.is_multiple_of(PAGE as u64) {
                return;
            }
            let n = pages as usize * PAGE;
            let _ = store.put_pages(
                &k,
                PutPages {
                    layer,
                    heads,
                    first_page: (held / PAGE as u64) as u32,
                    num_tokens: n as u32,
                    kv: &kv(seed, HEADS, n),
                    persist,
                },
            );
        }
        Op::Append { layer, tokens, persist } => {
            let _ = store.append_tokens(
                &k,
                AppendTokens {
                    layer,
                    heads,
                    num_tokens: tokens,
                    kv: &kv(seed, HEADS, tokens as usize),
                    expected_position: None,
                    persist,
                },
            );
        }
        Op::Set {
            layer,
            head,
            page,
            action,
        } => {
            let pages = lane_tokens(store, seq, layer).div_ceil(PAGE as u64) as u32;
            if pages == 0 {
                return;
            }
            let action = match action {
                0 => Action::Offload(ColdTier::Nvme),
                1 => Action::Migrate(ColdTier::Nvme),
                2 => Action::Summarize,
                _ => Action::Evict,
            };
            let _ = store.set_page_state(
                &k,
                SetPageState {
                    layer_start: layer,
                    layer_count: 1,
                    heads: HeadRange { start: head, count: 1 },
                    pages: PageSelection::Range {
                        first: page % pages,
                        count: 1,
                    },
                    action,
                    summary_rows: 2,
                    reason: Reason::Policy,
                },
            );
        }
    }
}

/// Positions in the lanes of a stored layer (both heads move together).
fn lane_tokens(store: &Store, seq: &str, layer: u32) -> u64 {
    fetch(store, seq, layer)
        .iter()
        .filter(|p| p.kv_head == 0)
        .map(|p| u64::from(p.rows))
        .sum()
}

fn fetch(store: &Store, seq: &str, layer: u32) -> Vec<FetchedPage> {
    store
        .fetch_pages(
            &key(seq),
            FetchPages {
                layer,
                heads: HeadRange { start: 0, count: HEADS },
                pages: PageList::All,
                with_digests: true,
            },
        )
        .unwrap()
}

/// A page as the copy must match it: hot and cold are one state here (the
/// receiver places pages by its own tiers).
fn comparable(p: &FetchedPage) -> (u32, u32, u32, PageContent, Option<Vec<u8>>) {
    let state = match p.state {
        PageState::Hot | PageState::Cold(_) => 0,
        PageState::Summary => 1,
        PageState::Gone => 2,
    };
    (
        p.kv_head,
        p.page,
        state * 1000 + p.rows,
        p.content.clone(),
        p.digest.clone(),
    )
}

/// Every page's score in every ranking mode (sketch modes read every
/// token's sketch, so index entries that differ show here).
fn scores(store: &Arc<Store>, seq: &str, layer: u32) -> Vec<Vec<f32>> {
    let queries: Vec<f32> = (0..HEADS as usize * 2 * DIM).map(|i| (i % 7) as f32 - 3.0).collect();
    Mode::ALL
        .into_iter()
        .flat_map(|mode| {
            let req = SelectPages {
                ranking: Ranking::new(mode),
                ..SelectPages::new(
                    layer,
                    HeadRange { start: 0, count: HEADS },
                    &queries,
                    Budget {
                        pages: 64,
                        sinks: 0,
                        window: 0,
                    },
                )
            };
            let selection = store.select_pages(&key(seq), req).unwrap();
            selection
                .heads
                .into_iter()
                .map(|h| h.pages.iter().map(|p| p.bound).collect::<Vec<f32>>())
        })
        .collect()
}

/// Moves `seq` from `from` to `to` as a drain does: header, then each
/// lane's pages in chunks of about `chunk` bytes. Returns which pages
/// were durable: `(lane, page, durable)`.
fn move_sequence(from: &Store, to: &Store, seq: &str, chunk: usize) -> Vec<(usize, u32, bool)> {
    let k = key(seq);
    let export = from.export_sequence(&k).unwrap();
    to.create_moved(k.clone(), export.layout.clone(), export.hashes.clone())
        .unwrap();
    let mut durable = Vec::new();
    for (lane, at) in export.lanes.iter().enumerate() {
        let mut next = 0;
        while next < at.pages {
            let pages = from.export_pages(&k, *at, next, chunk).unwrap();
            assert!(!pages.is_empty());
            for (i, p) in pages.iter().enumerate() {
                durable.push((lane, next + i as u32, p.durable));
            }
            let n = pages.len() as u32;
            to.import_pages(&k, *at, next, pages).unwrap();
            next += n;
        }
        assert!(from.export_pages(&k, *at, next, chunk).unwrap().is_empty());
    }
    to.commit_moved(&k).unwrap();
    durable
}

fn check_copy(from: &Arc<Store>, to: &Arc<Store>, seq: &str) {
    for layer in 0..3 {
        let a: Vec<_> = fetch(from, seq, layer).iter().map(comparable).collect();
        let b: Vec<_> = fetch(to, seq, layer).iter().map(comparable).collect();
        assert_eq!(a, b, "layer {layer}: the copy reads back differently");
        assert_eq!(
            scores(from, seq, layer),
            scores(to, seq, layer),
            "layer {layer}: ranks differently"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn a_moved_sequence_reads_ranks_shares_and_persists_as_the_original(
        ops in proptest::collection::vec(op(), 1..24),
        chunk in prop_oneof![Just(1usize), Just(300), Just(1 << 20)],
    ) {
        let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let hashes: Vec<Vec<u8>> = (0..2).map(|p| format!("prompt-{p}").into_bytes()).collect();
        let (a, b) = (open(dir_a.path()), open(dir_b.path()));
        // The prompt's first two pages, stored on both nodes already by
        // other sequences; `s` attaches them on the sender.
        for (store, other) in [(&a, "other-a"), (&b, "other-b")] {
            store.create_sequence(key(other), layout(), hashes.clone()).unwrap();
            for layer in 0..2 {
                apply(store, other, &Op::Put { layer, pages: 2, persist: true }, 1);
            }
        }
        let created = a.create_sequence(key("s"), layout(), hashes.clone()).unwrap();
        prop_assert_eq!(created.attached_pages, 2);
        for (i, op) in ops.iter().enumerate() {
            apply(&a, "s", op, 10 + i as u32);
        }
        let durable = move_sequence(&a, &b, "s", chunk);
        check_copy(&a, &b, "s");
        // The receiver shares the prompt's pages it already held.
        let info = b.sequence_info(&key("s")).unwrap();
        let shared_at_sender = a.sequence_info(&key("s")).unwrap().shared_pages;
        prop_assert_eq!(info.shared_pages, shared_at_sender, "shared pages: receiver vs sender");

        // The receiver restarts: every page durable at the sender is back
        // bit-exact, summaries and gone pages stay what they were.
        let before: Vec<Vec<FetchedPage>> = (0..3).map(|l| fetch(&a, "s", l)).collect();
        drop(b);
        let b = open(dir_b.path());
        for (layer, pages) in before.iter().enumerate() {
            let after = fetch(&b, "s", layer as u32);
            let lane_of = |kv_head: u32| layout().lane(layer as u32, kv_head);
            for p in pages {
                let was_durable = durable.iter().any(|&(lane, page, d)| d && lane == lane_of(p.kv_head) && page == p.page);
                let keeps = was_durable || matches!(p.state, PageState::Summary | PageState::Gone);
                if !keeps {
                    continue;
                }
                let got = after.iter().find(|q| q.kv_head == p.kv_head && q.page == p.page);
                let got = got.map(comparable).map(|(h, pg, _, content, digest)| (h, pg, content, digest));
                let (h, pg, _, content, digest) = comparable(p);
                prop_assert_eq!(got, Some((h, pg, content, digest)), "layer {} head {} page {} after the restart", layer, p.kv_head, p.page);
            }
        }
    }
}

#[test]
fn an_import_that_does_not_fit_its_lane_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.create_moved(key("m"), layout(), vec![]).unwrap();
    let lane = kvtier_store::LaneAt {
        layer: 0,
        kv_head: 0,
        pages: 0,
    };
    let gone = |entry: usize| kvtier_store::ExportedPage {
        rows: PAGE as u32,
        content: MovedContent::Gone {
            reason: Reason::Policy,
            index_entry: vec![0; entry],
        },
        durable: false,
    };
    let entry = kvtier_core::PageIndex::entry_len(DType::F32, DIM, PAGE as u32);
    let e = store
        .import_pages(&key("m"), lane, 0, vec![gone(entry - 1)])
        .unwrap_err();
    assert!(e.to_string().starts_with("lane.pages[0].index_entry"), "{e}");
    let e = store.import_pages(&key("m"), lane, 3, vec![gone(entry)]).unwrap_err();
    assert!(e.to_string().starts_with("lane.first_page"), "{e}");
    let summary = kvtier_store::ExportedPage {
        rows: PAGE as u32,
        content: MovedContent::Summary {
            counts: vec![2, 1],
            kv: vec![0; 2 * 2 * DIM * 4],
            reason: Reason::Policy,
            index_entry: vec![0; entry],
        },
        durable: false,
    };
    let e = store.import_pages(&key("m"), lane, 0, vec![summary]).unwrap_err();
    assert!(e.to_string().starts_with("lane.pages[0].summary_counts"), "{e}");
    assert_eq!(
        store.sequence_info(&key("m")).unwrap().tokens,
        0,
        "nothing was imported"
    );
    store.import_pages(&key("m"), lane, 0, vec![gone(entry)]).unwrap();
    assert_eq!(store.sequence_info(&key("m")).unwrap().max_tokens, PAGE as u64);
}
