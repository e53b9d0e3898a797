//! Swap-in, deadlines, leases and prefetch: selected pages become hot from
//! wherever they were, bit-exact and counted per source; a deadline bounds
//! the call while the swap-in finishes behind it; leased pages never move;
//! prefetch counters follow a drifting workload.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kvtier_core::rank::{Mode, Ranking};
use kvtier_core::select::{Budget, TopP};
use kvtier_core::{Action, ColdTier, DType, Layout, LayoutSpec, PageState, Reason, SequenceKey, TenantId};
use kvtier_store::{
    EngineChoice, FetchPages, HeadRange, Miss, NvmeConfig, PageContent, PageList, PageSelection, PutPages, SelectPages,
    SetPageState, Store, StoreConfig, StoreError, SwapReport, TierKind,
};
use kvtier_tiers::faults::{Faults, FaultyTier};
use kvtier_tiers::{ArenaTier, NvmeTier};

const PAGE: usize = 16;
const DIM: usize = 64;
const PAGE_BYTES: u64 = 4096; // 2 × 16 × 64 × f16

fn layout() -> Layout {
    Layout::new(LayoutSpec {
        num_layers: 1,
        num_kv_heads: 1,
        num_query_heads: 1,
        head_dim: DIM as u32,
        dtype: DType::F16,
        page_size: PAGE as u32,
        layer_groups: vec![],
    })
    .unwrap()
}

fn key() -> SequenceKey {
    SequenceKey::parse("t", "s").unwrap()
}

/// Page `p`'s keys point along dimension `p % DIM`, and half as much along
/// the one before: a query along dimensions `{s, s + 1}` ranks page `s + 1`,
/// then `s`, then `s + 2` (what a drifting query needs next).
fn page_data(p: usize) -> Vec<u8> {
    let mut k = Vec::new();
    let mut v = Vec::new();
    for t in 0..PAGE {
        for i in 0..DIM {
            let key = if i == p % DIM {
                1.0
            } else if (i + 1) % DIM == p % DIM {
                0.5
            } else {
                0.01 * (t as f32)
            };
            k.extend_from_slice(&half::f16::from_f32(key).to_le_bytes());
            v.extend_from_slice(&half::f16::from_f32((p * 1000 + t * 10 + i) as f32 * 0.001).to_le_bytes());
        }
    }
    [k, v].concat()
}

/// Writes pages `0..pages` of `layer`'s one KV head, page `p` holding
/// `page_data(p)`.
fn put_layer(store: &Store, layer: u32, pages: usize) {
    for p in 0..pages {
        let kv = page_data(p);
        let put = PutPages {
            layer,
            heads: HeadRange { start: 0, count: 1 },
            first_page: p as u32,
            num_tokens: PAGE as u32,
            kv: &kv,
            persist: false,
        };
        store.put_pages(&key(), put).unwrap();
    }
}

