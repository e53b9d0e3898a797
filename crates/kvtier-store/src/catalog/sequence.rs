//! A sequence: its layout, prefix hash chain and one lane per (stored layer,
//! KV head), plus the range checks every operation shares.

use std::ops::Range;
use std::sync::Arc;

use kvtier_core::policy::TokenStats;
use kvtier_core::reuse::LastRanking;
use kvtier_core::{Lane, Layout, PageState, SequenceKey, wire};
use kvtier_sync::{Mutex, Rank};

use crate::accounts::Charge;
use crate::page::{ShareKey, StoreLane};
use crate::{StoreError, StoreResult};
use kvtier_core::policy::RegisteredPolicy;

#[derive(Debug)]
pub(crate) struct Sequence {
    pub(crate) key: SequenceKey,
    pub(crate) layout: Arc<Layout>,
    /// The prefix hash chain, one hash per leading page (shared with the
    /// access trace's records, hence the `Arc`).
    pub(crate) hashes: Arc<[Arc<[u8]>]>,
    pub(crate) lanes: Vec<StoreLane>,
    /// Set by `drop_sequence`; an operation that was waiting for the lock
    /// then finds the sequence gone.
    pub(crate) dropped: bool,
    /// Per lane, the attention reported or computed so far (empty until
    /// the first report).
    pub(crate) attention: Vec<TokenStats>,
    /// A policy that runs by itself as the sequence grows.
    pub(crate) auto_policy: Option<RegisteredPolicy>,
    /// Per lane, the leading pages known to need no persisting: each has a
    /// current NVMe copy or no original bytes (a full page's copy stays
    /// current, since nothing changes a full page). A persist starts here.
    pub(crate) persisted: Vec<usize>,
    /// The metadata it is charged for; refunded when it is dropped.
    pub(crate) charge: Charge,
    /// Per lane, its last full ranking, kept while selections ask to reuse
    /// it (taken out while a selection ranks the lane, put back after).
    pub(crate) last_rankings: Vec<Mutex<Option<LastRanking>>>,
    /// Changes that need the write lock but were decided without it (the
    /// sketch sweep's on a busy sequence, a ranking's sketches read back),
    /// left for the next writer, which makes them first (`Cell::write`).
    /// Shared with the sequence's `Cell`, which reaches it without the
    /// sequence's lock.
    pub(crate) deferred: Arc<Mutex<Deferred>>,
}

/// A change left for a sequence's next writer.
type Change = Box<dyn FnOnce(&mut Sequence) + Send>;

/// Changes left for a sequence's next writer.
#[derive(Default)]
pub(crate) struct Deferred {
    changes: Vec<Change>,
    /// A sweep's change is among them: the sweep decides again once it is
    /// made.
    sweep_waiting: bool,
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Deferred({} changes)", self.changes.len())
    }
}

impl Deferred {
    /// Leaves the sketch sweep's `change` for the next writer.
    pub(crate) fn push_sweep(&mut self, change: impl FnOnce(&mut Sequence) + Send + 'static) {
        self.changes.push(Box::new(change));
        self.sweep_waiting = true;
    }

    /// Whether a sweep's change waits.
    pub(crate) fn sweep_waiting(&self) -> bool {
        self.sweep_waiting
    }

    /// Leaves `change` unless `max` changes wait already: for changes
    /// that only save work later, which must not pile up while no writer
    /// comes.
    pub(crate) fn push_unless(&mut self, max: usize, change: impl FnOnce(&mut Sequence) + Send + 'static) {
        if self.changes.len() < max {
            self.changes.push(Box::new(change));
        }
    }

    /// Makes the changes, in the order they were left.
    pub(crate) fn run(self, seq: &mut Sequence) {
        for change in self.changes {
            change(seq);
        }
    }
}

