//! Restarting a store over the same NVMe file and manifest: persisted pages
//! come back bit-exact (shared ones still shared), pages that were only in
//! memory come back gone with reason `lost_on_restart`, evictions stay
//! evictions, dropped sequences stay dropped, and writing continues.

mod common;

use std::path::Path;
use std::sync::Arc;

use kvtier_core::rank::{Mode, Ranking};
use kvtier_core::select::Budget;
use kvtier_core::{ColdTier, DType, Layout, LayoutSpec, PageState, Reason, SequenceKey};
use kvtier_store::{
    AppendTokens, FetchPages, HeadRange, PageContent, PageList, PageSelection, PutPages, SelectPages, SetPageState,
    Store, StoreConfig,
};

const PAGE: usize = 4;
const DIM: usize = 8;
const HEADS: u32 = 2;
const ROW: usize = DIM * 2;

fn layout() -> Layout {
    Layout::new(LayoutSpec {
        num_layers: 1,
        num_kv_heads: HEADS,
        num_query_heads: HEADS,
        head_dim: DIM as u32,
        dtype: DType::Bf16,
        page_size: PAGE as u32,
        layer_groups: vec![],
    })
    .unwrap()
}

fn open(dir: &Path) -> Arc<Store> {
    Store::new(StoreConfig {
        device_bytes: 1 << 20,
        host_bytes: 8 << 20,
        nvme: common::nvme(dir, 8 << 20, true),
        ..StoreConfig::default()
    })
    .unwrap()
}

fn key(s: &str) -> SequenceKey {
    SequenceKey::parse("t", s).unwrap()
}

/// Distinct finite bf16 bytes for (seed, token range), both heads.
fn kv(seed: u32, tokens: std::ops::Range<usize>) -> Vec<u8> {
    let mut out = Vec::new();
    for h in 0..HEADS {
        for part in 0..2u32 {
            for t in tokens.clone() {
                for i in 0..DIM {
                    let v = (seed * 7 + h * 3 + part) as f32 + t as f32 * 0.25 + i as f32 * 0.01;
                    out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                }
            }
        }
    }
    out
}

/// Expected K then V rows of one page of head `h` from `kv(seed, 0..n)`.
fn expected(seed: u32, n: usize, h: usize, page: usize) -> Vec<u8> {
    let all = kv(seed, 0..n);
    let per_head = 2 * n * ROW;
    let (k, v) = all[h * per_head..(h + 1) * per_head].split_at(n * ROW);
    let (a, b) = (page * PAGE, ((page + 1) * PAGE).min(n));
    [&k[a * ROW..b * ROW], &v[a * ROW..b * ROW]].concat()
}

fn heads() -> HeadRange {
    HeadRange { start: 0, count: HEADS }
}

fn fetch(store: &Store, seq: &str) -> Vec<kvtier_store::FetchedPage> {
    store
        .fetch_pages(
            &key(seq),
            FetchPages {
                layer: 0,
                heads: heads(),
                pages: PageList::All,
                with_digests: false,
            },
        )
        .unwrap()
}

fn put(store: &Store, seq: &str, first_page: u32, data: &[u8], tokens: usize, persist: bool) {
    let req = PutPages {
        layer: 0,
        heads: heads(),
        first_page,
        num_tokens: tokens as u32,
        kv: data,
        persist,
    };
    store.put_pages(&key(seq), req).unwrap();
}

