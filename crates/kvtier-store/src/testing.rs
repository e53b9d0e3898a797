//! The store's components built alone over real tiers (an arena device and
//! host, an NVMe file behind a fault injector), for their unit tests: each
//! component is tested against its own contract, not through the store.

use std::sync::Arc;

use kvtier_core::{DType, Layout, LayoutSpec, TenantId};
use kvtier_tiers::faults::{Faults, FaultyTier};
use kvtier_tiers::{ArenaTier, EngineChoice, NvmeConfig, NvmeTier, Tier};

use crate::accounts::{Account, Accounts, Limits};
use crate::device::{DevicePolicy, HotSet};
use crate::durability::Durable;
use crate::host::{HostCache, HostPolicy};
use crate::page::{PhysPage, Placement};
use crate::reader::Reader;
use crate::stats::Counters;

/// One page: 16 tokens of 64 f16 dimensions, K then V.
pub(crate) const PAGE_BYTES: u64 = 4096;

pub(crate) fn layout() -> Arc<Layout> {
    Arc::new(
        Layout::new(LayoutSpec {
            num_layers: 1,
            num_kv_heads: 1,
            num_query_heads: 1,
            head_dim: 64,
            dtype: DType::F16,
            page_size: 16,
            layer_groups: vec![],
        })
        .expect("a valid layout"),
    )
}

/// The components, sized in pages.
pub(crate) struct Parts {
    pub(crate) counters: Arc<Counters>,
    pub(crate) accounts: Arc<Accounts>,
    pub(crate) owner: Arc<Account>,
    pub(crate) host: HostCache,
    pub(crate) device: HotSet,
    pub(crate) durable: Durable,
    pub(crate) faults: Arc<Faults>,
    pub(crate) layout: Arc<Layout>,
    _dir: tempfile::TempDir,
}

impl Parts {
    pub(crate) fn new(device_pages: u64, host_pages: u64, exclusive: bool) -> Self {
        Self::with_policy(device_pages, host_pages, exclusive, DevicePolicy::Lru)
    }

    /// [`Parts::new`] with the device under `policy`.
    pub(crate) fn with_policy(device_pages: u64, host_pages: u64, exclusive: bool, policy: DevicePolicy) -> Self {
        Self::with_policies(device_pages, host_pages, exclusive, policy, HostPolicy::Lru, (1.0, 1.0))
    }

    /// [`Parts::new`] with host memory under `policy`.
    pub(crate) fn with_host_policy(device_pages: u64, host_pages: u64, policy: HostPolicy) -> Self {
        Self::with_policies(device_pages, host_pages, false, DevicePolicy::Lru, policy, (1.0, 1.0))
    }

    /// [`Parts::new`] with host memory's background rounds between
    /// `watermarks` (high, low). Elsewhere they are 1,1: pages migrate
    /// only when memory is full, in the policies' own order.
    pub(crate) fn with_host_watermarks(host_pages: u64, policy: HostPolicy, watermarks: (f64, f64)) -> Self {
        Self::with_policies(1, host_pages, false, DevicePolicy::Lru, policy, watermarks)
    }

    fn with_policies(
        device_pages: u64,
        host_pages: u64,
        exclusive: bool,
        policy: DevicePolicy,
        host_policy: HostPolicy,
        (high, low): (f64, f64),
    ) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let nvme = NvmeTier::open(NvmeConfig {
            path: dir.path().join("nvme.data"),
            capacity: 1 << 20,
            engine: EngineChoice::Auto,
            queue_depth: 8,
            direct: true,
        })
        .expect("an NVMe file");
        let faults = Faults::none();
        let nvme: Arc<dyn Tier> = Arc::new(FaultyTier::new(nvme, Arc::clone(&faults)));
        let device: Arc<dyn Tier> = Arc::new(ArenaTier::emulated_device(device_pages * PAGE_BYTES).expect("device"));
        let host: Arc<dyn Tier> = Arc::new(ArenaTier::host(host_pages * PAGE_BYTES).expect("host"));
        let counters = Arc::new(Counters::default());
        let accounts = Accounts::new(Limits::default());
        let owner = accounts.account(&TenantId::parse("tenant", "t").expect("a tenant"));
        Self {
            durable: Durable::new(None, 0, [&device, &host], Some(nvme), Arc::clone(&counters)),
            host: HostCache::new(host, host_policy, high, low),
            device: HotSet::new(device, exclusive, policy, Arc::clone(&counters)),
            counters,
            accounts,
            owner,
            faults,
            layout: layout(),
            _dir: dir,
        }
    }

    pub(crate) fn reader(&self) -> Reader<'_> {
        Reader {
            host: &self.host,
            device: &**self.device.tier(),
            durable: &self.durable,
            counters: &self.counters,
            promote: false,
            touch: true,
        }
    }

    /// The bytes of page `id`: every byte `id` plus its offset's low bits.
    pub(crate) fn bytes(id: u64) -> Vec<u8> {
        (0..PAGE_BYTES).map(|i| (id as u8).wrapping_add(i as u8)).collect()
    }

    /// A full page `id` with its bytes in host memory, known to the host's
    /// LRU.
    pub(crate) fn page(&self, id: u64) -> Arc<PhysPage> {
        let host = self.host.tier();
        let slot = self
            .owner
            .slot(kvtier_tiers::TierKind::Host, PAGE_BYTES, true, || {
                host.allocate(PAGE_BYTES)
            })
            .expect("host room");
        self.in_line(id, slot)
    }

    /// [`Parts::page`], its slot taken as a write takes one: through the
    /// host cache, which makes room when memory is full.
    pub(crate) fn write_page(&self, id: u64) -> crate::StoreResult<Arc<PhysPage>> {
        let slot = self.host.allocate(
            PAGE_BYTES,
            &self.durable,
            &mut crate::host::MigrationTime::default(),
            &self.owner,
        )?;
        Ok(self.in_line(id, slot))
    }

    /// Page `id`'s bytes written to `slot`, the page then in line.
    fn in_line(&self, id: u64, mut slot: kvtier_tiers::Slot) -> Arc<PhysPage> {
        self.host
            .tier()
            .write(&mut slot, 0, &Self::bytes(id))
            .expect("host write");
        let charge = self.accounts.page_charge(&self.owner, 0);
        let place = Placement::written(None, slot, self.layout.page_size());
        let page = Arc::new(PhysPage::new(id, Arc::clone(&self.layout), None, place, charge));
        self.host.touch_written([&page]);
        page
    }
}
