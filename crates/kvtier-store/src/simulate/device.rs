//! A miniature device: the device tier's own policy code (`device/`) over
//! tiers of tiny pages, fed a stream of page writes and selections. LRU
//! has an exact model (stack distances); the loop policy's resident
//! subset, stream region and layer-ahead prefetch have none, so they are
//! run, not modelled: the same `HotSet` the store uses serves each
//! selection in the store's order (`HotSet::serve_selection`, then the
//! read of its hot pages, which touches them), with two assumptions
//! stated here: every selection reads its pages' data (as decode steps
//! do), and a layer-ahead prefetch lands before the next selection (the
//! store runs it in the background;
//! `kvtier_prefetch_pages_total{outcome="late"}` says how often it did
//! not).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;

use kvtier_core::{Reason, SequenceKey};
use kvtier_tiers::{ArenaTier, TierKind};

use super::{Miniature, PAGE_BYTES};
use crate::StoreResult;
use crate::device::{DevicePolicy, HotSet};
use crate::durability::Durable;
use crate::host::{HostCache, HostPolicy};
use crate::page::{PhysPage, Pins};
use crate::reader::Reader;

/// A device of some pages under one policy, over host memory that holds
/// every page; pages are named by the caller's keys.
#[derive(Debug)]
pub struct DeviceSimulation<K> {
    device: HotSet,
    host: HostCache,
    durable: Durable,
    mini: Miniature,
    pages: HashMap<K, Arc<PhysPage>>,
    /// A key per simulated sequence, for the layer-ahead lists.
    sequences: HashMap<u64, SequenceKey>,
}

impl<K: Eq + Hash + Clone> DeviceSimulation<K> {
    /// A device of `device_pages` pages (at least one) under `policy`,
    /// over host memory of `host_pages` (every page that will be written
    /// or selected).
    pub fn new(policy: DevicePolicy, device_pages: u64, host_pages: u64) -> StoreResult<Self> {
        let device = Miniature::arena(device_pages, ArenaTier::emulated_device)?;
        let host = Miniature::arena(host_pages, ArenaTier::host)?;
        let mini = Miniature::new()?;
        Ok(Self {
            durable: Durable::new(None, 0, [&device, &host], None, Arc::clone(&mini.counters)),
            host: HostCache::new(host, HostPolicy::Lru, 1.0, 1.0),
            device: HotSet::new(device, false, policy, Arc::clone(&mini.counters)),
            mini,
            pages: HashMap::new(),
            sequences: HashMap::new(),
        })
    }

    /// Page `key` was written: a new page lands in host memory and, room
    /// permitting, on the device (as the store caches writes on it); a
    /// page written again is only touched.
    pub fn write(&mut self, key: K) -> StoreResult<()> {
        if let Some(page) = self.pages.get(&key) {
            if page.place.read().device().is_some() {
                self.device.touch([page]);
            }
            return Ok(());
        }
        let device = self
            .device
            .allocate(PAGE_BYTES, &self.host, &self.mini.owner, false)
            .ok();
        let page = self.new_page(device)?;
        if page.place.read().device().is_some() {
            self.device.touch([&page]);
        }
        self.pages.insert(key, page);
        Ok(())
    }

    /// A selection of `keys` in `layer` of `sequence` (of `layers` layers)
    /// that swaps in, served as the store serves one, its layer-ahead
    /// prefetch landing at once. Returns how many of the pages were not on
    /// the device when selected (a page never written before is one).
    pub fn select(&mut self, sequence: u64, layer: u32, layers: u32, keys: &[K]) -> StoreResult<u64> {
        let mut chosen = Vec::with_capacity(keys.len());
        for key in keys {
            let page = match self.pages.get(key) {
                Some(page) => Arc::clone(page),
                None => {
                    let page = self.new_page(None)?;
                    self.pages.insert(key.clone(), Arc::clone(&page));
                    page
                }
            };
            chosen.push(page);
        }
        let key = self
            .sequences
            .entry(sequence)
            .or_insert_with(|| SequenceKey::parse("simulation", &sequence.to_string()).expect("a valid name"))
            .clone();
        let reader = Reader {
            host: &self.host,
            device: &**self.device.tier(),
            durable: &self.durable,
            counters: &self.mini.counters,
            promote: false,
            touch: true,
        };
        let (report, ahead) = self.device.serve_selection((&key, layer, layers), &chosen, true, || {
            let pins = Pins::new(chosen.clone());
            self.device.make_hot(pins.pages(), Reason::Demand, &reader)
        });
        // The selection reads its pages (as a decode step's does, with its
        // data): those read from the device are touched, before the
        // prefetch it queued lands.
        let read_hot: Vec<&Arc<PhysPage>> = chosen.iter().filter(|p| p.place.read().device().is_some()).collect();
        self.device.touch(read_hot);
        if !ahead.is_empty() {
            let pins = Pins::new(ahead);
            self.device.make_hot(pins.pages(), Reason::Prefetch, &reader);
        }
        Ok(u64::from(report.from_host + report.from_nvme + report.not_hot))
    }

    /// Another sequence attached page `key` (through its prefix hash
    /// chain): the loop policy counts it as shared.
    pub fn attach(&mut self, key: &K) {
        if let Some(page) = self.pages.get(key) {
            page.attached_again();
        }
    }

    /// Page `key` was freed (its last sequence dropped it): its slots go.
    pub fn free(&mut self, key: &K) {
        if let Some(page) = self.pages.remove(key) {
            self.device.forget([page.id]);
            self.host.forget([page.id]);
        }
    }

    /// A new page in host memory (and on the device, in `device`).
    fn new_page(&mut self, device: Option<kvtier_tiers::Slot>) -> StoreResult<Arc<PhysPage>> {
        let host = self.host.tier();
        let slot = self
            .mini
            .owner
            .slot(TierKind::Host, PAGE_BYTES, true, || host.allocate(PAGE_BYTES))?;
        let page = self.mini.page(device, slot);
        self.host.touch([&page]);
        Ok(page)
    }
}
