//! What the device did for selections: the chosen pages it held, by the
//! policy's region, and those it did not; and what became of each
//! prefetch. A page carries one prefetch mark (`PhysPage::prefetch`) from
//! the moment a prefetch is queued for it to the selection that uses it
//! (used), finds it still on its way (late), or the demotion that drops it
//! unused (wasted).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{DevicePolicy, HotSet};
use crate::page::PhysPage;
use crate::stats::{Counters, PrefetchKind};

/// Mark bits: queued (not hot yet), made hot by the prefetch (not used
/// yet), and the layer-ahead kind (otherwise asked).
const QUEUED: u8 = 1;
const HOT: u8 = 2;
const AHEAD: u8 = 4;

fn kind_bit(kind: PrefetchKind) -> u8 {
    match kind {
        PrefetchKind::Asked => 0,
        PrefetchKind::LayerAhead => AHEAD,
    }
}

fn kind_of(mark: u8) -> PrefetchKind {
    if mark & AHEAD == 0 {
        PrefetchKind::Asked
    } else {
        PrefetchKind::LayerAhead
    }
}

impl HotSet {
    /// A prefetch of `kind` is queued for `pages`: marks those no other
    /// prefetch marked. The marks it set are cleared, on pages it did not
    /// make hot, when the returned value drops (after the prefetch ran, or
    /// with a job the backlog refused).
    pub(crate) fn mark_queued(&self, pages: &[Arc<PhysPage>], kind: PrefetchKind) -> QueuedMarks {
        QueuedMarks(
            pages
                .iter()
                .filter(|p| {
                    p.prefetch
                        .compare_exchange(0, QUEUED | kind_bit(kind), Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                })
                .cloned()
                .collect(),
        )
    }

    /// A prefetch made `page` hot: issued, by its mark's kind, and marked
    /// for `used` or `wasted` (unless a selection already settled it).
    pub(crate) fn mark_arrived(&self, page: &PhysPage) {
        let arrived = page.prefetch.fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
            (m & QUEUED != 0).then_some(HOT | (m & AHEAD))
        });
        if let Ok(mark) = arrived {
            Counters::add(&self.counters.prefetch[kind_of(mark).index()].issued, 1);
        }
    }

    /// A selection chose `pages` (before its swap-in): counts each as a
    /// hit of its region or a miss, and settles their prefetch marks: a
    /// page a prefetch made hot is used (also when the prefetch installed
    /// it and has yet to mark it: counted issued here, as its arrival will
    /// find no mark), one still on its way is late.
    pub(crate) fn note_chosen(&self, pages: &[Arc<PhysPage>]) {
        let hot: Vec<bool> = pages.iter().map(|p| p.place.read().device().is_some()).collect();
        let resident = match self.policy {
            DevicePolicy::Lru => 0,
            DevicePolicy::Loop => {
                let resident = self.resident.lock();
                hot.iter()
                    .zip(pages)
                    .filter(|&(&hot, page)| hot && resident.contains(page.id))
                    .count() as u64
            }
        };
        let hits = hot.iter().filter(|&&h| h).count() as u64;
        Counters::add(&self.counters.device_hits_resident, resident);
        Counters::add(&self.counters.device_hits_stream, hits - resident);
        Counters::add(&self.counters.device_misses, pages.len() as u64 - hits);
        for (page, hot) in pages.iter().zip(hot) {
            let mark = page.prefetch.swap(0, Ordering::AcqRel);
            let counters = &self.counters.prefetch[kind_of(mark).index()];
            if mark & HOT != 0 {
                Counters::add(&counters.used, 1);
            } else if mark & QUEUED != 0 && hot {
                Counters::add(&counters.issued, 1);
                Counters::add(&counters.used, 1);
            } else if mark & QUEUED != 0 {
                Counters::add(&counters.late, 1);
            }
        }
    }

    /// Counts a prefetched page that left the device, or was freed, unused.
    pub(crate) fn note_wasted(&self, page: &PhysPage) {
        let mark = page.prefetch.load(Ordering::Acquire);
        if mark & HOT != 0
            && page
                .prefetch
                .compare_exchange(mark, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            Counters::add(&self.counters.prefetch[kind_of(mark).index()].wasted, 1);
        }
    }
}

/// The prefetch marks one prefetch set (`HotSet::mark_queued`): dropped,
/// those still queued (their page was not made hot) are cleared.
#[derive(Debug)]
pub(crate) struct QueuedMarks(pub(super) Vec<Arc<PhysPage>>);

impl Drop for QueuedMarks {
    fn drop(&mut self) {
        for page in &self.0 {
            let _ = page
                .prefetch
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| (m & QUEUED != 0).then_some(0));
        }
    }
}
