//! Recovery: the image a replay produced, back into sequences and pages.
//! Physical pages come back NVMe-only (their extents claimed), shared ones
//! shared again; summaries come back into host memory.

use std::collections::HashMap;
use std::sync::Arc;

use kvtier_core::{Layout, LogicalPage, PhysId, Reason};

use super::image::{CopyImage, Image, PageKind};
use crate::Store;
use crate::page::{NvmeCopy, PageRef, PhysPage, Placement, ShareKey, StorePage, SummaryPage};
use crate::sequence::Sequence;
use crate::store::share_key;
use crate::sync::lock;

/// What a restart found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    pub sequences: u64,
    /// Pages back with their bytes (on NVMe).
    pub pages: u64,
    pub summaries: u64,
    /// Pages that were only in memory.
    pub lost_on_restart: u64,
}

impl Store {
    /// Rebuilds the sequences of `image`.
    pub(crate) fn recover(&self, image: Image) -> Recovered {
        let mut report = Recovered::default();
        // Each physical page is built once and shared by every logical page
        // that maps it.
        let mut built: HashMap<u64, Option<PageRef>> = HashMap::new();
        for rec in image.sequences {
            let mut seq = Sequence::new(rec.key, rec.layout, rec.hashes);
            for (lane, pages) in rec.lanes.into_iter().enumerate() {
                for (p, page) in pages.into_iter().enumerate() {
                    let logical = match page.kind {
                        PageKind::Copy { phys } => {
                            let share = seq
                                .hashes
                                .get(p)
                                .filter(|_| page.rows == seq.layout.page_size())
                                .map(|h| share_key(&seq, h, lane));
                            match self.adopt(phys, &image.copies[&phys], &seq.layout, share, &mut built) {
                                Some(r) => {
                                    report.pages += 1;
                                    LogicalPage::Physical(r)
                                }
                                None => LogicalPage::Gone(Reason::Integrity),
                            }
                        }
                        PageKind::Summary { reason, counts, kv } => match self.host_copy(&kv) {
                            Some(slot) => {
                                report.summaries += 1;
                                StorePage::Summary(SummaryPage { counts, slot, reason })
                            }
                            None => {
                                tracing::error!(sequence = %seq.key, lane, page = p, "no host room for a recovered summary; it is gone");
                                LogicalPage::Gone(reason)
                            }
                        },
                        PageKind::Gone(reason) => {
                            report.lost_on_restart += u64::from(reason == Reason::LostOnRestart);
                            LogicalPage::Gone(reason)
                        }
                    };
                    seq.lanes[lane].push_known(logical, page.rows, &page.digest);
                }
            }
            report.sequences += 1;
            self.insert_recovered(seq);
        }
        report
    }

    /// A new reference to physical page `phys`, built (its extent claimed,
    /// registered under its share key) the first time; `None` if its
    /// extent cannot be claimed.
    fn adopt(
        &self,
        phys: u64,
        copy: &CopyImage,
        layout: &Arc<Layout>,
        share: Option<ShareKey>,
        built: &mut HashMap<u64, Option<PageRef>>,
    ) -> Option<PageRef> {
        let mut table = lock(&self.pages);
        if let Some(existing) = built.get(&phys) {
            let r = existing.as_ref()?;
            table.acquire(r.id).expect("recovered pages are live");
            return Some(PageRef {
                id: r.id,
                page: Arc::clone(&r.page),
            });
        }
        let page = self.claim(phys, copy, layout);
        let r = page.map(|page| {
            // A page is shared only with the digest that attaching needs.
            let share = share.filter(|_| page.digest.is_some());
            let id: PhysId = match table.insert(Arc::clone(&page), share) {
                Ok(id) => id,
                // Two recovered pages claim one prefix: keep the first shared.
                Err((_, page)) => table
                    .insert(page, None)
                    .map_err(|(e, _)| e)
                    .expect("unkeyed inserts succeed"),
            };
            PageRef { id, page }
        });
        let out = r.as_ref().map(|r| PageRef {
            id: r.id,
            page: Arc::clone(&r.page),
        });
        built.insert(phys, r);
        out
    }

    /// Physical page `phys` with its NVMe extent claimed.
    fn claim(&self, phys: u64, copy: &CopyImage, layout: &Arc<Layout>) -> Option<Arc<PhysPage>> {
        let nvme = self.nvme.as_ref()?;
        let slot = match nvme.claim(copy.offset, copy.len) {
            Ok(slot) => slot,
            Err(e) => {
                tracing::error!(page = phys, error = %e, "manifest extent cannot be claimed; page lost");
                return None;
            }
        };
        let place = Placement {
            device: None,
            host: None,
            nvme: Some(NvmeCopy {
                slot: Arc::new(slot),
                crc: copy.crc,
                rows: copy.rows,
            }),
            durable_prefix: None,
            rows: copy.rows,
            version: 0,
            lost: None,
        };
        let digest = (copy.rows == layout.page_size() && copy.digest.len() == 2 * layout.row_bytes())
            .then(|| copy.digest.clone().into_boxed_slice());
        Some(Arc::new(PhysPage::new(phys, Arc::clone(layout), digest, place)))
    }

    /// A host slot holding `bytes`.
    fn host_copy(&self, bytes: &[u8]) -> Option<kvtier_tiers::Slot> {
        let mut slot = self.host.allocate(bytes.len() as u64).ok()?;
        self.host.write(&mut slot, 0, bytes).ok()?;
        Some(slot)
    }
}
