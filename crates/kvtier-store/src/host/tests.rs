//! The host cache's contract: when host memory is full, room is made by
//! migrating least recently used pages to NVMe (whose copies then hold
//! their bytes), never a pinned page; without NVMe a full host says so.

use std::sync::Arc;

use kvtier_core::{ColdTier, PageState};
use kvtier_tiers::TierError;

use super::MigrationTime;
use crate::StoreError;
use crate::page::Pins;
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
