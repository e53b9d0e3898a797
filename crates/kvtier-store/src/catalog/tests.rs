//! The catalog's contract: one page per share key, referenced by every
//! logical page that maps it and freed with its last reference; one
//! sequence per key; a removed sequence is not found.

use std::sync::Arc;

use kvtier_core::{SequenceKey, TenantId};

use super::{Catalog, Sequence};
use crate::StoreError;
use crate::page::{ShareKey, StorePage};
use crate::testing::Parts;

fn share_key(parts: &Parts, hash: u8) -> ShareKey {
    ShareKey {
        tenant: TenantId::parse("tenant", "t").unwrap(),
        layout: Arc::clone(&parts.layout),
        hash: Arc::from(&[hash][..]),
        lane: 0,
    }
}

#[test]
fn a_key_names_one_page_freed_with_its_last_reference() {
    let parts = Parts::new(1, 8, false);
    let catalog = Catalog::default();
    let (first, second) = (parts.page(1), parts.page(2));
    let (a, shared) = catalog.publish(Arc::clone(&first), Some(share_key(&parts, 9))).unwrap();
    assert!(!shared);
    // Another page stored under the same key meanwhile: the first is used.
    let (b, shared) = catalog.publish(second, Some(share_key(&parts, 9))).unwrap();
    assert!(shared);
    assert!(Arc::ptr_eq(&b.page, &first));
    let c = catalog.share(&share_key(&parts, 9)).expect("shared by key");
    assert!(
        catalog.share(&share_key(&parts, 8)).is_none(),
        "another key names nothing"
    );
    assert_eq!((catalog.physical_pages(), catalog.shared([a.id])), (1, 1));
    let freed = catalog.release([StorePage::Physical(a), StorePage::Physical(b)]);
    assert!(freed.is_empty(), "one reference is left");
    let freed = catalog.release([StorePage::Physical(c)]);
    assert_eq!(freed.len(), 1);
    assert!(Arc::ptr_eq(&freed[0], &first));
    assert_eq!(catalog.physical_pages(), 0);
    assert!(
        catalog.share(&share_key(&parts, 9)).is_none(),
        "the key went with the page"
    );
}

#[test]
fn one_sequence_per_key_and_a_removed_one_is_not_found() {
    let parts = Parts::new(1, 8, false);
    let catalog = Catalog::default();
    let key = SequenceKey::parse("t", "s").unwrap();
    let sequence = || {
        let charge = parts.accounts.open(&key, 0, true).unwrap();
        Sequence::new(key.clone(), Arc::clone(&parts.layout), vec![], charge)
    };
    catalog.insert(sequence(), |_| {}).unwrap();
    let mut announced = false;
    assert!(catalog.insert(sequence(), |_| announced = true).is_err());
    assert!(!announced, "a refused insert journals nothing");
    assert_eq!(catalog.keys(), vec![key.clone()]);
    catalog.remove(&key);
    assert!(matches!(catalog.cell(&key), Err(StoreError::NotFound { .. })));
    assert!(!catalog.contains(&key));
}

/// A page gains a second chance (the host's frequency policy) from each
/// further reference a request takes: a publish that finds the key taken
/// counts; a share lookup alone does not (the write that asked counts it
/// once it publishes, so a refused write leaves none).
#[test]
fn another_requests_reference_is_a_second_chance_a_lookup_is_not() {
    let parts = Parts::new(1, 8, false);
    let catalog = Catalog::default();
    let (first, second) = (parts.page(1), parts.page(2));
    catalog.publish(Arc::clone(&first), Some(share_key(&parts, 9))).unwrap();
    assert!(!first.has_chance(), "the first reference is no second chance");
    let looked_up = catalog.share(&share_key(&parts, 9)).expect("shared by key");
    assert!(!first.has_chance(), "a lookup is not an attach");
    let (_, shared) = catalog.publish(second, Some(share_key(&parts, 9))).unwrap();
    assert!(shared && first.has_chance(), "a second writer's reference is");
    drop(looked_up);
}
