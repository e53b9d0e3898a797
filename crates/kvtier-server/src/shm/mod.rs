//! The shared-memory data plane: clients on this machine register a sealed
//! memfd over a Unix socket (`socket.rs`), and fetches and selections that
//! name a window of it get their page bytes written there instead of into
//! gRPC messages. A region is its client's for as long as the registering
//! connection stays open; when it closes (the client ended, or died and the
//! kernel closed its sockets) the region leaves the registry, and its
//! mapping goes once the last call writing into it is done.

mod socket;

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};

use kvtier_core::{TenantId, wire};
use kvtier_proto::v1 as pb;
use kvtier_store::{StoreError, StoreResult};
use memmap2::{MmapOptions, MmapRaw};
use tonic::Status;

use crate::status::invalid;

pub(crate) use socket::{bind, serve};

/// Largest region one client may register: bounds the address space one
/// registration takes, not memory (the client's memfd holds the pages).
pub(crate) const MAX_REGION_BYTES: u64 = 1 << 40;

/// Regions registered at once, over all clients (each holds a file
/// descriptor and a mapping).
pub(crate) const MAX_REGIONS: usize = 1024;

/// Why a registration was refused; the message goes back to the client.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    #[error("the region must be a memfd sealed with F_SEAL_SHRINK (so it cannot shrink under the server): {0}")]
    NotSealed(String),
    #[error("the region is {0} bytes; it must be 1 to {MAX_REGION_BYTES}")]
    Size(u64),
    #[error("{MAX_REGIONS} regions are registered, the server's limit")]
    Full,
    #[error("mapping the region: {0}")]
    Map(std::io::Error),
}

/// One registered region, mapped shared with its client.
#[derive(Debug)]
pub(crate) struct Region {
    tenant: TenantId,
    map: MmapRaw,
}

impl Region {
    fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Copies `bytes` to `offset`, which the caller checked lies with
    /// `bytes` inside the region.
    fn write(&self, offset: u64, bytes: &[u8]) {
        assert!(
            offset
                .checked_add(bytes.len() as u64)
                .is_some_and(|end| end <= self.len())
        );
        // SAFETY: the range is inside the mapping (asserted above), which
        // lives as long as `self`. The memfd is sealed against shrinking
        // (checked at registration), so every mapped page stays backed and
        // the write cannot fault. The client may write the same memory
        // concurrently: only raw pointers touch it here, never a Rust
        // reference, and what the client then reads is its own affair.
        unsafe {
            let dst = self.map.as_mut_ptr().add(offset as usize);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len());
        }
    }
}

/// The registered regions, by id.
#[derive(Debug, Default)]
pub(crate) struct Regions {
    by_id: Mutex<HashMap<u64, Arc<Region>>>,
}

impl Regions {
    fn by_id(&self) -> MutexGuard<'_, HashMap<u64, Arc<Region>>> {
        self.by_id.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Maps `file` for `tenant`; the new region's id (random, so that one
    /// client cannot guess another's) and size.
    pub(crate) fn register(&self, tenant: TenantId, file: &File) -> Result<(u64, u64), RegisterError> {
        // SAFETY: fcntl on a descriptor `file` owns; F_GET_SEALS only reads.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(RegisterError::NotSealed(std::io::Error::last_os_error().to_string()));
        }
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(RegisterError::NotSealed("F_SEAL_SHRINK is not set".into()));
        }
        let len = file.metadata().map_err(RegisterError::Map)?.len();
        if len == 0 || len > MAX_REGION_BYTES {
            return Err(RegisterError::Size(len));
        }
        let map = MmapOptions::new()
            .len(len as usize)
            .map_raw(file)
            .map_err(RegisterError::Map)?;
        let region = Arc::new(Region { tenant, map });
        let mut by_id = self.by_id();
        if by_id.len() >= MAX_REGIONS {
            return Err(RegisterError::Full);
        }
        let id = loop {
            let id = kvtier_store::random_id();
            if !by_id.contains_key(&id) {
                break id;
            }
        };
        by_id.insert(id, region);
        Ok((id, len))
    }

    /// The region leaves the registry; calls still writing into it finish.
    pub(crate) fn remove(&self, id: u64) {
        self.by_id().remove(&id);
    }

    /// Regions and their bytes: all, or `tenant`'s.
    pub(crate) fn usage(&self, tenant: Option<&TenantId>) -> (u64, u64) {
        self.by_id()
            .values()
            .filter(|r| tenant.is_none_or(|t| *t == r.tenant))
            .fold((0, 0), |(n, bytes), r| (n + 1, bytes + r.len()))
    }

    /// The window a request names, checked against its tenant's regions
    /// and against `needed`, the most bytes the call can write.
    pub(crate) fn window(&self, tenant: &TenantId, w: &pb::ShmWindow, needed: usize) -> Result<Window, Status> {
        let region = self
            .by_id()
            .get(&w.region_id)
            .filter(|r| r.tenant == *tenant)
            .cloned()
            .ok_or_else(|| {
                Status::not_found(format!(
                    "{}: is {}, which tenant {:?} has not registered (or its connection closed)",
                    wire::SHM_REGION_ID.path,
                    w.region_id,
                    tenant.as_str()
                ))
            })?;
        if w.length == 0 {
            return Err(invalid(wire::SHM_LENGTH, "must be at least 1"));
        }
        if w.offset >= region.len() {
            return Err(invalid(
                wire::SHM_OFFSET,
                format!("is {}, past the region's {} bytes", w.offset, region.len()),
            ));
        }
        let end = w.offset.checked_add(w.length).filter(|&end| end <= region.len());
        let Some(end) = end else {
            return Err(invalid(
                wire::SHM_LENGTH,
                format!(
                    "is {}: the window ends past the region's {} bytes",
                    w.length,
                    region.len()
                ),
            ));
        };
        if w.length < needed as u64 {
            return Err(invalid(
                wire::SHM_LENGTH,
                format!("is {} bytes; the call can return up to {needed}", w.length),
            ));
        }
        Ok(Window {
            region,
            next: w.offset,
            end,
        })
    }
}

/// Where a call writes its pages: the rest of its window.
#[derive(Debug)]
pub(crate) struct Window {
    region: Arc<Region>,
    next: u64,
    end: u64,
}

impl Window {
    /// Moves a page's bytes out of its message into the window.
    pub(crate) fn take_page(&mut self, page: &mut pb::Page) -> StoreResult<()> {
        let kv = std::mem::take(&mut page.kv);
        let len = kv.len() as u64;
        if len > self.end - self.next {
            // The window was checked against the call's bound; a call
            // returning more is a server bug, refused rather than written.
            return Err(StoreError::Internal("a response outgrew its checked shm window".into()));
        }
        self.region.write(self.next, &kv);
        page.shm_offset = self.next;
        page.shm_bytes = len;
        self.next += len;
        Ok(())
    }
}