/// A store over emulated device, host and a (possibly slowed) NVMe tier,
/// holding `pages` pages.
fn store(dir: &std::path::Path, device_pages: u64, pages: usize) -> (Arc<Store>, Arc<Faults>) {
    let faults = Faults::none();
    let nvme = NvmeTier::open(NvmeConfig {
        path: dir.join("nvme.data"),
        capacity: 4 << 20,
        engine: EngineChoice::Auto,
        queue_depth: 8,
        direct: true,
    })
    .unwrap();
    let store = Store::with_tiers(
        Arc::new(ArenaTier::emulated_device(device_pages * PAGE_BYTES).unwrap()),
        Arc::new(ArenaTier::host(4 << 20).unwrap()),
        Some(Arc::new(FaultyTier::new(nvme, Arc::clone(&faults)))),
        StoreConfig {
            manifest_path: Some(dir.join("manifest")),
            promote_on_read: false,
            cache_writes_on_device: false,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    store.create_sequence(key(), layout(), vec![]).unwrap();
    put_layer(&store, 0, pages);
    (store, faults)
}

fn set(store: &Store, action: Action, pages: &[u32]) -> Result<(), StoreError> {
    let req = SetPageState {
        layer_start: 0,
        layer_count: 1,
        heads: HeadRange { start: 0, count: 1 },
        pages: PageSelection::List(pages),
        action,
        summary_rows: 1,
        reason: Reason::Explicit,
    };
    store.set_page_state(&key(), req).map(drop)
}

fn fetch_all(store: &Store) -> Vec<kvtier_store::FetchedPage> {
    let req = FetchPages {
        layer: 0,
        heads: HeadRange { start: 0, count: 1 },
        pages: PageList::All,
        with_digests: false,
    };
    store.fetch_pages(&key(), req).unwrap()
}

fn states(store: &Store) -> Vec<PageState> {
    fetch_all(store).into_iter().map(|p| p.state).collect()
}

/// Every page reads back whole; exactly the pages `hot` names are hot.
fn assert_whole(store: &Store, hot: impl Fn(u32) -> bool) {
    for p in fetch_all(store) {
        assert_eq!(
            p.content,
            PageContent::Original(page_data(p.page as usize)),
            "page {}",
            p.page
        );
        assert_eq!(p.state == PageState::Hot, hot(p.page), "page {} {:?}", p.page, p.state);
    }
}

/// 8 pages written to host memory only, under an exclusive device cache
/// of 4 pages (with an NVMe tier and its manifest in `dir`, if given).
fn exclusive_store(dir: Option<&std::path::Path>) -> Arc<Store> {
    let nvme = dir.map(|d| {
        let nvme = NvmeTier::open(NvmeConfig {
            path: d.join("nvme.data"),
            capacity: 4 << 20,
            engine: EngineChoice::Auto,
            queue_depth: 8,
            direct: true,
        })
        .unwrap();
        Arc::new(FaultyTier::new(nvme, Faults::none())) as Arc<dyn kvtier_store::Tier>
    });
    let store = Store::with_tiers(
        Arc::new(ArenaTier::emulated_device(4 * PAGE_BYTES).unwrap()),
        Arc::new(ArenaTier::host(4 << 20).unwrap()),
        nvme,
        StoreConfig {
            manifest_path: dir.map(|d| d.join("manifest")),
            cache_writes_on_device: false,
            device_cache: kvtier_store::DeviceCache::Exclusive,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    store.create_sequence(key(), layout(), vec![]).unwrap();
    put_layer(&store, 0, 8);
    store
}

fn query(dims: &[usize]) -> Vec<f32> {
    (0..DIM).map(|i| if dims.contains(&i) { 1.0 } else { 0.0 }).collect()
}

fn select<'a>(q: &'a [f32], budget: usize) -> SelectPages<'a> {
    SelectPages::new(
        0,
        HeadRange { start: 0, count: 1 },
        q,
        Budget {
            pages: budget,
            sinks: 0,
            window: 0,
        },
    )
}

#[test]
fn one_call_swaps_in_from_host_and_nvme_bit_exact_with_per_source_counts() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = store(dir.path(), 16, 9);
    // Pages 0..3 hot, 3..6 cold(host), 6..9 cold(nvme).
    set(&store, Action::SwapIn, &[0, 1, 2]).unwrap();
    set(&store, Action::Migrate(ColdTier::Nvme), &[6, 7, 8]).unwrap();
    let q = query(&[]);
    let req = SelectPages {
        swap_in: true,
        with_data: true,
        ..select(&q, 9)
    };
    let sel = store.select_pages(&key(), req).unwrap();
    assert_eq!(
        (
            sel.swap.already_hot,
            sel.swap.from_host,
            sel.swap.from_nvme,
            sel.swap.not_hot
        ),
        (3, 3, 3, 0)
    );
    assert!(
        sel.heads[0]
            .pages
            .iter()
            .all(|p| p.state == PageState::Hot && p.miss.is_none())
    );
    assert_eq!(sel.data.len(), 9);
    for page in &sel.data {
        assert_eq!(
            page.content,
            PageContent::Original(page_data(page.page as usize)),
            "page {}",
            page.page
        );
    }
    assert!(states(&store).iter().all(|s| *s == PageState::Hot));
    let stats = store.stats();
    assert_eq!((stats.swapped_from_host, stats.swapped_from_nvme), (3, 3));
}

#[test]
fn a_deadline_returns_on_time_and_the_swap_in_finishes_behind_it() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faults) = store(dir.path(), 16, 6);
    set(&store, Action::Migrate(ColdTier::Nvme), &[0, 1, 2, 3, 4, 5]).unwrap();
    // Every NVMe read now takes 300 ms; the deadline is 30 ms.
    faults.read_delay_us.store(300_000, Relaxed);
    let q = query(&[]);
    let req = SelectPages {
        swap_in: true,
        deadline: Some(Duration::from_millis(30)),
        ..select(&q, 6)
    };
    let start = Instant::now();
    let sel = store.select_pages(&key(), req).unwrap();
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(250),
        "the call waited for the slow swap-in: {took:?}"
    );
    assert!(sel.past_deadline);
    assert_eq!(sel.swap, SwapReport::default());
    for p in &sel.heads[0].pages {
        assert_eq!(
            (p.state, p.miss),
            (PageState::Cold(ColdTier::Nvme), Some(Miss::Deadline)),
            "page {}",
            p.page
        );
    }
    // The swap-in goes on in the background and completes.
    store.wait_idle();
    assert!(
        states(&store).iter().all(|s| *s == PageState::Hot),
        "{:?}",
        states(&store)
    );
    assert_eq!(store.stats().swapped_from_nvme, 6);
}

