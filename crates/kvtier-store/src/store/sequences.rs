//! Creating, dropping and describing sequences.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvtier_core::{Layout, LogicalPage, PageState, Reason, SequenceKey, TenantId, wire};

use super::Store;
use crate::catalog::{Sequence, not_found};
use crate::cost;
use crate::durability::{Record, created_records};
use crate::page::StorePage;
use crate::stats::{SequenceInfo, StateCounts, TierBytes};
use crate::{StoreError, StoreResult};

/// A new sequence and how many leading pages it shares with earlier ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    /// Leading pages per lane attached from earlier sequences (shared, not
    /// copied); 0 without a prefix hash chain or a match.
    pub attached_pages: u64,
    /// The new sequence, as `GetSequence` describes it.
    pub info: SequenceInfo,
}

const MAX_HASH_BYTES: usize = 64;

impl Store {
    /// Creates a sequence. With a prefix hash chain (one hash per full page),
    /// the longest run of leading pages already stored for every lane under
    /// the same tenant, layout and hashes is attached at once: those pages are
    /// shared, not copied, and need not be sent again.
    pub fn create_sequence(
        &self,
        key: SequenceKey,
        layout: Layout,
        prefix_hashes: Vec<Vec<u8>>,
    ) -> StoreResult<Created> {
        let cost = cost::sequence(&key, &layout, &prefix_hashes);
        let hashes = check_hashes(prefix_hashes)?;
        if self.catalog.contains(&key) {
            return Err(already_exists(&key));
        }
        // Charged before anything is allocated: a refusal allocates nothing.
        let charge = self.accounts.open(&key, cost, false)?;
        let mut seq = Sequence::new(key.clone(), Arc::new(layout), hashes, charge);
        let attached_pages = self.catalog.attach_prefix(&mut seq);
        let attached = cost::pages(&seq.layout, attached_pages * seq.lanes.len() as u64, 0, false);
        if let Err(e) = seq.charge.grow(attached) {
            self.release_pages(&mut seq);
            return Err(e.into());
        }
        let info = self.info_of(&seq);
        let inserted = self.catalog.insert(seq, |seq| {
            self.durable.journal(|| created_records(seq, attached_pages as usize));
        });
        if let Err(mut seq) = inserted {
            self.release_pages(&mut seq);
            return Err(already_exists(&key));
        }
        tracing::info!(sequence = %key, attached_pages, "sequence created");
        Ok(Created { attached_pages, info })
    }

    /// How many leading pages of a hash chain are stored for `tenant` and
    /// `layout`: what [`Store::create_sequence`] with these hashes would
    /// attach, without creating anything.
    pub fn lookup_prefix(&self, tenant: &TenantId, layout: Layout, prefix_hashes: Vec<Vec<u8>>) -> StoreResult<u64> {
        let hashes = check_hashes(prefix_hashes)?;
        Ok(self.catalog.stored_prefix(tenant, &Arc::new(layout), &hashes))
    }

    /// Drops a sequence; physical pages no other sequence uses are freed.
    /// Durable before it returns: a crash cannot bring the sequence back.
    pub fn drop_sequence(&self, key: &SequenceKey) -> StoreResult<()> {
        let cell = self.catalog.cell(key)?;
        let mut seq = cell.write();
        if seq.dropped {
            return Err(not_found(key));
        }
        // Under the sequence's lock, and before it leaves the map: every
        // record of this sequence comes before its `Drop`, and a sequence
        // created again under the key journals its start after it.
        seq.dropped = true;
        self.durable.journal(|| vec![Record::Drop { key: key.clone() }]);
        if let Some(tracer) = self.tracer(&seq) {
            tracer.dropped();
        }
        self.catalog.remove(key);
        self.device.forget_sequence(key, seq.layout.num_layers());
        self.release_pages(&mut seq);
        drop(seq);
        tracing::info!(sequence = %key, "sequence dropped");
        self.durable.commit()
    }

    fn release_pages(&self, seq: &mut Sequence) {
        let pages: Vec<StorePage> = seq.lanes.iter_mut().flat_map(|l| l.take_pages()).collect();
        self.release(pages);
    }

    /// A sequence's layout and the positions of its longest lane: what
    /// sizing a read needs, without the cost of [`Store::sequence_info`].
    pub fn shape(&self, key: &SequenceKey) -> StoreResult<(Arc<Layout>, u64)> {
        self.catalog
            .read(key, |seq| Ok((Arc::clone(&seq.layout), seq.tokens())))
    }

