//! The least-recently-used order of a cache's pages (the host cache's, the
//! device's), and taking victims out of it.

use std::sync::{Arc, Weak};

use kvtier_sync::Mutex;

use super::PhysPage;
use crate::accounts::Account;

/// A cache's least-recently-used order of its pages (the host cache's, the
/// device's), keyed by page id.
pub(crate) type PageLru = Mutex<lru::LruCache<u64, Weak<PhysPage>>>;

/// Marks `pages` as just used in `lru`. A page in line already only moves
/// to the front: no new weak reference, no old one dropped (each an atomic
/// on the page, thousands of them in a decode step).
pub(crate) fn touch_lru<'a>(lru: &PageLru, pages: impl IntoIterator<Item = &'a Arc<PhysPage>>) {
    let mut lru = lru.lock();
    for page in pages {
        if lru.get(&page.id).is_none() {
            lru.put(page.id, Arc::downgrade(page));
        }
    }
}

/// Takes a page LRU's entries out, least recently used first: any page, or
/// only `owner`'s (a tenant past its quota makes room from its own pages).
#[derive(Debug)]
pub(crate) struct LruVictims<'a> {
    lru: &'a PageLru,
    /// The owner's candidates, found in one pass over the LRU.
    owned: Option<std::vec::IntoIter<u64>>,
}

impl<'a> LruVictims<'a> {
    /// With an owner, up to `n` of its pages are candidates.
    pub(crate) fn new(lru: &'a PageLru, owner: Option<&Arc<Account>>, n: usize) -> Self {
        let owned = owner.map(|o| least_recent_of(lru, o, n).into_iter());
        Self { lru, owned }
    }

    /// The next entry, taken out of the LRU.
    pub(crate) fn pop(&mut self) -> Option<(u64, Weak<PhysPage>)> {
        match &mut self.owned {
            None => self.lru.lock().pop_lru(),
            Some(ids) => ids.find_map(|id| self.lru.lock().pop_entry(&id)),
        }
    }
}

/// The ids of up to `n` of `owner`'s pages in a page LRU, least recently
/// used first: one pass over the LRU, for a tenant past its quota.
fn least_recent_of(lru: &PageLru, owner: &Arc<Account>, n: usize) -> Vec<u64> {
    // The pages seen are dropped after the LRU's lock: the last reference
    // to a page may go here, and freeing its slots takes other locks.
    let mut seen = Vec::new();
    let mut ids = Vec::new();
    {
        let lru = lru.lock();
        for (id, weak) in lru.iter().rev() {
            let Some(page) = weak.upgrade() else { continue };
            if page.owned_by(owner) {
                ids.push(*id);
            }
            seen.push(page);
            if ids.len() == n {
                break;
            }
        }
    }
    drop(seen);
    ids
}