#[test]
fn leased_pages_do_not_move_until_released_or_expired() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = store(dir.path(), 4, 12);
    let q = query(&[0, 1]);
    // Pages 0 and 1 rank first; lease them hot for a long time.
    let req = SelectPages {
        swap_in: true,
        lease: Some(Duration::from_secs(60)),
        ..select(&q, 2)
    };
    let sel = store.select_pages(&key(), req).unwrap();
    let (lease, _) = sel.lease.expect("a lease");
    assert_eq!(states(&store)[..2], [PageState::Hot, PageState::Hot]);
    assert_eq!(store.stats().leases, 1);
    // Moving them is refused; device pressure does not demote them.
    let err = set(&store, Action::Offload(ColdTier::Host), &[0]).unwrap_err();
    assert!(err.to_string().contains("leased"), "{err}");
    set(&store, Action::SwapIn, &[4, 5]).unwrap();
    let err = set(&store, Action::SwapIn, &[6, 7, 8]).unwrap_err();
    assert!(
        matches!(err, StoreError::ResourceExhausted(_)),
        "only 2 unpinned device pages: {err}"
    );
    set(&store, Action::SwapIn, &[6, 7]).unwrap();
    assert_eq!(
        states(&store)[..2],
        [PageState::Hot, PageState::Hot],
        "pinned pages were demoted"
    );
    // Released: they move again.
    let other = TenantId::parse("tenant", "other").unwrap();
    assert!(!store.release_lease(&other, lease), "another tenant's lease");
    assert!(store.release_lease(&key().tenant, lease));
    assert!(!store.release_lease(&key().tenant, lease), "a lease ends once");
    set(&store, Action::Offload(ColdTier::Host), &[0]).unwrap();

    // A lease the client forgets expires by itself.
    let req = SelectPages {
        swap_in: true,
        lease: Some(Duration::from_millis(50)),
        ..select(&q, 2)
    };
    store.select_pages(&key(), req).unwrap();
    assert!(set(&store, Action::Offload(ColdTier::Host), &[1]).is_err());
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.stats().leases > 0 {
        assert!(Instant::now() < deadline, "the lease never expired");
        std::thread::sleep(Duration::from_millis(10));
    }
    set(&store, Action::Offload(ColdTier::Host), &[1]).unwrap();
}

