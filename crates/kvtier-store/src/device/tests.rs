//! The hot set's contract: device room is made by demoting the least
//! recently used page that is not pinned, never by dropping the only copy;
//! a swap-in is best effort for selections and all or nothing when asked;
//! an exclusive cache moves pages up and copies them back down.

use std::sync::Arc;

use kvtier_core::{ColdTier, PageState, Reason};

use crate::page::{PhysPage, Pins};
use crate::testing::{PAGE_BYTES, Parts};

fn state(page: &PhysPage) -> PageState {
    page.place.read().state()
}

#[test]
fn making_room_demotes_the_least_recently_used_unpinned_page() {
    let parts = Parts::new(2, 16, false);
    let (a, b, c) = (parts.page(1), parts.page(2), parts.page(3));
    let report = parts
        .device
        .make_hot(&[Arc::clone(&a), Arc::clone(&b)], Reason::Demand, &parts.reader());
    assert_eq!(report.from_host, 2);
    // `b` was made hot with `a`; using `a` since leaves `b` the least
    // recently used, but `b` is pinned: `a` goes.
    parts.device.touch([&b, &a]);
    let _pinned = Pins::new(vec![Arc::clone(&b)]);
    let report = parts
        .device
        .make_hot(&[Arc::clone(&c)], Reason::Demand, &parts.reader());
    assert_eq!(report.from_host, 1);
    assert_eq!(state(&a), PageState::Cold(ColdTier::Host), "demoted");
    assert_eq!(state(&b), PageState::Hot, "pinned pages stay");
    assert_eq!(state(&c), PageState::Hot);
    assert!(a.place.read().host().is_some(), "demotion keeps the backing copy");
}

#[test]
fn an_all_or_nothing_swap_in_moves_nothing_without_room_for_all() {
    let parts = Parts::new(2, 16, false);
    let pages: Vec<_> = (1..=4).map(|id| parts.page(id)).collect();
    parts.device.make_hot(&pages[..2], Reason::Demand, &parts.reader());
    let _pinned = Pins::new(pages[..2].to_vec());
    let used = parts.device.tier().used_bytes();
    assert!(
        parts
            .device
            .make_all_hot(&pages[2..], Reason::Explicit, &parts.reader())
            .is_err()
    );
    assert_eq!(parts.device.tier().used_bytes(), used, "no slot kept");
    assert!(pages[2..].iter().all(|p| state(p) == PageState::Cold(ColdTier::Host)));
    // Best effort, the same request makes what room allows hot: none.
    let report = parts.device.make_hot(&pages[2..], Reason::Demand, &parts.reader());
    assert_eq!((report.from_host, report.not_hot), (0, 2));
    // With room for all, all move, each counted once.
    drop(_pinned);
    let report = parts
        .device
        .make_all_hot(&pages[2..], Reason::Explicit, &parts.reader())
        .expect("room after the pins went");
    assert_eq!(report.from_host, 2);
    let counted = parts.counters.transitions();
    let swapped: u64 = counted
        .iter()
        .filter(|t| t.to == PageState::Hot && t.reason == Reason::Explicit)
        .map(|t| t.count)
        .sum();
    assert_eq!(swapped, 2);
}

#[test]
fn an_exclusive_cache_moves_pages_up_and_copies_them_back_down() {
    let parts = Parts::new(1, 16, true);
    let (a, b) = (parts.page(1), parts.page(2));
    parts
        .device
        .make_hot(&[Arc::clone(&a)], Reason::Demand, &parts.reader());
    assert!(
        a.place.read().host().is_none(),
        "the device copy replaced the host copy"
    );
    assert_eq!(parts.host.tier().used_bytes(), PAGE_BYTES, "only b in host memory");
    // Room for b demotes a, whose only copy is on the device: copied down.
    parts
        .device
        .make_hot(&[Arc::clone(&b)], Reason::Demand, &parts.reader());
    assert_eq!(state(&a), PageState::Cold(ColdTier::Host));
    let originals = parts
        .reader()
        .originals(&parts.layout, &[(Arc::clone(&a), parts.layout.page_size())])
        .unwrap();
    assert_eq!(
        originals[0].as_deref(),
        Some(&Parts::bytes(1)[..]),
        "a's bytes came back down whole"
    );
}
