//! Physical pages with reference counts and a prefix index.
//!
//! Logical pages of many sequences may map to one physical page: sequences
//! that declare the same prefix hash chain share the physical pages of that
//! prefix. A physical page lives while at least one logical page refers to
//! it; the last release hands its payload back so the owner can free the
//! storage behind it.

use std::collections::HashMap;
use std::hash::Hash;

use crate::chunked::ChunkedVec;

/// Handle to a physical page. The generation makes a stale handle (to a
/// freed and reused index) detectable instead of aliasing a new page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PhysId {
    index: u32,
    generation: u32,
}

/// Why a [`PhysicalPages`] operation was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageTableError {
    /// The handle names no live page (never issued, or already freed).
    #[error("physical page {0:?} does not exist")]
    Unknown(PhysId),
    /// The share key is already registered, to this live page.
    #[error("a physical page is already registered under this share key")]
    KeyTaken(PhysId),
    /// The page's reference count would overflow `u32`.
    #[error("physical page {0:?} has too many references")]
    TooManyRefs(PhysId),
}

#[derive(Debug)]
enum Entry<T, K> {
    Vacant {
        generation: u32,
    },
    Live {
        generation: u32,
        refs: u32,
        key: Option<K>,
        payload: T,
    },
}

/// The refcounted set of physical pages; `K` is the share key (tenant,
/// layout, prefix hash, lane), `T` what the owner keeps per page.
#[derive(Debug)]
pub struct PhysicalPages<T, K> {
    entries: ChunkedVec<Entry<T, K>>,
    vacant: Vec<u32>,
    by_key: HashMap<K, PhysId>,
    live: usize,
}

impl<T, K> Default for PhysicalPages<T, K> {
    fn default() -> Self {
        Self {
            entries: ChunkedVec::default(),
            vacant: Vec::new(),
            by_key: HashMap::new(),
            live: 0,
        }
    }
}

