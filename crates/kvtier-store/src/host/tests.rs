//! The host cache's contract: when host memory is full, room is made by
//! migrating least recently used pages to NVMe (whose copies then hold
//! their bytes), never a pinned page; without NVMe a full host says so.

use std::sync::Arc;
use std::sync::atomic::Ordering;

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

/// Host memory of 256 pages between the watermarks 0.75 and 0.5 under LRU,
/// filled with `pages` pages (0 the least recently used).
fn filled(pages: u64) -> (Parts, Vec<Arc<PhysPage>>) {
    let parts = Parts::with_host_watermarks(256, super::HostPolicy::Lru, (0.75, 0.5));
    let written = (0..pages).map(|id| parts.write_page(id).unwrap()).collect();
    (parts, written)
}

fn used_pages(parts: &Parts) -> u64 {
    parts.host.tier().used_bytes() / PAGE_BYTES
}

fn due_pages(parts: &Parts) -> u64 {
    parts.host.due_bytes.load(Ordering::Acquire) / PAGE_BYTES
}

fn unchosen_pages(parts: &Parts) -> u64 {
    parts.host.unchosen.load(Ordering::Acquire) / PAGE_BYTES
}

#[test]
fn a_round_opens_where_memory_passes_the_high_watermark_and_ends_at_the_low_one() {
    // 192 pages are the high watermark: no round is open at it.
    let (parts, pages) = filled(192);
    assert_eq!((due_pages(&parts), unchosen_pages(&parts)), (0, 0));
    // The 193rd takes memory past it: a round of what is above the low
    // watermark (65 pages) opens. Its allocation and its joining the queue
    // chose two pages each, the least recently used; none has moved.
    let page = parts.write_page(192).unwrap();
    let per_call = super::CHOSEN_PER_PAGE as u64;
    assert_eq!(
        (due_pages(&parts), unchosen_pages(&parts)),
        (2 * per_call, 65 - 2 * per_call)
    );
    assert!(in_host(&pages).iter().all(|&h| h));
    // Every later page allocated or written chooses more (reads choose
    // nothing), until the round is chosen.
    parts.host.touch(pages.iter());
    assert_eq!(due_pages(&parts), 2 * per_call);
    let mut calls = 0;
    while unchosen_pages(&parts) > 0 {
        parts.host.touch_written([&page]);
        calls += 1;
    }
    assert_eq!(calls, (65 - 2 * per_call).div_ceil(per_call));
    assert_eq!(due_pages(&parts), 65);
    parts.host.rebalance(&parts.durable);
    assert_eq!(used_pages(&parts), 128, "down to the low watermark");
    // The 4 chosen before the read went all the same (not chosen twice),
    // then the least recent after them.
    let kept = in_host(&pages);
    assert!(kept[..65].iter().all(|&h| !h), "the 65 least recent went");
    assert!(kept[65..].iter().all(|&h| h) && in_host(&[page]) == [true]);
    assert_eq!(due_pages(&parts), 0);
}

#[test]
fn a_round_moves_the_pages_chosen_and_chases_no_later_write() {
    let (parts, pages) = filled(193);
    while unchosen_pages(&parts) > 0 {
        parts.host.touch_written([&pages[192]]);
    }
    // Before the round runs: the least recent page is read (it still goes:
    // it was chosen), and 40 more pages are written (memory less the pages
    // chosen stays under the high watermark: no other round opens).
    parts.host.touch([&pages[0]]);
    let later: Vec<_> = (1000..1040).map(|id| parts.write_page(id).unwrap()).collect();
    assert_eq!((due_pages(&parts), unchosen_pages(&parts)), (65, 0));
    parts.host.rebalance(&parts.durable);
    assert!(!in_host(&pages)[0], "chosen before it was read");
    assert_eq!(in_host(&pages).iter().filter(|&&h| !h).count(), 65);
    assert!(in_host(&later).iter().all(|&h| h));
    assert_eq!(used_pages(&parts), 128 + 40, "the round did not chase the later writes");
}

#[test]
fn a_write_that_finds_memory_full_runs_the_round_due_before_choosing_its_own() {
    // The round (65 pages, chosen as the writes go on) has not run when
    // they fill memory: the write that finds it full runs it, and
    // migrates nothing else.
    let (parts, pages) = filled(193);
    let more: Vec<_> = (1000..1063).map(|id| parts.write_page(id).unwrap()).collect();
    assert_eq!(used_pages(&parts), 256);
    let last = parts.write_page(2000).unwrap();
    assert_eq!(used_pages(&parts), 256 - 65 + 1);
    assert_eq!(in_host(&pages).iter().filter(|&&h| !h).count(), 65);
    assert!(in_host(&more).iter().chain(&in_host(&[last])).all(|&h| h));
}

/// One step of [`where_rounds_fall_due_does_not_depend_on_when_they_run`].
#[derive(Debug, Clone)]
enum Op {
    Write,
    Touch(usize),
    Attach(usize),
    Free(usize),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        4 => Just(Op::Write),
        2 => any::<usize>().prop_map(Op::Touch),
        1 => any::<usize>().prop_map(Op::Attach),
        1 => any::<usize>().prop_map(Op::Free),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Which pages migrate, and where the next round opens, are the
    /// calls' doing alone: the same calls leave the same pages in host
    /// memory whether each round runs as soon as it falls due (as `kvtier
    /// tune`'s replay runs it) or only when it happens to (the background
    /// thread's timing; a write finding memory full runs it itself).
    #[test]
    fn where_rounds_fall_due_does_not_depend_on_when_they_run(
        frequency: bool,
        ops in proptest::collection::vec((op(), proptest::bool::weighted(0.2)), 1..400),
    ) {
        let policy = if frequency { super::HostPolicy::Frequency } else { super::HostPolicy::Lru };
        let [eager, lazy] = [(); 2].map(|_| Parts::with_host_watermarks(32, policy, (0.75, 0.5)));
        let mut live: [Vec<Arc<PhysPage>>; 2] = Default::default();
        for (id, (op, runs_now)) in (0u64..).zip(ops) {
            for (i, parts) in [&eager, &lazy].into_iter().enumerate() {
                let pages = &mut live[i];
                match op {
                    // NVMe holds 256 pages: the oldest goes first.
                    Op::Write if pages.len() >= 200 => {
                        parts.host.forget([pages.remove(0).id]);
                    }
                    Op::Write => pages.push(parts.write_page(id).unwrap()),
                    // A read touches what it finds in memory: the lazy
                    // store finds pages chosen but not yet moved, which
                    // must change no later choice.
                    Op::Touch(k) if !pages.is_empty() => {
                        let page = &pages[k % pages.len()];
                        if page.place.read().host().is_some() {
                            parts.host.touch([page]);
                        }
                    }
                    Op::Attach(k) if !pages.is_empty() => pages[k % pages.len()].attached_again(),
                    Op::Free(k) if !pages.is_empty() => {
                        let page = pages.remove(k % pages.len());
                        parts.host.forget([page.id]);
                    }
                    _ => {}
                }
                if i == 0 || runs_now {
                    parts.host.rebalance(&parts.durable);
                }
            }
            let held = |p: &Parts| p.host.tier().used_bytes() - p.host.due_bytes.load(Ordering::Acquire);
            proptest::prop_assert_eq!(held(&eager), held(&lazy));
        }
        lazy.host.rebalance(&lazy.durable);
        proptest::prop_assert_eq!(in_host(&live[0]), in_host(&live[1]));
    }
}
