//! Disk faults on the NVMe tier: ENOSPC and EIO, injected through a wrapper
//! and, where this machine allows a loop mount, real ENOSPC from a tiny
//! filesystem. Each surfaces as a precise error or a per-page status, and
//! the store stays consistent and keeps serving what it has.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use kvtier_core::{Action, ColdTier, DType, Layout, LayoutSpec, PageState, Reason, SequenceKey};
use kvtier_store::{
    Durability, EngineChoice, FetchPages, HeadRange, NvmeConfig, PageContent, PageList, PageSelection, PutPages,
    SetPageState, Store, StoreConfig, StoreError, TierError,
};
use kvtier_tiers::faults::{Faults, FaultyTier};
use kvtier_tiers::{ArenaTier, NvmeTier};

const PAGE: usize = 16;
const DIM: usize = 64;
/// 2 × 16 × 64 × 2 bytes.
const PAGE_BYTES: u64 = 4096;

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

fn nvme_config(path: &Path, capacity: u64) -> NvmeConfig {
    NvmeConfig {
        path: path.to_owned(),
        capacity,
        engine: EngineChoice::Auto,
        queue_depth: 8,
        direct: true,
    }
}

/// A store with `host_pages` of host memory over a fault-injecting NVMe tier.
fn faulty_store(dir: &Path, host_pages: u64, durability: Durability) -> (Arc<Store>, Arc<Faults>) {
    let faults = Faults::none();
    let nvme = NvmeTier::open(nvme_config(&dir.join("nvme.data"), 1 << 20)).unwrap();
    let config = StoreConfig {
        manifest_path: Some(dir.join("manifest")),
        promote_on_read: false,
        durability,
        ..StoreConfig::default()
    };
    let store = Store::with_tiers(
        Arc::new(ArenaTier::emulated_device(0).unwrap()),
        Arc::new(ArenaTier::host(host_pages * PAGE_BYTES).unwrap()),
        Some(Arc::new(FaultyTier::new(nvme, Arc::clone(&faults)))),
        config,
    )
    .unwrap();
    store.create_sequence(key(), layout(), vec![]).unwrap();
    (store, faults)
}

/// K then V bytes for `pages` pages starting at `first`, distinct per page.
fn data(first: usize, pages: usize) -> Vec<u8> {
    let mut k = Vec::new();
    let mut v = Vec::new();
    for t in first * PAGE..(first + pages) * PAGE {
        for i in 0..DIM {
            k.extend_from_slice(&half::f16::from_f32(t as f32 * 0.125 + i as f32 * 0.001).to_le_bytes());
            v.extend_from_slice(&half::f16::from_f32(-(t as f32) - i as f32).to_le_bytes());
        }
    }
    [k, v].concat()
}

fn page_bytes(p: usize) -> Vec<u8> {
    data(p, 1)
}

fn put(store: &Store, first: usize, pages: usize, persist: bool) -> Result<(), StoreError> {
    let kv = data(first, pages);
    let req = PutPages {
        layer: 0,
        heads: HeadRange { start: 0, count: 1 },
        first_page: first as u32,
        num_tokens: (pages * PAGE) as u32,
        kv: &kv,
        persist,
    };
    store.put_pages(&key(), req).map(drop)
}

fn fetch(store: &Store) -> Vec<kvtier_store::FetchedPage> {
    let req = FetchPages {
        layer: 0,
        heads: HeadRange { start: 0, count: 1 },
        pages: PageList::All,
        with_digests: false,
    };
    store.fetch_pages(&key(), req).unwrap()
}

fn set(store: &Store, action: Action, first: u32, count: u32) -> Result<(), StoreError> {
    let req = SetPageState {
        layer_start: 0,
        layer_count: 1,
        heads: HeadRange { start: 0, count: 1 },
        pages: PageSelection::Range { first, count },
        action,
        summary_rows: 1,
        reason: Reason::Explicit,
    };
    store.set_page_state(&key(), req).map(drop)
}

/// Every page the store serves with bytes has the bytes written.
fn consistent(store: &Store) -> usize {
    let pages = fetch(store);
    for p in &pages {
        if let PageContent::Original(b) = &p.content {
            assert_eq!(b, &page_bytes(p.page as usize), "page {} changed", p.page);
        }
    }
    let stats = store.stats();
    assert!(stats.tiers.iter().all(|t| t.used_bytes <= t.capacity_bytes));
    pages.len()
}

#[test]
fn enospc_during_migration_refuses_the_write_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faults) = faulty_store(dir.path(), 8, Durability::Relaxed);
    // Room on "disk" for 10 pages only.
    faults.writes_left.store(10 * PAGE_BYTES, Relaxed);
    let mut written = 0;
    let err = loop {
        match put(&store, written, 2, false) {
            Ok(()) => written += 2,
            Err(e) => break e,
        }
        assert!(written < 100, "ENOSPC never surfaced");
    };
    assert!(
        matches!(&err, StoreError::ResourceExhausted(e) if e.is_no_space()),
        "{err}"
    );
    assert!(err.to_string().contains("No space left on device"), "{err}");
    assert_eq!(consistent(&store), written, "every acknowledged page is still there");
    assert_eq!(store.sequence_info(&key()).unwrap().pages.get(PageState::Gone), 0);
    // The disk frees up: writing works again.
    faults.writes_left.store(u64::MAX, Relaxed);
    put(&store, written, 2, false).unwrap();
    assert_eq!(consistent(&store), written + 2);
}

