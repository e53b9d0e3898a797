//! Miniature host memory: the host tier's own policy code (`host/`) over
//! tiny pages, with an arena standing in for NVMe, fed what the store
//! does to host memory: page writes (which migrate pages to NVMe when
//! memory is full), reads (a page on NVMe is read from there and, under
//! `promote_on_read`, promoted back when memory has room), attaches of a
//! stored page by another sequence (the frequency policy's second
//! chances) and frees. Both policies are run: the frequency policy's
//! queues and chances have no closed model, and the store's LRU is not an
//! ideal one (a read does not evict to promote, so a loop a little larger
//! than memory keeps part of itself where an ideal LRU keeps none). The
//! store's background migration (down from the high watermark to the low
//! one) is its own code too: a round opens at the call that takes memory
//! past the high watermark and the calls that follow choose its pages,
//! whatever the timing of the thread that migrates them (`host/`); here
//! what is chosen migrates at the end of each call, where the store's has
//! most often moved by the next (a benchmark that reads right after a
//! write lets it: `Store::wait_idle`).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;

use kvtier_tiers::ArenaTier;

use super::{Miniature, PAGE_BYTES};
use crate::durability::Durable;
use crate::host::{HostCache, HostPolicy, MigrationTime};
use crate::page::PhysPage;
use crate::reader::Reader;
use crate::{StoreError, StoreResult};

/// Host memory of some pages under one policy, over NVMe that holds every
/// page; pages are named by the caller's keys.
#[derive(Debug)]
pub struct HostSimulation<K> {
    host: HostCache,
    durable: Durable,
    /// The device tier the store's read path needs; never used.
    device: Arc<dyn kvtier_tiers::Tier>,
    mini: Miniature,
    pages: HashMap<K, Arc<PhysPage>>,
    /// The store's `promote_on_read`.
    promote_on_read: bool,
}

impl<K: Eq + Hash + Clone> HostSimulation<K> {
    /// Host memory of `host_pages` pages under `policy`, migrating between
    /// the `(high, low)` watermarks (shares of its pages, as the store's
    /// config has them), over NVMe of `nvme_pages` (every page that will
    /// be written or read); with `promote_on_read`, a page read from NVMe
    /// comes back to memory where it has room.
    pub fn new(
        policy: HostPolicy,
        host_pages: u64,
        nvme_pages: u64,
        (high, low): (f64, f64),
        promote_on_read: bool,
    ) -> StoreResult<Self> {
        let device = Miniature::arena(1, ArenaTier::emulated_device)?;
        let host = Miniature::arena(host_pages, ArenaTier::host)?;
        let nvme = Miniature::arena(nvme_pages, ArenaTier::host)?;
        let mini = Miniature::new()?;
        Ok(Self {
            durable: Durable::new(None, 0, [&device, &host], Some(nvme), Arc::clone(&mini.counters)),
            host: HostCache::new(host, policy, high, low),
            device,
            mini,
            pages: HashMap::new(),
            promote_on_read,
        })
    }

    /// One call wrote pages `keys`: as the store's write does, every new
    /// page takes its host slot (migrating others to NVMe when memory is
    /// full) before any of them joins the queues, so a call larger than
    /// the pages in line takes its room from wherever it is; pages written
    /// again are touched. A call larger than host memory, which the store
    /// would refuse, is taken in parts (a tier that small is still drawn
    /// on the curve). A background round that fell due meanwhile runs at
    /// its end.
    pub fn write(&mut self, keys: &[K]) -> StoreResult<()> {
        let mut written = Vec::with_capacity(keys.len());
        for key in keys {
            let page = match self.pages.get(key) {
                Some(page) if page.place.read().host().is_none() => continue,
                Some(page) => Arc::clone(page),
                None => {
                    let page = match self.new_page() {
                        Err(StoreError::ResourceExhausted(_)) if !written.is_empty() => {
                            self.host.touch_written(&written);
                            written.clear();
                            self.new_page()?
                        }
                        other => other?,
                    };
                    self.pages.insert(key.clone(), Arc::clone(&page));
                    page
                }
            };
            written.push(page);
        }
        // One at a time, as the store publishes them: a round may fall due
        // at any of them.
        for page in &written {
            self.host.touch_written([page]);
        }
        self.host.rebalance(&self.durable);
        Ok(())
    }

    /// Another sequence attached page `key` (through its prefix hash
    /// chain): one more request uses it. Whether the page exists.
    pub fn attach(&mut self, key: &K) -> bool {
        self.pages.get(key).map(|page| page.attached_again()).is_some()
    }

    /// A read of `keys`, as a fetch reads them. Returns how many were not
    /// in host memory (a page never written before is one, and lands
    /// there as if written).
    pub fn read(&mut self, keys: &[K]) -> StoreResult<u64> {
        let mut missed = 0;
        let mut stored = Vec::with_capacity(keys.len());
        for key in keys {
            match self.pages.get(key) {
                Some(page) => {
                    missed += u64::from(page.place.read().host().is_none());
                    stored.push((Arc::clone(page), self.mini.layout.page_size()));
                }
                None => {
                    missed += 1;
                    let page = self.new_page()?;
                    self.host.touch_written([&page]);
                    self.pages.insert(key.clone(), page);
                }
            }
        }
        let reader = Reader {
            host: &self.host,
            device: &*self.device,
            durable: &self.durable,
            counters: &self.mini.counters,
            promote: self.promote_on_read,
            touch: true,
        };
        reader.originals(&self.mini.layout, &stored)?;
        // Promotions may have made a round due.
        self.host.rebalance(&self.durable);
        Ok(missed)
    }

    /// Page `key` was freed (its last sequence dropped it).
    pub fn free(&mut self, key: &K) {
        if let Some(page) = self.pages.remove(key) {
            self.host.forget([page.id]);
        }
    }

    /// A new page in host memory, not yet in line to migrate.
    fn new_page(&mut self) -> StoreResult<Arc<PhysPage>> {
        let slot = self.host.allocate(
            PAGE_BYTES,
            &self.durable,
            &mut MigrationTime::default(),
            &self.mini.owner,
        )?;
        Ok(self.mini.page(None, slot))
    }
}
