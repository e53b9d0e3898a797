//! The read path: a page's original bytes wherever they are (host, device,
//! or NVMe in one CRC-checked batch), promotion of NVMe-only pages back to
//! host memory, and a host copy on demand for the writes that need one.

use std::sync::Arc;

use kvtier_core::{Layout, LogicalPage, PageState, Reason, wire};
use kvtier_tiers::{AlignedBuf, Tier, TierKind};

use crate::durability::{CopyRead, Durable};
use crate::host::{HostCache, MigrationTime};
use crate::page::{NvmeCopy, PhysPage, StoreLane, read_rows, rows_of, write_rows};
use crate::stats::Counters;
use crate::sync::{read, write};
use crate::{StoreError, StoreResult};

/// A view over the tiers for reading; built by the store on demand.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reader<'a> {
    pub(crate) host: &'a HostCache,
    pub(crate) device: &'a dyn Tier,
    pub(crate) durable: &'a Durable,
    pub(crate) counters: &'a Counters,
    /// Reading an NVMe-only page gives it a host copy again.
    pub(crate) promote: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PageContent {
    /// The original bytes: K rows `[rows][head_dim]` then V rows.
    Original(Vec<u8>),
    /// `counts.len()` summary rows, K then V, each standing for `counts[i]`
    /// tokens.
    Summary { counts: Vec<u32>, kv: Vec<u8> },
    /// No bytes; why they are gone.
    Gone(Reason),
}

/// A whole page's bytes read from one of its copies.
enum Source {
    Now(Vec<u8>),
    Nvme(NvmeCopy, u64),
}

