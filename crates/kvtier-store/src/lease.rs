//! Leases: pages handed out by reference stay pinned (never demoted, moved
//! or freed) until the holder releases them or the lease expires, so a
//! client that vanishes cannot leak pins.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::page::{PhysPage, Pins};
use crate::sync::lock;

#[derive(Debug, Default)]
pub(crate) struct Leases {
    next: AtomicU64,
    table: Mutex<HashMap<u64, Lease>>,
}

#[derive(Debug)]
struct Lease {
    expires: Instant,
    _pins: Pins,
}

/// Longest lease a client may ask for.
pub const MAX_LEASE: Duration = Duration::from_secs(600);

impl Leases {
    /// Pins `pages` for `ttl` (capped at [`MAX_LEASE`]); returns the lease id.
    pub(crate) fn grant(&self, pages: Vec<Arc<PhysPage>>, ttl: Duration) -> (u64, Instant) {
        let id = self.next.fetch_add(1, Relaxed) + 1;
        let expires = Instant::now() + ttl.min(MAX_LEASE);
        lock(&self.table).insert(
            id,
            Lease {
                expires,
                _pins: Pins::new(pages),
            },
        );
        (id, expires)
    }

    /// Ends a lease early; false if it does not exist (any more).
    pub(crate) fn release(&self, id: u64) -> bool {
        lock(&self.table).remove(&id).is_some()
    }

    /// Ends every lease past its expiry; returns how many.
    pub(crate) fn expire(&self, now: Instant) -> usize {
        let mut table = lock(&self.table);
        let before = table.len();
        table.retain(|_, l| l.expires > now);
        before - table.len()
    }

    pub(crate) fn active(&self) -> usize {
        lock(&self.table).len()
    }
}