/// A page named by a request or a policy, located.
#[derive(Debug)]
pub(crate) struct Target {
    pub(crate) layer: u32,
    pub(crate) head: u32,
    pub(crate) lane: usize,
    pub(crate) page: usize,
    pub(crate) from: PageState,
}

/// A range of KV heads, `start..start + count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadRange {
    /// The first KV head.
    pub start: u32,
    /// How many KV heads; checked against the layout by each operation.
    pub count: u32,
}

impl HeadRange {
    /// Every KV head of `layout`.
    pub fn all(layout: &Layout) -> Self {
        Self {
            start: 0,
            count: layout.num_kv_heads(),
        }
    }
}

impl Sequence {
    /// A sequence with no pages; `charge` covers what it costs.
    pub(crate) fn new(key: SequenceKey, layout: Arc<Layout>, hashes: Vec<Arc<[u8]>>, charge: Charge) -> Self {
        let lanes: Vec<_> = (0..layout.num_lanes())
            .map(|_| Lane::new(layout.dtype(), layout.head_dim() as usize, layout.page_size()))
            .collect();
        let persisted = vec![0; lanes.len()];
        let last_rankings = (0..lanes.len())
            .map(|_| Mutex::new(Rank::LaneLastRanking, None))
            .collect();
        Self {
            key,
            layout,
            hashes: hashes.into(),
            lanes,
            dropped: false,
            attention: Vec::new(),
            auto_policy: None,
            persisted,
            charge,
            last_rankings,
            deferred: Arc::new(Mutex::new(Rank::DeferredWrites, Deferred::default())),
        }
    }

    /// Positions held by the longest lane.
    pub(crate) fn tokens(&self) -> u64 {
        self.lanes.iter().map(|l| l.tokens()).max().unwrap_or(0)
    }

    pub(crate) fn check_layer(&self, layer: u32) -> StoreResult<()> {
        if layer >= self.layout.num_layers() {
            return Err(StoreError::invalid(
                wire::LAYER,
                format!("is {layer}, but the layout has {} layers", self.layout.num_layers()),
            ));
        }
        Ok(())
    }

    pub(crate) fn check_layers(&self, start: u32, count: u32) -> StoreResult<Range<u32>> {
        check_range(
            wire::LAYER_START,
            wire::LAYER_COUNT,
            start,
            count,
            self.layout.num_layers(),
            "layers",
        )
    }

    pub(crate) fn check_heads(&self, heads: HeadRange) -> StoreResult<Range<u32>> {
        check_range(
            wire::KV_HEAD_START,
            wire::KV_HEAD_COUNT,
            heads.start,
            heads.count,
            self.layout.num_kv_heads(),
            "KV heads",
        )
    }

    /// The key under which page `page` of lane `lane` is shared: the same
    /// prefix (hash chain entry) of the same layout in the same tenant.
    pub(crate) fn share_key(&self, page: usize, lane: usize) -> ShareKey {
        ShareKey {
            tenant: self.key.tenant.clone(),
            layout: Arc::clone(&self.layout),
            hash: Arc::clone(&self.hashes[page]),
            lane: lane as u32,
        }
    }

    /// Lane indices of `layer` × `heads`.
    pub(crate) fn lanes_of(&self, layer: u32, heads: Range<u32>) -> impl Iterator<Item = (u32, usize)> + '_ {
        heads.map(move |h| (h, self.layout.lane(layer, h)))
    }
}

fn check_range(
    start_field: wire::Field,
    count_field: wire::Field,
    start: u32,
    count: u32,
    limit: u32,
    what: &str,
) -> StoreResult<Range<u32>> {
    if count == 0 {
        return Err(StoreError::invalid(count_field, "must be at least 1"));
    }
    match start.checked_add(count) {
        Some(end) if end <= limit => Ok(start..end),
        _ => Err(StoreError::invalid(
            if start >= limit { start_field } else { count_field },
            format!(
                "{what} {start}..{} exceed the layout's {limit}",
                u64::from(start) + u64::from(count)
            ),
        )),
    }
}