impl Reader<'_> {
    /// Reads logical pages: each one's state and bytes (the original, the
    /// summary, or why it is gone). Originals on NVMe are read in one batch.
    /// Hot pages are collected in `hot` so the caller can mark them used.
    pub(crate) fn contents(
        &self,
        layout: &Layout,
        pages: &[(&StoreLane, usize)],
        hot: &mut Vec<Arc<PhysPage>>,
    ) -> StoreResult<Vec<(PageState, PageContent)>> {
        let mut out = Vec::with_capacity(pages.len());
        let mut originals = Vec::new();
        for (i, &(lane, p)) in pages.iter().enumerate() {
            let Some(logical) = lane.page(p) else {
                return Err(StoreError::Internal(format!("page {p} is beyond its lane")));
            };
            out.push(match logical {
                LogicalPage::Physical(r) => {
                    let state = read(&r.page.place).state();
                    if state == PageState::Hot {
                        hot.push(Arc::clone(&r.page));
                    }
                    originals.push((i, (Arc::clone(&r.page), lane.rows_in(p))));
                    (state, PageContent::Gone(Reason::Integrity))
                }
                LogicalPage::Summary(s) => {
                    let mut kv = vec![0u8; s.slot.len() as usize];
                    self.host.tier().read(&s.slot, 0, &mut kv)?;
                    (
                        PageState::Summary,
                        PageContent::Summary {
                            counts: s.counts.clone(),
                            kv,
                        },
                    )
                }
                LogicalPage::Gone(reason) => (PageState::Gone, PageContent::Gone(*reason)),
            });
        }
        let (index, requests): (Vec<usize>, Vec<_>) = originals.into_iter().unzip();
        let bytes = self.originals(layout, &requests)?;
        for ((i, bytes), (page, _)) in index.into_iter().zip(bytes).zip(&requests) {
            out[i] = match bytes {
                Some(b) => (out[i].0, PageContent::Original(b)),
                None => {
                    let reason = read(&page.place).lost.unwrap_or(Reason::Integrity);
                    (PageState::Gone, PageContent::Gone(reason))
                }
            };
        }
        Ok(out)
    }

    /// The original bytes (K rows then V rows, `rows` each) of each page, or
    /// `None` for a page whose bytes are lost. Host and device copies are read
    /// directly; NVMe copies in one batch, each checked against its CRC32C.
    /// A copy that fails its check or its read makes the page lost (gone,
    /// reason `integrity`) for every sequence sharing it; it is never served.
    pub(crate) fn originals(
        &self,
        layout: &Layout,
        pages: &[(Arc<PhysPage>, u32)],
    ) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let mut out: Vec<Option<Vec<u8>>> = vec![None; pages.len()];
        let mut pending = Vec::new();
        for (i, (page, rows)) in pages.iter().enumerate() {
            match self.source(page, layout, *rows)? {
                Some(Source::Now(bytes)) => out[i] = Some(bytes),
                Some(Source::Nvme(copy, version)) => pending.push((i, copy, version)),
                None => {}
            }
        }
        if pending.is_empty() {
            return Ok(out);
        }
        let copies = pending
            .iter()
            .map(|(i, c, _)| (Arc::clone(&pages[*i].0), c.clone()))
            .collect();
        let mut promote = Vec::new();
        for ((i, _, version), read) in pending.into_iter().zip(self.durable.read_copies(layout, copies)) {
            let (page, rows) = &pages[i];
            match read {
                CopyRead::Intact(buf) => {
                    out[i] = Some(rows_of(&buf, layout, *rows));
                    promote.push((Arc::clone(page), buf, version));
                }
                // Another copy appeared meanwhile: it is used.
                CopyRead::Elsewhere => {
                    if let Some(Source::Now(bytes)) = self.source(page, layout, *rows)? {
                        out[i] = Some(bytes);
                    }
                }
                CopyRead::Lost => {}
            }
        }
        if self.promote {
            self.promote(layout, promote);
        }
        Ok(out)
    }

    /// Where to read a page's bytes: now from host or device, or later from
    /// NVMe; `None` when lost.
    fn source(&self, page: &Arc<PhysPage>, layout: &Layout, rows: u32) -> StoreResult<Option<Source>> {
        let place = read(&page.place);
        if place.lost.is_some() {
            return Ok(None);
        }
        if let Some(host) = &place.host {
            let bytes = read_rows(&**self.host.tier(), host, layout, rows)?;
            // The LRU after the page lock is released: never an LRU lock
            // under a page lock (migration takes them the other way).
            drop(place);
            self.host.touch([page]);
            return Ok(Some(Source::Now(bytes)));
        }
        if let Some(device) = &place.device {
            return Ok(Some(Source::Now(read_rows(self.device, device, layout, rows)?)));
        }
        match &place.nvme {
            Some(copy) => Ok(Some(Source::Nvme(copy.clone(), place.version))),
            None => Err(StoreError::Internal(format!(
                "page {} has no copy and is not lost",
                page.id
            ))),
        }
    }

    /// Gives NVMe-only pages a host copy again (best effort: never makes
    /// room for it), so the next read is a memory read.
    fn promote(&self, layout: &Layout, pages: Vec<(Arc<PhysPage>, AlignedBuf, u64)>) {
        let host = self.host.tier();
        for (page, buf, version) in pages {
            let len = layout.page_bytes() as u64;
            let Ok(mut slot) = page.owner().slot(TierKind::Host, len, false, || host.allocate(len)) else {
                continue;
            };
            if host.write(&mut slot, 0, &buf[..layout.page_bytes()]).is_err() {
                continue;
            }
            let mut place = write(&page.place);
            if place.version == version && place.host.is_none() && place.lost.is_none() {
                let from = place.state();
                place.host = Some(slot);
                let to = place.state();
                drop(place);
                self.counters.counted(from, to, Reason::Demand);
                self.host.touch([&page]);
            }
        }
    }

    /// Gives `page` a host copy now, making room if needed (appends and
    /// explicit moves need one).
    pub(crate) fn ensure_host(
        &self,
        page: &Arc<PhysPage>,
        layout: &Layout,
        reason: Reason,
        spent: &mut MigrationTime,
    ) -> StoreResult<()> {
        if read(&page.place).host.is_some() {
            return Ok(());
        }
        let whole = self.originals(layout, &[(Arc::clone(page), layout.page_size())])?;
        let Some(bytes) = whole.into_iter().next().flatten() else {
            return Err(StoreError::precondition(wire::PAGES, "the page's bytes are lost"));
        };
        let mut slot = self
            .host
            .allocate(layout.page_bytes() as u64, self.durable, spent, page.owner())?;
        let (k, v) = bytes.split_at(bytes.len() / 2);
        write_rows(&**self.host.tier(), &mut slot, layout, 0, k, v)?;
        let mut place = write(&page.place);
        if place.host.is_none() {
            let from = place.state();
            place.host = Some(slot);
            let to = place.state();
            drop(place);
            self.counters.counted(from, to, reason);
            self.host.touch([page]);
        }
        Ok(())
    }
}
