//! What the store's resident metadata costs, the server-wide budget it is
//! charged against, and per-tenant quotas.
//!
//! Metadata is what a sequence keeps in process memory besides page bytes:
//! its lanes, page tables, digests, summaries' row counts and policy
//! statistics. Each is charged when it is created (before the allocation, so
//! that a refused request allocates nothing) and refunded when its sequence
//! is dropped (a physical page carries its own charge, refunded when the
//! page is freed). What each costs is in `cost.rs` (the crate's); pages that go gone keep
//! their charge until the sequence is dropped (their table entry and digest
//! stay).
//!
//! A tenant's page bytes per tier are counted as its pages' slots come and
//! go; a quota on one refuses the allocation that would pass it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvtier_core::{SequenceKey, TenantId};
use kvtier_sync::{Mutex, Rank};
use kvtier_tiers::{Slot, TierKind};

use crate::{StoreError, StoreResult};

/// What one tenant may hold. `None`: no limit of that kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quota {
    /// Live sequences the tenant may hold at once.
    pub sequences: Option<u64>,
    /// Resident metadata of the tenant's sequences, in bytes.
    pub metadata_bytes: Option<u64>,
    /// Page bytes in the device tier (slots as reserved, granule rounding included).
    pub device_bytes: Option<u64>,
    /// Page bytes in host memory, counted like `device_bytes`.
    pub host_bytes: Option<u64>,
    /// Page bytes on NVMe, counted like `device_bytes`.
    pub nvme_bytes: Option<u64>,
}

impl Quota {
    fn tier(&self, kind: TierKind) -> Option<u64> {
        match kind {
            TierKind::Device => self.device_bytes,
            TierKind::Host => self.host_bytes,
            TierKind::Nvme => self.nvme_bytes,
        }
    }
}

/// The metadata budget of the whole server and the quotas of its tenants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Resident metadata of all sequences together.
    pub metadata_bytes: u64,
    /// The quota of a tenant not named in `tenants`.
    pub default_quota: Quota,
    /// Quotas of named tenants, in place of `default_quota`.
    pub tenants: BTreeMap<TenantId, Quota>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            metadata_bytes: 1 << 30,
            default_quota: Quota::default(),
            tenants: BTreeMap::new(),
        }
    }
}

/// A request that would pass a limit. Nothing was charged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{holder} holds {used} {unit} and this needs {asked} more, over its limit of {limit} ({setting})")]
pub struct OverLimit {
    /// `the server's metadata` or `tenant "a"'s host bytes`.
    pub holder: String,
    /// What the numbers count: `bytes` or `sequences`.
    pub unit: &'static str,
    /// What the holder held before the request, in `unit`.
    pub used: u64,
    /// What the request needed on top of `used`, in `unit`.
    pub asked: u64,
    /// The limit it would pass, in `unit`.
    pub limit: u64,
    /// The configuration key that sets the limit.
    pub setting: &'static str,
}

/// Adds `n` to a counter unless that passes `limit`; refused, it returns
/// what was in use.
fn take(counter: &AtomicU64, n: u64, limit: Option<u64>) -> Result<(), u64> {
    let mut used = counter.load(Ordering::Relaxed);
    loop {
        let next = used.saturating_add(n);
        if limit.is_some_and(|l| next > l) {
            return Err(used);
        }
        match counter.compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return Ok(()),
            Err(now) => used = now,
        }
    }
}

fn give(counter: &AtomicU64, n: u64) {
    counter.fetch_sub(n, Ordering::AcqRel);
}

fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// What one tenant holds now.
#[derive(Debug)]
pub(crate) struct Account {
    tenant: TenantId,
    quota: Quota,
    sequences: AtomicU64,
    metadata: AtomicU64,
    /// Page bytes per tier (indexed like `TierKind::ALL`); each slot of the
    /// tenant's pages holds the one of its tier, and leaves it when freed.
    tiers: [Arc<AtomicU64>; 3],
}

/// A tenant's usage, as statistics report it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Live sequences the tenant holds.
    pub sequences: u64,
    /// Resident metadata charged to the tenant, in bytes.
    pub metadata_bytes: u64,
    /// Page bytes per tier, indexed like `TierKind::ALL`.
    pub tier_bytes: [u64; 3],
    /// The quota the tenant is held to (its own, or the default).
    pub quota: Quota,
}

impl Account {
    fn over(
        &self,
        what: &str,
        unit: &'static str,
        used: u64,
        asked: u64,
        limit: Option<u64>,
        setting: &'static str,
    ) -> OverLimit {
        OverLimit {
            holder: format!("tenant {:?}'s {what}", self.tenant.as_str()),
            unit,
            used,
            asked,
            limit: limit.unwrap_or(u64::MAX),
            setting,
        }
    }