    /// The prefix hash chain sequence `key` was created with.
    pub fn prefix_hashes(&self, key: &SequenceKey) -> StoreResult<Vec<Vec<u8>>> {
        self.catalog
            .read(key, |seq| Ok(seq.hashes.iter().map(|h| h.to_vec()).collect()))
    }

    /// Whether the store holds sequence `key` now.
    pub fn holds(&self, key: &SequenceKey) -> bool {
        self.catalog.contains(key)
    }

    /// Every sequence held, as of now.
    pub fn sequence_keys(&self) -> Vec<SequenceKey> {
        self.catalog.keys()
    }

    /// Whether a read of sequence `key` would wait for its writer now (a
    /// hint for where to make it: a write holds its sequence across its
    /// NVMe I/O). False for an unknown sequence, whose call fails at once.
    pub fn would_wait(&self, key: &SequenceKey) -> bool {
        self.catalog.cell(key).is_ok_and(|cell| cell.would_wait())
    }

    /// Runs `f` while holding sequence `key`'s lock as its writer, changing
    /// nothing: what a slow write does to the sequence's readers, for tests.
    #[cfg(feature = "testing")]
    pub fn with_sequence_held<T>(&self, key: &SequenceKey, f: impl FnOnce() -> T) -> StoreResult<T> {
        self.catalog.write(key, |_| Ok(f()))
    }

    /// Describes sequence `key`: its layout, length, pages by state and bytes
    /// per tier.
    pub fn sequence_info(&self, key: &SequenceKey) -> StoreResult<SequenceInfo> {
        self.catalog.read(key, |seq| Ok(self.info_of(seq)))
    }

    fn info_of(&self, seq: &Sequence) -> SequenceInfo {
        let layout = &seq.layout;
        let page_bytes = layout.page_bytes() as u64;
        let mut states = StateCounts::default();
        let mut bytes = TierBytes::default();
        let mut physical = Vec::new();
        let mut gone: HashMap<Reason, u64> = HashMap::new();
        for page in seq.lanes.iter().flat_map(|l| l.pages()) {
            match page {
                LogicalPage::Physical(r) => {
                    let place = r.page.place.read();
                    states.add(place.state());
                    if let Some(reason) = place.lost() {
                        *gone.entry(reason).or_default() += 1;
                    }
                    bytes.device += page_bytes * u64::from(place.device().is_some());
                    bytes.host += page_bytes * u64::from(place.host().is_some());
                    bytes.nvme += page_bytes * u64::from(place.nvme().is_some());
                    physical.push(r.id);
                }
                LogicalPage::Summary(s) => {
                    states.add(PageState::Summary);
                    bytes.host += s.slot.len();
                }
                LogicalPage::Gone(reason) => {
                    states.add(PageState::Gone);
                    *gone.entry(*reason).or_default() += 1;
                }
            }
        }
        let tokens = seq.lanes.iter().map(|l| l.tokens());
        SequenceInfo {
            layout: (**layout).clone(),
            tokens: tokens.clone().min().unwrap_or(0),
            max_tokens: tokens.max().unwrap_or(0),
            pages: states,
            bytes,
            shared_pages: self.catalog.shared(physical),
            digest_bytes: seq.lanes.iter().map(|l| l.digests().byte_len() as u64).sum(),
            prefix_hashes: seq.hashes.len() as u64,
            gone_by_reason: Reason::ALL
                .iter()
                .filter_map(|r| gone.get(r).map(|n| (*r, *n)))
                .collect(),
        }
    }
}

pub(super) fn check_hashes(hashes: Vec<Vec<u8>>) -> StoreResult<Vec<Arc<[u8]>>> {
    let mut seen = HashSet::with_capacity(hashes.len());
    hashes
        .into_iter()
        .enumerate()
        .map(|(i, h)| {
            let field = wire::PREFIX_HASHES.at(i);
            if h.is_empty() || h.len() > MAX_HASH_BYTES {
                return Err(StoreError::invalid(
                    field,
                    format!("is {} bytes long, must be 1..={MAX_HASH_BYTES}", h.len()),
                ));
            }
            let h: Arc<[u8]> = h.into();
            if !seen.insert(Arc::clone(&h)) {
                return Err(StoreError::invalid(
                    field,
                    "repeats an earlier hash; a hash chain names each prefix once",
                ));
            }
            Ok(h)
        })
        .collect()
}

pub(super) fn already_exists(key: &SequenceKey) -> StoreError {
    StoreError::AlreadyExists {
        what: format!("sequence {key}"),
    }
}
