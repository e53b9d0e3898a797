//! The host cache's contract: when host memory is full, room is made by
//! migrating least recently used pages to NVMe (whose copies then hold
//! their bytes), never a pinned page; without NVMe a full host says so.

use std::sync::Arc;

use kvtier_core::{ColdTier, PageState};
use kvtier_tiers::TierError;

use super::MigrationTime;
use crate::StoreError;
use crate::page::{PhysPage, Pins};
use crate::testing::{PAGE_BYTES, Parts};

#[test]
fn a_full_host_migrates_unpinned_pages_to_nvme_and_keeps_their_bytes() {
    let parts = Parts::new(1, 4, false);
    let pages: Vec<_> = (1..=4).map(|id| parts.page(id)).collect();
    let _pinned = Pins::new(vec![Arc::clone(&pages[1])]);
    let slot = parts
        .host
        .allocate(PAGE_BYTES, &parts.durable, &mut MigrationTime::default(), &parts.owner)
        .expect("room made by migration");
    drop(slot);
    for (i, page) in pages.iter().enumerate() {
        let state = page.place.read().state();
        if i == 1 {
            assert_eq!(state, PageState::Cold(ColdTier::Host), "a pinned page never migrates");
        } else {
            assert_eq!(state, PageState::Cold(ColdTier::Nvme), "page {i} migrated");
        }
    }
    let requests: Vec<_> = pages
        .iter()
        .map(|p| (Arc::clone(p), parts.layout.page_size()))
        .collect();
    let read = parts.reader().originals(&parts.layout, &requests).unwrap();
    for (id, bytes) in (1..=4).zip(read) {
        assert_eq!(bytes.as_deref(), Some(&Parts::bytes(id)[..]), "page {id}'s bytes");
    }
}

#[test]
fn recently_used_pages_migrate_last() {
    // Half the LRU (64 pages a batch) migrates at once: of 128 pages, the
    // 64 least recently used go, the 64 touched since stay.
    let parts = Parts::new(1, 128, false);
    let pages: Vec<_> = (0..128).map(|id| parts.page(id)).collect();
    parts.host.touch(pages[..64].iter());
    parts
        .host
        .allocate(PAGE_BYTES, &parts.durable, &mut MigrationTime::default(), &parts.owner)
        .expect("room made by migration");
    let in_host: Vec<bool> = pages.iter().map(|p| p.place.read().host().is_some()).collect();
    assert!(in_host[..64].iter().all(|&h| h), "recently used pages stay");
    assert!(in_host[64..].iter().all(|&h| !h), "the least recently used go");
}

#[test]
fn without_room_to_migrate_to_a_full_host_is_refused() {
    let parts = Parts::new(1, 2, false);
    let pages: Vec<_> = (1..=2).map(|id| parts.page(id)).collect();
    let _pinned = Pins::new(pages.clone());
    let refused = parts
        .host
        .allocate(PAGE_BYTES, &parts.durable, &mut MigrationTime::default(), &parts.owner);
    assert!(
        matches!(refused, Err(StoreError::ResourceExhausted(TierError::Full { .. }))),
        "{refused:?}"
    );
    assert!(pages.iter().all(|p| p.place.read().host().is_some()));
}

/// 128 pages (0 the least recently used) in a full host under `policy`,
/// pages `attached` attached by a second request, after one allocation.
fn after_one_migration(policy: super::HostPolicy, attached: std::ops::Range<usize>) -> (Parts, Vec<Arc<PhysPage>>) {
    let parts = Parts::with_host_policy(1, 128, policy);
    let pages: Vec<_> = (0..128).map(|id| parts.page(id)).collect();
    for page in &pages[attached] {
        page.attached_again();
    }
    allocate_one(&parts);
    (parts, pages)
}

fn allocate_one(parts: &Parts) {
    parts
        .host
        .allocate(PAGE_BYTES, &parts.durable, &mut MigrationTime::default(), &parts.owner)
        .expect("room made by migration");
}

fn in_host(pages: &[Arc<PhysPage>]) -> Vec<bool> {
    pages.iter().map(|p| p.place.read().host().is_some()).collect()
}

#[test]
fn under_the_frequency_policy_one_off_pages_migrate_before_pages_attached_again() {
    use super::HostPolicy::{Frequency, Lru};
    // The 16 least recently used pages are a prefix a second request
    // attached; a batch of 64 migrates.
    let (_, pages) = after_one_migration(Lru, 0..16);
    assert!(
        in_host(&pages)[..64].iter().all(|&h| !h),
        "LRU: the prefix goes with the oldest"
    );
    let (parts, pages) = after_one_migration(Frequency, 0..16);
    let kept = in_host(&pages);
    assert!(kept[..16].iter().all(|&h| h), "the prefix moved to the main queue");
    assert!(kept[16..80].iter().all(|&h| !h), "the next 64 go instead");
    assert!(kept[80..].iter().all(|&h| h));
    // A burst of one-off pages churns through the small queue alone.
    for round in 0..4 {
        let _burst: Vec<_> = (0..64).map(|id| parts.page(1000 * (round + 1) + id)).collect();
        allocate_one(&parts);
        assert!(in_host(&pages)[..16].iter().all(|&h| h), "round {round}");
    }
}

#[test]
fn a_main_queue_past_its_share_spends_chances_then_migrates_its_least_recent() {
    // 120 of 128 pages attached again: they move to the main queue, the 8
    // others migrate.
    let (parts, pages) = after_one_migration(super::HostPolicy::Frequency, 0..120);
    assert_eq!(in_host(&pages).iter().filter(|&&h| h).count(), 120);
    // The main queue holds more than 90% of the pages: its turn first.
    // Each spends its one chance, so the room comes from the small queue
    // (only the page asked for: a batch fills from the queue in turn) ...
    let first: Vec<_> = (1000..1008).map(|id| parts.page(id)).collect();
    allocate_one(&parts);
    assert!(in_host(&pages)[..120].iter().all(|&h| h));
    assert_eq!(in_host(&first), [false, true, true, true, true, true, true, true]);
    // ... and at their next turn, with none left, a batch of the least
    // recent goes.
    let _second = parts.page(2000);
    allocate_one(&parts);
    let kept = in_host(&pages);
    assert!(kept[..64].iter().all(|&h| !h), "{kept:?}");
    assert!(kept[64..120].iter().all(|&h| h), "{kept:?}");
}

#[test]
fn chances_only_reorder_a_host_of_attached_pages_still_makes_room() {
    let (_, pages) = after_one_migration(super::HostPolicy::Frequency, 0..128);
    let kept = in_host(&pages);
    assert_eq!(kept.iter().filter(|&&h| !h).count(), 1, "exactly the room asked for");
    assert!(!kept[0], "the least recent goes");
}