#[test]
fn prefetch_counters_follow_a_drifting_workload() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = store(dir.path(), 8, 40);
    // Slow drift: each step the query moves one dimension along, so the
    // page ranked next (the next dimension) is the one needed next.
    for step in 0..12 {
        let q = query(&[step, step + 1]);
        let req = SelectPages {
            swap_in: true,
            prefetch_pages: 1,
            ..select(&q, 2)
        };
        store.select_pages(&key(), req).unwrap();
        store.wait_idle();
    }
    let s = store.stats();
    assert!(s.prefetch.issued >= 8, "{s:?}");
    assert!(
        s.prefetch.used >= 8,
        "prefetched pages were used by the next step: {s:?}"
    );
    let wasted_before = s.prefetch.wasted;
    // Jumps: each prediction is wrong, and under device pressure (8 device
    // pages for 40) what was prefetched is demoted unused.
    for step in 0..12 {
        let at = (13 + step * 7) % 36;
        let q = query(&[at, at + 1]);
        let req = SelectPages {
            swap_in: true,
            prefetch_pages: 2,
            ..select(&q, 2)
        };
        store.select_pages(&key(), req).unwrap();
        store.wait_idle();
    }
    let after = store.stats();
    assert!(after.prefetch.issued > s.prefetch.issued, "{after:?}");
    assert!(
        after.prefetch.wasted > wasted_before,
        "abandoned predictions count as wasted: {after:?}"
    );
}

#[test]
fn exclusive_caching_moves_pages_up_and_back_down_without_loss() {
    let dir = tempfile::tempdir().unwrap();
    let store = exclusive_store(Some(dir.path()));
    let host_used = |s: &Store| s.stats().tiers[1].used_bytes;
    assert_eq!(host_used(&store), 8 * PAGE_BYTES);
    // Swapping in 4 pages moves them: the host keeps only the 4 cold ones.
    let q = query(&[0, 1, 2, 3]);
    store
        .select_pages(
            &key(),
            SelectPages {
                swap_in: true,
                ..select(&q, 4)
            },
        )
        .unwrap();
    assert_eq!(host_used(&store), 4 * PAGE_BYTES);
    // Swapping in 4 others demotes the first 4, which are copied back down.
    let q = query(&[4, 5, 6, 7]);
    let sel = store
        .select_pages(
            &key(),
            SelectPages {
                swap_in: true,
                with_data: true,
                ..select(&q, 4)
            },
        )
        .unwrap();
    assert_eq!(sel.swap.from_host, 4);
    assert_eq!(host_used(&store), 4 * PAGE_BYTES);
    assert_whole(&store, |p| (4..8).contains(&p));
}

/// An explicit swap-in (SetPageState) and a selection's swap-in are one
/// path: with an exclusive device cache both move the page up, so the host
/// keeps only cold pages, and both count the transition and the bytes moved.
#[test]
fn an_explicit_swap_in_moves_pages_like_a_selection_does() {
    let store = exclusive_store(None);
    let host_used = |s: &Store| s.stats().tiers[1].used_bytes;
    assert_eq!(host_used(&store), 8 * PAGE_BYTES);
    let before = store.stats();
    let swap_in = SetPageState {
        layer_start: 0,
        layer_count: 1,
        heads: HeadRange { start: 0, count: 1 },
        pages: PageSelection::Range { first: 0, count: 4 },
        action: Action::SwapIn,
        summary_rows: 0,
        reason: Reason::Explicit,
    };
    assert_eq!(store.set_page_state(&key(), swap_in).unwrap().pages, 4);
    assert_eq!(
        host_used(&store),
        4 * PAGE_BYTES,
        "the device copies replace the host copies"
    );
    let after = store.stats();
    let moved_up = |s: &kvtier_store::StatsSnapshot| {
        s.bytes_moved
            .iter()
            .find(|(from, to, _)| *from == TierKind::Host && *to == TierKind::Device)
            .map_or(0, |m| m.2)
    };
    assert_eq!(moved_up(&after) - moved_up(&before), 4 * PAGE_BYTES);
    let swapped = after
        .transitions
        .iter()
        .filter(|t| t.from == PageState::Cold(ColdTier::Host) && t.to == PageState::Hot && t.reason == Reason::Explicit)
        .map(|t| t.count)
        .sum::<u64>();
    assert_eq!(swapped, 4, "counted once each");
    // Every page is still whole, the hot ones only on the device.
    assert_whole(&store, |p| p < 4);
}

