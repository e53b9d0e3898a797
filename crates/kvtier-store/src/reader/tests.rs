//! The reader's contract: a page's original bytes from wherever they are
//! (host, device only, NVMe only), the same bytes each way; reading an
//! NVMe-only page gives it a host copy again when promotion is on; a lost
//! page reads as nothing.

use std::sync::Arc;

use kvtier_core::{ColdTier, PageState, Reason};

use crate::durability::Keep;
use crate::testing::Parts;

#[test]
fn bytes_read_the_same_from_every_tier() {
    let parts = Parts::new(4, 8, true);
    let (host, device, nvme) = (parts.page(1), parts.page(2), parts.page(3));
    // Exclusive: the device copy is the only one.
    parts
        .device
        .make_hot(&[Arc::clone(&device)], Reason::Demand, &parts.reader());
    parts
        .durable
        .write_copies(&[Arc::clone(&nvme)], Keep::Nothing, Reason::Explicit)
        .unwrap();
    let states: Vec<_> = [&host, &device, &nvme].iter().map(|p| p.place.read().state()).collect();
    assert_eq!(
        states,
        [
            PageState::Cold(ColdTier::Host),
            PageState::Hot,
            PageState::Cold(ColdTier::Nvme)
        ]
    );
    assert!(device.place.read().host().is_none());
    let rows = parts.layout.page_size();
    let requests: Vec<_> = [&host, &device, &nvme].iter().map(|p| (Arc::clone(p), rows)).collect();
    let read = parts.reader().originals(&parts.layout, &requests).unwrap();
    for (id, bytes) in (1..=3).zip(read) {
        assert_eq!(bytes.as_deref(), Some(&Parts::bytes(id)[..]), "page {id}");
    }
    assert!(nvme.place.read().host().is_none(), "no promotion when it is off");
    let promoting = crate::reader::Reader {
        promote: true,
        ..parts.reader()
    };
    promoting.originals(&parts.layout, &requests[2..]).unwrap();
    assert!(nvme.place.read().host().is_some(), "promoted on read");
}

#[test]
fn a_lost_page_reads_as_nothing() {
    let parts = Parts::new(1, 8, false);
    let page = parts.page(1);
    parts
        .durable
        .write_copies(&[Arc::clone(&page)], Keep::Nothing, Reason::Explicit)
        .unwrap();
    parts.faults.read_eio.store(true, std::sync::atomic::Ordering::Relaxed);
    let read = parts
        .reader()
        .originals(&parts.layout, &[(Arc::clone(&page), parts.layout.page_size())])
        .unwrap();
    assert_eq!(read, vec![None]);
    assert_eq!(page.place.read().state(), PageState::Gone);
}
