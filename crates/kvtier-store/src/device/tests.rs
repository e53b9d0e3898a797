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

/// Hits over passes 2.. of a loop over `pages` pages, one page a
/// selection (no layer-ahead prefetch: selections made on the hot set
/// directly), on a device of 8 pages under `policy`. Checks that the
/// device's own counts of hits by region and misses agree with what the
/// swap-ins found, and returns the resident hits with them.
fn loop_hits(policy: super::DevicePolicy, pages: u64) -> (u32, u32, u64) {
    let parts = Parts::with_policy(8, 64, false, policy);
    let all: Vec<_> = (0..pages).map(|id| parts.page(id)).collect();
    let (mut hits, mut asked, mut all_hits) = (0, 0, 0);
    for pass in 0..10 {
        for group in all.chunks(1) {
            parts.device.note_chosen(group);
            parts.device.selected(group);
            let report = parts.device.make_hot(group, Reason::Demand, &parts.reader());
            all_hits += u64::from(report.already_hot);
            if pass >= 2 {
                hits += report.already_hot;
                asked += group.len() as u32;
            }
        }
    }
    let c = &parts.counters;
    let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    let (resident, stream, misses) = (
        load(&c.device_hits_resident),
        load(&c.device_hits_stream),
        load(&c.device_misses),
    );
    assert_eq!(resident + stream, all_hits, "{policy}: hits by region");
    assert_eq!(misses, 10 * pages - all_hits, "{policy}: misses");
    (hits, asked, resident)
}

#[test]
fn on_a_loop_longer_than_the_device_lru_keeps_nothing_and_loop_keeps_a_subset() {
    let (lru, asked, resident) = loop_hits(super::DevicePolicy::Lru, 32);
    assert_eq!(lru, 0, "LRU's worst case: every page goes before its next use");
    assert_eq!(resident, 0, "LRU has no resident region");
    let (kept, _, resident) = loop_hits(super::DevicePolicy::Loop, 32);
    assert!(resident >= u64::from(kept), "the loop's hits are the subset's");
    // The stream region keeps 2 pages (twice a selection); the resident
    // subset's 6 hit on every pass: 6 of 32.
    let ratio = f64::from(kept) / f64::from(asked);
    assert!(
        ratio >= 0.9 * 6.0 / 32.0,
        "hit ratio {ratio} from {kept} hits of {asked}"
    );
    // A loop that fits is served from the device either way.
    let (lru, asked, _) = loop_hits(super::DevicePolicy::Lru, 8);
    let (kept, ..) = loop_hits(super::DevicePolicy::Loop, 8);
    assert_eq!((lru, kept), (asked, asked));
}

#[test]
fn only_an_explicit_swap_in_takes_a_resident_pages_room() {
    let parts = Parts::with_policy(5, 64, false, super::DevicePolicy::Loop);
    let pages: Vec<_> = (0..8).map(|id| parts.page(id)).collect();
    // Pages 0..3 are chosen often, one a selection: resident (3 of the 5
    // device pages; the stream region keeps 2).
    for _ in 0..3 {
        for page in &pages[..3] {
            let one = [Arc::clone(page)];
            parts.device.selected(&one);
            parts.device.make_hot(&one, Reason::Demand, &parts.reader());
        }
    }
    parts.device.make_hot(&pages[3..5], Reason::Demand, &parts.reader());
    let _pinned = Pins::new(pages[3..5].to_vec());
    // The stream region's pages are pinned: a prefetch finds no room.
    let report = parts.device.make_hot(&pages[5..7], Reason::Prefetch, &parts.reader());
    assert_eq!((report.from_host, report.not_hot), (0, 2));
    assert!(pages[..5].iter().all(|p| state(p) == PageState::Hot));
    // Nor does a selection's swap-in: its miss stays cold.
    let report = parts.device.make_hot(&pages[7..8], Reason::Demand, &parts.reader());
    assert_eq!((report.from_host, report.not_hot), (0, 1));
    // An explicit swap-in takes the lowest resident page's room.
    let report = parts
        .device
        .make_all_hot(&pages[7..8], Reason::Explicit, &parts.reader())
        .unwrap();
    assert_eq!(report.from_host, 1);
    assert_eq!(pages[..3].iter().filter(|p| state(p) == PageState::Hot).count(), 2);
}