/// A top-p selection stops short of its budget; its prefetch still takes
/// only the next `prefetch_pages` pages by estimated mass (not every page
/// the cut left out). Two-stage prefetches only among the pages it
/// re-ranked (the others have no mass to rank by).
#[test]
fn a_cut_selection_prefetches_only_its_next_pages() {
    // (mode, candidates, budget, top-p, pages queued)
    for (mode, candidates, budget, top_p, want) in
        [(Mode::Sketch, 4, 12, Some(0.3), 2), (Mode::TwoStage, 1, 4, None, 0)]
    {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store(dir.path(), 16, 12);
        let q = query(&[3, 4]);
        let req = SelectPages {
            ranking: Ranking {
                top_p: top_p.map(|p| TopP { p, min_pages: 1 }),
                candidates,
                ..Ranking::new(mode)
            },
            prefetch_pages: 2,
            ..select(&q, budget)
        };
        let sel = store.select_pages(&key(), req).unwrap();
        let chosen = sel.heads[0].pages.len();
        assert!(chosen < 12, "{mode}: chose {chosen}");
        assert_eq!(sel.prefetch_queued, want, "{mode}: after {chosen} chosen");
    }
}

/// A store with a device of `device_pages` pages (host memory for all) and
/// `key()` created with `layers` layers of one KV head.
fn layered_store(layers: u32, device_pages: u64, config: StoreConfig) -> Arc<Store> {
    let layout = Layout::new(LayoutSpec {
        num_layers: layers,
        ..layout().spec().clone()
    })
    .unwrap();
    let store = Store::with_tiers(
        Arc::new(ArenaTier::emulated_device(device_pages * PAGE_BYTES).unwrap()),
        Arc::new(ArenaTier::host(4 << 20).unwrap()),
        None,
        config,
    )
    .unwrap();
    store.create_sequence(key(), layout, vec![]).unwrap();
    store
}

