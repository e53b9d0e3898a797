//! Leases: pages handed out by reference stay pinned (never demoted, moved
//! or freed) until the holder releases them or the lease expires, so a
//! client that vanishes cannot leak pins. A lease belongs to the tenant
//! whose selection took it, and its id is random: one tenant can neither
//! guess nor release another's.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::TenantId;
use kvtier_sync::{Mutex, Rank};

use crate::page::{PhysPage, Pins};

#[derive(Debug)]
pub(crate) struct Leases {
    table: Mutex<HashMap<u64, Lease>>,
}

impl Default for Leases {
    fn default() -> Self {
        Self {
            table: Mutex::new(Rank::Leases, HashMap::new()),
        }
    }
}

#[derive(Debug)]
struct Lease {
    tenant: TenantId,
    expires: Instant,
    _pins: Pins,
}

/// Longest lease a client may ask for.
pub const MAX_LEASE: Duration = Duration::from_secs(600);

impl Leases {
    /// Pins `pages` for `ttl` (capped at [`MAX_LEASE`]) on behalf of
    /// `tenant`; returns the lease id.
    pub(crate) fn grant(&self, tenant: &TenantId, pages: Vec<Arc<PhysPage>>, ttl: Duration) -> (u64, Instant) {
        let expires = Instant::now() + ttl.min(MAX_LEASE);
        let lease = Lease {
            tenant: tenant.clone(),
            expires,
            _pins: Pins::new(pages),
        };
        let mut table = self.table.lock();
        loop {
            let id = random_id();
            if let std::collections::hash_map::Entry::Vacant(slot) = table.entry(id) {
                slot.insert(lease);
                return (id, expires);
            }
        }
    }

    /// Ends one of `tenant`'s leases early; false if it has no such lease
    /// (any more).
    pub(crate) fn release(&self, tenant: &TenantId, id: u64) -> bool {
        let ended = {
            let mut table = self.table.lock();
            match table.get(&id) {
                Some(lease) if lease.tenant == *tenant => table.remove(&id),
                _ => None,
            }
        };
        // Unpinned after the table's lock: a lease may hold the last
        // reference to a page, whose freeing takes other locks.
        ended.is_some()
    }

    /// Ends every lease past its expiry; returns how many.
    pub(crate) fn expire(&self, now: Instant) -> usize {
        let ended: Vec<Lease> = self
            .table
            .lock()
            .extract_if(|_, l| l.expires <= now)
            .map(|(_, l)| l)
            .collect();
        // Unpinned after the table's lock, as in `release`.
        ended.len()
    }

    pub(crate) fn active(&self) -> usize {
        self.table.lock().len()
    }
}

/// A nonzero id from the operating system's random source, which no client
/// can guess (0 means "none" on the wire): leases, shared-memory regions.
pub fn random_id() -> u64 {
    loop {
        let mut bytes = [0u8; 8];
        // The OS random source fails only where it does not exist (no
        // getrandom(2) and no /dev/urandom): no server can run there.
        getrandom::getrandom(&mut bytes).expect("the operating system's random source");
        let id = u64::from_le_bytes(bytes);
        if id != 0 {
            return id;
        }
    }
}