#[test]
fn a_restart_recovers_what_was_persisted_and_reports_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let hashes: Vec<Vec<u8>> = (0..3).map(|p| format!("doc-{p}").into_bytes()).collect();
    {
        let store = open(dir.path());
        // a: 12 tokens persisted (3 full pages, shareable), then 6 more in
        // memory only.
        store.create_sequence(key("a"), layout(), hashes.clone()).unwrap();
        let all = kv(1, 0..18);
        let split = |range: std::ops::Range<usize>| -> Vec<u8> {
            // Re-slice the per-head K/V of `all` for a token range.
            let per_head = 2 * 18 * ROW;
            (0..HEADS as usize)
                .flat_map(|h| {
                    let (k, v) = all[h * per_head..(h + 1) * per_head].split_at(18 * ROW);
                    [
                        &k[range.start * ROW..range.end * ROW],
                        &v[range.start * ROW..range.end * ROW],
                    ]
                    .concat()
                })
                .collect()
        };
        put(&store, "a", 0, &split(0..12), 12, true);
        put(&store, "a", 3, &split(12..18), 6, false);
        // b shares a's first 3 pages, then appends 2 persisted tokens.
        let created = store.create_sequence(key("b"), layout(), hashes.clone()).unwrap();
        assert_eq!(created.attached_pages, 3);
        let append = AppendTokens {
            layer: 0,
            heads: heads(),
            num_tokens: 2,
            kv: &kv(2, 0..2),
            expected_position: Some(12),
            persist: true,
        };
        assert_eq!(
            store.append_tokens(&key("b"), append).unwrap().durability,
            kvtier_store::Acknowledged::Relaxed
        );
        // a: evict page 1 of head 0, summarize page 2 of head 1.
        let set = |action, first, head| SetPageState {
            layer_start: 0,
            layer_count: 1,
            heads: HeadRange { start: head, count: 1 },
            pages: PageSelection::Range { first, count: 1 },
            action,
            summary_rows: 1,
            reason: Reason::Explicit,
        };
        store
            .set_page_state(&key("a"), set(kvtier_core::Action::Evict, 1, 0))
            .unwrap();
        store
            .set_page_state(&key("a"), set(kvtier_core::Action::Summarize, 2, 1))
            .unwrap();
        // c: created and dropped.
        store.create_sequence(key("c"), layout(), vec![]).unwrap();
        put(&store, "c", 0, &kv(3, 0..4), 4, true);
        store.drop_sequence(&key("c")).unwrap();
    }

    let store = open(dir.path());
    assert!(store.sequence_info(&key("c")).is_err(), "dropped stays dropped");
    let a = store.sequence_info(&key("a")).unwrap();
    // Pages 3 and 4 (both heads) were memory only: page 3 is gone, and the
    // lane ends before page 4 (partial), so that appends can continue it.
    assert_eq!(a.tokens, 16);
    let gone: std::collections::HashMap<Reason, u64> = a.gone_by_reason.iter().copied().collect();
    assert_eq!(gone.get(&Reason::LostOnRestart), Some(&2));
    assert_eq!(gone.get(&Reason::Explicit), Some(&1));
    assert_eq!(a.pages.get(PageState::Summary), 1);
    for p in fetch(&store, "a") {
        let (h, page) = (p.kv_head as usize, p.page as usize);
        match (h, page) {
            (0, 1) => assert_eq!(p.content, PageContent::Gone(Reason::Explicit)),
            (1, 2) => assert!(
                matches!(&p.content, PageContent::Summary { counts, .. } if counts == &[4]),
                "the summary survives the restart: {:?}",
                p.content
            ),
            (_, 3) => assert_eq!(p.content, PageContent::Gone(Reason::LostOnRestart)),
            _ => {
                assert_eq!(p.state, PageState::Cold(ColdTier::Nvme));
                assert_eq!(
                    p.content,
                    PageContent::Original(expected(1, 18, h, page)),
                    "a head {h} page {page}"
                );
            }
        }
    }
    // b's shared prefix is still one physical page per lane, and its own
    // persisted tokens came back.
    let b = store.sequence_info(&key("b")).unwrap();
    assert_eq!(b.tokens, 14);
    assert!(b.shared_pages >= 4, "shared pages after restart: {}", b.shared_pages);
    let b_pages = fetch(&store, "b");
    let tail = b_pages.iter().find(|p| p.kv_head == 1 && p.page == 3).unwrap();
    assert_eq!(tail.content, PageContent::Original(expected(2, 2, 1, 0)));
    // Sharing continues: a new sequence attaches the recovered prefix.
    assert_eq!(
        store
            .create_sequence(key("d"), layout(), hashes)
            .unwrap()
            .attached_pages,
        3
    );
    // Writing continues where b ended.
    let append = AppendTokens {
        layer: 0,
        heads: heads(),
        num_tokens: 3,
        kv: &kv(4, 0..3),
        expected_position: Some(14),
        persist: true,
    };
    store.append_tokens(&key("b"), append).unwrap();
    drop(store);

    // A second restart (after the first one's checkpoint) sees it all.
    let store = open(dir.path());
    assert_eq!(store.sequence_info(&key("b")).unwrap().tokens, 17);
    assert_eq!(store.sequence_info(&key("d")).unwrap().tokens, 12);
    assert_eq!(fetch(&store, "a").len(), 2 * 4);
}

