//! Where a physical page's bytes are, as a state machine: the fields are
//! private and the named transitions below are their only writers. Each
//! keeps the invariant and returns the [`Change`] of page state it made
//! (the caller counts it), so the store's counters, the journal and the
//! core's state machine (`kvtier_core::PageState`) see every move.
//!
//! # Invariant
//!
//! Unless the page is lost, at least one copy exists; the device copy is
//! the only one only under an exclusive device cache (where it replaced
//! the host copy). A host copy next to a current NVMe copy is a cache, and
//! so is a device copy next to a host or NVMe copy: dropping either loses
//! nothing. A lost page is never served again and gets no new copy.

use std::sync::Arc;

use kvtier_core::{ColdTier, PageState, Reason};
use kvtier_tiers::Slot;

/// A page's copy on NVMe, with the CRC32C of the slot's page bytes and the
/// token rows it holds.
#[derive(Debug, Clone)]
pub(crate) struct NvmeCopy {
    pub(crate) slot: Arc<Slot>,
    pub(crate) crc: u32,
    pub(crate) rows: u32,
}

/// A transition's effect on the page's state (`from == to` when it moved
/// a cache copy only).
#[must_use = "a transition's change is counted by its caller"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Change {
    pub(crate) from: PageState,
    pub(crate) to: PageState,
}

/// Which memory copy an append writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemoryCopy {
    Host,
    Device,
}

/// What a new NVMe copy displaced: slots to free once the placement lock
/// is released (freeing takes the tier's lock).
#[derive(Debug)]
pub(crate) struct NvmeInstalled {
    pub(crate) change: Change,
    /// The durable prefix the new copy supersedes (its extent is retired
    /// through the journal).
    pub(crate) superseded: Option<Arc<Slot>>,
    /// The host copy dropped because the new copy made it a cache.
    pub(crate) dropped_host: Option<Slot>,
}

/// The result of marking a page lost after its NVMe copy failed.
#[derive(Debug)]
pub(crate) enum Lost {
    /// Lost now; the failed copy's extent is to be retired.
    Now { change: Change, failed: Arc<Slot> },
    /// It was lost already.
    Already,
    /// Another copy exists, or the failed copy is no longer the current
    /// one: the page is not lost.
    Elsewhere,
}

#[derive(Debug)]
pub(crate) struct Placement {
    device: Option<Slot>,
    host: Option<Slot>,
    nvme: Option<NvmeCopy>,
    /// The NVMe copy from before rows were last appended: no longer a copy
    /// of the page, but still the manifest's record of its first rows
    /// (appends never change rows already written). It is kept until a
    /// current copy replaces it, so a crash in between recovers those rows.
    durable_prefix: Option<NvmeCopy>,
    /// Valid token rows in the page.
    rows: u32,
    /// Bumped by every change of the page's bytes, so that a copy taken
    /// without the lock can tell whether it is still current.
    version: u64,
    /// The bytes are gone for every sequence sharing the page (a failed
    /// checksum or read); the page is never served again.
    lost: Option<Reason>,
}

impl Placement {
    /// A new page written to host memory (and the device, with a slot).
    pub(crate) fn written(device: Option<Slot>, host: Slot, rows: u32) -> Self {
        Self {
            device,
            host: Some(host),
            nvme: None,
            durable_prefix: None,
            rows,
            version: 0,
            lost: None,
        }
    }

    /// A page recovered from its NVMe copy after a restart.
    pub(crate) fn recovered(copy: NvmeCopy) -> Self {
        Self {
            device: None,
            host: None,
            rows: copy.rows,
            nvme: Some(copy),
            durable_prefix: None,
            version: 0,
            lost: None,
        }
    }

    pub(crate) fn device(&self) -> Option<&Slot> {
        self.device.as_ref()
    }

    pub(crate) fn host(&self) -> Option<&Slot> {
        self.host.as_ref()
    }

    pub(crate) fn nvme(&self) -> Option<&NvmeCopy> {
        self.nvme.as_ref()
    }

    pub(crate) fn durable_prefix(&self) -> Option<&NvmeCopy> {
        self.durable_prefix.as_ref()
    }

    pub(crate) fn rows(&self) -> u32 {
        self.rows
    }

    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    pub(crate) fn lost(&self) -> Option<Reason> {
        self.lost
    }

    pub(crate) fn state(&self) -> PageState {
        match (self.lost, &self.device, &self.host, &self.nvme) {
            (Some(_), ..) => PageState::Gone,
            (None, Some(_), ..) => PageState::Hot,
            (None, None, Some(_), _) => PageState::Cold(ColdTier::Host),
            (None, None, None, Some(_)) => PageState::Cold(ColdTier::Nvme),
            // Not lost yet without a copy: the transitions never leave a
            // page so, and it would never be served.
            (None, None, None, None) => PageState::Gone,
        }
    }

    /// The cold tier holding the page's backing copy (host preferred).
    pub(crate) fn backing_tier(&self) -> Option<ColdTier> {
        match (&self.host, &self.nvme) {
            (Some(_), _) => Some(ColdTier::Host),
            (None, Some(_)) => Some(ColdTier::Nvme),
            (None, None) => None,
        }
    }