#[test]
fn eio_on_reads_turns_pages_gone_and_the_rest_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faults) = faulty_store(dir.path(), 64, Durability::Relaxed);
    put(&store, 0, 6, false).unwrap();
    set(&store, Action::Migrate(ColdTier::Nvme), 0, 3).unwrap();
    faults.read_eio.store(true, Relaxed);
    let pages = fetch(&store);
    for p in &pages {
        match p.page {
            0..3 => assert_eq!(p.content, PageContent::Gone(Reason::Integrity), "page {}", p.page),
            _ => assert_eq!(p.content, PageContent::Original(page_bytes(p.page as usize))),
        }
    }
    faults.read_eio.store(false, Relaxed);
    // Lost stays lost (never served from a copy that failed), and is counted.
    assert_eq!(fetch(&store)[0].content, PageContent::Gone(Reason::Integrity));
    let info = store.sequence_info(&key()).unwrap();
    assert_eq!(info.gone_by_reason, [(Reason::Integrity, 3)]);
    consistent(&store);
}

#[test]
fn eio_on_writes_fails_the_move_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faults) = faulty_store(dir.path(), 64, Durability::Relaxed);
    put(&store, 0, 4, false).unwrap();
    faults.write_eio.store(true, Relaxed);
    let err = set(&store, Action::Migrate(ColdTier::Nvme), 0, 4).unwrap_err();
    assert!(
        matches!(&err, StoreError::Unavailable(TierError::Io { errno: Some(5), .. })),
        "{err}"
    );
    assert!(fetch(&store).iter().all(|p| p.state == PageState::Cold(ColdTier::Host)));
    let err = put(&store, 4, 1, true).unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    faults.write_eio.store(false, Relaxed);
    set(&store, Action::Migrate(ColdTier::Nvme), 0, 4).unwrap();
    assert_eq!(consistent(&store), 5);
}

#[test]
fn under_fsync_the_manifest_is_never_synced_ahead_of_the_data_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faults) = faulty_store(dir.path(), 64, Durability::Fsync);
    put(&store, 0, 2, false).unwrap();
    // The manifest now names page 0's NVMe copy.
    set(&store, Action::Migrate(ColdTier::Nvme), 0, 1).unwrap();
    // From here the data file cannot be synced: the commit of an eviction,
    // which syncs the manifest, must fail rather than sync it alone.
    faults.write_eio.store(true, Relaxed);
    let err = set(&store, Action::Evict, 1, 1).unwrap_err();
    assert!(
        matches!(&err, StoreError::Manifest(_)) && err.to_string().contains("fdatasync"),
        "{err}"
    );
    faults.write_eio.store(false, Relaxed);
    assert_eq!(consistent(&store), 2);
}

/// Unmounts and removes the loop mount when the test ends.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn real_enospc_from_a_tiny_filesystem() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("tiny.img");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    std::fs::File::create(&image).unwrap().set_len(4 << 20).unwrap();
    let ok = |c: &mut Command| c.output().map(|o| o.status.success()).unwrap_or(false);
    let mounted = ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image))
        && ok(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(&mnt));
    if !mounted {
        assert!(
            std::env::var_os("KVTIER_REQUIRE_LOOP").is_none(),
            "a loop mount is required but failed"
        );
        println!("skipped: cannot mount a loop filesystem here (needs root and loop devices)");
        return;
    }
    let _mount = Mount(mnt.clone());
    // 64 MiB of tier on a 4 MiB filesystem: the sparse file is created, and
    // the disk runs out long before the tier does.
    let store = Store::new(StoreConfig {
        device_bytes: 0,
        host_bytes: 64 * PAGE_BYTES,
        nvme: Some(nvme_config(&mnt.join("nvme.data"), 64 << 20)),
        manifest_path: Some(dir.path().join("manifest")),
        ..StoreConfig::default()
    })
    .unwrap();
    store.create_sequence(key(), layout(), vec![]).unwrap();
    let mut written = 0;
    let err = loop {
        match put(&store, written, 8, true) {
            Ok(()) => written += 8,
            Err(e) => break e,
        }
        assert!(written < 10_000, "ENOSPC never surfaced");
    };
    assert!(
        matches!(&err, StoreError::ResourceExhausted(e) if e.is_no_space()),
        "{err}"
    );
    // What was acknowledged is served, bit-exact; nothing else changed.
    assert!(written > 0);
    assert_eq!(
        consistent(&store),
        written + 8,
        "the refused write's pages stay in memory, not lost"
    );
    drop(store);
}
