//! NVMe copies' contract: a copy is written from a memory copy and checked
//! by CRC32C when read back; keeping nothing drops the host copy once the
//! NVMe copy is current; a copy that fails its read makes the page lost
//! (gone, `integrity`) unless another copy exists.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use kvtier_core::{ColdTier, PageState, Reason};

use super::{CopyRead, Keep};
use crate::testing::Parts;

#[test]
fn a_copy_moves_the_page_to_nvme_and_reads_back_whole() {
    let parts = Parts::new(1, 8, false);
    let page = parts.page(7);
    let moved = parts
        .durable
        .write_copies(&[Arc::clone(&page)], Keep::Nothing, Reason::Explicit)
        .unwrap();
    assert_eq!(moved, 1);
    assert_eq!(page.place.read().state(), PageState::Cold(ColdTier::Nvme));
    let copy = page.place.read().nvme().cloned().expect("a current copy");
    match &parts
        .durable
        .read_copies(&parts.layout, vec![(Arc::clone(&page), copy)])[..]
    {
        [CopyRead::Intact(buf)] => assert_eq!(&buf[..Parts::bytes(7).len()], &Parts::bytes(7)[..]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_failed_read_loses_the_page_only_if_it_was_the_last_copy() {
    let parts = Parts::new(1, 8, false);
    let (kept, only) = (parts.page(1), parts.page(2));
    parts
        .durable
        .write_copies(&[Arc::clone(&kept)], Keep::Host, Reason::Explicit)
        .unwrap();
    parts
        .durable
        .write_copies(&[Arc::clone(&only)], Keep::Nothing, Reason::Explicit)
        .unwrap();
    parts.faults.read_eio.store(true, Relaxed);
    let copies = [&kept, &only]
        .iter()
        .map(|p| (Arc::clone(p), p.place.read().nvme().cloned().expect("a copy")))
        .collect();
    let read = parts.durable.read_copies(&parts.layout, copies);
    assert!(
        matches!(read[0], CopyRead::Elsewhere),
        "the host copy still holds page 1"
    );
    assert!(matches!(read[1], CopyRead::Lost), "page 2's only copy failed");
    assert_eq!(kept.place.read().state(), PageState::Cold(ColdTier::Host));
    assert_eq!(only.place.read().state(), PageState::Gone);
    assert_eq!(only.place.read().lost(), Some(Reason::Integrity));
}