fn append(store: &Store, seq: &str, data: &[u8], tokens: u32, at: u64, persist: bool) {
    let req = AppendTokens {
        layer: 0,
        heads: heads(),
        num_tokens: tokens,
        kv: data,
        expected_position: Some(at),
        persist,
    };
    store.append_tokens(&key(seq), req).unwrap();
}

fn offload_to_nvme(store: &Store, seq: &str, pages: PageSelection<'_>) {
    let req = SetPageState {
        layer_start: 0,
        layer_count: 1,
        heads: heads(),
        pages,
        action: kvtier_core::Action::Offload(ColdTier::Nvme),
        summary_rows: 1,
        reason: Reason::Explicit,
    };
    store.set_page_state(&key(seq), req).unwrap();
}

/// Every page of `seq` holds the bytes of `kv(seed, 0..n)`.
fn assert_original(store: &Store, seq: &str, seed: u32, n: usize) {
    for p in fetch(store, seq) {
        let (h, page) = (p.kv_head as usize, p.page as usize);
        assert_eq!(
            p.content,
            PageContent::Original(expected(seed, n, h, page)),
            "{seq} head {h} page {page}"
        );
    }
}

#[test]
fn appending_to_a_persisted_page_keeps_its_persisted_rows_recoverable() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path());
        store.create_sequence(key("a"), layout(), vec![]).unwrap();
        // 6 tokens durable: page 0 full, page 1 with 2 rows.
        put(&store, "a", 0, &kv(1, 0..6), 6, true);
        // A 7th token in memory only: page 1's NVMe copy is now a prefix.
        append(&store, "a", &kv(9, 0..1), 1, 6, false);
        // Other persisted writes need NVMe space and flush the manifest.
        store.create_sequence(key("b"), layout(), vec![]).unwrap();
        put(&store, "b", 0, &kv(2, 0..8), 8, true);
    }
    let store = open(dir.path());
    assert_eq!(store.sequence_info(&key("a")).unwrap().tokens, 6);
    assert_original(&store, "a", 1, 6);
    // Writing resumes at the durable end.
    append(&store, "a", &kv(9, 0..1), 1, 6, true);
}

/// Copies the store's files as they are now: what a `kill -9` would leave.
fn crash_image(from: &Path, to: &Path) {
    for name in ["nvme.data", "nvme.manifest"] {
        std::fs::copy(from.join(name), to.join(name)).unwrap();
    }
}

#[test]
fn an_extent_is_reused_only_once_the_manifest_no_longer_points_to_it() {
    for _ in 0..8 {
        let dir = tempfile::tempdir().unwrap();
        let image = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        store.create_sequence(key("a"), layout(), vec![]).unwrap();
        put(&store, "a", 0, &kv(1, 0..8), 8, true);
        // The drop is journalled but not yet written when b's pages are
        // offloaded to NVMe right after; the crash comes before either is.
        store.drop_sequence(&key("a")).unwrap();
        store.create_sequence(key("b"), layout(), vec![]).unwrap();
        put(&store, "b", 0, &kv(2, 0..8), 8, false);
        offload_to_nvme(&store, "b", PageSelection::Range { first: 0, count: 0 });
        crash_image(dir.path(), image.path());
        let recovered = open(image.path());
        // Whether or not the drop reached the manifest first, a is either
        // dropped or intact: never pointing at b's bytes.
        if recovered.sequence_info(&key("a")).is_ok() {
            assert_original(&recovered, "a", 1, 8);
        }
    }
}

#[test]
fn a_lane_recovers_up_to_a_page_that_was_only_partly_durable() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path());
        store.create_sequence(key("a"), layout(), vec![]).unwrap();
        put(&store, "a", 0, &kv(1, 0..6), 6, true);
        // 4 more tokens in memory fill page 1 and open page 2 ...
        append(&store, "a", &kv(9, 0..4), 4, 6, false);
        // ... and page 2 alone reaches NVMe: page 1 is durable only up to
        // its first 2 rows, so nothing after them can be recovered.
        offload_to_nvme(&store, "a", PageSelection::Range { first: 2, count: 1 });
    }
    let store = open(dir.path());
    assert_eq!(store.sequence_info(&key("a")).unwrap().tokens, 6);
    assert_eq!(fetch(&store, "a").len(), 2 * 2);
    assert_original(&store, "a", 1, 6);
}