/// A decode loop (every layer selected in order, step after step) on a
/// device of half one step's pages: LRU evicts every page before its next
/// use and serves no hit; the loop policy keeps a resident subset of the
/// pages chosen most and streams the next layer's last choice ahead.
#[test]
fn on_the_decode_loop_the_loop_policy_hits_where_lru_never_does() {
    const LAYERS: u32 = 4;
    const PER_LAYER: usize = 8;
    let run = |policy: kvtier_store::DevicePolicy| {
        let config = StoreConfig {
            cache_writes_on_device: false,
            device_policy: policy,
            ..StoreConfig::default()
        };
        let store = layered_store(LAYERS, 8, config);
        for layer in 0..LAYERS {
            put_layer(&store, layer, PER_LAYER);
        }
        // The same query every step: each layer chooses the same 4 pages,
        // 16 a step on a device of 8.
        let q = query(&[1, 2, 3, 4]);
        let (mut hits, mut asked, mut prefetched, mut all_hits) = (0, 0, 0, 0);
        for step in 0..8 {
            for layer in 0..LAYERS {
                let req = SelectPages {
                    layer,
                    swap_in: true,
                    ..select(&q, 4)
                };
                let sel = store.select_pages(&key(), req).unwrap();
                prefetched += sel.prefetch_queued;
                all_hits += u64::from(sel.swap.already_hot);
                if step >= 2 {
                    hits += sel.swap.already_hot;
                    asked += 4;
                }
                // The next layer's prefetch lands before it is asked for,
                // as it would while this layer's attention runs.
                store.wait_idle();
            }
        }
        // The store's own counts agree with what the selections found.
        let s = store.stats();
        let d = s.device_hits;
        assert_eq!(d.resident + d.stream, all_hits, "{policy}: {d:?}");
        assert_eq!(d.misses, 8 * u64::from(LAYERS) * 4 - all_hits, "{policy}: {d:?}");
        (hits, asked, prefetched, s)
    };
    let (lru, asked, _, s) = run(kvtier_store::DevicePolicy::Lru);
    assert_eq!(lru, 0, "LRU's worst case");
    assert_eq!(s.layer_ahead, Default::default(), "no layer-ahead under LRU");
    let (hits, _, prefetched, s) = run(kvtier_store::DevicePolicy::Loop);
    assert!(prefetched > 0, "the next layer is streamed ahead");
    // The stream region holds this layer's 4 pages and the next layer's,
    // brought up while this one is served: every selection hits, the
    // prefetched pages used, none late (each landed before its layer).
    assert_eq!(hits, asked);
    let ahead = s.layer_ahead;
    assert!(ahead.issued > 0 && ahead.used > 0, "{ahead:?}");
    assert_eq!(ahead.late, 0, "{ahead:?}");
    assert!(ahead.used <= ahead.issued, "{ahead:?}");
}

/// The simulation `kvtier tune` predicts policies with serves a stream as
/// the store does: the same writes and selections (a drifting query, so
/// the loop policy's subset changes), each prefetch landed before the next
/// selection, miss for miss, under every device policy.
#[test]
fn the_device_simulation_misses_what_the_store_misses() {
    use kvtier_store::{DevicePolicy, DeviceSimulation};
    const LAYERS: u32 = 4;
    const PER_LAYER: usize = 12;
    // Smaller than a step's 12 selected pages, about one, and larger.
    for (policy, device_pages) in DevicePolicy::ALL.into_iter().flat_map(|p| [(p, 7), (p, 11), (p, 16)]) {
        let config = StoreConfig {
            device_policy: policy,
            ..StoreConfig::default()
        };
        let store = layered_store(LAYERS, device_pages, config);
        let mut sim = DeviceSimulation::new(policy, device_pages, 64).unwrap();
        for layer in 0..LAYERS {
            put_layer(&store, layer, PER_LAYER);
            for p in 0..PER_LAYER as u32 {
                sim.write((layer, p)).unwrap();
            }
        }
        let mut missed = 0;
        for step in 0..16 {
            let q = query(&[step / 3, step / 3 + 1, (step * 5) % PER_LAYER]);
            for layer in 0..LAYERS {
                // With data, as the simulation assumes: reading a page
                // from the device marks it used.
                let req = SelectPages {
                    layer,
                    swap_in: true,
                    with_data: true,
                    ..select(&q, 3)
                };
                let sel = store.select_pages(&key(), req).unwrap();
                let chosen: Vec<_> = sel.heads[0].pages.iter().map(|p| (layer, p.page)).collect();
                let by_store = u64::from(sel.swap.from_host + sel.swap.from_nvme + sel.swap.not_hot);
                let by_simulation = sim.select(0, layer, LAYERS, &chosen).unwrap();
                let at = format!("{policy}, {device_pages} pages: step {step}, layer {layer}");
                assert_eq!(by_simulation, by_store, "{at}");
                missed += by_store;
                store.wait_idle();
            }
        }
        assert!(
            missed > 0,
            "{policy}, {device_pages} pages: the stream has misses to agree on"
        );
    }
}
