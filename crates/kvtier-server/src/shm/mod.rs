//! The shared-memory data plane: clients on this machine register a sealed
//! memfd over a Unix socket (`socket.rs`), and fetches and selections that
//! name a window of it get their page bytes written there instead of into
//! gRPC messages. A region is its client's for as long as the registering
//! connection stays open; when it closes (the client ended, or died and the
//! kernel closed its sockets) the region leaves the registry, and its
//! mapping goes once the last call writing into it is done.

mod calls;
mod long_polls;
mod socket;

use std::collections::HashMap;
use std::fs::File;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use kvtier_core::{TenantId, wire};
use kvtier_proto::v1 as pb;
use kvtier_store::{FetchedPage, PageBuf};
use kvtier_sync::{Mutex, MutexGuard, Rank};
use memmap2::{MmapOptions, MmapRaw};
use tonic::Status;

use crate::responses::page_to_pb;
use crate::status::invalid;

pub(crate) use calls::{CallContext, LocalCalls};
pub(crate) use long_polls::LongPolls;
pub(crate) use socket::{bind, serve};

/// Largest region one client may register. Regions cost the server address
/// space, not memory (the client's memfd holds the pages), but address
/// space runs out too: 128 TiB, which a few 1 TiB sparse memfds would take.
pub(crate) const MAX_REGION_BYTES: u64 = 64 << 30;

/// Bytes of all regions mapped at once, over all clients.
pub(crate) const MAX_TOTAL_BYTES: u64 = 1 << 40;

/// Regions registered at once, over all clients (each holds a file
/// descriptor and a mapping), and per tenant, so that one tenant cannot
/// take them all.
pub(crate) const MAX_REGIONS: usize = 1024;
pub(crate) const MAX_REGIONS_PER_TENANT: usize = 64;

/// Why a registration was refused; the message goes back to the client.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    #[error("the region must be a memfd sealed with F_SEAL_SHRINK (so it cannot shrink under the server): {0}")]
    NotSealed(String),
    #[error("the region must be an ordinary memfd (tmpfs), not hugetlbfs or another file system")]
    NotTmpfs,
    #[error("the region is {0} bytes; it must be 1 to {MAX_REGION_BYTES}")]
    Size(u64),
    #[error(
        "the server's limits are reached: {MAX_REGIONS} regions, {MAX_REGIONS_PER_TENANT} per tenant, \
         {MAX_TOTAL_BYTES} bytes in all"
    )]
    Full,
    #[error("mapping the region: {0}")]
    Map(std::io::Error),
}

/// One registered region, mapped shared with its client.
#[derive(Debug)]
pub(crate) struct Region {
    tenant: TenantId,
    map: MmapRaw,
    /// The windows calls are writing now: no two overlap, so each call's
    /// view of its window is the only one in this process.
    busy: Mutex<Vec<Range<u64>>>,
}

impl Region {
    fn len(&self) -> u64 {
        self.map.len() as u64
    }

    fn busy(&self) -> MutexGuard<'_, Vec<Range<u64>>> {
        self.busy.lock()
    }
}

/// The registered regions, by id.
#[derive(Debug)]
pub(crate) struct Regions {
    by_id: Mutex<HashMap<u64, Arc<Region>>>,
}

impl Default for Regions {
    fn default() -> Self {
        Self {
            by_id: Mutex::new(Rank::ShmRegions, HashMap::new()),
        }
    }
}

impl Regions {
    fn by_id(&self) -> MutexGuard<'_, HashMap<u64, Arc<Region>>> {
        self.by_id.lock()
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
        // A hugetlbfs memfd can be sealed too, but a hole punched in it
        // drops its huge-page reservation, and the server's next write into
        // the hole could find no page: SIGBUS. Ordinary shmem just gets a
        // new page.
        // SAFETY: statfs is plain data; fstatfs fills it from a descriptor
        // `file` owns.
        let on_tmpfs = unsafe {
            let mut fs: libc::statfs = std::mem::zeroed();
            libc::fstatfs(file.as_raw_fd(), &mut fs) == 0 && fs.f_type == libc::TMPFS_MAGIC
        };
        if !on_tmpfs {
            return Err(RegisterError::NotTmpfs);
        }
        let len = file.metadata().map_err(RegisterError::Map)?.len();
        if len == 0 || len > MAX_REGION_BYTES {
            return Err(RegisterError::Size(len));
        }
        let map = MmapOptions::new()
            .len(len as usize)
            .map_raw(file)
            .map_err(RegisterError::Map)?;
        let region = Arc::new(Region {
            tenant,
            map,
            busy: Mutex::new(Rank::ShmWindows, Vec::new()),
        });
        let mut by_id = self.by_id();
        let (all, total) = usage(&by_id, None);
        let (tenant_regions, _) = usage(&by_id, Some(&region.tenant));
        if all >= MAX_REGIONS as u64 || tenant_regions >= MAX_REGIONS_PER_TENANT as u64 || total + len > MAX_TOTAL_BYTES
        {
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
        usage(&self.by_id(), tenant)
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
        let range = w.offset..end;
        let mut busy = region.busy();
        if busy.iter().any(|b| b.start < range.end && range.start < b.end) {
            return Err(Status::failed_precondition(format!(
                "{}: the window overlaps one another call is writing now; give each call in flight a window of its own",
                wire::SHM.path
            )));
        }
        busy.push(range.clone());
        drop(busy);
        Ok(Window { region, range })
    }
}

/// Regions in `by_id` and their bytes: all, or `tenant`'s.
fn usage(by_id: &HashMap<u64, Arc<Region>>, tenant: Option<&TenantId>) -> (u64, u64) {
    by_id
        .values()
        .filter(|r| tenant.is_none_or(|t| *t == r.tenant))
        .fold((0, 0), |(n, bytes), r| (n + 1, bytes + r.len()))
}