fn digests(store: &Store, seq: &str) -> Vec<(u32, u32, Option<Vec<u8>>)> {
    store
        .fetch_pages(
            &key(seq),
            FetchPages {
                layer: 0,
                heads: heads(),
                pages: PageList::All,
                with_digests: true,
            },
        )
        .unwrap()
        .into_iter()
        .map(|p| (p.kv_head, p.page, p.digest))
        .collect()
}

/// Every page's score in every ranking mode: the sketch modes' depend on
/// each token's sketch, the cuboid's on the sketches too.
fn scores(store: &Arc<Store>, seq: &str) -> Vec<Vec<f32>> {
    let queries: Vec<f32> = (0..HEADS as usize * DIM).map(|i| (i % 5) as f32 - 2.0).collect();
    Mode::ALL
        .into_iter()
        .flat_map(|mode| {
            let budget = Budget {
                pages: 64,
                sinks: 0,
                window: 0,
            };
            let req = SelectPages {
                ranking: Ranking::new(mode),
                ..SelectPages::new(0, heads(), &queries, budget)
            };
            let selection = store.select_pages(&key(seq), req).unwrap();
            selection
                .heads
                .into_iter()
                .map(|h| h.pages.iter().map(|p| p.bound).collect())
        })
        .collect()
}

#[test]
fn digests_and_sketches_survive_restarts_and_checkpoints_partial_pages_included() {
    let dir = tempfile::tempdir().unwrap();
    let before = {
        let store = open(dir.path());
        store.create_sequence(key("a"), layout(), vec![]).unwrap();
        put(&store, "a", 0, &kv(1, 0..6), 6, true);
        (digests(&store, "a"), scores(&store, "a"))
    };
    // The first restart replays the journal and checkpoints; the second
    // replays that checkpoint.
    for _ in 0..2 {
        let store = open(dir.path());
        assert_eq!((digests(&store, "a"), scores(&store, "a")), before);
    }
}

#[test]
fn a_checkpoint_of_lanes_longer_than_one_read_brings_back_every_page() {
    // 750 pages per lane: the checkpoint reads each lane in several holds
    // of its sequence's lock, and writes as it goes.
    const N: usize = 3000;
    let (live, image) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let hashes: Vec<Vec<u8>> = (0..100).map(|p| format!("long-{p}").into_bytes()).collect();
    let store = open(live.path());
    store.create_sequence(key("long"), layout(), hashes.clone()).unwrap();
    // Pages 0..100 persisted and shared with "twin"; 600..610 offloaded
    // to NVMe later; page 300 of head 0 evicted; the rest in memory only.
    put(&store, "long", 0, &kv(1, 0..400), 400, true);
    put(&store, "long", 100, &kv(1, 400..N), N - 400, false);
    let created = store.create_sequence(key("twin"), layout(), hashes).unwrap();
    assert_eq!(created.attached_pages, 100);
    offload_to_nvme(&store, "long", PageSelection::Range { first: 600, count: 10 });
    let evict = SetPageState {
        layer_start: 0,
        layer_count: 1,
        heads: HeadRange { start: 0, count: 1 },
        pages: PageSelection::Range { first: 300, count: 1 },
        action: kvtier_core::Action::Evict,
        summary_rows: 1,
        reason: Reason::Explicit,
    };
    store.set_page_state(&key("long"), evict).unwrap();
    let before = (digests(&store, "long"), digests(&store, "twin"));
    store.checkpoint();
    crash_image(live.path(), image.path());
    drop(store);

    let store = open(image.path());
    assert_eq!(store.sequence_info(&key("long")).unwrap().tokens, N as u64);
    for p in fetch(&store, "long") {
        let (h, page) = (p.kv_head as usize, p.page as usize);
        let want = match (h, page) {
            (_, 0..100 | 600..610) => PageContent::Original(expected(1, N, h, page)),
            (0, 300) => PageContent::Gone(Reason::Explicit),
            _ => PageContent::Gone(Reason::LostOnRestart),
        };
        assert_eq!(p.content, want, "long head {h} page {page}");
    }
    let twin = store.sequence_info(&key("twin")).unwrap();
    assert_eq!((twin.tokens, twin.shared_pages), (400, 200));
    assert_original(&store, "twin", 1, 400);
    assert_eq!((digests(&store, "long"), digests(&store, "twin")), before);
}
