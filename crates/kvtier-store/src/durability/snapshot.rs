//! The checkpoint: the current state as records, which replace the journal.

use std::collections::HashSet;
use std::io;

use kvtier_core::LogicalPage;

use super::Durable;
use super::journal::SnapshotOut;
use super::persist::{gone_record, map_record, summary_record};
use super::record::{FORMAT_VERSION, Record};
use crate::catalog::{Catalog, Sequence};

/// Pages whose records are made under one hold of their sequence's lock.
const PAGES_PER_HOLD: usize = 256;

impl Durable {
    /// Writes everything needed to rebuild the current state to `out`. A
    /// sequence is read [`PAGES_PER_HOLD`] pages of one lane at a time, so
    /// a write waits for at most that many pages' records, and only those
    /// are in memory before they go to the file; what changes meanwhile is
    /// journalled after the snapshot and replayed over it.
    fn write_snapshot(&self, catalog: &Catalog, out: &mut SnapshotOut) -> io::Result<()> {
        out.write(&[
            Record::Header {
                version: FORMAT_VERSION,
            },
            Record::Ids {
                next: self.ids.reserved(),
            },
        ])?;
        // Physical pages whose copy is recorded: a page shared by several
        // lanes is recorded once.
        let mut persisted: HashSet<u64> = HashSet::new();
        let mut records = Vec::new();
        for cell in catalog.cells() {
            let lanes = {
                let seq = cell.read_behind_writers();
                if seq.dropped {
                    continue;
                }
                records.push(Record::Sequence {
                    key: seq.key.clone(),
                    layout: (*seq.layout).clone(),
                    hashes: seq.hashes.iter().map(|h| h.to_vec()).collect(),
                });
                seq.lanes.len()
            };
            'lanes: for lane in 0..lanes {
                let mut from = Some(0);
                while let Some(start) = from {
                    {
                        let seq = cell.read_behind_writers();
                        if seq.dropped {
                            break 'lanes;
                        }
                        let pages = seq.lanes[lane].num_pages();
                        let end = pages.min(start + PAGES_PER_HOLD);
                        self.page_records(&seq, lane, start..end, &mut records, &mut persisted);
                        from = (end < pages).then_some(end);
                    }
                    out.write(&records)?;
                    records.clear();
                }
            }
        }
        out.write(&records)
    }

    /// The records of pages `pages` of one lane, and the `Persist` record of
    /// each physical page they map that has an NVMe copy and is not in
    /// `persisted` yet.
    fn page_records(
        &self,
        seq: &Sequence,
        lane: usize,
        pages: std::ops::Range<usize>,
        records: &mut Vec<Record>,
        persisted: &mut HashSet<u64>,
    ) {
        let l = &seq.lanes[lane];
        for p in pages {
            let Some(logical) = l.page(p) else { break };
            let record = match logical {
                LogicalPage::Physical(r) => {
                    let place = r.page.place.read();
                    if let Some(reason) = place.lost() {
                        gone_record(seq, lane, p, reason)
                    } else {
                        if let Some(copy) = place.nvme().or(place.durable_prefix())
                            && persisted.insert(r.page.id)
                        {
                            // The lane's digest covers at least the copy's
                            // rows, so it bounds them (a partial page's
                            // too); the sketches are the copy's rows'.
                            records.push(Record::Persist {
                                phys: r.page.id,
                                offset: copy.slot.offset(),
                                len: copy.slot.len(),
                                crc: copy.crc,
                                rows: copy.rows,
                                // A shared page keeps its whole entry even
                                // while the lane's sketches are spilled.
                                digest: match &r.page.index_entry {
                                    Some(entry) if copy.rows == seq.layout.page_size() => entry.to_vec(),
                                    _ => l.index().entry(p, copy.rows),
                                },
                            });
                        }
                        map_record(seq, lane, p, r.page.id)
                    }
                }
                LogicalPage::Summary(s) => {
                    let mut kv = vec![0u8; s.slot.len() as usize];
                    match self.host.read(&s.slot, 0, &mut kv) {
                        Ok(()) => summary_record(seq, lane, p, s.reason, &s.counts, kv),
                        Err(e) => {
                            tracing::error!(sequence = %seq.key, lane, page = p, error = %e, "summary unreadable; checkpointed as gone");
                            gone_record(seq, lane, p, s.reason)
                        }
                    }
                }
                LogicalPage::Gone(reason) => gone_record(seq, lane, p, *reason),
            };
            records.push(record);
        }
    }

    /// Rewrites the manifest as a checkpoint of `catalog`'s state.
    pub(crate) fn checkpoint(&self, catalog: &Catalog) {
        let Some(manifest) = &self.manifest else { return };
        let started = std::time::Instant::now();
        tracing::debug!("manifest checkpoint started");
        match manifest.checkpoint(|out| self.write_snapshot(catalog, out)) {
            Ok(bytes) => {
                let elapsed = started.elapsed();
                self.counters.latency.checkpoint.observe(elapsed);
                tracing::info!(bytes, ms = elapsed.as_millis() as u64, "manifest checkpoint written")
            }
            Err(e) => tracing::error!(error = %e, "manifest checkpoint failed; the journal keeps growing"),
        }
    }
}
