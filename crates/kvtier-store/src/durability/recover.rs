//! Recovery: the image a replay produced, back into sequences and pages.
//! Physical pages come back NVMe-only (their extents claimed), shared ones
//! shared again; summaries come back into host memory.

use std::collections::HashMap;
use std::sync::Arc;

use kvtier_core::{Layout, LogicalPage, PageIndex, Reason};
use kvtier_tiers::TierKind;

use super::Durable;
use super::image::{CopyImage, Image, PageImage, PageKind};
use crate::accounts::{Account, Accounts, PageCharge};
use crate::catalog::{Catalog, Sequence};
use crate::cost;
use crate::page::{NvmeCopy, PageRef, PhysPage, Placement, StorePage, SummaryPage};

/// What a restart found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Sequences rebuilt from the manifest.
    pub sequences: u64,
    /// Pages back with their bytes (on NVMe).
    pub pages: u64,
    /// Summaries back (in host memory).
    pub summaries: u64,
    /// Pages that were only in memory.
    pub lost_on_restart: u64,
}

/// A recovery in progress.
struct Rebuild<'a> {
    copies: &'a HashMap<u64, CopyImage>,
    catalog: &'a Catalog,
    /// Each physical page is built once and shared by every logical page
    /// that maps it.
    built: HashMap<u64, Option<PageRef>>,
    /// Metadata of the summaries of the sequence being rebuilt (a physical
    /// page carries its own).
    extra: u64,
    accounts: &'a Arc<Accounts>,
    report: Recovered,
}

impl Durable {
    /// Rebuilds the sequences of `image` into `catalog`, each charged to
    /// `accounts` whatever the limits (what was acknowledged comes back).
    pub(crate) fn recover(&self, image: Image, catalog: &Catalog, accounts: &Arc<Accounts>) -> Recovered {
        let mut r = Rebuild {
            copies: &image.copies,
            catalog,
            built: HashMap::new(),
            extra: 0,
            accounts,
            report: Recovered::default(),
        };
        for rec in image.sequences {
            let charge = accounts
                .open(&rec.key, cost::sequence(&rec.key, &rec.layout, &rec.hashes), true)
                .expect("forced charges have no limit");
            let mut seq = Sequence::new(rec.key, rec.layout, rec.hashes, charge);
            let mut logical = 0u64;
            r.extra = 0;
            for (lane, pages) in rec.lanes.into_iter().enumerate() {
                logical += pages.len() as u64;
                for (p, page) in pages.into_iter().enumerate() {
                    let (entry, rows) = (page.digest.clone(), page.rows);
                    let logical = self.recover_page(&mut r, &seq, (lane, p), page);
                    seq.lanes[lane].push_known(logical, &entry, rows);
                }
            }
            let pages = cost::pages(&seq.layout, logical, 0, false) + r.extra;
            seq.charge.force(pages);
            r.report.sequences += 1;
            catalog.insert_recovered(seq);
        }
        r.report
    }

    /// Page `p` of lane `lane` of `seq`, as the image says.
    fn recover_page(
        &self,
        r: &mut Rebuild<'_>,
        seq: &Sequence,
        (lane, p): (usize, usize),
        page: PageImage,
    ) -> StorePage {
        let (catalog, report) = (r.catalog, &mut r.report);
        match page.kind {
            PageKind::Copy { phys } => {
                let adopted = match r.built.get(&phys) {
                    Some(existing) => existing.as_ref().and_then(|e| catalog.acquire(e).ok()),
                    None => {
                        let share = (page.rows == seq.layout.page_size() && p < seq.hashes.len())
                            .then(|| seq.share_key(p, lane));
                        let adopted = r
                            .copies
                            .get(&phys)
                            .and_then(|copy| {
                                let charge = r.accounts.page_charge(
                                    seq.charge.account(),
                                    cost::physical_page(&seq.layout, share.is_some()),
                                );
                                self.claim(phys, copy, &seq.layout, charge)
                            })
                            .and_then(|physical| {
                                // A page is shared only with the index entry that attaching needs.
                                let share = share.filter(|_| physical.index_entry.is_some());
                                catalog.adopt(physical, share).ok()
                            });
                        let out = adopted.as_ref().map(|a| PageRef {
                            id: a.id,
                            page: Arc::clone(&a.page),
                        });
                        r.built.insert(phys, adopted);
                        out
                    }
                };
                match adopted {
                    Some(a) => {
                        report.pages += 1;
                        LogicalPage::Physical(a)
                    }
                    None => LogicalPage::Gone(Reason::Integrity),
                }
            }
            PageKind::Summary { reason, counts, kv } => match self.host_copy(&kv, seq.charge.account()) {
                Some(slot) => {
                    report.summaries += 1;
                    r.extra += cost::summary(counts.len() as u64);
                    LogicalPage::Summary(SummaryPage { counts, slot, reason })
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
        }
    }

    /// Physical page `phys` with its NVMe extent claimed; `None` (lost) if
    /// the extent cannot be claimed.
    fn claim(&self, phys: u64, copy: &CopyImage, layout: &Arc<Layout>, charge: PageCharge) -> Option<Arc<PhysPage>> {
        let nvme = self.nvme.as_ref()?;
        // Recovered whatever the quotas are now: it was acknowledged.
        let slot = match charge
            .owner()
            .slot(TierKind::Nvme, copy.len, true, || nvme.claim(copy.offset, copy.len))
        {
            Ok(slot) => slot,
            Err(e) => {
                tracing::error!(page = phys, error = %e, "manifest extent cannot be claimed; page lost");
                return None;
            }
        };
        let place = Placement::recovered(NvmeCopy {
            slot: Arc::new(slot),
            crc: copy.crc,
            rows: copy.rows,
        });
        let full = PageIndex::entry_len(layout.dtype(), layout.head_dim() as usize, layout.page_size());
        let entry = (copy.rows == layout.page_size() && copy.digest.len() == full)
            .then(|| copy.digest.clone().into_boxed_slice());
        Some(Arc::new(PhysPage::new(phys, Arc::clone(layout), entry, place, charge)))
    }

    /// A host slot holding `bytes`.
    fn host_copy(&self, bytes: &[u8], owner: &Account) -> Option<kvtier_tiers::Slot> {
        let len = bytes.len() as u64;
        let mut slot = owner.slot(TierKind::Host, len, true, || self.host.allocate(len)).ok()?;
        self.host.write(&mut slot, 0, bytes).ok()?;
        Some(slot)
    }
}
