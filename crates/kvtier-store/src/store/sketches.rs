//! Where a lane's key sketches live (docs/CONCEPTS.md §3.1): in memory,
//! and with `spill_sketches` on NVMe — as the pages' own key rows, from
//! which a sketch is derived again bit for bit — once three quarters of
//! their chunk's pages are NVMe-only. A background sweep spills and
//! restores chunks; a ranking reads the spilled sketches it needs
//! (`reader/sketches.rs`).

use std::sync::atomic::Ordering;

use kvtier_core::LogicalPage;
use kvtier_core::sketch_column::{SKETCH_CHUNK_PAGES, SKETCH_LOOSE_KEPT, SKETCH_LOOSE_MAX};

use super::Store;
use crate::catalog::{Sequence, Target};
use crate::page::StoreLane;
use crate::reader::LaneSketches;
use crate::stats::IndexMemory;

/// Background ticks between two sweeps: the sweep visits every page's
/// placement, so it runs about once a second, not every tick.
const SWEEP_EVERY_TICKS: u32 = 50;

/// What one chunk of a lane needs.
enum ChunkWork {
    /// Cold enough, every page full: these pages' sketches can leave
    /// memory (the chunk's, bar a few kept loose).
    Spill(Vec<usize>),
    /// Spilled, but half its pages or more are in memory again: their
    /// sketches come back (from the pages' key rows), as do the rest's.
    Restore(Vec<(usize, Vec<u8>)>),
}

impl Store {
    /// Sketch memory now, summed over every sequence.
    pub fn index_memory(&self) -> IndexMemory {
        let mut out = IndexMemory::default();
        for cell in self.catalog.cells() {
            let seq = cell.read();
            for lane in &seq.lanes {
                let index = lane.index();
                out.pages += index.digests().pages() as u64;
                out.spilled_pages += index.spilled_pages() as u64;
                out.sketch_bytes += index.resident_sketch_bytes() as u64;
            }
        }
        out
    }

    /// Spills and restores sketches where placements changed, every
    /// [`SWEEP_EVERY_TICKS`] background ticks; skips what is busy.
    pub(super) fn sweep_sketches_if_due(&self) {
        if self
            .sketch_sweep_ticks
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(SWEEP_EVERY_TICKS)
            && !self.sketch_sweeping.swap(true, Ordering::Acquire)
        {
            self.sweep(false);
            self.sketch_sweeping.store(false, Ordering::Release);
        }
    }

    /// One sweep over every sequence now, waiting for busy ones (and for a
    /// background sweep under way); returns the pages spilled and restored.
    pub fn sweep_sketches(&self) -> (u64, u64) {
        while self.sketch_sweeping.swap(true, Ordering::Acquire) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let moved = self.sweep(true);
        self.sketch_sweeping.store(false, Ordering::Release);
        moved
    }

    /// One sweep: `wait` for busy sequences, or leave the change to a busy
    /// sequence's next writer (the background never waits out a call's
    /// NVMe I/O, and skips a sequence whose last change still waits).
    /// Without an NVMe tier nothing is NVMe-only.
    fn sweep(&self, wait: bool) -> (u64, u64) {
        let mut moved = (0, 0);
        if self.durable.nvme().is_none() {
            return moved;
        }
        for cell in self.catalog.cells() {
            if !wait && cell.would_wait() {
                continue;
            }
            // The last sweep's change waits for a writer: made now if the
            // sequence is idle (it may stay so), decided again after.
            if !wait && cell.deferred().sweep_waiting() && cell.try_write().is_none() {
                continue;
            }
            let lanes = {
                let seq = cell.read();
                // With spilling off, only what a checkpoint left spilled
                // needs the sweep.
                let spilled = || seq.lanes.iter().any(|l| l.index().spilled_pages() > 0);
                if !self.config.spill_sketches && !spilled() {
                    continue;
                }
                seq.lanes.len()
            };
            // One lane at a time, decided (and restored keys read) under the
            // read lock, behind waiting writers: an append never waits out
            // a whole sequence's scan.
            let mut work = Vec::new();
            for l in 0..lanes {
                let seq = cell.read_behind_writers();
                if seq.dropped {
                    break;
                }
                let lane_work = self.chunk_work(&seq, &seq.lanes[l]);
                if !lane_work.is_empty() {
                    work.push((l, lane_work));
                }
            }
            if work.is_empty() {
                continue;
            }
            let seq = if wait { Some(cell.write()) } else { cell.try_write() };
            match seq {
                Some(mut seq) => {
                    let (spilled, restored) = apply(&mut seq, work);
                    moved = (moved.0 + spilled, moved.1 + restored);
                }
                None => cell.deferred().push_sweep(move |seq| {
                    apply(seq, work);
                }),
            }
        }
        if moved != (0, 0) {
            tracing::debug!(spilled = moved.0, restored = moved.1, "sketches swept");
        }
        moved
    }