    /// A slot of `len` bytes in `kind` for one of this tenant's pages, made
    /// by `allocate` once the tenant's quota there admits it (`force`: past
    /// the quota); it counts against the tenant, at the size it reserves in
    /// the tier (`len` rounded up to the tier's granule), until it is
    /// dropped.
    pub(crate) fn slot<E>(
        &self,
        kind: TierKind,
        len: u64,
        force: bool,
        allocate: impl FnOnce() -> Result<Slot, E>,
    ) -> StoreResult<Slot>
    where
        StoreError: From<E>,
    {
        self.admit(kind, len, force)?;
        let slot = match allocate() {
            Ok(slot) => slot,
            Err(e) => {
                give(self.gauge(kind), len);
                return Err(e.into());
            }
        };
        // The granule's rounding counts too; refused, the slot is freed as
        // it drops here.
        let rounding = slot.reserved().saturating_sub(len);
        if let Err(e) = self.admit(kind, rounding, force) {
            give(self.gauge(kind), len);
            return Err(e.into());
        }
        Ok(slot.metered(Arc::clone(self.gauge(kind))))
    }

    /// Whether `len` more bytes in `kind` fit the quota, without taking them.
    pub(crate) fn fits(&self, kind: TierKind, len: u64) -> bool {
        self.quota
            .tier(kind)
            .is_none_or(|q| get(self.gauge(kind)).saturating_add(len) <= q)
    }

    fn admit(&self, kind: TierKind, len: u64, force: bool) -> Result<(), OverLimit> {
        let limit = self.quota.tier(kind);
        take(self.gauge(kind), len, limit.filter(|_| !force)).map_err(|used| {
            let setting = match kind {
                TierKind::Device => "quota device_bytes",
                TierKind::Host => "quota host_bytes",
                TierKind::Nvme => "quota nvme_bytes",
            };
            self.over(&format!("{} bytes", kind.name()), "bytes", used, len, limit, setting)
        })
    }

    fn gauge(&self, kind: TierKind) -> &Arc<AtomicU64> {
        &self.tiers[TierKind::ALL
            .iter()
            .position(|k| *k == kind)
            .expect("every kind is in ALL")]
    }

    pub(crate) fn usage(&self) -> Usage {
        Usage {
            sequences: get(&self.sequences),
            metadata_bytes: get(&self.metadata),
            tier_bytes: std::array::from_fn(|i| get(&self.tiers[i])),
            quota: self.quota,
        }
    }
}

/// Every tenant's account and the server-wide metadata budget.
#[derive(Debug)]
pub(crate) struct Accounts {
    limits: Limits,
    metadata: AtomicU64,
    tenants: Mutex<HashMap<TenantId, Arc<Account>>>,
}

impl Accounts {
    pub(crate) fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            metadata: AtomicU64::new(0),
            tenants: Mutex::new(Rank::Tenants, HashMap::new()),
        })
    }

    pub(crate) fn account(&self, tenant: &TenantId) -> Arc<Account> {
        let mut tenants = self.tenants.lock();
        let account = tenants.entry(tenant.clone()).or_insert_with(|| {
            Arc::new(Account {
                tenant: tenant.clone(),
                quota: self.quota(tenant),
                sequences: AtomicU64::new(0),
                metadata: AtomicU64::new(0),
                tiers: Default::default(),
            })
        });
        Arc::clone(account)
    }

    /// The metadata the whole server holds.
    pub(crate) fn metadata_bytes(&self) -> u64 {
        get(&self.metadata)
    }

    pub(crate) fn metadata_budget(&self) -> u64 {
        self.limits.metadata_bytes
    }

    /// What `tenant` holds; asking makes no account (tenant names are the
    /// client's to choose).
    pub(crate) fn usage(&self, tenant: &TenantId) -> Usage {
        match self.tenants.lock().get(tenant) {
            Some(account) => account.usage(),
            None => Usage {
                quota: self.quota(tenant),
                ..Usage::default()
            },
        }
    }

    fn quota(&self, tenant: &TenantId) -> Quota {
        self.limits
            .tenants
            .get(tenant)
            .copied()
            .unwrap_or(self.limits.default_quota)
    }

    /// Forgets `account` once nothing else refers to it and it holds
    /// nothing, so that the map holds only tenants with something stored.
    fn forget_if_idle(&self, account: &Arc<Account>) {
        let mut tenants = self.tenants.lock();
        // The map's reference and the caller's.
        let idle = Arc::strong_count(account) == 2
            && get(&account.sequences) == 0
            && get(&account.metadata) == 0
            && account.tiers.iter().all(|t| get(t) == 0);
        if idle && tenants.get(&account.tenant).is_some_and(|a| Arc::ptr_eq(a, account)) {
            tenants.remove(&account.tenant);
        }
    }

    /// Opens the charge of a new sequence: one sequence and its base
    /// metadata, or the limit it would pass. `force` charges past the
    /// limits (recovery brings back what was acknowledged, whatever the
    /// limits are now).
    pub(crate) fn open(self: &Arc<Self>, key: &SequenceKey, bytes: u64, force: bool) -> Result<Charge, OverLimit> {
        let account = self.account(&key.tenant);
        let limit = |l: Option<u64>| l.filter(|_| !force);
        take(&account.sequences, 1, limit(account.quota.sequences)).map_err(|used| {
            account.over(
                "sequences",
                "sequences",
                used,
                1,
                account.quota.sequences,
                "quota sequences",
            )
        })?;
        // Dropped on refusal, which gives the sequence back.
        let mut charge = Charge {
            accounts: Arc::clone(self),
            account,
            bytes: 0,
        };
        charge.grow_inner(bytes, force)?;
        charge.bytes = bytes;
        Ok(charge)
    }
}