#[test]
fn a_burst_of_one_off_requests_does_not_displace_a_shared_prefix() {
    // 8 device pages: 2 for the stream region (one page a selection), 6
    // for the subset. Tenant A's prefix: 3 pages a second request attached,
    // chosen twice each. Then tenant B's burst: 40 one-off pages, each
    // chosen 6 times by its own request (far more often than A's).
    let parts = Parts::with_policy(8, 128, false, super::DevicePolicy::Loop);
    let choose = |page: &Arc<PhysPage>| {
        let one = [Arc::clone(page)];
        parts.device.selected(&one);
        parts.device.make_hot(&one, Reason::Demand, &parts.reader());
    };
    let prefix: Vec<_> = (0..3).map(|id| parts.page(id)).collect();
    for page in &prefix {
        page.attached_again();
        choose(page);
        choose(page);
    }
    let burst: Vec<_> = (100..140).map(|id| parts.page(id)).collect();
    for page in &burst {
        for _ in 0..6 {
            choose(page);
        }
    }
    assert!(
        prefix.iter().all(|p| state(p) == PageState::Hot),
        "the shared prefix stays on the device: {:?}",
        prefix.iter().map(|p| state(p)).collect::<Vec<_>>()
    );
    // The burst had the rest of the device: the subset's other 3 pages
    // and the stream region's 2.
    assert_eq!(burst.iter().filter(|p| state(p) == PageState::Hot).count(), 5);
}

#[test]
fn a_left_behind_member_gives_way_only_to_a_page_chosen_lately_and_not_shared_less() {
    let parts = Parts::with_policy(8, 64, false, super::DevicePolicy::Loop);
    let (member, page, brought, other) = (parts.page(1), parts.page(2), parts.page(3), parts.page(4));
    let reuse = &parts.device.reuse;
    reuse.loop_changed(10); // a step chooses 10 pages
    reuse.count(&member);
    for _ in 0..50 {
        reuse.count(&other); // 5 steps without the member
    }
    reuse.count(&page);
    let gives_way = |page: &PhysPage| parts.device.gives_way(&member, page, reuse.score(page));
    assert!(gives_way(&page), "left behind, to a page chosen now");
    assert!(!gives_way(&brought), "never chosen: a client's prefetch brought it");
    member.attached_again();
    assert!(!gives_way(&page), "shared by more requests than the page");
    page.attached_again();
    assert!(gives_way(&page), "shared alike");
}

#[test]
fn a_prefetch_is_used_late_or_wasted_once_by_its_kind() {
    use crate::stats::PrefetchKind::{self, Asked, LayerAhead};
    let parts = Parts::new(2, 16, false);
    let pages: Vec<_> = (1..=5).map(|id| parts.page(id)).collect();
    let c = |kind: PrefetchKind| {
        let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
        let p = &parts.counters.prefetch[kind.index()];
        (load(&p.issued), load(&p.used), load(&p.late), load(&p.wasted))
    };
    let prefetch = |group: &[Arc<PhysPage>], kind| {
        let marks = parts.device.mark_queued(group, kind);
        parts.device.make_hot(group, Reason::Prefetch, &parts.reader());
        drop(marks);
    };
    // Made hot, then chosen: issued and used, once.
    prefetch(&pages[..1], LayerAhead);
    parts.device.note_chosen(&pages[..1]);
    parts.device.note_chosen(&pages[..1]);
    assert_eq!(c(LayerAhead), (1, 1, 0, 0));
    // Chosen while still queued: late; its arrival then counts for nothing.
    let marks = parts.device.mark_queued(&pages[1..2], Asked);
    parts.device.note_chosen(&pages[1..2]);
    parts.device.make_hot(&pages[1..2], Reason::Prefetch, &parts.reader());
    drop(marks);
    parts.device.note_chosen(&pages[1..2]);
    assert_eq!(c(Asked), (0, 0, 1, 0));
    // Made hot, then demoted unchosen: wasted (the device holds 2 pages;
    // the two after it push it out).
    prefetch(&pages[2..3], Asked);
    parts.device.make_hot(&pages[..2], Reason::Demand, &parts.reader());
    parts.device.make_hot(&pages[3..4], Reason::Demand, &parts.reader());
    assert_eq!(state(&pages[2]), PageState::Cold(ColdTier::Host));
    assert_eq!(c(Asked), (1, 0, 1, 1));
    // A prefetch that made nothing hot (already hot) leaves no mark: a
    // later choice of the page is neither used nor late.
    prefetch(&pages[3..4], LayerAhead);
    parts.device.note_chosen(&pages[3..4]);
    assert_eq!(c(LayerAhead), (1, 1, 0, 0));
    // Two prefetches of one page: the first to queue it owns its mark, so
    // the page counts once, for that kind, whichever job brings it up.
    let ahead = parts.device.mark_queued(&pages[4..5], LayerAhead);
    assert_eq!(ahead.0.len(), 1);
    assert!(parts.device.mark_queued(&pages[4..5], Asked).0.is_empty());
    parts.device.make_hot(&pages[4..5], Reason::Prefetch, &parts.reader());
    parts.device.note_chosen(&pages[4..5]);
    assert_eq!(c(LayerAhead), (2, 2, 0, 0));
    assert_eq!(c(Asked), (1, 0, 1, 1));
}
