//! The host's frequency policy through the store: a prompt prefix that a
//! second request wrote again (shared through its hash chain by a put,
//! not attached at create) stays in host memory while one-off pages push
//! through; under LRU it migrates with them.

use std::sync::Arc;

use kvtier_core::{ColdTier, DType, Layout, LayoutSpec, PageState, SequenceKey};
use kvtier_store::{EngineChoice, HeadRange, HostPolicy, NvmeConfig, PutPages, Store, StoreConfig};

const PAGE: u32 = 16;
const DIM: usize = 64;
const PAGE_BYTES: u64 = 2 * PAGE as u64 * DIM as u64 * 2;

fn layout() -> Layout {
    Layout::new(LayoutSpec {
        num_layers: 1,
        num_kv_heads: 1,
        num_query_heads: 1,
        head_dim: DIM as u32,
        dtype: DType::F16,
        page_size: PAGE,
        layer_groups: vec![],
    })
    .unwrap()
}

fn key(name: &str) -> SequenceKey {
    SequenceKey::parse("t", name).unwrap()
}

/// `pages` full pages of finite f16 rows seeded by `seed`, from page `first`.
fn put(store: &Store, name: &str, seed: u8, first: u32, pages: u32) {
    let rows = (2 * pages * PAGE) as usize * DIM;
    let kv: Vec<u8> = (0..rows)
        .flat_map(|i| half::f16::from_f32(f32::from(seed) + (i % 97) as f32 * 0.01).to_le_bytes())
        .collect();
    let req = PutPages {
        layer: 0,
        heads: HeadRange { start: 0, count: 1 },
        first_page: first,
        num_tokens: pages * PAGE,
        kv: &kv,
        persist: false,
    };
    store.put_pages(&key(name), req).unwrap();
}

/// Pages of `name` in host memory (not only on NVMe).
fn in_host(store: &Store, name: &str) -> u64 {
    let pages = store.sequence_info(&key(name)).unwrap().pages;
    pages.get(PageState::Cold(ColdTier::Host)) + pages.get(PageState::Hot)
}

fn prefix_after_a_burst(policy: HostPolicy) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<Store> = Store::new(StoreConfig {
        device_bytes: 4 * PAGE_BYTES,
        host_bytes: 256 * PAGE_BYTES,
        cache_writes_on_device: false,
        host_policy: policy,
        nvme: Some(NvmeConfig {
            path: dir.path().join("nvme.data"),
            capacity: 64 << 20,
            engine: EngineChoice::Auto,
            queue_depth: 8,
            direct: true,
        }),
        ..StoreConfig::default()
    })
    .unwrap();
    let chain: Vec<Vec<u8>> = (0..4).map(|p| format!("prefix-{p}").into_bytes()).collect();
    // Both requests exist before either writes: the second shares the
    // prefix by writing it again, not by attaching it.
    for name in ["first", "second"] {
        let created = store.create_sequence(key(name), layout(), chain.clone()).unwrap();
        assert_eq!(created.attached_pages, 0);
    }
    put(&store, "first", 1, 0, 4);
    let outcome_pages = {
        put(&store, "second", 1, 0, 4);
        store.sequence_info(&key("second")).unwrap().shared_pages
    };
    assert_eq!(outcome_pages, 4, "the second write shared the prefix");
    // One-off pages, four times what host memory holds, in small writes.
    // (Host memory holds several migration batches of 64: a batch is
    // filled from the small queue.)
    store.create_sequence(key("burst"), layout(), vec![]).unwrap();
    for i in 0..256 {
        put(&store, "burst", 2, i * 4, 4);
    }
    in_host(&store, "first")
}

#[test]
fn a_prefix_written_again_by_another_request_outlasts_a_burst_under_frequency() {
    assert_eq!(prefix_after_a_burst(HostPolicy::Frequency), 4);
    assert_eq!(prefix_after_a_burst(HostPolicy::Lru), 0);
}