/// The metadata one sequence is charged for, refunded (with the sequence
/// itself) when it is dropped.
#[derive(Debug)]
pub(crate) struct Charge {
    accounts: Arc<Accounts>,
    account: Arc<Account>,
    bytes: u64,
}

impl Charge {
    /// Charges `n` more bytes, or refuses with the limit it would pass.
    pub(crate) fn grow(&mut self, n: u64) -> Result<(), OverLimit> {
        self.grow_inner(n, false)?;
        self.bytes += n;
        Ok(())
    }

    /// Charges `n` more bytes whatever the limits.
    pub(crate) fn force(&mut self, n: u64) {
        self.grow_inner(n, true).expect("forced charges have no limit");
        self.bytes += n;
    }

    /// Refunds `n` of the bytes charged (a write that failed after charging).
    pub(crate) fn shrink(&mut self, n: u64) {
        let n = n.min(self.bytes);
        self.accounts.give_metadata(&self.account, n);
        self.bytes -= n;
    }

    pub(crate) fn account(&self) -> &Arc<Account> {
        &self.account
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Moves `n` of the bytes charged into a new page's own charge.
    pub(crate) fn split(&mut self, n: u64) -> PageCharge {
        let n = n.min(self.bytes);
        self.bytes -= n;
        PageCharge {
            accounts: Arc::clone(&self.accounts),
            account: Arc::clone(&self.account),
            bytes: n,
        }
    }

    fn grow_inner(&self, n: u64, force: bool) -> Result<(), OverLimit> {
        self.accounts.take_metadata(&self.account, n, force)
    }
}

/// The metadata of one physical page, held by the page itself: refunded
/// when the page is freed, whichever sequence made it and however many
/// share it.
#[derive(Debug)]
pub(crate) struct PageCharge {
    accounts: Arc<Accounts>,
    account: Arc<Account>,
    bytes: u64,
}

impl PageCharge {
    /// The tenant whose quotas the page's slots count against.
    pub(crate) fn owner(&self) -> &Arc<Account> {
        &self.account
    }
}

impl Drop for PageCharge {
    fn drop(&mut self) {
        self.accounts.give_metadata(&self.account, self.bytes);
        self.accounts.forget_if_idle(&self.account);
    }
}

impl Accounts {
    /// Charges `n` bytes of metadata to the server and to `account`, or
    /// refuses with the limit it would pass (`force`: none).
    fn take_metadata(&self, account: &Account, n: u64, force: bool) -> Result<(), OverLimit> {
        let budget = self.limits.metadata_bytes;
        take(&self.metadata, n, (!force).then_some(budget)).map_err(|used| OverLimit {
            holder: "the server's metadata".into(),
            unit: "bytes",
            used,
            asked: n,
            limit: budget,
            setting: "metadata_bytes",
        })?;
        let quota = account.quota.metadata_bytes;
        if let Err(used) = take(&account.metadata, n, quota.filter(|_| !force)) {
            give(&self.metadata, n);
            return Err(account.over("metadata", "bytes", used, n, quota, "quota metadata_bytes"));
        }
        Ok(())
    }

    fn give_metadata(&self, account: &Account, n: u64) {
        give(&self.metadata, n);
        give(&account.metadata, n);
    }

    /// A page's charge of `bytes`, past every limit (recovery).
    pub(crate) fn page_charge(self: &Arc<Self>, account: &Arc<Account>, bytes: u64) -> PageCharge {
        self.take_metadata(account, bytes, true)
            .expect("forced charges have no limit");
        PageCharge {
            accounts: Arc::clone(self),
            account: Arc::clone(account),
            bytes,
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.shrink(self.bytes);
        give(&self.account.sequences, 1);
        self.accounts.forget_if_idle(&self.account);
    }
}
