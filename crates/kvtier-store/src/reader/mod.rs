//! The read path: a page's original bytes wherever they are (host, device,
//! or NVMe in one CRC-checked batch), promotion of NVMe-only pages back to
//! host memory, and a host copy on demand for the writes that need one.

mod sketches;
#[cfg(test)]
mod tests;

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;

use kvtier_core::{Layout, LogicalPage, PageState, Reason, wire};
use kvtier_tiers::{AlignedBuf, Tier, TierKind};

use crate::durability::{CopyRead, Durable};
use crate::host::{HostCache, MigrationTime};
use crate::page::{NvmeCopy, PhysPage, StoreLane, read_rows_into, rows_of, write_rows};
use crate::page_buf::PageBuf;
use crate::prefetch;
use crate::stats::Counters;
use crate::{StoreError, StoreResult};

pub(crate) use sketches::LaneSketches;

/// A view over the tiers for reading; built by the store on demand.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reader<'a> {
    pub(crate) host: &'a HostCache,
    pub(crate) device: &'a dyn Tier,
    pub(crate) durable: &'a Durable,
    pub(crate) counters: &'a Counters,
    /// Reading an NVMe-only page gives it a host copy again.
    pub(crate) promote: bool,
    /// Reading a page from host memory counts as a use of it (its place in
    /// the host's eviction order); a ranking's reads do not.
    pub(crate) touch: bool,
}

/// A page's content as read: its bytes are a `B`, owned (`Vec<u8>`) or a
/// range of the [`PageBuf`] the read filled.
#[derive(Debug, Clone, PartialEq)]
pub enum PageContent<B = Vec<u8>> {
    /// The original bytes: K rows `[rows][head_dim]` then V rows.
    Original(B),
    /// `counts.len()` summary rows, K then V, each standing for `counts[i]`
    /// tokens.
    Summary {
        /// Per summary row, the tokens it stands for.
        counts: Vec<u32>,
        /// The summary rows' bytes, laid out like original rows.
        kv: B,
    },
    /// No bytes; why they are gone.
    Gone(Reason),
}

impl<B> PageContent<B> {
    /// The same content with its bytes mapped by `f`.
    pub fn map<C>(self, f: impl FnOnce(B) -> C) -> PageContent<C> {
        match self {
            PageContent::Original(b) => PageContent::Original(f(b)),
            PageContent::Summary { counts, kv } => PageContent::Summary { counts, kv: f(kv) },
            PageContent::Gone(reason) => PageContent::Gone(reason),
        }
    }
}

/// Where a page's bytes are to be had.
enum Source {
    /// Read already, from device memory.
    Read,
    /// Read already, from host memory: the caller marks it used there
    /// (one LRU lock for a whole read, not one per page).
    ReadFromHost,
    /// On NVMe only: to be read (and checked) in a batch.
    Nvme(NvmeCopy, u64),
}

/// [`Source`], with bytes read into a buffer of their own.
enum Owned {
    Read(Vec<u8>),
    Nvme(NvmeCopy, u64),
}