    /// Runs `change` and reports the state before and after it.
    fn changing<R>(&mut self, change: impl FnOnce(&mut Self) -> R) -> (Change, R) {
        let from = self.state();
        let out = change(self);
        (Change { from, to: self.state() }, out)
    }

    /// cold → hot: a device copy of the bytes as they were at `version`.
    /// Exclusive, the device copy replaces the host copy (returned, to be
    /// freed; an NVMe copy, being durable, stays). Refused, handing the
    /// slot back, if the page has a device copy, is lost, or changed since.
    pub(crate) fn install_device(
        &mut self,
        slot: Slot,
        version: u64,
        exclusive: bool,
    ) -> Result<(Change, Option<Slot>), Slot> {
        if self.device.is_some() || self.lost.is_some() || self.version != version {
            return Err(slot);
        }
        Ok(self.changing(|p| {
            p.device = Some(slot);
            if exclusive { p.host.take() } else { None }
        }))
    }

    /// A host copy of the bytes as they were at `version` (a promotion, a
    /// copy down before demotion, room for an append). Refused, handing the
    /// slot back, if the page has one, is lost, or changed since.
    pub(crate) fn install_host(&mut self, slot: Slot, version: u64) -> Result<Change, Slot> {
        if self.host.is_some() || self.lost.is_some() || self.version != version {
            return Err(slot);
        }
        Ok(self.changing(|p| p.host = Some(slot)).0)
    }

    /// A current NVMe copy of the bytes as they were at `version`; it
    /// supersedes the durable prefix, and the host copy goes unless
    /// `keep_host`. Refused, handing the copy back, if the page has a
    /// current NVMe copy, is lost, or changed since.
    pub(crate) fn install_nvme(
        &mut self,
        copy: NvmeCopy,
        version: u64,
        keep_host: bool,
    ) -> Result<NvmeInstalled, NvmeCopy> {
        if self.nvme.is_some() || self.lost.is_some() || self.version != version {
            return Err(copy);
        }
        let (change, (superseded, dropped_host)) = self.changing(|p| {
            p.nvme = Some(copy);
            let superseded = p.durable_prefix.take().map(|c| c.slot);
            let dropped_host = if keep_host { None } else { p.host.take() };
            (superseded, dropped_host)
        });
        Ok(NvmeInstalled {
            change,
            superseded,
            dropped_host,
        })
    }

    /// hot → cold: drops the device copy. Refused (`None`) without one, or
    /// when it is the only copy.
    pub(crate) fn drop_device(&mut self) -> Option<(Change, Slot)> {
        if self.device.is_none() || self.backing_tier().is_none() {
            return None;
        }
        let (change, slot) = self.changing(|p| p.device.take());
        slot.map(|s| (change, s))
    }

    /// Drops the host copy next to a current NVMe copy (cold(host) →
    /// cold(nvme), or a hot page's cache). Refused (`None`) without both.
    pub(crate) fn drop_host(&mut self) -> Option<(Change, Slot)> {
        if self.host.is_none() || self.nvme.is_none() {
            return None;
        }
        let (change, slot) = self.changing(|p| p.host.take());
        slot.map(|s| (change, s))
    }

    /// Appends `rows` token rows: `write` writes them into each memory
    /// copy. An NVMe copy then holds only the page's first rows, so it
    /// becomes the durable prefix; the version moves on, so copies taken
    /// before are refused. Refused if the page has no memory copy.
    pub(crate) fn append_rows<E>(
        &mut self,
        rows: u32,
        mut write: impl FnMut(MemoryCopy, &mut Slot) -> Result<(), E>,
    ) -> Result<Change, AppendRefused<E>> {
        if self.host.is_none() && self.device.is_none() {
            return Err(AppendRefused::NoMemoryCopy);
        }
        if let Some(host) = self.host.as_mut() {
            write(MemoryCopy::Host, host).map_err(AppendRefused::Write)?;
        }
        if let Some(device) = self.device.as_mut() {
            write(MemoryCopy::Device, device).map_err(AppendRefused::Write)?;
        }
        let (change, ()) = self.changing(|p| {
            if let Some(copy) = p.nvme.take() {
                p.durable_prefix = Some(copy);
            }
            p.rows += rows;
            p.version += 1;
        });
        Ok(change)
    }

    /// cold(nvme) → gone: the NVMe copy `failed` failed its check or read,
    /// and no other copy exists.
    pub(crate) fn lose_nvme_copy(&mut self, failed: &Arc<Slot>) -> Lost {
        if self.lost.is_some() {
            return Lost::Already;
        }
        let current = self.nvme.as_ref().is_some_and(|c| Arc::ptr_eq(&c.slot, failed));
        if !current || self.host.is_some() || self.device.is_some() {
            return Lost::Elsewhere;
        }
        let from = self.state();
        let Some(copy) = self.nvme.take() else {
            return Lost::Elsewhere; // `current` saw it: not reached
        };
        self.lost = Some(Reason::Integrity);
        Lost::Now {
            change: Change { from, to: self.state() },
            failed: copy.slot,
        }
    }
}

/// Why an append wrote nothing, or stopped.
#[derive(Debug)]
pub(crate) enum AppendRefused<E> {
    /// The page has no memory copy to fill in place.
    NoMemoryCopy,
    /// Writing a copy failed; the page's rows and version are unchanged.
    Write(E),
}

#[cfg(test)]
mod tests;