impl<T, K: Hash + Eq + Clone> PhysicalPages<T, K> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of live physical pages.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no page is live.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Adds a page with one reference, registered under `key` if given.
    /// A key already in use is refused and the payload handed back.
    pub fn insert(&mut self, payload: T, key: Option<K>) -> Result<PhysId, (PageTableError, T)> {
        if let Some(existing) = key.as_ref().and_then(|k| self.by_key.get(k)) {
            return Err((PageTableError::KeyTaken(*existing), payload));
        }
        let (index, generation) = match self.vacant.pop() {
            Some(index) => match *self.entries.get(index as usize).expect("vacant entries exist") {
                Entry::Vacant { generation } => (index, generation),
                Entry::Live { .. } => unreachable!("vacant list names a live entry"),
            },
            None => {
                self.entries.push(Entry::Vacant { generation: 0 });
                ((self.entries.len() - 1) as u32, 0)
            }
        };
        let id = PhysId { index, generation };
        if let Some(k) = &key {
            self.by_key.insert(k.clone(), id);
        }
        *self.entries.get_mut(index as usize).expect("allocated above") = Entry::Live {
            generation,
            refs: 1,
            key,
            payload,
        };
        self.live += 1;
        Ok(id)
    }

    /// The live page registered under `key`.
    pub fn find(&self, key: &K) -> Option<PhysId> {
        self.by_key.get(key).copied()
    }

    fn live_mut(&mut self, id: PhysId) -> Result<(&mut u32, &mut Option<K>, &mut T), PageTableError> {
        match self.entries.get_mut(id.index as usize) {
            Some(Entry::Live {
                generation,
                refs,
                key,
                payload,
            }) if *generation == id.generation => Ok((refs, key, payload)),
            _ => Err(PageTableError::Unknown(id)),
        }
    }

    /// The payload of live page `id`, or `None` for a stale or unknown handle.
    pub fn get(&self, id: PhysId) -> Option<&T> {
        match self.entries.get(id.index as usize) {
            Some(Entry::Live {
                generation, payload, ..
            }) if *generation == id.generation => Some(payload),
            _ => None,
        }
    }

    /// References to live page `id` (at least 1), or `None` for a stale or
    /// unknown handle.
    pub fn refs(&self, id: PhysId) -> Option<u32> {
        match self.entries.get(id.index as usize) {
            Some(Entry::Live { generation, refs, .. }) if *generation == id.generation => Some(*refs),
            _ => None,
        }
    }

    /// Adds a reference (another logical page now maps here).
    pub fn acquire(&mut self, id: PhysId) -> Result<(), PageTableError> {
        let (refs, _, _) = self.live_mut(id)?;
        *refs = refs.checked_add(1).ok_or(PageTableError::TooManyRefs(id))?;
        Ok(())
    }

    /// Drops a reference. The last one removes the page, unregisters its key
    /// and returns the payload.
    pub fn release(&mut self, id: PhysId) -> Result<Option<T>, PageTableError> {
        let (refs, _, _) = self.live_mut(id)?;
        *refs -= 1;
        if *refs > 0 {
            return Ok(None);
        }
        let next = Entry::Vacant {
            generation: id.generation.wrapping_add(1),
        };
        let Entry::Live { key, payload, .. } =
            std::mem::replace(self.entries.get_mut(id.index as usize).expect("checked live"), next)
        else {
            unreachable!("live_mut checked the entry")
        };
        if let Some(k) = key {
            self.by_key.remove(&k);
        }
        self.vacant.push(id.index);
        self.live -= 1;
        Ok(Some(payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn shared_page_is_freed_at_the_last_release_only() {
        let mut pages: PhysicalPages<&str, u64> = PhysicalPages::new();
        let id = pages.insert("p0", Some(7)).unwrap();
        assert_eq!(pages.find(&7), Some(id));
        pages.acquire(id).unwrap();
        assert_eq!(pages.refs(id), Some(2));
        assert_eq!(pages.release(id), Ok(None));
        assert_eq!(pages.find(&7), Some(id));
        assert_eq!(pages.release(id), Ok(Some("p0")));
        assert_eq!(pages.find(&7), None);
        assert_eq!(pages.release(id), Err(PageTableError::Unknown(id)));
        assert!(pages.is_empty());
    }

    #[test]
    fn stale_ids_do_not_alias_reused_entries() {
        let mut pages: PhysicalPages<u8, u64> = PhysicalPages::new();
        let old = pages.insert(1, None).unwrap();
        pages.release(old).unwrap();
        let new = pages.insert(2, None).unwrap();
        assert_ne!(old, new);
        assert_eq!(pages.get(old), None);
        assert_eq!(pages.acquire(old), Err(PageTableError::Unknown(old)));
        assert_eq!(pages.get(new), Some(&2));
    }

    #[test]
    fn a_taken_key_hands_the_payload_back() {
        let mut pages: PhysicalPages<u8, u64> = PhysicalPages::new();
        let id = pages.insert(1, Some(3)).unwrap();
        assert_eq!(pages.insert(2, Some(3)), Err((PageTableError::KeyTaken(id), 2)));
        assert_eq!(pages.len(), 1);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(Option<u8>),
        Share(u8),
        Release(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            proptest::option::of(0u8..6).prop_map(Op::Insert),
            (0u8..6).prop_map(Op::Share),
            (0usize..64).prop_map(Op::Release),
        ]
    }

    proptest! {
        /// Model: every logical reference is a (phys id, payload) the caller
        /// holds. The table must agree with the model on refcounts, on key
        /// lookups, and must return each payload exactly once, at the release
        /// of the last reference.
        #[test]
        fn refcounts_match_a_model(ops in proptest::collection::vec(op(), 0..200)) {
            let mut pages: PhysicalPages<u32, u8> = PhysicalPages::new();
            let mut held: Vec<(PhysId, u32)> = Vec::new();
            let mut keys: HashMap<u8, (PhysId, u32)> = HashMap::new();
            let mut next_payload = 0u32;
            let mut returned: Vec<u32> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(key) => {
                        let payload = next_payload;
                        next_payload += 1;
                        match pages.insert(payload, key) {
                            Ok(id) => {
                                if let Some(k) = key {
                                    prop_assert!(!keys.contains_key(&k));
                                    keys.insert(k, (id, payload));
                                }
                                held.push((id, payload));
                            }
                            Err((PageTableError::KeyTaken(id), back)) => {
                                prop_assert_eq!(back, payload);
                                prop_assert_eq!(keys.get(&key.unwrap()).map(|e| e.0), Some(id));
                            }
                            Err((e, _)) => prop_assert!(false, "unexpected {e:?}"),
                        }
                    }
                    Op::Share(k) => match pages.find(&k) {
                        Some(id) => {
                            let (mid, payload) = keys[&k];
                            prop_assert_eq!(id, mid);
                            pages.acquire(id).unwrap();
                            held.push((id, payload));
                        }
                        None => prop_assert!(!keys.contains_key(&k)),
                    },
                    Op::Release(i) if !held.is_empty() => {
                        let (id, payload) = held.swap_remove(i % held.len());
                        let still_held = held.iter().any(|h| h.0 == id);
                        match pages.release(id).unwrap() {
                            Some(p) => {
                                prop_assert!(!still_held);
                                prop_assert_eq!(p, payload);
                                returned.push(p);
                                keys.retain(|_, v| v.0 != id);
                            }
                            None => prop_assert!(still_held),
                        }
                    }
                    Op::Release(_) => {}
                }
                // Invariants after every step.
                let mut model_refs: HashMap<PhysId, u32> = HashMap::new();
                for (id, payload) in &held {
                    *model_refs.entry(*id).or_default() += 1;
                    prop_assert_eq!(pages.get(*id), Some(payload));
                }
                prop_assert_eq!(pages.len(), model_refs.len());
                for (id, n) in &model_refs {
                    prop_assert_eq!(pages.refs(*id), Some(*n));
                }
                for (k, (id, _)) in &keys {
                    prop_assert_eq!(pages.find(k), Some(*id));
                }
            }
            let mut unique = returned.clone();
            unique.sort_unstable();
            unique.dedup();
            prop_assert_eq!(unique.len(), returned.len(), "a payload came back twice");
        }
    }
}