impl Reader<'_> {
    /// Reads logical pages: each one's state and content (the original, the
    /// summary, or why it is gone), the bytes straight into `buf` in request
    /// order. Originals on NVMe are read in one batch. Hot pages are
    /// collected in `hot` so the caller can mark them used.
    pub(crate) fn contents(
        &self,
        layout: &Layout,
        pages: &[(&StoreLane, usize)],
        hot: &mut Vec<Arc<PhysPage>>,
        buf: &mut PageBuf<'_>,
    ) -> StoreResult<Vec<(PageState, PageContent<Range<usize>>)>> {
        let mut out = Vec::with_capacity(pages.len());
        let mut later = Vec::new();
        let mut from_host = Vec::new();
        for (i, &(lane, p)) in pages.iter().enumerate() {
            if let Some(&(lane, p)) = pages.get(i + prefetch::AHEAD)
                && let Some(LogicalPage::Physical(r)) = lane.page(p)
            {
                prefetch::prefetch(&r.page.place);
            }
            if let Some(&(lane, p)) = pages.get(i + prefetch::BYTES_AHEAD)
                && let Some(LogicalPage::Physical(r)) = lane.page(p)
            {
                self.prefetch_bytes(&r.page);
            }
            let Some(logical) = lane.page(p) else {
                return Err(StoreError::Internal(format!("page {p} is beyond its lane")));
            };
            out.push(match logical {
                LogicalPage::Physical(r) => {
                    let rows = lane.rows_in(p);
                    let range = buf.take(room_for(layout, lane, p))?;
                    let state = r.page.place.read().state();
                    if state == PageState::Hot {
                        hot.push(Arc::clone(&r.page));
                    }
                    match self.source(&r.page, layout, buf.at(&range))? {
                        Some(Source::Read) => (state, PageContent::Original(range)),
                        Some(Source::ReadFromHost) => {
                            from_host.push(&r.page);
                            (state, PageContent::Original(range))
                        }
                        Some(Source::Nvme(..)) => {
                            later.push((i, (Arc::clone(&r.page), rows), range));
                            (state, PageContent::Gone(Reason::Integrity))
                        }
                        None => {
                            buf.zero(&range);
                            (PageState::Gone, PageContent::Gone(lost_reason(&r.page)))
                        }
                    }
                }
                LogicalPage::Summary(s) => {
                    let range = buf.take(room_for(layout, lane, p))?;
                    // Laid out like an original's rows: K rows, then as many V rows.
                    let (k, v) = buf.at(&range);
                    let tier = self.host.tier();
                    tier.read_uninit(&s.slot, 0, k)?;
                    tier.read_uninit(&s.slot, (range.len() / 2) as u64, v)?;
                    (
                        PageState::Summary,
                        PageContent::Summary {
                            counts: s.counts.clone(),
                            kv: range,
                        },
                    )
                }
                LogicalPage::Gone(reason) => (PageState::Gone, PageContent::Gone(*reason)),
            });
        }
        self.host.touch(from_host);
        let requests: Vec<(Arc<PhysPage>, u32)> = later.iter().map(|(_, r, _)| r.clone()).collect();
        for ((i, (page, _), range), bytes) in later.into_iter().zip(self.originals(layout, &requests)?) {
            out[i] = match bytes {
                Some(b) => {
                    buf.fill(&range, &b);
                    (out[i].0, PageContent::Original(range))
                }
                None => {
                    buf.zero(&range);
                    (PageState::Gone, PageContent::Gone(lost_reason(&page)))
                }
            };
        }
        Ok(out)
    }

    /// Like [`Self::contents`], each page's bytes owned.
    pub(crate) fn owned_contents(
        &self,
        layout: &Layout,
        pages: &[(&StoreLane, usize)],
        hot: &mut Vec<Arc<PhysPage>>,
    ) -> StoreResult<Vec<(PageState, PageContent)>> {
        // A summary is never larger than the page it stands for.
        let mut room = Vec::with_capacity(pages.len() * layout.page_bytes());
        let mut buf = PageBuf::new(room.spare_capacity_mut());
        let read = self.contents(layout, pages, hot, &mut buf)?;
        let filled = buf.filled();
        Ok(read
            .into_iter()
            .map(|(state, c)| (state, c.map(|r| filled[r].to_vec())))
            .collect())
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
            match self.source_owned(page, layout, *rows)? {
                Some(Owned::Read(bytes)) => out[i] = Some(bytes),
                Some(Owned::Nvme(copy, version)) => pending.push((i, copy, version)),
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
                    if let Some(Owned::Read(bytes)) = self.source_owned(page, layout, *rows)? {
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

    /// Asks the tier holding a page's bytes in memory to start loading them.
    fn prefetch_bytes(&self, page: &PhysPage) {
        let place = page.place.read();
        match (place.host(), place.device()) {
            (Some(host), _) => self.host.tier().prefetch(host),
            (None, Some(device)) => self.device.prefetch(device),
            (None, None) => {}
        }
    }

    /// Reads a page's first K rows into `dst.0` and as many V rows into
    /// `dst.1` ([`read_rows_into`]) when a host or device copy has them;
    /// otherwise says where they are (NVMe), or `None` when lost.
    fn source(
        &self,
        page: &Arc<PhysPage>,
        layout: &Layout,
        dst: (&mut [MaybeUninit<u8>], &mut [MaybeUninit<u8>]),
    ) -> StoreResult<Option<Source>> {
        let place = page.place.read();
        if place.lost().is_some() {
            return Ok(None);
        }
        if let Some(host) = place.host() {
            read_rows_into(&**self.host.tier(), host, layout, dst)?;
            // The LRU after the page lock is released: never an LRU lock
            // under a page lock (migration takes them the other way).
            return Ok(Some(Source::ReadFromHost));
        }
        if let Some(device) = place.device() {
            read_rows_into(self.device, device, layout, dst)?;
            return Ok(Some(Source::Read));
        }
        match place.nvme() {
            Some(copy) => Ok(Some(Source::Nvme(copy.clone(), place.version()))),
            None => Err(StoreError::Internal(format!(
                "page {} has no copy and is not lost",
                page.id
            ))),
        }
    }

    /// [`Self::source`] into a new buffer: the bytes, or the NVMe copy and
    /// version to read them from.
    fn source_owned(&self, page: &Arc<PhysPage>, layout: &Layout, rows: u32) -> StoreResult<Option<Owned>> {
        let len = 2 * rows as usize * layout.row_bytes();
        let mut bytes = Vec::with_capacity(len);
        Ok(
            match self.source(page, layout, bytes.spare_capacity_mut()[..len].split_at_mut(len / 2))? {
                Some(read @ (Source::Read | Source::ReadFromHost)) => {
                    if self.touch && matches!(read, Source::ReadFromHost) {
                        self.host.touch([page]);
                    }
                    // SAFETY: `source` wrote all `len` bytes (it returned Read
                    // or ReadFromHost).
                    unsafe { bytes.set_len(len) };
                    Some(Owned::Read(bytes))
                }
                Some(Source::Nvme(copy, version)) => Some(Owned::Nvme(copy, version)),
                None => None,
            },
        )
    }

    /// Gives NVMe-only pages a host copy again (best effort: never makes
    /// room for it), so the next read is a memory read.
    fn promote(&self, layout: &Layout, pages: Vec<(Arc<PhysPage>, AlignedBuf, u64)>) {
        let host = self.host.tier();
        for (page, buf, version) in pages {
            let len = layout.page_bytes() as u64;
            let Ok(mut slot) = page
                .owner()
                .slot(TierKind::Host, len, false, || self.host.allocate_if_room(len))
            else {
                continue;
            };
            if host.write(&mut slot, 0, &buf[..layout.page_bytes()]).is_err() {
                continue;
            }
            let installed = page.place.write().install_host(slot, version);
            if let Ok(change) = installed {
                self.counters.counted(change.from, change.to, Reason::Demand);
                self.counters.moved(TierKind::Nvme, TierKind::Host, len);
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
        let version = {
            let place = page.place.read();
            if place.host().is_some() {
                return Ok(());
            }
            place.version()
        };
        let whole = self.originals(layout, &[(Arc::clone(page), layout.page_size())])?;
        let Some(bytes) = whole.into_iter().next().flatten() else {
            return Err(StoreError::precondition(wire::PAGES, "the page's bytes are lost"));
        };
        let mut slot = self
            .host
            .allocate(layout.page_bytes() as u64, self.durable, spent, page.owner())?;
        let (k, v) = bytes.split_at(bytes.len() / 2);
        write_rows(&**self.host.tier(), &mut slot, layout, 0, k, v)?;
        // Refused when another path gave it a host copy meanwhile (this
        // slot is freed as it drops), or when it changed or was lost.
        let installed = page.place.write().install_host(slot, version);
        match installed {
            Ok(change) => {
                self.counters.counted(change.from, change.to, reason);
                self.host.touch([page]);
                Ok(())
            }
            Err(_) if page.place.read().host().is_some() => Ok(()),
            Err(_) => Err(StoreError::precondition(
                wire::PAGES,
                "the page changed or lost its bytes while being copied to host memory",
            )),
        }
    }
}

/// The bytes [`Reader::contents`] takes for page `p` of `lane`: the
/// original's valid rows, a summary's rows, nothing for a gone page.
pub(crate) fn room_for(layout: &Layout, lane: &StoreLane, p: usize) -> usize {
    match lane.page(p) {
        Some(LogicalPage::Physical(_)) => 2 * lane.rows_in(p) as usize * layout.row_bytes(),
        Some(LogicalPage::Summary(s)) => s.slot.len() as usize,
        Some(LogicalPage::Gone(_)) | None => 0,
    }
}

/// Why a page's bytes are not to be had: the reason it was lost for, or a
/// failed check.
fn lost_reason(page: &PhysPage) -> Reason {
    page.place.read().lost().unwrap_or(Reason::Integrity)
}
