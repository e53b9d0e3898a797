//! The policy's contract over pages: the scorer's kept pages stay, the
//! other candidates are acted on; a partial last page is never a
//! candidate; an offload keeps the pages a lease pins.

use std::sync::Arc;

use kvtier_core::policy::{Allocator, PolicyAction, PolicySpec, Scorer};
use kvtier_core::{ColdTier, LogicalPage, SequenceKey};

use super::decide;
use crate::catalog::{Catalog, Sequence};
use crate::page::{PageRef, Pins};
use crate::testing::Parts;

/// A sequence of one lane holding `full` full pages and, with `partial`,
/// a last page of half the rows.
fn sequence(parts: &Parts, catalog: &Catalog, full: u64, partial: bool) -> Sequence {
    let key = SequenceKey::parse("t", "s").unwrap();
    let charge = parts.accounts.open(&key, 0, true).unwrap();
    let mut seq = Sequence::new(key, Arc::clone(&parts.layout), vec![], charge);
    let rows = parts.layout.page_size() as usize;
    let row = parts.layout.row_bytes();
    for id in 0..full + u64::from(partial) {
        let (r, _) = catalog.publish(parts.page(id), None).unwrap();
        let n = if id == full { rows / 2 } else { rows };
        let keys = &Parts::bytes(id)[..n * row];
        seq.lanes[0].push_page(LogicalPage::Physical(PageRef { id: r.id, page: r.page }), keys);
    }
    seq
}

fn spec(budget_pages: u32, action: PolicyAction, parts: &Parts) -> PolicySpec {
    PolicySpec {
        layer_start: 0,
        layer_count: 1,
        scorer: Scorer::Streaming { sink_tokens: 4 },
        allocator: Allocator::Uniform,
        budget_tokens: budget_pages * parts.layout.page_size(),
        action,
    }
}

fn acted_on(seq: &mut Sequence, parts: &Parts, spec: &PolicySpec) -> Vec<usize> {
    let decision = decide(seq, &parts.reader(), spec, &[]).unwrap();
    decision.targets.iter().map(|t| t.page).collect()
}

#[test]
fn the_scorers_pages_stay_and_the_other_candidates_go() {
    let parts = Parts::new(1, 16, false);
    let catalog = Catalog::default();
    let mut seq = sequence(&parts, &catalog, 8, false);
    // StreamingLLM with 3 pages: the sink page and the two newest stay.
    let evict = spec(3, PolicyAction::Evict, &parts);
    assert_eq!(acted_on(&mut seq, &parts, &evict), vec![1, 2, 3, 4, 5]);
}

#[test]
fn a_partial_last_page_is_never_a_candidate() {
    let parts = Parts::new(1, 16, false);
    let catalog = Catalog::default();
    let mut seq = sequence(&parts, &catalog, 6, true);
    // Budget 2 over the 6 full pages: the sink and the newest full one
    // stay; page 6, being appended to, is left out.
    let evict = spec(2, PolicyAction::Evict, &parts);
    assert_eq!(acted_on(&mut seq, &parts, &evict), vec![1, 2, 3, 4]);
}

#[test]
fn an_offload_keeps_leased_pages() {
    let parts = Parts::new(8, 16, false);
    let catalog = Catalog::default();
    let mut seq = sequence(&parts, &catalog, 6, false);
    // An offload's candidates are hot pages.
    let pages: Vec<_> = (0..6)
        .filter_map(|p| match seq.lanes[0].page(p) {
            Some(LogicalPage::Physical(r)) => Some(Arc::clone(&r.page)),
            _ => None,
        })
        .collect();
    parts
        .device
        .make_hot(&pages, kvtier_core::Reason::Explicit, &parts.reader());
    let pinned = match seq.lanes[0].page(2) {
        Some(LogicalPage::Physical(r)) => Arc::clone(&r.page),
        _ => unreachable!("page 2 is physical"),
    };
    let _lease = Pins::new(vec![pinned]);
    let offload = spec(2, PolicyAction::Offload(ColdTier::Nvme), &parts);
    assert_eq!(acted_on(&mut seq, &parts, &offload), vec![1, 3, 4]);
    let evict = spec(2, PolicyAction::Evict, &parts);
    assert_eq!(
        acted_on(&mut seq, &parts, &evict),
        vec![1, 2, 3, 4],
        "an eviction is not held by a lease"
    );
}
