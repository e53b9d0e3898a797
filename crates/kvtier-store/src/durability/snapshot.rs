//! The checkpoint: the current state as records, which replace the journal.

use std::collections::BTreeMap;

use kvtier_core::LogicalPage;

use super::Durable;
use super::persist::{gone_record, map_record, summary_record};
use super::record::{FORMAT_VERSION, Record};
use crate::catalog::{Catalog, Sequence};
use crate::sync::read;

impl Durable {
    /// Everything needed to rebuild the current state. A sequence is read
    /// one lane at a time, so a write waits for at most one lane's records;
    /// what changes meanwhile is journalled after the snapshot and replayed
    /// over it.
    fn checkpoint_records(&self, catalog: &Catalog) -> Vec<Record> {
        let mut records = vec![
            Record::Header {
                version: FORMAT_VERSION,
            },
            Record::Ids {
                next: self.ids.reserved(),
            },
        ];
        let mut copies: BTreeMap<u64, Record> = BTreeMap::new();
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
            for lane in 0..lanes {
                let seq = cell.read_behind_writers();
                if seq.dropped {
                    break;
                }
                self.lane_records(&seq, lane, &mut records, &mut copies);
            }
        }
        records.extend(copies.into_values());
        records
    }

    /// The records of every page of one lane, and the `Persist` record of
    /// each physical page it maps that has an NVMe copy (once per page).
    fn lane_records(&self, seq: &Sequence, lane: usize, records: &mut Vec<Record>, copies: &mut BTreeMap<u64, Record>) {
        let l = &seq.lanes[lane];
        for (p, logical) in l.pages().enumerate() {
            records.push(match logical {
                LogicalPage::Physical(r) => {
                    let place = read(&r.page.place);
                    if let Some(reason) = place.lost {
                        gone_record(seq, lane, p, reason)
                    } else {
                        if let Some(copy) = place.nvme.as_ref().or(place.durable_prefix.as_ref()) {
                            // The lane's digest covers at least the copy's
                            // rows, so it bounds them (a partial page's
                            // too); the sketches are the copy's rows'.
                            copies.entry(r.page.id).or_insert_with(|| Record::Persist {
                                phys: r.page.id,
                                offset: copy.slot.offset(),
                                len: copy.slot.len(),
                                crc: copy.crc,
                                rows: copy.rows,
                                digest: l.index().entry(p, copy.rows),
                            });
                        }
                        map_record(seq, lane, p, r.page.id)
                    }
                }
                LogicalPage::Summary(s) => {
                    let mut kv = vec![0u8; s.slot.len() as usize];
                    if let Err(e) = self.host.read(&s.slot, 0, &mut kv) {
                        tracing::error!(sequence = %seq.key, lane, page = p, error = %e, "summary unreadable; checkpointed as gone");
                        records.push(gone_record(seq, lane, p, s.reason));
                        continue;
                    }
                    summary_record(seq, lane, p, s.reason, &s.counts, kv)
                }
                LogicalPage::Gone(reason) => gone_record(seq, lane, p, *reason),
            });
        }
    }

    /// Rewrites the manifest as a checkpoint of `catalog`'s state.
    pub(crate) fn checkpoint(&self, catalog: &Catalog) {
        let Some(manifest) = &self.manifest else { return };
        let started = std::time::Instant::now();
        tracing::debug!("manifest checkpoint started");
        match manifest.checkpoint(|| self.checkpoint_records(catalog)) {
            Ok(bytes) => {
                let elapsed = started.elapsed();
                self.counters.latency.checkpoint.observe(elapsed);
                tracing::info!(bytes, ms = elapsed.as_millis() as u64, "manifest checkpoint written")
            }
            Err(e) => tracing::error!(error = %e, "manifest checkpoint failed; the journal keeps growing"),
        }
    }
}