    /// Makes the spilled sketches of `targets` resident again, read from
    /// their pages' keys, before the pages go: a page that goes keeps its
    /// index. One whose keys are lost keeps none (ranked as zero keys).
    pub(super) fn restore_sketches(&self, seq: &mut Sequence, targets: &[Target]) {
        let mut keys = Vec::new();
        for (l, lane) in seq.lanes.iter().enumerate() {
            let spilled: Vec<usize> = targets
                .iter()
                .filter(|t| t.lane == l && lane.index().sketch(t.page).is_none())
                .map(|t| t.page)
                .collect();
            if spilled.is_empty() {
                continue;
            }
            let cold = LaneSketches::new(self.reader(), &seq.layout, lane);
            for (p, k) in spilled.iter().zip(cold.keys(&spilled)) {
                keys.extend(k.map(|k| (l, *p, k)));
            }
        }
        for (l, p, k) in keys {
            seq.lanes[l].restore_sketch(p, &k);
        }
    }

    /// Per chunk of `lane`, what it needs now.
    fn chunk_work(&self, seq: &Sequence, lane: &StoreLane) -> Vec<ChunkWork> {
        let index = lane.index();
        let chunks = lane.num_pages().div_ceil(SKETCH_CHUNK_PAGES);
        let mut out = Vec::new();
        for chunk in 0..chunks {
            let pages = chunk_pages(lane, chunk);
            let spilled = pages.clone().filter(|&p| index.sketch(p).is_none()).count();
            // Pages with bytes whose sketches are resident; pages that must
            // keep theirs (no original bytes to derive them from: gone,
            // summarised, lost); pages in memory; partial pages (they
            // still grow, and their sketches with them).
            let (mut spillable, mut keep, mut in_memory, mut partial) = (Vec::new(), 0, 0, false);
            for p in pages.clone() {
                let Some(LogicalPage::Physical(r)) = lane.page(p) else {
                    keep += usize::from(index.sketch(p).is_some());
                    continue;
                };
                let place = r.page.place.read();
                if lane.rows_in(p) < seq.layout.page_size() {
                    partial = true;
                } else if place.lost().is_some() {
                    keep += usize::from(index.sketch(p).is_some());
                } else {
                    in_memory += usize::from(place.host().is_some() || place.device().is_some());
                    if index.sketch(p).is_some() {
                        spillable.push(p);
                    }
                }
            }
            // Spill where three quarters of the pages or more are NVMe-only
            // (the others' sketches are read from memory; at half, they
            // come back), and only what gives memory back: a held chunk's
            // (few enough kept that they go loose), or the sketches
            // rankings read back into a chunk not held once it has no room
            // left for more (a quarter of it), so that later rankings'
            // candidates find room.
            let spill = self.config.spill_sketches;
            let cold_enough = 4 * in_memory <= pages.len();
            let frees =
                !spillable.is_empty() && spillable.len() + keep >= SKETCH_LOOSE_MAX && keep <= SKETCH_LOOSE_KEPT;
            if spill && frees && cold_enough && !partial {
                out.push(ChunkWork::Spill(spillable));
            } else if spilled > 0 && (!spill || 2 * in_memory >= pages.len()) {
                // (With spilling off, what a checkpoint left spilled comes
                // back.)
                let wanted: Vec<usize> = pages.filter(|&p| index.sketch(p).is_none()).collect();
                let cold = LaneSketches::new(self.reader(), &seq.layout, lane);
                let keys = wanted
                    .iter()
                    .zip(cold.keys(&wanted))
                    .filter_map(|(&p, k)| Some((p, k?)))
                    .collect();
                out.push(ChunkWork::Restore(keys));
            }
        }
        out
    }
}

/// Makes the sweep's decisions: spills and restores per lane; returns the
/// pages spilled and restored. Safe whatever changed since they were made:
/// a sketch is spilled only while its page keeps its original bytes (to
/// derive it from), and restored only while spilled, with the keys of a
/// full page (which never change).
fn apply(seq: &mut Sequence, work: Vec<(usize, Vec<ChunkWork>)>) -> (u64, u64) {
    let mut moved = (0, 0);
    if seq.dropped {
        return moved;
    }
    for (l, lane_work) in work {
        let lane = &mut seq.lanes[l];
        for w in lane_work {
            match w {
                ChunkWork::Spill(pages) => {
                    for p in pages {
                        if matches!(lane.page(p), Some(LogicalPage::Physical(_))) {
                            moved.0 += u64::from(lane.spill_sketch(p));
                        }
                    }
                }
                ChunkWork::Restore(keys) => {
                    for (p, keys) in keys {
                        moved.1 += u64::from(lane.restore_sketch(p, &keys));
                    }
                }
            }
        }
    }
    moved
}

/// The pages of chunk `chunk` of `lane`.
fn chunk_pages(lane: &StoreLane, chunk: usize) -> std::ops::Range<usize> {
    chunk * SKETCH_CHUNK_PAGES..((chunk + 1) * SKETCH_CHUNK_PAGES).min(lane.num_pages())
}