/// Where a call writes its pages, its own until it is dropped.
#[derive(Debug)]
pub(crate) struct Window {
    region: Arc<Region>,
    range: Range<u64>,
}

impl Window {
    /// The window as room for a read.
    pub(crate) fn buf(&mut self) -> PageBuf<'_> {
        PageBuf::new(self.room())
    }

    /// The window as room for a read of several KV heads' pages, each
    /// head's K rows, in the pages' order, then its V rows
    /// (`SelectPagesRequest.gather_heads`).
    pub(crate) fn per_head_buf(&mut self) -> PageBuf<'_> {
        PageBuf::per_head(self.room())
    }

    /// The window's bytes, to write.
    fn room(&mut self) -> &mut [MaybeUninit<u8>] {
        let len = (self.range.end - self.range.start) as usize;
        // SAFETY: the range lies inside the mapping (checked when the window
        // was made), which lives as long as `self.region`. The memfd is
        // sealed against shrinking (checked at registration), so every page
        // stays backed and no write faults. No other window of the region
        // overlaps this one while it lives (`busy`), and `&mut self` makes
        // this the only view of it here. The client may write the same bytes
        // concurrently from its process; that cannot make a `MaybeUninit<u8>`
        // invalid, and nothing here reads them back.
        unsafe {
            let start = self.region.map.as_mut_ptr().add(self.range.start as usize);
            std::slice::from_raw_parts_mut(start.cast::<MaybeUninit<u8>>(), len)
        }
    }

    /// Pages read into this window's [`Window::buf`], as messages saying
    /// where their bytes are in the region.
    pub(crate) fn pages(&self, pages: Vec<FetchedPage<Range<usize>>>) -> Vec<pb::Page> {
        let start = self.range.start;
        pages
            .into_iter()
            .map(|p| {
                page_to_pb(p, |page, r| {
                    page.shm_offset = start + r.start as u64;
                    page.shm_bytes = r.len() as u64;
                })
            })
            .collect()
    }

    /// Pages read into this window's [`Window::per_head_buf`], each with
    /// where its K half and its V half lie in it, as messages saying where
    /// they are in the region.
    pub(crate) fn gathered_pages(&self, pages: Vec<FetchedPage<(Range<usize>, Range<usize>)>>) -> Vec<pb::Page> {
        let start = self.range.start;
        pages
            .into_iter()
            .map(|p| {
                page_to_pb(p, |page, (k, v)| {
                    page.shm_offset = start + k.start as u64;
                    page.shm_v_offset = Some(start + v.start as u64);
                    page.shm_bytes = (k.len() + v.len()) as u64;
                })
            })
            .collect()
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        let mut busy = self.region.busy();
        if let Some(i) = busy.iter().position(|b| *b == self.range) {
            busy.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::FromRawFd;

    use super::*;

    /// A memfd of `len` bytes, sealed against shrinking when `sealed`.
    fn memfd(len: u64, sealed: bool) -> File {
        // SAFETY: a NUL-terminated name and valid flags.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor no one else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).unwrap();
        if sealed {
            // SAFETY: fcntl on a descriptor `file` owns.
            assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
        }
        file
    }

    fn window(id: u64, offset: u64, length: u64) -> pb::ShmWindow {
        pb::ShmWindow {
            region_id: id,
            offset,
            length,
        }
    }

    #[test]
    fn a_region_that_could_shrink_is_refused() {
        let regions = Regions::default();
        let tenant = TenantId::parse("tenant", "").unwrap();
        let err = regions.register(tenant.clone(), &memfd(4096, false)).unwrap_err();
        assert!(matches!(err, RegisterError::NotSealed(_)), "{err}");
        let file = tempfile::tempfile().unwrap();
        file.set_len(4096).unwrap();
        let err = regions.register(tenant.clone(), &file).unwrap_err();
        assert!(matches!(err, RegisterError::NotSealed(_)), "a plain file: {err}");
        assert!(regions.register(tenant, &memfd(4096, true)).is_ok());
    }

    #[test]
    fn one_tenant_cannot_take_every_region() {
        let regions = Regions::default();
        let greedy = TenantId::parse("tenant", "greedy").unwrap();
        let kept: Vec<_> = (0..MAX_REGIONS_PER_TENANT)
            .map(|_| regions.register(greedy.clone(), &memfd(4096, true)).unwrap())
            .collect();
        let err = regions.register(greedy, &memfd(4096, true)).unwrap_err();
        assert!(matches!(err, RegisterError::Full), "{err}");
        let other = TenantId::parse("tenant", "other").unwrap();
        assert!(regions.register(other, &memfd(4096, true)).is_ok());
        assert_eq!(kept.len(), MAX_REGIONS_PER_TENANT);
    }

    #[test]
    fn windows_in_use_do_not_overlap() {
        let regions = Regions::default();
        let tenant = TenantId::parse("tenant", "").unwrap();
        let (id, _) = regions.register(tenant.clone(), &memfd(1 << 16, true)).unwrap();
        let first = regions.window(&tenant, &window(id, 4096, 8192), 0).unwrap();
        let overlapping = regions.window(&tenant, &window(id, 8191, 10), 0).unwrap_err();
        assert_eq!(overlapping.code(), tonic::Code::FailedPrecondition, "{overlapping:?}");
        let beside = regions.window(&tenant, &window(id, 12288, 4096), 0).unwrap();
        drop(first);
        let again = regions.window(&tenant, &window(id, 8191, 10), 0);
        assert!(again.is_ok(), "a window is free again once its call is done");
        drop(beside);
    }
}
